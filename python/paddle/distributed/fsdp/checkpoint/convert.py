"""Converting a format-1 checkpoint (one metadata.json holding every checksum) to format 2 (format/index.py).

Why: format-1 checkpoints keep loading as they are; converting one makes its loads read what a format-2 load
reads (a small index, the rows and checksums of what is loaded). The data files are not rewritten: they are
hard-linked into a staging directory next to the checkpoint, the sidecars and index objects are written there,
COMMIT last, and the staging replaces the checkpoint atomically (writer.replace_dir), so a crash leaves the
format-1 checkpoint as it was.
"""

from __future__ import annotations

import os
import shutil
import uuid

from . import checksums, writer
from .directory import read_metadata
from .errors import CheckpointError
from .format.commit import commit_record
from .format.index import pack_sums, sums_name
from .format.metadata import COMMIT_FILE, METADATA_FILE, STOCK_METADATA_FILE
from .save_index import index_objects, piece_columns

__all__ = ["convert_to_format2"]


def convert_to_format2(path: str) -> bool:
    """Convert the committed checkpoint at ``path`` to format 2 (written as version 3: per-rank values stay the
    lists they are in format 1) in place (atomically); False when it has an index already. Every checksum is carried over as saved (nothing is re-read); ``verify_checkpoint`` afterwards
    checks them against the data."""
    path = os.path.abspath(os.fspath(path))
    md = read_metadata(path)
    if md.index is not None:  # format 2 or 3 already
        return False
    order = sorted(md.files, key=lambda n: (md.files[n].rank, n))
    with_sums = md.checksum != checksums.NONE
    cols = piece_columns(md.tensors, [(n, md.files[n].size) for n in order], md.chunk_bytes)
    reported = {
        i: {"size": md.files[n].size, "sums": cols["files"][i][2] if with_sums else 0} for i, n in enumerate(order)
    }
    header = {
        "checkpoint_id": md.checkpoint_id,
        "created_unix": md.created_unix,
        "world_size": md.world_size,
        "chunk_bytes": md.chunk_bytes,
        "checksum": md.checksum,
        "values": md.values,
    }
    objects = index_objects(cols, header, reported, with_sums)
    staging = f"{path}.tmp-convert-{uuid.uuid4().hex[:12]}"
    os.mkdir(staging)
    try:
        for name in os.listdir(path):
            if name in md.files or name == STOCK_METADATA_FILE:
                os.link(os.path.join(path, name), os.path.join(staging, name))
        if with_sums:
            by_file: dict[str, list] = {n: [] for n in order}
            for tm in md.tensors.values():
                for p in tm.pieces:
                    by_file[p.file].append((p.offset, p.checksums))
            for name, pieces in by_file.items():
                blob = pack_sums(sums for _off, sums in sorted(pieces, key=lambda x: x[0]))
                writer.write_file(os.path.join(staging, sums_name(name)), blob, fsync=True, atomic=False)
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
