"""The coordinator's part of a format-2 commit: the index objects (format/index.py) from the save plan.

Nothing here needs another rank's checksums (each rank wrote its own ``<file>.sums``): the rows follow from the
plan every rank holds, the coordinator checks each rank's reported size and checksum count against it. Linear
in the number of pieces, one pass; the per-piece work is a tuple append (the arrays are built in numpy).
"""

from __future__ import annotations

import numpy as np

from .errors import SaveFailedError
from .format.index import PIECE_ROW, chunk_count, encode


def sums_counts(plan, chunk_bytes: int, with_sums: bool) -> list[int]:
    """Checksums each rank's sidecar holds (0 without checksums), by rank."""
    if not with_sums:
        return [0] * len(plan.files)
    return [sum(chunk_count(p.nbytes, chunk_bytes) for _k, p in plan.files[r].pieces) for r in range(len(plan.files))]


def index_objects(plan, header: dict, reported: dict[int, dict], with_sums: bool) -> dict[str, bytes]:
    """``{name: bytes}`` of index.keys, index.pieces and metadata.json (last) of the checkpoint of ``plan``;
    ``reported``: rank -> its hand-over ``{"size", "sums"}``; SaveFailedError when one does not match the plan."""
    chunk = header["chunk_bytes"]
    world = len(plan.files)
    first_sum: dict[int, int] = {}  # id(piece) -> index of its first checksum in its file's sidecar
    files = []
    for r in range(world):
        layout = plan.files[r]
        pos = 0
        for _key, p in layout.pieces:
            first_sum[id(p)] = pos
            pos += chunk_count(p.nbytes, chunk)
        count = pos if with_sums else 0
        got = reported[r]
        if int(got["size"]) != layout.size or int(got.get("sums", 0)) != count:
            raise SaveFailedError(f"rank {r} reported a file that does not match the plan")
        files.append((layout.name, layout.size, count))
    file_index = {name: i for i, (name, _s, _c) in enumerate(files)}
    tensors, boxes, names, cols = {}, [], {}, []
    for key, tm in plan.tensors.items():
        start = len(cols)
        whole = tuple(tm.shape)
        for p in tm.pieces:
            box = -1
            if tuple(p.box_shape) != whole or any(p.box_offset):
                box = len(boxes)
                boxes.append([list(p.box_offset), list(p.box_shape)])
            fa, fb = p.flat_range if p.flat_range is not None else (-1, -1)
            if p.name != key:
                names[len(cols)] = p.name
            cols.append((file_index[p.file], box, p.offset, p.nbytes, fa, fb, first_sum[id(p)], len(tensors)))
        tensors[key] = (tm.dtype, whole, start, len(cols))
    rows = np.zeros(len(cols), PIECE_ROW)
    if cols:
        a = np.array(cols, dtype=np.int64)
        rows["file"], rows["box"], rows["offset"], rows["nbytes"] = a[:, 0], a[:, 1], a[:, 2], a[:, 3]
        rows["flat_a"], rows["flat_b"], rows["sums"], rows["key"] = a[:, 4], a[:, 5], a[:, 6], a[:, 7]
    return encode(header, tensors, files, rows, {"boxes": boxes, "names": names})
