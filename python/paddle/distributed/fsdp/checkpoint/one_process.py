"""A whole checkpoint directory written by one process: the index of a checkpoint whose every piece is known.

Who: the tools' writer (tools/ckpt_io.py: ``from-hf``, ``from-stock``, the memory tier's flush), ``convert.py``
(format 1 -> 3) and test fixtures. The collective save goes through the storage interface instead (commit.py);
both build the index with the same code (save_index.py: ``index_objects``), so there is one index writer.

``format3_objects(md, per_rank)``: from metadata with every piece and its checksums (the in-memory form of
format 1), the objects of format 3: each data file's checksum sidecar, ``index.keys``, ``index.pieces``, the
per-rank values objects with their table (when ``per_rank`` names keys), ``metadata.json`` last.
"""

from __future__ import annotations

import os

from . import checksums, writer
from .format import rank_values
from .format.commit import commit_record
from .format.index import pack_sums, sums_name
from .format.metadata import COMMIT_FILE, METADATA_FILE, CheckpointMetadata
from .save_index import index_objects, piece_columns


def format3_objects(md: CheckpointMetadata, per_rank: tuple[str, ...] = ()) -> dict[str, bytes]:
    """``{name: bytes}`` of the format-3 checkpoint of ``md`` (metadata.json last). ``per_rank``: keys of
    ``md.values`` that hold one value per saving rank (a list of ``md.world_size`` entries): each rank's entry
    goes into its own values object (format/rank_values.py). ValueError for a per-rank key of another shape."""
    order = sorted(md.files, key=lambda n: (md.files[n].rank, n))
    with_sums = md.checksum != checksums.NONE
    cols = piece_columns(md.tensors, [(n, md.files[n].size) for n in order], md.chunk_bytes)
    reported = {
        i: {"size": md.files[n].size, "sums": cols["files"][i][2] if with_sums else 0} for i, n in enumerate(order)
    }
    values = {k: rank_values.plain(v) for k, v in md.values.items() if k not in per_rank}
    header = {
        "checkpoint_id": md.checkpoint_id,
        "created_unix": md.created_unix,
        "world_size": md.world_size,
        "chunk_bytes": md.chunk_bytes,
        "checksum": md.checksum,
        "values": values,
    }
    out: dict[str, bytes] = {}
    if with_sums:
        by_file: dict[str, list] = {n: [] for n in order}
        for tm in md.tensors.values():
            for p in tm.pieces:
                by_file[p.file].append((p.offset, p.checksums))
        for name, pieces in by_file.items():
            out[sums_name(name)] = pack_sums(sums for _off, sums in sorted(pieces, key=lambda x: x[0]))
    if per_rank:
        receipts = []
        for r in range(md.world_size):
            mine = {}
            for k in per_rank:
                v = rank_values.plain(md.values.get(k))
                if type(v) is not list or len(v) != md.world_size:
                    raise ValueError(f"per-rank value {k!r} must be a list of {md.world_size} entries (one a rank)")
                if v[r] is not None:
                    mine[k] = v[r]
            blob = out[rank_values.object_name(r)] = rank_values.encode_entry(md.checkpoint_id, r, mine)
            receipts.append(rank_values.entry_receipt(blob))
        header["rank_values"] = (list(per_rank), rank_values.encode_table(receipts))
    out.update(index_objects(cols, header, reported, with_sums))
    return out


def write_format3(directory: str, md: CheckpointMetadata, write_stock: bool, per_rank: tuple[str, ...] = ()) -> bytes:
    """Write and fsync the format-3 index objects of ``md`` (``format3_objects``; stock paddle's ``0.metadata``
    too when ``write_stock``) into the (not yet visible) ``directory`` beside its data files; returns the bytes
    of metadata.json, which ``write_commit`` seals."""
    objects = format3_objects(md, per_rank)
    for name, blob in objects.items():
        writer.write_file(os.path.join(directory, name), blob, fsync=True, atomic=False)
    if write_stock:
        from .stock_compat import write_stock_metadata

        write_stock_metadata(directory, md)
    return objects[METADATA_FILE]


def write_metadata(directory: str, md: CheckpointMetadata, write_stock: bool) -> bytes:
    """Format 1 (test fixtures of the old format): write and fsync ``metadata.json`` (and stock paddle's
    ``0.metadata`` when ``write_stock``) into ``directory``; returns the bytes written."""
    data = md.dumps()
    writer.write_file(os.path.join(directory, METADATA_FILE), data, fsync=True, atomic=False)
    if write_stock:
        from .stock_compat import write_stock_metadata

        write_stock_metadata(directory, md)
    return data


def write_commit(directory: str, checkpoint_id: str, metadata_bytes: bytes) -> None:
    """Write and fsync the ``COMMIT`` record (after every data file and ``metadata.json`` are durable)."""
    writer.write_file(
        os.path.join(directory, COMMIT_FILE), commit_record(checkpoint_id, metadata_bytes), fsync=True, atomic=False
    )
