"""``verify CKPT``: prove a checkpoint complete and intact, or name what is wrong.

Runs the engine's ``verify_checkpoint``: commit record and metadata hash; every element of every tensor covered
by exactly one record (no gap, no overlap); every referenced data file present with the size the metadata
records and a safetensors header that matches it; no two pieces overlapping inside a file; every chunk
checksum (all data is read once). A path that is not a checkpoint at all is bad input (raised), not a problem.
A CheckpointManager root is verified through its latest checkpoint.
"""

from __future__ import annotations

import os

from ..checkpoint import read_metadata, verify_checkpoint
from ..checkpoint.errors import CheckpointError, CheckpointRemovedError, NotACheckpointError
from .ckpt_io import resolve_checkpoint_path
from .progress import Progress


def verify(path: str | os.PathLike, progress: bool | None = None) -> tuple[list[str], dict | None]:
    """``(problems, summary)``; ``problems == []`` means sound. Raises NotACheckpointError for a non-checkpoint.

    ``summary`` (tensors, files, bytes) is None when the metadata itself cannot be read. ``progress``: a bar on
    stderr (None: when it is a terminal).
    """
    try:
        path = resolve_checkpoint_path(path)
    except NotACheckpointError:
        raise
    except CheckpointError as e:  # a root whose saves all crashed
        return [f"{type(e).__name__}: {e}"], None
    summary = None
    data_bytes = 0
    try:
        md = read_metadata(path)
        md.prefetch(list(md.tensors))  # format 2: every row at once
        data_bytes = sum(p.nbytes for tm in md.tensors.values() for p in tm.pieces)
        summary = {
            "path": path,
            "tensors": len(md.tensors),
            "tensor_bytes": data_bytes,
            "files": len(md.files),
            "file_bytes": sum(f.size for f in md.files.values()),
            "checksum": md.checksum,
        }
    except CheckpointRemovedError as e:  # removed (keep_last rotation) while it was read: not corrupt
        return [f"{type(e).__name__}: {e}"], None
    except NotACheckpointError:
        raise
    except CheckpointError:
        pass  # reported (with the same message) by verify_checkpoint below
    with Progress(data_bytes, "verify", enabled=progress if summary else False) as bar:
        return verify_checkpoint(path, on_bytes=bar.update), summary
