"""Rename and transpose rules for converting between checkpoints and Hugging Face safetensors.

A rules file is JSON::

    {
      "rename": [["^blocks\\.(\\d+)\\.", "model.layers.\\1."],
                 ["^embed\\.weight$", "model.embed_tokens.weight"]],
      "transpose": ["\\.(q|k|v|o|up|down|gate)\\.weight$"]
    }

Both lists are optional; top-level keys starting with ``_`` (e.g. ``"_comment"``) are ignored, any other
key is an error (so a typo such as ``"transpose_"`` cannot silently do nothing).

Rules always map a SOURCE name to a TARGET name, and a rules file therefore has a direction:

* ``to-hf --rules``: source = checkpoint key (``blocks.0.mix.weight``), target = Hugging Face name.
* ``from-hf --rules``: source = Hugging Face name, target = checkpoint key.

``rename``: every rule is applied in order with :func:`re.sub` to the result of the previous one (all rules,
not only the first that matches); the replacement uses Python's syntax (``\\1``, ``\\g<name>``). A name no
rule matches is kept as is.

``transpose``: a tensor is transposed (``[a, b] -> [b, a]``) iff one of the patterns :func:`re.search`-es its
SOURCE name (before renaming). Only 2-D tensors can be transposed; a pattern matching another tensor is an
error. Paddle's ``Linear`` stores ``[in, out]`` where torch/Hugging Face store ``[out, in]``, so the Linear
weights are what a transpose rule usually names, in both directions.

Regexes cannot be inverted in general, so ``from-hf`` does not derive its renaming from the ``to-hf`` rules:
``to-hf`` records the exact name map and the transposed names in ``model.safetensors.index.json`` (see
``to_hf_cmd``), and ``from-hf`` without ``--rules`` inverts that record; for Hugging Face weights that did not
come from ``to-hf`` (no record), give ``from-hf`` its own rules file in the HF -> checkpoint direction.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

from .errors import ToolError

KNOWN_KEYS = ("rename", "transpose")


@dataclass
class Rules:
    """Compiled rules; ``Rules()`` is the identity (no renaming, no transposing)."""

    rename: list[tuple[re.Pattern, str]] = field(default_factory=list)
    transpose: list[re.Pattern] = field(default_factory=list)
    where: str = "rules"

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> Rules:
        path = os.fspath(path)
        from ..checkpoint.errors import CheckpointError
        from ..checkpoint.format.strict_json import SMALL_FILE_BYTES, loads_strict, read_capped

        try:  # bounded, strict, never blocking on a FIFO
            raw = read_capped(path, SMALL_FILE_BYTES, "rules file")
        except OSError as e:
            raise ToolError(f"cannot read rules file {path}: {e.strerror or e}") from None
        except CheckpointError as e:
            raise ToolError(f"cannot read rules file {path}: {e}") from None
        try:
            data = loads_strict(raw, f"rules file {path}")
        except CheckpointError as e:
            raise ToolError(f"rules file {path} is not valid JSON: {e}") from None
        return cls.from_dict(data, where=f"rules file {path}")

    @classmethod
    def from_dict(cls, data: Any, where: str = "rules") -> Rules:
        if not isinstance(data, dict):
            raise ToolError(f"{where}: expected a JSON object with 'rename' and/or 'transpose'")
        unknown = sorted(k for k in data if not str(k).startswith("_") and k not in KNOWN_KEYS)
        if unknown:
            raise ToolError(f"{where}: unknown key {unknown[0]!r} (allowed: {', '.join(KNOWN_KEYS)})")
        rename_raw = data.get("rename", [])
        transpose_raw = data.get("transpose", [])
        if not isinstance(rename_raw, list):
            raise ToolError(f"{where}: 'rename' must be a list of [regex, replacement] pairs")
        if not isinstance(transpose_raw, list):
            raise ToolError(f"{where}: 'transpose' must be a list of regexes")
        rename = []
        for i, item in enumerate(rename_raw):
            if not isinstance(item, (list, tuple)) or len(item) != 2 or not all(isinstance(x, str) for x in item):
                raise ToolError(
                    f"{where}: rename rule {i} must be a [regex, replacement] pair of strings, got {item!r}"
                )
            rename.append((_compile(item[0], f"{where}: rename rule {i}"), item[1]))
        transpose = []
        for i, item in enumerate(transpose_raw):
            if not isinstance(item, str):
                raise ToolError(f"{where}: transpose rule {i} must be a regex string, got {item!r}")
            transpose.append(_compile(item, f"{where}: transpose rule {i}"))
        return cls(rename, transpose, where)

    @property
    def is_identity(self) -> bool:
        return not self.rename and not self.transpose

    def rename_name(self, name: str) -> str:
        """The target name of source ``name`` (every rename rule, in order)."""
        out = name
        for i, (pattern, replacement) in enumerate(self.rename):
            try:
                out = pattern.sub(replacement, out)
            except (re.error, IndexError, OverflowError, RecursionError, ValueError) as e:
                raise ToolError(
                    f"{self.where}: rename rule {i} ({pattern.pattern!r} -> {replacement!r}) fails on {name!r}: {e}"
                ) from None
        if not out:
            raise ToolError(f"{self.where}: renaming {name!r} gives an empty name")
        return out

    def transposes(self, name: str) -> bool:
        """Whether the tensor whose source name is ``name`` is transposed."""
        return any(p.search(name) for p in self.transpose)

    def to_json(self) -> dict:
        return {
            "rename": [[p.pattern, r] for p, r in self.rename],
            "transpose": [p.pattern for p in self.transpose],
        }


def _compile(pattern: str, where: str) -> re.Pattern:
    try:
        return re.compile(pattern)
    except (re.error, OverflowError, RecursionError, ValueError) as e:  # e.g. a{99999999999} overflows
        raise ToolError(f"{where}: invalid regex {pattern!r}: {e}") from None


def load_rules(path: str | os.PathLike | None) -> Rules:
    """Rules from ``path``, or the identity rules when ``path`` is None."""
    return Rules() if path is None else Rules.from_file(path)
