"""``verify CKPT``: prove a checkpoint complete and intact, or name what is wrong.

Runs the engine's ``verify_checkpoint``: commit record and metadata hash; every element of every tensor covered
by exactly one record (no gap, no overlap); every referenced data file present with the size the metadata
records and a safetensors header that matches it; no two pieces overlapping inside a file; every chunk
checksum (all data is read once). A path that is not a checkpoint at all is bad input (raised), not a problem.
A CheckpointManager root is verified through its latest checkpoint; when that one is removed meanwhile (another
job's ``keep_last`` rotation) verify tries what ``latest`` names then, as loads do, and finally raises
CheckpointRemovedError (its own exit code, 4): a removed checkpoint is neither "not a checkpoint" nor "NOT sound".
"""

from __future__ import annotations

import os

from ..checkpoint import read_metadata, verify_checkpoint
from ..checkpoint.commit_record import removed_or
from ..checkpoint.errors import CheckpointError, CheckpointRemovedError, CorruptCheckpointError, NotACheckpointError
from ..checkpoint.manager import is_checkpoint_root, retry_removed
from ..checkpoint.paths import local_path
from .ckpt_io import resolve_checkpoint_path
from .progress import Progress


def verify(path: str | os.PathLike, progress: bool | None = None) -> tuple[list[str], dict | None]:
    """``(problems, summary)``; ``problems == []`` means sound. Raises NotACheckpointError for a non-checkpoint,
    CheckpointRemovedError when the checkpoint went away while it was verified (another job's keep_last rotation
    or a replacing save; for a root: after the retries loads make with what ``latest`` names then).

    ``summary`` (tensors, files, bytes) is None when the metadata itself cannot be read. ``progress``: a bar on
    stderr (None: when it is a terminal).
    """
    given = local_path(path)  # a checkpoint given by its own path is not retried: it is gone, not replaced
    return retry_removed(lambda: _verify_once(given, progress), f"verify {given}", lambda e: is_checkpoint_root(given))


def _verify_once(given: str | os.PathLike, progress: bool | None) -> tuple[list[str], dict | None]:
    try:
        path = resolve_checkpoint_path(given)
    except NotACheckpointError:
        raise
    except CheckpointError as e:  # a root whose saves all crashed
        return [f"{type(e).__name__}: {e}"], None
    from_root = path != local_path(given)
    summary, md = None, None
    data_bytes = 0
    try:
        md = read_metadata(path)
        md.prefetch(list(md.tensors))  # format 2: every row at once
        data_bytes = sum(p.nbytes for tm in md.tensors.values() for p in tm.pieces)
        summary = {
            "path": path,
            "tensors": len(md.tensors),
            "derived": len(md.derived),  # weights stored as their master weight cast (format 4): no bytes
            "tensor_bytes": data_bytes,
            "files": len(md.files),
            "file_bytes": sum(f.size for f in md.files.values()),
            "checksum": md.checksum,
        }
    except NotACheckpointError as e:  # resolved from a root, then gone: removed, not "not a checkpoint"
        gone = _removed(path, e, None) if from_root else e
        if gone is not e:
            raise gone from e
        raise
    except CheckpointError as e:  # reported (with the same message) by verify_checkpoint below
        if from_root or isinstance(e, CheckpointRemovedError):
            gone = _removed(path, e, None)
            if isinstance(gone, CheckpointRemovedError):
                raise gone from e
    with Progress(data_bytes, "verify", enabled=progress if summary else False) as bar:
        problems = verify_checkpoint(path, on_bytes=bar.update)
    if problems and (from_root or md is not None):  # it was there when verify began: gone since, or damaged?
        gone = _removed(path, CorruptCheckpointError(problems[0]), md.checkpoint_id if md is not None else None)
        if isinstance(gone, CheckpointRemovedError):
            raise gone
    return problems, summary


def _removed(path: str, error: CheckpointError, checkpoint_id: str | None) -> CheckpointError:
    """CheckpointRemovedError when the checkpoint at ``path``, resolved from a root or read before, has gone (or
    was replaced); else ``error``."""
    if isinstance(error, CheckpointRemovedError):
        return error
    return removed_or(path, error, checkpoint_id)
