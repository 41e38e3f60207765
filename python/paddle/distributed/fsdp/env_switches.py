"""Every environment switch of the package, and the one parser that reads them.

Why: switches parsed here and there read ``false`` as on, or garbage as "auto" (issue #50 item 5). Each
variable is declared once in ``SWITCHES`` (name, kind, default, bounds, meaning); code reads it with
``read(name)`` and nothing else reads a ``PADDLE_FSDP_*`` variable (a test greps the package for that, and goes
through every switch of this table with every spelling and with garbage).

Spellings (any case, surrounding blanks ignored):

* ``bool``: ``1``/``true``/``yes``/``on`` and ``0``/``false``/``no``/``off``;
* ``mode`` (``auto`` or a boolean): ``auto`` plus the boolean spellings (``on`` -> True, ``off`` -> False);
* ``choice``: one of the listed names;
* ``int`` / ``float``: a number within the declared bounds (``int`` switches marked ``bool_aliases`` also take
  the boolean spellings as 1 / 0);
* ``text``: any value (a path, a name; its user checks it).

An unset or empty (blank) variable means the default. Anything else is an ``EnvSwitchError`` (a ``ValueError``)
naming the variable, what it was given and what it accepts; the checkpoint's switches raise
``CheckpointEnvError``, which is also a ``CheckpointError`` (the caller passes ``error=``).

Two switches are read before paddle or this package exist (``PADDLE_FSDP_FORK_DISABLE``,
``PADDLE_FSDP_FORK_SKIP_VERSION_CHECK``, by ``paddle_fsdp_fork_activate`` at interpreter start-up): they are
declared here for the test, and the activator parses them with the same spellings (tested against ``read``).
Stdlib only: checkpoint/ and the training core both import it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
KINDS = ("bool", "mode", "choice", "int", "float", "text")


class EnvSwitchError(ValueError):
    """An environment switch holds a value it does not accept (the message names the variable and the values
    it accepts)."""


@dataclass(frozen=True)
class Switch:
    """One environment variable: how it is spelled and what an unset or empty one means."""

    name: str
    kind: str
    default: Any
    meaning: str
    choices: tuple[str, ...] = ()
    minimum: float | None = None
    maximum: float | None = None
    bool_aliases: bool = False

    def accepted(self) -> str:
        """The accepted values, for error messages and docs."""
        words = "/".join(TRUE_WORDS) + " or " + "/".join(FALSE_WORDS)
        if self.kind == "bool":
            return words + " (any case)"
        if self.kind == "mode":
            return "auto, " + words + " (any case)"
        if self.kind == "choice":
            return ", ".join(self.choices) + " (any case)"
        if self.kind == "text":
            return "any text"
        lo = "" if self.minimum is None else f" >= {self.minimum:g}"
        hi = "" if self.maximum is None else f" <= {self.maximum:g}"
        what = "an integer" if self.kind == "int" else "a number"
        return f"{what}{lo}{' and' if lo and hi else ''}{hi}" + (f", or {words}" if self.bool_aliases else "")


SWITCHES: dict[str, Switch] = {}


def _declare(*switches: Switch) -> None:
    for s in switches:
        assert s.kind in KINDS and s.name not in SWITCHES, s
        SWITCHES[s.name] = s


CKPT = "PADDLE_FSDP_CKPT_"
_declare(
    Switch(CKPT + "CHECKSUM", "choice", None, "checksum of new checkpoints", choices=("xxh3-64", "crc32", "none")),
    Switch(
        CKPT + "QUANTIZE_MOMENTS",
        "choice",
        None,
        "lossy moments of save_checkpoint (quantize_moments=None: this)",
        choices=("none", "int8", "int4"),
    ),
    Switch(CKPT + "CHECKSUM_THREADS", "int", 2, "checksum helper threads of a load", minimum=0),
    Switch(
        CKPT + "CODEC",
        "choice",
        "auto",
        "chunk codec of saves (auto: compressed on object stores)",
        choices=("auto", "raw", "byteplane-zstd"),
    ),
    # (maximum: checkpoint/options.MAX_CODEC_THREADS; each thread holds ~2 chunks in flight)
    Switch(CKPT + "CODEC_THREADS", "int", 0, "encode threads of a save (0: cores - 1)", minimum=0, maximum=1024),
    Switch(CKPT + "COMMIT_TIMEOUT", "float", 1800.0, "seconds a save waits for the commit", minimum=1e-3),
    Switch(CKPT + "HEARTBEAT_LEASE", "float", 5.0, "seconds of silence before a rank counts as dead", minimum=1e-3),
    Switch(CKPT + "READ_SLAB", "int", 16 << 20, "bytes per read of a large range", minimum=1),
    Switch(CKPT + "MAX_METADATA_BYTES", "int", 512 << 20, "largest metadata.json read", minimum=1),
    Switch(CKPT + "MAX_OPEN_FILES", "int", 64, "descriptors a reader keeps open", minimum=2),
    Switch(CKPT + "ODIRECT", "mode", "auto", "O_DIRECT reads and writes"),
    Switch(CKPT + "HUGEPAGES", "mode", "auto", "transparent huge pages for host buffers"),
    Switch(CKPT + "IN_PLACE", "bool", True, "loads read straight into contiguous host targets"),
    Switch(CKPT + "TRACE", "bool", False, "phase timings of every save and load on stderr"),
    Switch(CKPT + "DERIVE_WEIGHTS", "bool", True, "saves leave out weights equal to their master weight cast"),
    Switch("PADDLE_FSDP_MEMTIER_QUOTA", "int", None, "bytes the memory tier may use on a node", minimum=0),
    Switch("PADDLE_FSDP_MEMTIER_ROOT", "text", "/dev/shm/paddle-fsdp-memtier", "the memory tier's directory"),
    Switch("PADDLE_FSDP_JOB_ID", "text", None, "the memory tier's job id (checked by memtier/roots.py)"),
    Switch(
        "PADDLE_FSDP_CHECK_COLLECTIVE_ORDER",
        "int",
        0,
        "the collective order check: 0 off, N every N-th backward pass",
        minimum=0,
        bool_aliases=True,
    ),
    Switch("PADDLE_FSDP_EMULATE_COLLECTIVE_DELAY_MS", "float", 0.0, "emulated collective duration (ms)", minimum=0),
    Switch("PADDLE_FSDP_FAKE_DEVICE", "bool", False, "treat CPU tensors as device memory (CI)"),
    Switch("PADDLE_FSDP_EMULATE_GPU_COLLECTIVES", "bool", False, "run the GPU-only collective paths on gloo"),
    Switch("PADDLE_FSDP_FORK_DISABLE", "bool", False, "run stock paddle (no overlay); read by the activator"),
    Switch("PADDLE_FSDP_FORK_SKIP_VERSION_CHECK", "bool", False, "skip the paddle version check (activator)"),
)


def parse_bool(raw: str) -> bool | None:
    """True / False for a boolean spelling (any case, blanks ignored), None for anything else."""
    word = raw.strip().lower()
    return True if word in TRUE_WORDS else False if word in FALSE_WORDS else None


def parse(switch: Switch, raw: str | None, error: type[EnvSwitchError] = EnvSwitchError) -> Any:
    """The value ``raw`` (the variable's text, None when unset) means for ``switch``."""
    if raw is None or not raw.strip():
        return switch.default
    text = raw.strip()
    value = _parse_set(switch, text)
    if value is None:
        raise error(f"{switch.name}={raw!r} is not accepted: expected {switch.accepted()}, or empty for the default")
    return value


def _parse_set(switch: Switch, text: str) -> Any:
    """The meaning of a non-empty ``text``, None when ``switch`` does not accept it."""
    if switch.kind == "text":
        return text
    if switch.kind in ("bool", "mode"):
        if switch.kind == "mode" and text.lower() == "auto":
            return "auto"
        return parse_bool(text)
    if switch.kind == "choice":
        return text.lower() if text.lower() in switch.choices else None
    as_bool = parse_bool(text) if switch.bool_aliases else None
    if as_bool is not None:
        return int(as_bool)
    try:
        value = int(text, 10) if switch.kind == "int" else float(text)
    except ValueError:
        return None
    if value != value or value in (float("inf"), float("-inf")):  # nan, inf
        return None
    if (switch.minimum is not None and value < switch.minimum) or (
        switch.maximum is not None and value > switch.maximum
    ):
        return None
    return value


def read(name: str, environ: Mapping[str, str] | None = None, error: type[EnvSwitchError] = EnvSwitchError) -> Any:
    """The value of switch ``name`` in ``environ`` (default: ``os.environ``, read now)."""
    env = os.environ if environ is None else environ
    return parse(SWITCHES[name], env.get(name), error)
