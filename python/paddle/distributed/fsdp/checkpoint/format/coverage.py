"""Exact coverage of a tensor by its pieces, with work bounded by the number of pieces, never by their shapes.

Why: a checkpoint's pieces must cover every element of each tensor exactly once; a load that only counts
elements accepts pieces that overlap and leave a gap (8 + 8 = 16 of 16 elements) and fills the gap with
whatever the staging memory held. Listing the flat runs of every piece (geometry.Region.runs) would be exact too,
but costs memory proportional to the rows a piece *declares*: a 2 KB crafted index declaring a column box of
2^30 rows would need gigabytes. Here each region is cut into at most ``2 * ndim + 1`` boxes (a box, or a flat
range of one, is a union of a few boxes), and boxes are compared pairwise on their bounds, so the cost depends
on the number of pieces only. With no two boxes overlapping, the sum of their volumes is the number of elements
covered, so equal to the tensor's element count means every element exactly once.

``coverage_problems`` is THE check: verify_checkpoint (every tensor), load_state_dict and load_full_state_dict
(every requested tensor, before any byte of data is read) and the save plan all use it.
"""

from __future__ import annotations

import math

import numpy as np

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offset, extent) in global coordinates

# Below this many flat runs in total, a gap is reported with its first uncovered flat element (exact message of
# the run-based check); above it only the counts are given.
_MESSAGE_RUNS_LIMIT = 1 << 16


def flat_range_boxes(shape: tuple[int, ...], a: int, b: int) -> list[Box]:
    """Boxes (local to an array of ``shape``) whose union is its row-major flat elements ``[a, b)``."""
    if a >= b:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    i0, r0 = divmod(a, inner)
    i1, r1 = divmod(b, inner)
    out: list[Box] = []

    def row(i: int, lo: int, hi: int) -> None:
        for off, ext in flat_range_boxes(shape[1:], lo, hi):
            out.append(((i, *off), (1, *ext)))

    if i0 == i1:
        row(i0, r0, r1)
        return out
    if r0:
        row(i0, r0, inner)
        i0 += 1
    if i1 > i0:
        out.append(((i0, *(0,) * (len(shape) - 1)), (i1 - i0, *shape[1:])))
    if r1:
        row(i1, 0, r1)
    return out


def region_boxes(box_offset, box_shape, flat_range) -> list[Box]:
    """Global boxes of a region: its box, or the boxes of the flat range of it."""
    box_offset, box_shape = tuple(box_offset), tuple(box_shape)
    if flat_range is None:
        return [] if any(s == 0 for s in box_shape) else [(box_offset, box_shape)]
    local = flat_range_boxes(box_shape, int(flat_range[0]), int(flat_range[1]))
    return [(tuple(o + p for o, p in zip(box_offset, off)), ext) for off, ext in local]


def flat_span(shape, box_offset, box_shape, flat_range) -> tuple[int, int]:
    """``[first, last + 1)`` global row-major flat indices of a region's elements (``(0, 0)`` when empty), from its
    bounds alone: O(ndim), whatever the number of rows the region declares."""
    shape, box_offset, box_shape = tuple(shape), tuple(box_offset), tuple(box_shape)
    n = math.prod(box_shape) if box_shape else 1
    a, b = (0, n) if flat_range is None else (int(flat_range[0]), int(flat_range[1]))
    if a >= b or n == 0:
        return 0, 0
    if box_shape == shape and not any(box_offset):  # a box of the whole tensor (FSDP's flat pieces): as is
        return a, b

    def global_index(local: int) -> int:
        idx = []
        for s in reversed(box_shape):
            local, r = divmod(local, s)
            idx.append(r)
        g = 0
        for o, i, s in zip(box_offset, reversed(idx), shape):
            g = g * s + o + i
        return g

    return global_index(a), global_index(b - 1) + 1


def _run_count(shape, box_shape) -> int:
    """Flat runs of a box (what Region.runs would list)."""
    nd = len(shape)
    k = nd - 1
    while k > 0 and box_shape[k] == shape[k]:
        k -= 1
    return math.prod(box_shape[:k]) if nd else 1


def coverage_problems(key: str, shape, regions: list) -> list[str]:
    """Problems (empty: exact) of ``regions``, a list of ``(owner, Region)`` (owner: a rank or file index),
    covering the tensor of ``shape``: overlaps (naming both owners) or elements left uncovered."""
    shape = tuple(int(s) for s in shape)
    total = math.prod(shape) if all(s > 0 for s in shape) or not shape else 0
    single = [(reg.single_run(), owner) for owner, reg in regions]
    if all(run is not None for run, _ in single):
        return _interval_problems(key, total, [(a, a + n, o) for (a, n), o in single if n > 0])
    boxes: list[tuple[Box, int]] = []
    for owner, reg in regions:
        for bx in region_boxes(reg.box_offset, reg.box_shape, reg.flat_range):
            boxes.append((bx, owner))
    problem = _box_overlap(key, boxes)
    if problem is not None:
        return [problem]
    covered = sum(math.prod(ext) for (_off, ext), _o in boxes)
    if covered == total:
        return []
    if sum(_run_count(shape, reg.box_shape) for _o, reg in regions) <= _MESSAGE_RUNS_LIMIT:
        return runs_coverage_problems(key, total, regions)  # same verdict; its message names the first gap
    return [f"key {key!r}: records cover {covered} of {total} elements"]


def _box_overlap(key: str, boxes: list[tuple[Box, int]]) -> str | None:
    """First pair of boxes sharing an element (a sweep over one dimension, vectorised over the rest)."""
    if len(boxes) < 2:
        return None
    nd = len(boxes[0][0][0])
    if nd == 0:
        return f"key {key!r}: overlapping records (owners {boxes[0][1]} and {boxes[1][1]} both hold flat element 0)"
    # bounds fit int64: every box lies inside its tensor, whose dimensions are at most 2**62 (schema.py)
    lo = np.array([off for (off, _e), _o in boxes], dtype=np.int64).reshape(len(boxes), nd)
    hi = lo + np.array([e for (_off, e), _o in boxes], dtype=np.int64).reshape(len(boxes), nd)
    # sweep along the dimension where the boxes start at the most distinct places (column shards: the columns),
    # so each box is compared with few candidates
    k = max(range(nd), key=lambda d: len(np.unique(lo[:, d])))
    order = np.argsort(lo[:, k], kind="stable")
    lo, hi = lo[order], hi[order]
    owners = [boxes[i][1] for i in order.tolist()]
    starts0 = lo[:, k]
    for i in range(len(boxes) - 1):
        # candidates: later boxes starting (dim 0) before this one ends
        j_end = int(np.searchsorted(starts0, hi[i, k], "left"))
        if j_end <= i + 1:
            continue
        cand_lo, cand_hi = lo[i + 1 : j_end], hi[i + 1 : j_end]
        hit = np.all((cand_lo < hi[i]) & (lo[i] < cand_hi), axis=1)
        if hit.any():
            j = i + 1 + int(np.argmax(hit))
            corner = np.maximum(lo[i], lo[j]).tolist()
            return (
                f"key {key!r}: overlapping records (owners {owners[i]} and {owners[j]} both hold the element at "
                f"index {corner})"
            )
    return None


def runs_coverage_problems(key: str, total: int, regions: list) -> list[str]:
    """coverage_problems by listing every flat run of every region (``Region.runs``): exact, with memory
    proportional to the runs; names the first uncovered element. The reference the bounded check is tested
    against, and its message for gaps when the runs are few."""
    parts = []
    for owner, reg in regions:
        s, l = reg.runs()
        parts.append((s, l, np.full(len(s), owner, dtype=np.int64)))
    if parts:
        starts = np.concatenate([p[0] for p in parts])
        lengths = np.concatenate([p[1] for p in parts])
        owners = np.concatenate([p[2] for p in parts])
    else:
        starts = lengths = owners = np.zeros(0, np.int64)
    problems = []
    order = np.argsort(starts, kind="stable")
    starts, lengths, owners = starts[order], lengths[order], owners[order]
    ends = starts + lengths
    if len(starts) > 1:
        bad = np.nonzero(starts[1:] < ends[:-1])[0]
        if len(bad):
            i = int(bad[0])
            problems.append(
                f"key {key!r}: overlapping records (owners {int(owners[i])} and {int(owners[i + 1])} both hold "
                f"flat element {int(starts[i + 1])})"
            )
    covered = int(lengths.sum())
    if not problems and covered != total:
        # find the first gap for the message
        pos, gap = 0, None
        for s, e in zip(starts.tolist(), ends.tolist()):
            if s > pos:
                gap = pos
                break
            pos = max(pos, e)
        if gap is None:
            gap = pos
        problems.append(
            f"key {key!r}: records cover {covered} of {total} elements (first uncovered flat element {gap})"
        )
    return problems


def _interval_problems(key: str, total: int, spans: list[tuple[int, int, int]]) -> list[str]:
    """coverage_problems for regions that are single runs (start, end, owner): the same checks and messages."""
    spans = sorted(spans, key=lambda sp: sp[0])  # stable, like the general path
    for (_s0, e0, o0), (s1, _e1, o1) in zip(spans, spans[1:]):
        if s1 < e0:
            return [f"key {key!r}: overlapping records (owners {o0} and {o1} both hold flat element {s1})"]
    covered = sum(e - s for s, e, _o in spans)
    if covered == total:
        return []
    pos = 0
    for s, e, _o in spans:
        if s > pos:
            break
        pos = max(pos, e)
    return [f"key {key!r}: records cover {covered} of {total} elements (first uncovered flat element {pos})"]
