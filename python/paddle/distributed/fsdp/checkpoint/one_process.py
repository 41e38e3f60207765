"""A whole checkpoint directory written by one process: the index of a checkpoint whose every piece is known.

``CheckpointWriter`` writes one data file at a time, one tensor in memory, then the index and ``COMMIT``. Who:
the tools (``from-hf``, stock ``import``, through tools/ckpt_io.py), the memory tier's flush (memtier/flush.py),
``convert.py`` (format 1 -> 3, through the functions below) and test fixtures. The collective save goes through
the storage interface instead (save/commit.py); both build the index with the same code (save_index.py:
``index_objects``), so there is one index writer.

``format3_objects(md, per_rank)``: from metadata with every piece and its checksums (the in-memory form of
format 1), the objects of format 3: each data file's checksum sidecar, ``index.keys``, ``index.pieces``, the
per-rank values objects with their table (when ``per_rank`` names keys), ``metadata.json`` last.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import checksums, writer
from .errors import ToolError
from .format import rank_values
from .format.codecs import RAW
from .format.commit import commit_record
from .format.index import pack_sums, sums_name
from .format.metadata import (
    COMMIT_FILE,
    DEFAULT_CHUNK_BYTES,
    DTYPES,
    FORMAT_NAME,
    METADATA_FILE,
    CheckpointMetadata,
    FileMeta,
    PieceMeta,
    TensorMeta,
    itemsize,
    rank_file_name,
)
from .format.reserved import key_problem
from .format.safetensors import build_header
from .geometry import Region
from .options import CheckpointOptions
from .save_index import index_objects, piece_columns


def format3_objects(
    md: CheckpointMetadata, per_rank: tuple[str, ...] = (), derived: dict | None = None, codec: str = RAW
) -> dict[str, bytes]:
    """``{name: bytes}`` of the format-3 checkpoint of ``md`` (metadata.json last). ``per_rank``: keys of
    ``md.values`` that hold one value per saving rank (a list of ``md.world_size`` entries): each rank's entry
    goes into its own values object (format/rank_values.py). ValueError for a per-rank key of another shape.
    ``derived`` (format 4's field, format/derived.py) and ``codec`` (every data file stored through it, format/
    codecs.py; its chunk tables written beside the files) make the index format 4, as a collective save's."""
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
    if derived:
        header["derived"] = derived
    if codec != RAW:
        header["codecs"] = dict.fromkeys(order, codec)
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


def write_format3(
    directory: str,
    md: CheckpointMetadata,
    write_stock: bool,
    per_rank: tuple[str, ...] = (),
    derived: dict | None = None,
    codec: str = RAW,
) -> bytes:
    """Write and fsync the format-3 index objects of ``md`` (``format3_objects``; stock paddle's ``0.metadata``
    too when ``write_stock``) into the (not yet visible) ``directory`` beside its data files; returns the bytes
    of metadata.json, which ``write_commit`` seals."""
    objects = format3_objects(md, per_rank, derived, codec)
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


def write_commit(directory: str, checkpoint_id: str, metadata_bytes: bytes, lineage: dict | None = None) -> None:
    """Write and fsync the ``COMMIT`` record (after every data file and ``metadata.json`` are durable);
    ``lineage``: the run it belongs to (lineage.py), None for a tool's checkpoint of no run."""
    record = commit_record(checkpoint_id, metadata_bytes, lineage)
    writer.write_file(os.path.join(directory, COMMIT_FILE), record, fsync=True, atomic=False)


# ------------------------------------------------------------------------------------------------ writing


Producer = Callable[[], np.ndarray]  # returns the tensor's bytes (uint8, row-major), called when written


@dataclass
class WriteEntry:
    key: str
    dtype: str  # engine dtype name
    shape: tuple[int, ...]
    produce: Producer

    @property
    def nbytes(self) -> int:
        return Region.full(self.shape).numel * itemsize(self.dtype)


class CheckpointWriter:
    """Writes a checkpoint of the engine's format from ONE process, one data file at a time, one tensor in memory.

    Every tensor is stored whole (one box piece covering it), so any world size can load any slice of it. Each
    data file is ``<i>_0.safetensors`` with file rank ``i`` (as if rank ``i`` had saved it); ``commit`` writes
    the index (format 3: checksum sidecars, ``index.keys``, ``index.pieces``, ``metadata.json``), the stock-paddle
    index ``0.metadata`` and the ``COMMIT`` record last, exactly like a collective save. Write into a staging directory (see :func:`staged_output`).
    """

    def __init__(
        self,
        directory: str,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        on_bytes: Callable[[int], None] | None = None,
        options: CheckpointOptions | None = None,
    ):
        self.directory = directory
        self.chunk_bytes = chunk_bytes
        self.checksum = (
            CheckpointOptions.from_env().checksum_algorithm() if options is None else options.checksum_algorithm()
        )
        self._digest = checksums.digest_function(self.checksum) if self.checksum != checksums.NONE else None
        self.checkpoint_id = uuid.uuid4().hex
        self.created = time.time()
        self.files: dict[str, FileMeta] = {}
        self.tensors: dict[str, TensorMeta] = {}
        self.on_bytes = on_bytes

    def write_file(self, entries: list[WriteEntry]) -> str:
        rank = len(self.files)
        name = rank_file_name(rank)
        header_entries, stored, pos = [], [], 0
        seen: set[str] = set()
        for e in entries:
            if e.key in self.tensors or e.key in seen:
                raise ToolError(f"key {e.key!r} is written twice")
            seen.add(e.key)
            problem = key_problem(e.key, tensor=True)
            if problem is not None:
                raise ToolError(f"key {e.key!r:.200} cannot be stored in a checkpoint: {problem}")
            if e.dtype not in DTYPES:
                raise ToolError(f"key {e.key!r}: dtype {e.dtype} is not supported by the checkpoint format")
            if e.nbytes == 0:
                continue
            header_entries.append((e.key, e.dtype, tuple(e.shape), pos, pos + e.nbytes))
            stored.append(e)
            pos += e.nbytes
        header = build_header(
            header_entries, {"format": FORMAT_NAME, "checkpoint_id": self.checkpoint_id, "rank": str(rank)}
        )
        # one tensor in memory at a time: produced, checksummed and written by the engine's rank-file writer
        size, sums = writer.write_rank_file(
            os.path.join(self.directory, name),
            header,
            [self._provider(e) for e in stored],
            self.chunk_bytes,
            self._digest,
            batch_bytes=0,
        )
        if size != len(header) + pos:
            raise ToolError(f"{name}: wrote {size} bytes, expected {len(header) + pos}")
        self.files[name] = FileMeta(rank=rank, size=size)
        for e in entries:
            self.tensors[e.key] = TensorMeta(dtype=e.dtype, shape=tuple(e.shape), pieces=[])
        for (key, _dtype, shape, begin, end), piece_sums in zip(header_entries, sums):
            self.tensors[key].pieces.append(
                PieceMeta(
                    file=name,
                    name=key,
                    offset=len(header) + begin,
                    nbytes=end - begin,
                    box_offset=(0,) * len(shape),
                    box_shape=tuple(shape),
                    flat_range=None,
                    checksums=[int(c) for c in piece_sums],
                )
            )
        return name

    def _provider(self, e: WriteEntry) -> Callable[[], tuple[np.ndarray, None]]:
        def produce() -> tuple[np.ndarray, None]:
            data = e.produce()
            if data.dtype != np.uint8 or data.ndim != 1 or data.size != e.nbytes:
                raise ToolError(f"key {e.key!r}: produced {data.size} bytes, expected {e.nbytes}")
            if self.on_bytes is not None:
                self.on_bytes(e.nbytes)
            return data, None

        return produce

    def commit(
        self,
        values: dict[str, Any],
        write_stock_metadata: bool = True,
        per_rank_values: tuple[str, ...] = (),
        lineage: dict | None = None,
        derived: dict | None = None,
        codec: str = RAW,
    ) -> CheckpointMetadata:
        """Write the index (format 3, the one collective saves write) and the commit record. ``per_rank_values``:
        keys of ``values`` holding a list with one entry per data file (as if each file's rank had saved its
        own, e.g. its RNG state): each entry goes into that rank's values object."""
        md = CheckpointMetadata(
            checkpoint_id=self.checkpoint_id,
            world_size=max(len(self.files), 1),
            chunk_bytes=self.chunk_bytes,
            checksum=self.checksum,
            created_unix=self.created,
            files=dict(self.files),
            tensors=dict(self.tensors),
            values=dict(values),
        )
        md.validate(f"{self.directory}/{METADATA_FILE}")
        try:
            data = write_format3(self.directory, md, write_stock_metadata, tuple(per_rank_values), derived, codec)
        except ValueError as e:
            raise ToolError(str(e)) from None
        write_commit(self.directory, self.checkpoint_id, data, lineage)
        return md
