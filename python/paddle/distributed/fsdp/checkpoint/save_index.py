"""The coordinator's part of a format-2 commit: the index objects (format/index.py) of a save.

Nothing here needs another rank's checksums (each rank wrote its own ``<file>.sums``) nor its file layout: the
rows follow from the write assignment every rank holds, and each rank reports its header length, file size and
checksum count (O(1) bytes) with its hand-over, which are checked against the assignment. The columns of the
rows (key, file, offsets in the data region, flat ranges, first checksum) and the compressed key table depend
on the assignment only, so they are computed once per assignment (``assignment_columns``, remembered with it:
a training job's saves reuse it) and a commit only adds the header lengths and hashes: numpy work, linear in
the pieces with a small constant.
"""

from __future__ import annotations

import numpy as np

from .errors import SaveFailedError
from .format.index import PIECE_ROW, chunk_count, encode, keys_blob
from .format.metadata import DTYPES, numel, rank_file_name
from .format.reserved import QUANT_KEY
from .format.row_directory import NO_START, fences_of
from .format.versions import write_version


def _columns(keys, dtypes, shapes, pieces, files, boxes, names) -> dict:
    """Columns sorted by key, a key's rows by their first flat element (the row directory, index.starts: keys
    with box pieces keep their order and get NO_START), the row starts and the key table. ``pieces``: int64
    array ``[kid, file, box, rel, nbytes, fa, fb, sums]`` per piece."""
    a = np.asarray(pieces, dtype=np.int64).reshape(-1, 8)
    first = np.where(a[:, 5] >= 0, a[:, 5], 0)  # a flat range of the whole tensor starts there; a whole one at 0
    order = np.lexsort((a[:, 6], first, a[:, 0]))  # (ties: an empty flat range before the range it starts)
    a, first = a[order], first[order]
    starts = np.searchsorted(a[:, 0], np.arange(len(keys)), side="left")
    boxed = np.zeros(len(keys), bool)
    boxed[a[a[:, 2] >= 0, 0]] = True  # keys with a piece that is a box of the tensor: no directory
    directory = first.astype(np.uint64)
    directory[boxed[a[:, 0]]] = NO_START
    remap = {int(old): new for new, old in enumerate(order.tolist())} if names else {}
    cols = {
        "rows": a,
        "starts": directory,
        "fences": fences_of(directory, np.append(starts, len(a)).astype(np.int64)),
        "files": files,
        "keys_blob": keys_blob(
            keys,
            dtypes,
            shapes,
            starts.tolist(),
            len(a),
            {"boxes": boxes, "names": {remap[r]: n for r, n in names.items()}},
        ),
    }
    return cols


def assignment_columns(assignment, chunk_bytes: int) -> dict:
    """The rows of a save of ``assignment`` (planner.WriteAssignment) but the header lengths, remembered with
    it. Mirrors planner.lay_out_files: each rank's records in its write order, bytes packed from the start of
    its data region, pieces named by their key."""
    cached = assignment.cache.get(("columns", chunk_bytes))
    if cached is not None:
        return cached
    keys = [k for k, _d, _s in assignment.specs]
    kid = {k: i for i, k in enumerate(keys)}
    rows, boxes, files = [], [], []
    for rank in range(len(assignment.writes)):
        pos = sums = 0
        for key, w in assignment.writes[rank]:
            _k, dtype, shape, off, box, fr = w[:6]
            n = (fr[1] - fr[0]) if fr is not None else (0 if any(s == 0 for s in box) else numel(box))
            nbytes = max(0, n) * DTYPES[dtype][0]
            b = -1
            if tuple(box) != tuple(shape) or any(off):
                b = len(boxes)
                boxes.append([list(off), list(box)])
            fa, fb = fr if fr is not None else (-1, -1)
            rows.append((kid[key], rank, b, pos, nbytes, fa, fb, sums))
            pos += nbytes
            sums += chunk_count(nbytes, chunk_bytes)
        files.append((rank_file_name(rank), pos, sums))  # (name, bytes of the data region, checksums)
    shapes = [tuple(s) for _k, _d, s in assignment.specs]
    cols = _columns(keys, [d for _k, d, _s in assignment.specs], shapes, rows, files, boxes, {})
    assignment.cache[("columns", chunk_bytes)] = cols
    return cols


def piece_columns(tensors: dict, files: list[tuple[str, int]], chunk_bytes: int) -> dict:
    """The rows of existing pieces (format-1 metadata: convert.py); ``files``: ``(name, size)`` by index. Each
    file's pieces get their checksums in offset order; offsets stay absolute (header length 0)."""
    fidx = {name: i for i, (name, _size) in enumerate(files)}
    keys = list(tensors)
    by_file: dict[int, list] = {i: [] for i in range(len(files))}
    rows, boxes, names = [], [], {}
    for k, key in enumerate(keys):
        tm = tensors[key]
        for p in tm.pieces:
            b = -1
            if tuple(p.box_shape) != tuple(tm.shape) or any(p.box_offset):
                b = len(boxes)
                boxes.append([list(p.box_offset), list(p.box_shape)])
            if p.name != key:
                names[len(rows)] = p.name
            fa, fb = p.flat_range if p.flat_range is not None else (-1, -1)
            by_file[fidx[p.file]].append((p.offset, len(rows)))
            rows.append([k, fidx[p.file], b, p.offset, p.nbytes, fa, fb, 0])
    counts = []
    for i in range(len(files)):
        s = 0
        for _off, r in sorted(by_file[i]):
            rows[r][7] = s
            s += chunk_count(rows[r][4], chunk_bytes)
        counts.append(s)
    out_files = [(name, None, counts[i]) for i, (name, _size) in enumerate(files)]
    shapes = [tuple(tensors[k].shape) for k in keys]
    return _columns(keys, [tensors[k].dtype for k in keys], shapes, rows, out_files, boxes, names)


def index_objects(cols: dict, header: dict, reported: dict[int, dict], with_sums: bool) -> dict[str, bytes]:
    """``{name: bytes}`` of index.keys, index.pieces and metadata.json (last); ``reported``: file index -> the
    rank's hand-over ``{"size", "header", "sums"}``; SaveFailedError when one does not match the assignment."""
    files = []
    head = np.zeros(len(cols["files"]), np.int64)
    for i, (name, data_len, n_sums) in enumerate(cols["files"]):
        got = reported[i]
        head[i] = int(got.get("header", 0))
        count = n_sums if with_sums else 0
        size = int(got["size"])
        if (data_len is not None and size != head[i] + data_len) or int(got.get("sums", 0)) != count:
            raise SaveFailedError(f"rank {i} reported a file that does not match the plan")
        files.append((name, size, count))
    a = cols["rows"]
    rows = np.zeros(len(a), PIECE_ROW)
    if len(a):
        rows["key"], rows["file"], rows["box"] = a[:, 0], a[:, 1], a[:, 2]
        rows["offset"] = a[:, 3] + head[a[:, 1]]
        rows["nbytes"], rows["flat_a"], rows["flat_b"], rows["sums"] = a[:, 4], a[:, 5], a[:, 6], a[:, 7]
    if QUANT_KEY in header["values"]:  # lossy moments (checkpoint/lossy.py): a top-level field of format 4
        values = dict(header["values"])
        header = {**header, "values": values, "quant": values.pop(QUANT_KEY)}
    version = write_version(header)
    return encode(header, cols["keys_blob"], files, rows, cols["starts"], cols["fences"], version)
