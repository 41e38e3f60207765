"""Format 2: a small global index, piece rows read by key, and chunk checksums beside each data file.

Why: format 1 kept every piece's chunk checksums of every rank in ``metadata.json`` (~215 KB per GiB of state),
gathered on the coordinator and parsed whole by every loading rank. At thousands of ranks and terabytes that is
hundreds of MB per rank per load. In format 2 what a rank reads grows with the keys of the model and what it
loads, not with the world or the bytes of state::

    metadata.json        JSON (version 3; 2 before per-rank values had objects of their own): ids, chunk_bytes,
                         checksum, the data files (names, sizes, checksum counts), the JSON values, and the size +
                         SHA-256 of the two index objects below
    index.keys           zlib-compressed JSON, read whole: every key's dtype, shape and its rows [start, stop)
                         in index.pieces; the boxes of pieces that are not flat ranges of the whole tensor; the
                         safetensors names that are not the key
    index.pieces         PIECE_ROW rows (56 bytes, little-endian), sorted by key (format 3: a key's rows by their
                         first element): a load reads the rows of the keys it loads (coalesced ranges), verify
                         reads them all (SHA-256 in metadata.json)
    index.starts,        format 3: the row directory (row_directory.py): a rank loading part of a key split over
    index.fences         many ranks reads that key's fences, the block of starts and the rows overlapping its part
    <data file>.sums     written by the rank that wrote the data file (nothing gathered): its chunk checksums,
                         u64 little-endian, piece after piece in file order; a row's ``sums`` is its first one.
                         A load reads the checksums of the chunks it reads (blocks of SUMS_BLOCK).
    index.ranks,         version 3, a save with per-rank values (format/rank_values.py): each rank's own values
    <rank>.values        object, and the coordinator's table of their sizes and SHA-256; a rank reads its own

Every row carries a 32-bit check of its fields and its row number in ``pad`` (``row_checks``; ``"check":
"mix64"`` in metadata.json, saves since 2026-12-05), checked on each row a load reads: one flipped bit of a
row's ``file`` could otherwise point it at another rank's piece of the same layout, whose checksums match. Then
the structural checks (``_pieces``: key, file, bounds, sizes), no two rows read sharing bytes of a file, a whole
key's rows in directory order, the exact coverage of the key, and the data checksums the row points to;
``verify_checkpoint`` also checks the SHA-256 of every index object (a load of every row of a checkpoint
written before row checks checks that of index.pieces). ``index.keys`` inflates to the size metadata.json
declares (``inflated``; MAX_INFLATED_KEYS_BYTES for checkpoints without it).

Pure: the bytes of the objects (``encode``) and their checked headers (``decode_header``, ``decode_keys``); the
lazy views a load reads through are in index_view.py, which takes ``fetch(name, offset, length) -> bytes``
(directory.py) from the caller.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Callable, Iterable

import numpy as np

from ..errors import MetadataError
from . import rank_values
from .metadata import DTYPES, FileMeta, check_file_name
from .row_directory import FENCES_FILE, STARTS_FILE
from .schema import _Fields

KEYS_FILE = "index.keys"
PIECES_FILE = "index.pieces"
SUMS_SUFFIX = ".sums"
MAX_KEYS_BYTES = 1 << 30  # index.keys as stored (compressed): at most this
# index.keys inflates to the size metadata.json declares (``inflated``, saves since row checks); a checkpoint
# without it (written before) may inflate to this much (100k keys measure ~10 MB): a zip bomb stops here
MAX_INFLATED_KEYS_BYTES = 256 << 20
ROW_CHECK = "mix64"  # index.pieces rows carry a check of their own fields and position in ``pad`` (row_checks)
_MIX = np.uint64(0x9E3779B97F4A7C15)
_MASK32 = np.uint64(0xFFFFFFFF)

PIECE_ROW = np.dtype(
    [
        ("key", "<u4"),
        ("file", "<u4"),
        ("box", "<i4"),  # -1: the box is the whole tensor; else an index into index.keys' "boxes"
        ("pad", "<u4"),
        ("offset", "<u8"),
        ("nbytes", "<u8"),
        ("flat_a", "<i8"),  # -1: no flat range (the whole box)
        ("flat_b", "<i8"),
        ("sums", "<u8"),
    ]
)

Fetch = Callable[[str, int, int], bytes]  # (object name, offset, length) -> exactly those bytes


def sums_name(file: str) -> str:
    return file + SUMS_SUFFIX


def chunk_count(nbytes: int, chunk_bytes: int) -> int:
    return -(-nbytes // chunk_bytes)


def pack_sums(per_piece: Iterable[Iterable[int]]) -> bytes:
    """A data file's sidecar: the chunk checksums of its pieces, in file order."""
    flat = [int(c) for sums in per_piece for c in sums]
    return np.asarray(flat, dtype="<u8").tobytes()


# ------------------------------------------------------------------------------------------------------- writing


def row_checks(rows: np.ndarray, first_row: int) -> np.ndarray:
    """The check of each PIECE_ROW row (its ``pad``): a 64-bit multiply-xorshift chain over the row's other
    fields, seeded by its row number, folded to 32 bits. Every step is a bijection of the running value, so a
    damaged field (e.g. one flipped bit of ``file``, which would point the row at another rank's bytes of the
    same layout) or a row moved to another position always changes the 64-bit value; the 32 bits of it kept
    miss a damaged row with odds 2^-32. Vectorised: a few ns a row, no extra read (the check is in the row)."""
    words = np.ascontiguousarray(rows).view("<u8").reshape(len(rows), PIECE_ROW.itemsize // 8).T.copy()
    words[1] &= _MASK32  # word 1: box (low half) and pad (high half, the check itself)
    h = np.arange(first_row + 1, first_row + 1 + len(rows), dtype=np.uint64)
    h *= _MIX
    t = np.empty_like(h)
    for w in words:
        h ^= w
        h *= _MIX
        np.right_shift(h, np.uint64(29), out=t)
        h ^= t
    np.right_shift(h, np.uint64(32), out=t)
    h ^= t
    return (h & _MASK32).astype("<u4")


def keys_blob(keys: list, dtypes: list, shapes: list, row_starts: list, n_rows: int, extra: dict) -> bytes:
    """``index.keys``: per key (in row order) its dtype, shape (``ndims`` + the flat ``dims``) and row count;
    ``extra``: ``{"boxes": [[offset, shape]], "names": {row: name}}`` (pieces that are not whole-tensor boxes,
    safetensors names that are not the key)."""
    d = {
        "keys": keys,
        "dtypes": dtypes,
        "ndims": [len(s) for s in shapes],
        "dims": [int(x) for s in shapes for x in s],
        # format 3: rows per key (small repeated numbers: compresses ~3x better than the starts of format 2)
        "counts": np.diff(np.asarray(list(row_starts) + [n_rows], dtype=np.int64)).tolist(),
        "boxes": extra.get("boxes", []),
        "names": {str(r): n for r, n in extra.get("names", {}).items()},
    }
    return zlib.compress(json.dumps(d, separators=(",", ":")).encode(), 6)


def encode(
    header: dict,
    keys: bytes,
    files: list[tuple[str, int, int]],
    rows: np.ndarray,
    starts: np.ndarray,
    fences: np.ndarray,
    version: int,
) -> dict[str, bytes]:
    """The index objects of an indexed checkpoint: ``{name: bytes}`` with ``metadata.json`` last; ``version``:
    the format number it declares (versions.py ``WRITE_VERSION``).

    ``header``: checkpoint_id, created_unix, world_size, chunk_bytes, checksum, values, and optionally
    rank_values: ``(keys, index.ranks bytes)`` (rank_values.py). ``keys``: the ``keys_blob``. ``files``:
    ``(name, size, checksum count)`` by file index. ``rows``: PIECE_ROW array. ``starts``, ``fences``: the row
    directory (row_directory.py): one u64 per row, and every FENCE-th of a key with more rows."""
    rows = rows.astype(PIECE_ROW, copy=True)
    rows["pad"] = row_checks(rows, 0)
    pieces_blob = rows.tobytes()
    starts_blob = np.asarray(starts, dtype="<u8").tobytes()
    fences_blob = np.asarray(fences, dtype="<u8").tobytes()
    out = {KEYS_FILE: keys, PIECES_FILE: pieces_blob, STARTS_FILE: starts_blob, FENCES_FILE: fences_blob}
    default_names = all(name == f"{i}_0.safetensors" for i, (name, _s, _n) in enumerate(files))
    md = {
        "format": "paddle-fsdp-checkpoint",
        "version": version,
        **{k: header[k] for k in ("checkpoint_id", "created_unix", "world_size", "chunk_bytes", "checksum")},
        "files": {
            "names": None if default_names else [f[0] for f in files],
            "sizes": [int(f[1]) for f in files],
            "sums": [int(f[2]) for f in files],
        },
        "index": {
            KEYS_FILE: {
                "bytes": len(keys),
                "sha256": hashlib.sha256(keys).hexdigest(),
                "inflated": len(zlib.decompress(keys)),
            },
            PIECES_FILE: {
                "rows": int(len(rows)),
                "sha256": hashlib.sha256(pieces_blob).hexdigest(),
                "check": ROW_CHECK,
            },
            STARTS_FILE: {"sha256": hashlib.sha256(starts_blob).hexdigest()},
            FENCES_FILE: {"sha256": hashlib.sha256(fences_blob).hexdigest()},
        },
        "values": header["values"],
    }
    for extended in ("derived", "quant"):  # format 4's optional fields (versions.EXTENDED_FIELDS), only when used
        if header.get(extended):
            md[extended] = header[extended]
    if header.get("rank_values"):
        rank_keys, table = header["rank_values"]
        md["rank_values"] = rank_values.header_field(rank_keys, table)
        out[rank_values.TABLE_FILE] = table
    if header.get("codecs"):  # format 4 (versions.py): the stored data files' codecs (codecs.py)
        md["codecs"] = dict(header["codecs"])
    out["metadata.json"] = json.dumps(md, separators=(",", ":"), allow_nan=False).encode()
    return out


# ------------------------------------------------------------------------------------------------------- reading


def _fail(where: str, what: str) -> MetadataError:
    return MetadataError(f"{where}: {what}")


def _int_list(v, where: str, field: str, n: int | None = None, hi: int = 1 << 62) -> list[int]:
    if type(v) is not list or (n is not None and len(v) != n):
        raise _fail(where, f"field {field} must be a list of {n if n is not None else 'some'} integers")
    if v and (set(map(type, v)) - {int} or min(v) < 0 or max(v) > hi):
        raise _fail(where, f"field {field} must hold integers in [0, {hi}]")
    return v


def decode_header(d: dict, where: str) -> tuple[dict, dict]:
    """``(fields, index)`` of a parsed format-2 metadata.json: the typed header fields (``files`` as
    ``{name: FileMeta}``, plus ``sums_counts`` by file) and the index objects' declared sizes and hashes."""
    f = _Fields(where)
    files_d = f.obj(f.get(d, "files", "files"), "files")
    sizes = _int_list(files_d.get("sizes"), where, "files.sizes")
    counts = _int_list(files_d.get("sums"), where, "files.sums", len(sizes))
    names = files_d.get("names")
    if names is None:
        names = [f"{i}_0.safetensors" for i in range(len(sizes))]
    elif type(names) is not list or len(names) != len(sizes):
        raise _fail(where, "field files.names must be null or one name per size")
    files = {}
    for i, name in enumerate(names):
        check_file_name(name)
        if name in files:
            raise _fail(where, f"data file {name!r} is listed twice")
        files[name] = FileMeta(rank=i, size=sizes[i])
    idx = f.obj(f.get(d, "index", "index"), "index")
    keys_d = f.obj(f.get(idx, KEYS_FILE, f"index[{KEYS_FILE!r}]"), f"index[{KEYS_FILE!r}]")
    pieces_d = f.obj(f.get(idx, PIECES_FILE, f"index[{PIECES_FILE!r}]"), f"index[{PIECES_FILE!r}]")
    index = {
        "keys_bytes": f.int(f.get(keys_d, "bytes", "index.keys.bytes"), "index.keys.bytes", 0, MAX_KEYS_BYTES),
        "keys_sha256": f.str(f.get(keys_d, "sha256", "index.keys.sha256"), "index.keys.sha256", 64),
        "rows": f.int(f.get(pieces_d, "rows", "index.pieces.rows"), "index.pieces.rows", 0, 1 << 40),
        "pieces_sha256": f.str(f.get(pieces_d, "sha256", "index.pieces.sha256"), "index.pieces.sha256", 64),
        "starts_sha256": None,  # format 2: no row directory (every row of a key is read)
        "fences_sha256": None,
        "inflated": MAX_INFLATED_KEYS_BYTES,  # (a cap, when not declared)
        "inflated_declared": "inflated" in keys_d,
        "row_check": None,
    }
    if "inflated" in keys_d:
        index["inflated"] = f.int(keys_d["inflated"], "index.keys.inflated", 0, MAX_INFLATED_KEYS_BYTES)
    if "check" in pieces_d:
        index["row_check"] = f.str(pieces_d["check"], "index.pieces.check", 64)
        if index["row_check"] != ROW_CHECK:
            raise _fail(where, f"index.pieces.check {index['row_check']!r} is unknown (written by a newer build?)")
    for name, field in ((STARTS_FILE, "starts_sha256"), (FENCES_FILE, "fences_sha256")):
        if name in idx:
            d_ = f.obj(idx[name], f"index[{name!r}]")
            index[field] = f.str(f.get(d_, "sha256", f"{name}.sha256"), f"{name}.sha256", 64)
    fields = {
        "checkpoint_id": f.str(f.get(d, "checkpoint_id", "checkpoint_id"), "checkpoint_id", 128),
        "world_size": f.int(f.get(d, "world_size", "world_size"), "world_size", 1, 1 << 31),
        "chunk_bytes": f.int(f.get(d, "chunk_bytes", "chunk_bytes"), "chunk_bytes", 1, 1 << 40),
        "checksum": f.str(f.get(d, "checksum", "checksum"), "checksum", 64),
        "created_unix": f.number(d.get("created_unix", 0.0), "created_unix"),
        "files": files,
        "values": f.obj(d.get("values", {}), "values"),
        "sums_counts": counts,
        "version": d["version"],
    }
    if "rank_values" in d:
        fields["rank_values"] = rank_values.decode_field(d["rank_values"], fields["world_size"], where)
    if "codecs" in d:
        from .codecs import parse_codecs_field

        fields["codecs"] = parse_codecs_field(d["codecs"], files, where)
    if "quant" in d and d["version"] < 4:  # format 4's field (versions.py reads it): never in an older version
        raise _fail(where, f"field 'quant' in a format-{d['version']} checkpoint (it needs format 4)")
    return fields, index


def decode_keys(blob: bytes, index: dict, where: str) -> dict:
    """The parsed, checked ``index.keys``: ``keys``, ``dtypes``, ``shapes``, ``rows`` (starts + the row count)."""
    if len(blob) != index["keys_bytes"] or hashlib.sha256(blob).hexdigest() != index["keys_sha256"]:
        raise _fail(where, f"{KEYS_FILE} does not match its size and SHA-256 in metadata.json (damaged)")
    cap = index["inflated"]
    try:  # never more than ``cap`` bytes inflated: a zip bomb is refused, not inflated
        dec = zlib.decompressobj()
        text = dec.decompress(blob, cap + 1)
    except zlib.error as e:
        raise _fail(where, f"{KEYS_FILE} is not compressed JSON: {e}") from None
    if len(text) > cap or dec.unconsumed_tail:
        raise _fail(where, f"{KEYS_FILE} inflates beyond {cap} bytes")
    if index["inflated_declared"] and (len(text) != cap or not dec.eof):
        raise _fail(where, f"{KEYS_FILE} inflates to {len(text)} bytes, metadata.json declares {cap}")
    from .strict_json import loads_strict

    d = loads_strict(text, f"{where}: {KEYS_FILE}", _KEYS_TYPED)  # (nesting bounded: a MetadataError, no recursion)
    if type(d) is not dict or type(d.get("keys")) is not list:
        raise _fail(where, f"{KEYS_FILE} must be an object with a keys list")
    keys = d["keys"]
    n = len(keys)
    if set(map(type, keys)) - {str}:
        raise _fail(where, f"{KEYS_FILE}: keys must be distinct strings")
    ids = dict(zip(keys, range(n)))  # key -> its index (IndexedTensors), and the duplicate check
    if len(ids) != n:
        raise _fail(where, f"{KEYS_FILE}: keys must be distinct strings")
    dtypes = d.get("dtypes")
    if type(dtypes) is not list or len(dtypes) != n or set(map(type, dtypes)) - {str} or not set(dtypes) <= set(DTYPES):
        raise _fail(where, f"{KEYS_FILE}: dtypes must name a supported dtype per key")
    shapes = _shapes(d.get("ndims"), d.get("dims"), n, where)
    if "counts" in d:  # format 3: rows per key
        counts = _int_list(d.get("counts"), where, f"{KEYS_FILE} counts", n)
        rows = [0] + np.cumsum(np.asarray(counts, dtype=np.int64)).tolist()
    else:
        rows = _int_list(d.get("rows"), where, f"{KEYS_FILE} rows", n + 1)
    if rows[-1] != index["rows"] or rows[0] != 0 or (np.diff(np.asarray(rows, dtype=np.int64)) < 0).any():
        raise _fail(where, f"{KEYS_FILE}: row ranges must ascend from 0 to the {index['rows']} rows")
    boxes = d.get("boxes", [])
    names = d.get("names", {})
    if type(boxes) is not list or type(names) is not dict:
        raise _fail(where, f"{KEYS_FILE}: boxes must be a list and names an object")
    if names and (set(map(type, names.values())) != {str} or not all(map(str.isdigit, names))):
        raise _fail(where, f"{KEYS_FILE}: names must map row numbers to strings")
    return {"keys": keys, "ids": ids, "dtypes": dtypes, "shapes": shapes, "rows": rows, "boxes": boxes, "names": names}


# every field is typed field by field above (or by _box when used): loads_strict's generic walk is not needed
_KEYS_TYPED = frozenset({"keys", "dtypes", "ndims", "dims", "counts", "rows", "boxes", "names"})


def _shapes(ndims, dims, n: int, where: str) -> _Shapes:
    """The keys' shapes from ``ndims`` (one per key) and the flat ``dims``, checked in numpy (100k keys)."""
    nd = np.asarray(_int_list(ndims, where, f"{KEYS_FILE} ndims", n, 64), dtype=np.int64)
    flat = _int_list(dims, where, f"{KEYS_FILE} dims", int(nd.sum()) if n else 0)
    ends = np.cumsum(nd)
    if flat:
        c = np.concatenate([[0.0], np.cumsum(np.log2(np.maximum(np.asarray(flat, dtype=np.float64), 1.0)))])
        if (c[ends] - c[ends - nd] >= 61.9).any():  # log2 of each key's element count
            raise _fail(where, f"{KEYS_FILE}: a key declares 2^62 elements or more")
    return _Shapes(flat, (ends - nd).tolist(), ends.tolist())


class _Shapes:
    """Shape ``i`` as a tuple, cut from the flat dims when asked for (a load asks for its own keys only)."""

    def __init__(self, flat: list, starts: list, ends: list):
        self.flat, self.starts, self.ends = flat, starts, ends

    def __getitem__(self, i: int) -> tuple[int, ...]:
        return tuple(self.flat[self.starts[i] : self.ends[i]])

    def __len__(self) -> int:
        return len(self.starts)
