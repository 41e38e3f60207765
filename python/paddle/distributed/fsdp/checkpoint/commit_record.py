"""What the commit record of a checkpoint names now, and whether a checkpoint went away under its reader.

Why a module of its own: the reader of data files (reader.py), loads and verify ask ``removed_or`` when a read
fails, the directory questions (directory.py) and the commit (save/commit.py) ask ``commit_id``; it needs only the
format and the storage interface, so it sits below all of them. ``removed_or`` tells a checkpoint removed under
a reader (keep_last rotation, a replacing save) apart from a corrupt one, so that ``load_checkpoint(root)`` can
retry with what ``latest`` names now and never call a sound checkpoint corrupt.
"""

from __future__ import annotations

from .errors import CheckpointError, CheckpointRemovedError
from .format.metadata import COMMIT_FILE
from .format.schema import parse_commit
from .format.strict_json import SMALL_FILE_BYTES, loads_strict
from .io.backends import backend_for
from .io.storage import Storage


def commit_id(path: str, storage: Storage | None = None) -> str | None:
    """The checkpoint id the commit record at ``path`` names now (None: absent or unreadable): the truth about
    whether (and which) checkpoint is committed there."""
    try:
        return _read_commit_id(path, storage)
    except (OSError, CheckpointError):
        return None


def _read_commit_id(path: str, storage: Storage | None) -> str | None:
    """``commit_id``, but an unreadable commit record (EACCES, EIO: the storage cannot be read, which says
    nothing about whether the checkpoint is there) raises the OSError."""
    where = f"{path}/{COMMIT_FILE}"
    raw = (storage or backend_for(path)).get(path, COMMIT_FILE, SMALL_FILE_BYTES)
    try:
        return None if raw is None else parse_commit(loads_strict(raw, where), where)[0]
    except CheckpointError:
        return None


def removed_or(
    path: str, error: CheckpointError, checkpoint_id: str | None = None, storage: Storage | None = None
) -> CheckpointError:
    """CheckpointRemovedError when the checkpoint at ``path`` is gone (no commit record) or, given the
    ``checkpoint_id`` being read, was replaced by another one; else ``error`` (also when the commit record cannot
    be read: a rank denied by its storage is not told the checkpoint went away)."""
    try:
        now = _read_commit_id(path, storage)
    except (OSError, CheckpointError):  # (CheckpointError: a commit record that is not a regular file)
        return error
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
