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
from dataclasses import dataclass, field

from . import checksums, writer
from .directory import read_metadata
from .errors import CheckpointError
from .format.commit import commit_record
from .format.index import VERSION, pack_sums, sums_name
from .format.metadata import COMMIT_FILE, METADATA_FILE, STOCK_METADATA_FILE
from .save_index import index_objects

__all__ = ["convert_to_format2"]


@dataclass
class _Layout:
    name: str
    size: int
    pieces: list = field(default_factory=list)  # (key, piece) in file order


@dataclass
class _Plan:
    tensors: dict
    files: dict
    values: dict


def convert_to_format2(path: str) -> bool:
    """Convert the committed checkpoint at ``path`` to format 2 in place (atomically); False when it is one
    already. Every checksum is carried over as saved (nothing is re-read); ``verify_checkpoint`` afterwards
    checks them against the data."""
    path = os.path.abspath(os.fspath(path))
    md = read_metadata(path)
    if md.version == VERSION:
        return False
    order = sorted(md.files, key=lambda n: (md.files[n].rank, n))
    files = {i: _Layout(name, md.files[name].size) for i, name in enumerate(order)}
    by_name = {lay.name: lay for lay in files.values()}
    for key, tm in md.tensors.items():
        for p in tm.pieces:
            by_name[p.file].pieces.append((key, p))
    for lay in files.values():
        lay.pieces.sort(key=lambda kp: kp[1].offset)
    with_sums = md.checksum != checksums.NONE
    reported = {
        i: {"size": lay.size, "sums": sum(len(p.checksums) for _k, p in lay.pieces) if with_sums else 0}
        for i, lay in files.items()
    }
    header = {
        "checkpoint_id": md.checkpoint_id,
        "created_unix": md.created_unix,
        "world_size": md.world_size,
        "chunk_bytes": md.chunk_bytes,
        "checksum": md.checksum,
        "values": md.values,
    }
    objects = index_objects(_Plan(md.tensors, files, md.values), header, reported, with_sums)
    staging = f"{path}.tmp-convert-{uuid.uuid4().hex[:12]}"
    os.mkdir(staging)
    try:
        for name in os.listdir(path):
            if name in md.files or name == STOCK_METADATA_FILE:
                os.link(os.path.join(path, name), os.path.join(staging, name))
        if with_sums:
            for lay in files.values():
                blob = pack_sums(p.checksums for _k, p in lay.pieces)
                writer.write_file(os.path.join(staging, sums_name(lay.name)), blob, fsync=True, atomic=False)
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
