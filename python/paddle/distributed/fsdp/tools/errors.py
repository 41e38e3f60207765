"""The one exception type the checkpoint tools raise for bad input.

The CLI turns a :class:`ToolError` (and the engine's ``CheckpointError``) into one line on stderr and a
non-zero exit; anything else is a bug and keeps its traceback (with ``--debug``).
"""

from __future__ import annotations


class ToolError(ValueError):
    """Bad input to a tool: not a checkpoint, a bad rules file, a name collision, an unknown dtype..."""
