"""Converting a format-1 checkpoint (one metadata.json holding every checksum) to an indexed one (format 3).

Why: format-1 checkpoints keep loading as they are; converting one makes its loads read what a format-3 load
reads (a small index, the rows and checksums of what is loaded). The data files are not rewritten: they are
hard-linked into a staging directory next to the checkpoint, the sidecars and index objects are written there,
COMMIT last, and the staging replaces the checkpoint atomically (writer.replace_dir), so a crash leaves the
format-1 checkpoint as it was.
"""

from __future__ import annotations

import os
import shutil
import uuid

from . import writer
from .directory import read_metadata
from .errors import CheckpointError
from .format.commit import commit_record
from .format.metadata import COMMIT_FILE, METADATA_FILE, STOCK_METADATA_FILE
from .one_process import format3_objects

__all__ = ["convert_to_format3", "convert_to_format2"]


def convert_to_format3(path: str) -> bool:
    """Convert the format-1 checkpoint at ``path`` to the format saves write (format 3, versions.py
    ``WRITE_VERSION``; its per-rank values stay the lists they are in format 1, as format 3 reads them) in place
    (atomically); False when it has an index already (format 2 or 3). Every checksum is carried over as saved
    (nothing is re-read); ``verify_checkpoint`` afterwards checks them against the data."""
    path = os.path.abspath(os.fspath(path))
    md = read_metadata(path)
    if md.index is not None:  # format 2 or 3 already
        return False
    objects = format3_objects(md)  # the per-rank values of format 1 stay the lists they are
    staging = f"{path}.tmp-convert-{uuid.uuid4().hex[:12]}"
    os.mkdir(staging)
    try:
        for name in os.listdir(path):
            if name in md.files or name == STOCK_METADATA_FILE:
                os.link(os.path.join(path, name), os.path.join(staging, name))
        for name, blob in objects.items():
            writer.write_file(os.path.join(staging, name), blob, fsync=True, atomic=False)
        record = commit_record(md.checkpoint_id, objects[METADATA_FILE])
        writer.write_file(os.path.join(staging, COMMIT_FILE), record, fsync=True, atomic=False)
        writer.fsync_dir(staging)
        writer.replace_dir(staging, path, f"{path}.old-convert-{uuid.uuid4().hex[:12]}", background_delete=False)
    except (OSError, CheckpointError):
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return True


# its name before the format it writes was numbered 3 (docs and scripts call it so); the same function
convert_to_format2 = convert_to_format3
