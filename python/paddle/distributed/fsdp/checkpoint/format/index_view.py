"""The lazy views over a format-2/3 checkpoint's index objects: what a load reads of ``index.pieces`` and the
checksum sidecars, key by key, when first asked for.

Why a module of its own: index.py owns the bytes (layout, ``encode``, the checked header and ``index.keys``);
this one owns the reads a load makes through ``fetch`` and the checks each row passes before it is used (its row
check, the structural checks, no shared bytes, the directory order), so each stays readable on its own.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import numpy as np

from ..errors import CorruptCheckpointError, MetadataError
from . import rank_values, row_directory
from .index import (
    KEYS_FILE,
    PIECE_ROW,
    PIECES_FILE,
    Fetch,
    _fail,
    _int_list,
    chunk_count,
    decode_header,
    decode_keys,
    row_checks,
    sums_name,
)
from .metadata import DTYPES, CheckpointMetadata, PieceMeta, numel
from .row_directory import SMALL_KEY_ROWS
from .sidecar import CountedFetch, SidecarSums


class IndexSource:
    """Lazy reads of a format-2 checkpoint's piece rows and checksum sidecars through ``fetch``.

    ``load(keys)`` fills ``tensors[key].pieces`` for the keys not loaded yet, in coalesced range reads of
    index.pieces; each piece's ``checksums`` is a view of its file's sidecar, fetched by SUMS_BLOCK on demand."""

    def __init__(self, fetch: Fetch, where: str, keys_table: dict, fields: dict, tensors: dict):
        self.fetch, self.where = fetch, where
        self.table = keys_table
        self.files = fields["files"]
        self.names = list(self.files)
        self.sums_counts = fields["sums_counts"]
        self.chunk = fields["chunk_bytes"]
        self.with_sums = fields["checksum"] != "none"
        self.tensors = tensors
        self.sidecars: dict[int, SidecarSums] = {}

    def load(self, keys: Iterable[str], spans: Mapping[str, tuple[int, int]] | None = None) -> None:
        """Fill the pieces of ``keys``: all rows of a key, or with ``spans[key] = (lo, hi)`` (global flat
        elements) only the rows the directory says may overlap them (row_directory.py), in coalesced reads."""
        rows, spans = self.table["rows"], spans or {}
        todo, want = {}, {}
        for t in (self.tensors[k] for k in keys):
            span = spans.get(t.key)
            if t._pieces is not None and (t._span is None or (span is not None and _inside(span, t._span))):
                continue  # (loaded already, whole or a window holding this span)
            todo[t.key_id] = t
            if span is not None and self.starts_sha256 and rows[t.key_id + 1] - rows[t.key_id] > SMALL_KEY_ROWS:
                want[t.key_id] = span
        if want and self.fences_sha256 and self.fences is None:
            self.fences = row_directory.fence_offsets(rows)
        win = row_directory.windows(self.fetch, self.where, rows, want, self.fences) if want else {}
        todo_rows = [(*win.get(i, (rows[i], rows[i + 1], None)), todo[i]) for i in sorted(todo)]
        fetched, whole = [], []  # (first row, its rows, starts, tensor); whole keys of format 3
        for a, b, items in row_directory.coalesce(
            [(a, b, (a, b, st, t)) for a, b, st, t in todo_rows], PIECE_ROW.itemsize
        ):
            arr = self._rows(a, b)
            for r0, r1, st, t in items:
                rows_of = arr[r0 - a : r1 - a]
                if st is None:
                    whole.append((rows_of, numel(t.shape), t.key))
                else:
                    row_directory.check_window(rows_of, st, spans[t.key], numel(t.shape), self.where, t.key)
                fetched.append((r0, rows_of, st, t))
        if self.starts_sha256:  # format 3: a whole key's rows in directory order
            row_directory.check_order(whole, self.where)
        if fetched:  # before any piece is made of them (and any target allocated by their shapes)
            self._check_no_shared_bytes(fetched)
        for r0, arr, st, t in fetched:
            t._pieces = self._pieces(t, arr, r0)
            t._span = None if st is None else spans[t.key]

    def _rows(self, a: int, b: int) -> np.ndarray:
        """Rows ``[a, b)`` of index.pieces, each checked against its own check (``row_checks``; checkpoints
        written before them: the SHA-256 of metadata.json when the read is the whole object)."""
        arr = row_directory.fetch_items(self.fetch, PIECES_FILE, a, b, PIECE_ROW, self.where)
        if self.row_check is not None:
            bad = np.nonzero(arr["pad"] != row_checks(arr, a))[0]
            if len(bad):
                raise CorruptCheckpointError(
                    f"{self.where}: {PIECES_FILE} row {a + int(bad[0])} is damaged (it does not match its check)"
                )
        elif a == 0 and b == self.table["rows"][-1] and hashlib.sha256(arr.tobytes()).hexdigest() != self.pieces_sha256:
            raise CorruptCheckpointError(f"{self.where}: {PIECES_FILE} does not match its SHA-256 in metadata.json")
        return arr

    def _check_no_shared_bytes(self, fetched: list) -> None:
        """No two of the rows a load reads share bytes of a data file (as format 1: each piece owns its bytes,
        so a small file never stands for a large tensor, nor a row for another key's bytes)."""
        rows = np.concatenate([arr for _r0, arr, _st, _t in fetched])
        keys = np.concatenate([np.full(len(arr), t.key_id, np.int64) for _r0, arr, _st, t in fetched])
        # (a row beyond any file is named by _pieces' checks: left out here, so the sums below cannot wrap)
        used = (rows["nbytes"] > 0) & (rows["nbytes"] < 1 << 62) & (rows["offset"] < 1 << 62)
        rows, keys = rows[used], keys[used]
        order = np.lexsort((rows["offset"], rows["file"]))
        f, lo = rows["file"][order], rows["offset"][order].astype(np.int64)
        end = lo + rows["nbytes"][order].astype(np.int64)
        shared = np.nonzero((f[1:] == f[:-1]) & (lo[1:] < end[:-1]))[0]
        if len(shared):
            i = int(shared[0])
            k0, k1 = (self.table["keys"][int(keys[order[j]])] for j in (i, i + 1))
            name = self.names[int(f[i])] if int(f[i]) < len(self.names) else f"#{int(f[i])}"
            raise CorruptCheckpointError(
                f"{self.where}: pieces of {k0!r} and {k1!r} share bytes of data file {name} (pieces never share "
                f"bytes: a damaged or crafted index)"
            )

    def all_rows(self) -> np.ndarray:
        """Every row (verify_checkpoint), checked against the SHA-256 of metadata.json."""
        n = self.table["rows"][-1]
        raw = self.fetch(PIECES_FILE, 0, n * PIECE_ROW.itemsize + 1)
        if len(raw) != n * PIECE_ROW.itemsize:
            raise CorruptCheckpointError(f"{self.where}: {PIECES_FILE} has {len(raw)} bytes, expected {n} rows")
        return np.frombuffer(raw, PIECE_ROW)

    def _pieces(self, t, arr: np.ndarray, first_row: int) -> list[PieceMeta]:
        """PieceMeta of one key's rows, each checked against the key's shape and its file (MetadataError)."""
        isz = DTYPES[t.dtype][0]
        out = []
        boxes, names = self.table["boxes"], self.table["names"]
        whole = (tuple([0] * len(t.shape)), tuple(t.shape))
        for i, r in enumerate(arr.tolist()):
            key_id, fi, box, _pad, offset, nbytes, fa, fb, sums = r
            if key_id != t.key_id or fi >= len(self.names):
                raise _fail(self.where, f"{PIECES_FILE} row {first_row + i} does not belong to key {t.key!r}")
            if box < 0:
                off, shp = whole
            else:
                off, shp = _box(boxes, box, len(t.shape), self.where)
            fr = None if fa < 0 else (fa, fb)
            name = names.get(str(first_row + i), t.key)
            p = PieceMeta(self.names[fi], name, offset, nbytes, off, shp, fr, [])
            self._check(t, p, isz, fi, sums)
            if self.with_sums:
                p.checksums = self._sidecar(fi).view(sums, chunk_count(nbytes, self.chunk))
            out.append(p)
        return out

    def _check(self, t, p: PieceMeta, isz: int, fi: int, sums: int) -> None:
        for o, s, g in zip(p.box_offset, p.box_shape, t.shape):
            if o + s > g:
                raise _fail(self.where, f"key {t.key!r} has a piece outside its shape")
        if p.flat_range is not None and not 0 <= p.flat_range[0] <= p.flat_range[1] <= numel(p.box_shape):
            raise _fail(self.where, f"key {t.key!r} has a bad flat_range {p.flat_range}")
        if p.nbytes != p.numel * isz or p.offset + p.nbytes > self.files[p.file].size:
            raise _fail(self.where, f"key {t.key!r} has a piece whose bytes do not fit its elements or file {p.file}")
        if self.with_sums and sums + chunk_count(p.nbytes, self.chunk) > self.sums_counts[fi]:
            raise _fail(self.where, f"key {t.key!r} has a piece whose checksums lie outside {sums_name(p.file)}")

    def _sidecar(self, fi: int) -> SidecarSums:
        s = self.sidecars.get(fi)
        if s is None:
            s = self.sidecars[fi] = SidecarSums(self.fetch, sums_name(self.names[fi]), self.sums_counts[fi])
        return s


def _box(boxes: list, i: int, ndim: int, where: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    try:
        off, shp = boxes[i]
        off, shp = tuple(_int_list(off, where, "box", ndim)), tuple(_int_list(shp, where, "box", ndim))
    except (IndexError, TypeError, ValueError):
        raise _fail(where, f"{KEYS_FILE}: box {i} is missing or malformed") from None
    return off, shp


def _inside(span: tuple[int, int], outer: tuple[int, int]) -> bool:
    return outer[0] <= span[0] and span[1] <= outer[1]


class IndexedTensor:
    """A tensor of a format-2 checkpoint: dtype and shape from index.keys, pieces read when first asked for."""

    __slots__ = ("key", "key_id", "dtype", "shape", "_pieces", "_span", "_source")

    def __init__(self, key: str, key_id: int, dtype: str, shape: tuple[int, ...], source: IndexSource):
        self.key, self.key_id, self.dtype, self.shape = key, key_id, dtype, shape
        self._pieces: list[PieceMeta] | None = None
        self._span: tuple[int, int] | None = None  # the pieces are a window of the key's rows (for this span)
        self._source = source

    @property
    def pieces(self) -> list[PieceMeta]:
        """Every piece of the key (all its rows read)."""
        if self._pieces is None or self._span is not None:
            self._source.load([self.key])
        return self._pieces

    def window(self, lo: int, hi: int) -> tuple[list[PieceMeta], bool]:
        """``(pieces, whole)``: pieces among which are all those overlapping global flat elements ``[lo, hi)``
        (the rows the directory selects, or every piece: ``whole``)."""
        if self._pieces is None or (self._span is not None and not _inside((lo, hi), self._span)):
            self._source.load([self.key], {self.key: (lo, hi)})
        return self._pieces, self._span is None

    def to_json(self) -> dict:
        return {"dtype": self.dtype, "shape": list(self.shape), "pieces": [p.to_json() for p in self.pieces]}


class IndexedTensors(Mapping):
    """key -> IndexedTensor of every key of index.keys, each made when first asked for (100k keys: a load
    that asks for a few hundred does not pay for the others)."""

    def __init__(self, table: dict):
        self.table = table
        self.ids = table["ids"]
        self.made: dict[str, IndexedTensor] = {}
        self.source: IndexSource | None = None

    def __getitem__(self, key: str) -> IndexedTensor:
        t = self.made.get(key)
        if t is None:
            i = self.ids[key]
            t = self.made[key] = IndexedTensor(key, i, self.table["dtypes"][i], self.table["shapes"][i], self.source)
        return t

    def __contains__(self, key) -> bool:
        return key in self.ids

    def __iter__(self):
        return iter(self.ids)

    def __len__(self) -> int:
        return len(self.ids)


def open_indexed(d: dict, where: str, fetch: Fetch | None):
    """The CheckpointMetadata of a parsed format-2 or -3 ``metadata.json`` (the indexed formats): header fields typed, ``index.keys`` read
    whole (size and SHA-256 checked), pieces and checksums read through ``fetch`` when first needed."""
    if fetch is None:
        raise MetadataError(f"{where}: a format-2/3 checkpoint is read with its index objects (no fetch given)")
    fields, index = decode_header(d, where)
    fetch = CountedFetch(fetch)
    table = decode_keys(fetch(KEYS_FILE, 0, index["keys_bytes"]), index, where)
    md = CheckpointMetadata(
        checkpoint_id=fields["checkpoint_id"],
        world_size=fields["world_size"],
        chunk_bytes=fields["chunk_bytes"],
        checksum=fields["checksum"],
        created_unix=fields["created_unix"],
        files=fields["files"],
        values=fields["values"],
        version=fields["version"],
    )
    if "rank_values" in fields:
        md.rank_values = rank_values.RankValues(fetch, where, md.checkpoint_id, fields["rank_values"])
        both = set(md.rank_values.keys) & set(md.values)
        if both:
            raise _fail(where, f"keys stored both as per-rank and plain value: {sorted(both)[:5]}")
        md.values.update(md.rank_values.lists())
    overlap = set(table["keys"]) & set(md.values)
    if overlap:
        raise _fail(where, f"keys stored both as tensor and value: {sorted(overlap)[:5]}")
    tensors = IndexedTensors(table)
    source = tensors.source = IndexSource(fetch, where, table, fields, tensors)
    source.pieces_sha256, source.starts_sha256 = index["pieces_sha256"], index["starts_sha256"]
    source.fences_sha256, source.fences = index["fences_sha256"], None
    source.row_check = index["row_check"]
    md.tensors = tensors
    md.index = source
    return md
