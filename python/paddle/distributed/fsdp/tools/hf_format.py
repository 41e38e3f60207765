"""What to-hf and from-hf share: Hugging Face's file names and the ``paddle_fsdp`` record, size and dtype options,
``config.json`` reading, and the rename collision check.

The conversions themselves are ``to_hf_cmd.py`` (checkpoint -> Hugging Face safetensors) and ``from_hf_cmd.py``
(Hugging Face safetensors -> checkpoint). Both directions write into ``OUT.tmp-<id>`` and rename it to ``OUT`` only
when complete; an existing non-empty ``OUT`` is refused. ``to_hf(from_hf(x))`` reproduces ``x``'s names, dtypes and
values; when ``x`` itself came from ``to_hf`` with the same rules/shard size, the files are byte-identical.
"""

from __future__ import annotations

import json
import os
import re

from ..checkpoint.planner import Region
from . import json_schema
from .ckpt_io import FLOAT_DTYPES
from .errors import ToolError
from .hf_source import read_small_file

INDEX_FILE = "model.safetensors.index.json"
RECORD_KEY = "paddle_fsdp"
RECORD_VERSION = 1
DEFAULT_MAX_SHARD_SIZE = "5GB"
CONFIG_FILE = "config.json"
MAX_CONFIG_BYTES = 16 << 20
HF_FILE_METADATA = {"format": "pt"}

DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float32": "float32",
    "float": "float32",
}
DTYPE_CHOICES = ("bf16", "fp16", "fp32")

_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"500MiB"`` -> 524_288_000, ``"1234"`` -> 1234 (Hugging Face's convention)."""
    if isinstance(text, int):
        size = text
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", str(text))
        unit = m.group(2).upper() if m else None
        if not m or unit not in _SIZE_UNITS:
            raise ToolError(f"invalid size {text!r} (examples: 5GB, 500MB, 2GiB, 1000000)")
        size = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if size <= 0:
        raise ToolError(f"size must be positive, got {text!r}")
    return size


def parse_dtype(text: str | None) -> str | None:
    """``"bf16"`` -> ``"bfloat16"``; None stays None (keep dtypes)."""
    if text is None:
        return None
    try:
        return DTYPE_ALIASES[str(text).strip().lower()]
    except KeyError:
        raise ToolError(f"unknown dtype {text!r} (choose from {', '.join(DTYPE_CHOICES)})") from None


def target_dtype(src: str, dtype: str | None) -> str:
    """``dtype`` for a floating ``src`` dtype, when given; otherwise ``src`` (integer and float8 tensors are kept)."""
    return dtype if dtype is not None and src in FLOAT_DTYPES else src


def numel(shape) -> int:
    """Number of elements of ``shape``."""
    return Region.full(shape).numel


# ------------------------------------------------------------------------------------------------ safetensors


def check_collisions(pairs: list[tuple[str, str]], what: str) -> None:
    """ToolError when two ``(source, renamed)`` pairs rename to the same name."""
    seen: dict[str, str] = {}
    for src, dst in pairs:
        if dst in seen:
            raise ToolError(f"name collision after renaming: {what}s {seen[dst]!r} and {src!r} both become {dst!r}")
        seen[dst] = src


def read_config(path: str | os.PathLike) -> tuple[bytes, dict]:
    """The bytes and the parsed object of a Hugging Face ``config.json``."""
    path = os.fspath(path)
    raw = read_small_file(path, MAX_CONFIG_BYTES, "config")  # bounded; a local one only if a regular file
    try:
        cfg = json.loads(raw)  # lenient like transformers (NaN allowed; every field used is type-checked)
    except RecursionError:
        raise ToolError(f"config {path} is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ToolError(f"config {path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ToolError(f"config {path} is not a JSON object")
    json_schema.check(cfg, json_schema.CONFIG, f"config {path}")  # the fields the presets read
    return raw, cfg
