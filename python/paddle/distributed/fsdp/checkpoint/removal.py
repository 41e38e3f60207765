"""Readers racing a removal: telling "the checkpoint was removed under me" apart from "the checkpoint is corrupt".

Why: ``keep_last`` rotation (manager.py) and a save replacing a checkpoint at its path make a checkpoint
disappear whole (renamed away, then deleted) while a load or a verify may be reading it. A file missing at that
moment is not damage: the reader must say the checkpoint was removed (CheckpointRemovedError), so that
``load_checkpoint(root)`` can retry with what ``latest`` names now, and must never call a sound checkpoint
corrupt.
"""

from __future__ import annotations

import os

from .errors import CheckpointError, CheckpointRemovedError
from .format.metadata import COMMIT_FILE


def commit_id(path: str) -> str | None:
    """The checkpoint id the commit record at ``path`` names now (None: absent or unreadable)."""
    from .format.schema import parse_commit
    from .format.strict_json import SMALL_FILE_BYTES, loads_strict, read_capped

    try:
        where = os.path.join(path, COMMIT_FILE)
        return parse_commit(loads_strict(read_capped(where, SMALL_FILE_BYTES, COMMIT_FILE), where), where)[0]
    except (OSError, CheckpointError):
        return None


def removed_or(path: str, error: CheckpointError, checkpoint_id: str | None = None) -> CheckpointError:
    """CheckpointRemovedError when the checkpoint at ``path`` is gone (no commit record) or, given the
    ``checkpoint_id`` being read, was replaced by another one; else ``error``."""
    now = commit_id(path)
    if now is None:
        return CheckpointRemovedError(
            f"checkpoint {path} was removed while it was being read (keep_last rotation or a replacing save?)"
        )
    if checkpoint_id is not None and now != checkpoint_id:
        return CheckpointRemovedError(
            f"checkpoint {path} was replaced by another save while it was being read (checkpoint id "
            f"{checkpoint_id} -> {now})"
        )
    return error
