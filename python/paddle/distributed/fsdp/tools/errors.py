"""The one exception type the checkpoint tools raise for bad input.

The CLI turns a :class:`ToolError` (and the engine's ``CheckpointError``) into one line on stderr and a
non-zero exit; anything else is a bug and keeps its traceback (with ``--debug``). The class is defined beside the
engine's errors (checkpoint/errors.py), since the one-process writer the tools use lives in the engine.
"""

from __future__ import annotations

from ..checkpoint.errors import ToolError

__all__ = ["ToolError"]
