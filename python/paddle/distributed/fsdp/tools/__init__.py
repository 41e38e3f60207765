"""Command-line tools for FSDP checkpoints: ``paddle-fsdp-ckpt`` (``python -m paddle.distributed.fsdp.tools``).

Subcommands (see ``cli_parser.py``): ``inspect``, ``verify``, ``to-hf``, ``from-hf``, ``diff``. The library functions behind
them can be used directly: :func:`inspect_checkpoint`, :func:`verify`, :func:`to_hf`, :func:`from_hf`, :func:`diff`
(model-family presets: ``PRESETS``), and the streaming
:class:`CheckpointReader` / one-process :class:`CheckpointWriter`. Modules are imported lazily.
"""

from __future__ import annotations

__all__ = [
    "main",
    "inspect_checkpoint",
    "verify",
    "to_hf",
    "from_hf",
    "diff",
    "PRESETS",
    "Rules",
    "ToolError",
    "CheckpointReader",
    "CheckpointWriter",
    "classify_keys",
]

_LAZY = {
    "main": ("cli", "main"),
    "inspect_checkpoint": ("inspect_cmd", "inspect_checkpoint"),
    "verify": ("verify_cmd", "verify"),
    "to_hf": ("to_hf_cmd", "to_hf"),
    "from_hf": ("from_hf_cmd", "from_hf"),
    "diff": ("diff_cmd", "diff"),
    "PRESETS": ("presets", "PRESETS"),
    "Rules": ("rules", "Rules"),
    "ToolError": ("errors", "ToolError"),
    "CheckpointReader": ("ckpt_io", "CheckpointReader"),
    "CheckpointWriter": ("ckpt_io", "CheckpointWriter"),
    "classify_keys": ("ckpt_io", "classify_keys"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
