"""Region geometry: which elements of a global tensor a record holds, as flat runs, and how two run lists meet.

Every tensor is seen as its global row-major flat index space. A *region* (a box of the global tensor, optionally
narrowed to a ``[start, stop)`` range of the box's row-major flattening) covers a sorted list of contiguous flat
*runs*. Saving on N ranks and loading on M ranks, with any mix of box and flattened records, is then an interval
intersection between the runs of a requested region and the runs of each saved piece; the result is a list of
segments ``(source element offset in the piece, destination element offset in the target, length)``.

Why a module of its own: the planner (save and load plans) and the write assignment (assign.py, which the
planner calls) both need it; it depends on neither. All run arithmetic is vectorised with numpy so boxes with
many rows stay cheap.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .errors import InvalidStateDictError
from .format.metadata import PieceMeta, numel


@dataclass(frozen=True)
class Region:
    """Which elements of a global tensor of ``shape`` a record holds, in the record's storage order."""

    shape: tuple[int, ...]
    box_offset: tuple[int, ...]
    box_shape: tuple[int, ...]
    flat_range: tuple[int, int] | None = None

    @staticmethod
    def full(shape) -> Region:
        shape = tuple(map(int, shape))
        return Region(shape, (0,) * len(shape), shape, None)

    def normalized(self) -> Region:
        """Drop a flat_range that covers the whole box, so equal coverage compares equal."""
        if self.flat_range is not None and self.flat_range == (0, numel(self.box_shape)):
            return Region(self.shape, self.box_offset, self.box_shape, None)
        return self

    @property
    def numel(self) -> int:
        if self.flat_range is not None:
            return self.flat_range[1] - self.flat_range[0]
        if any(s == 0 for s in self.box_shape):
            return 0
        return numel(self.box_shape)

    def check(self, key: str) -> None:
        shape = self.shape
        whole = self.box_shape == shape and len(self.box_offset) == len(shape) and not any(self.box_offset)
        if not (whole and min(shape, default=0) >= 0):  # the whole tensor as the box (FSDP's records) is fine
            self._check_box(key)
        if self.flat_range is not None:
            a, b = self.flat_range
            if not (0 <= a <= b <= numel(self.box_shape)):
                raise InvalidStateDictError(
                    f"key {key!r}: flattened_range [{a}, {b}) outside the {numel(self.box_shape)} elements of its box"
                )

    def _check_box(self, key: str) -> None:
        nd = len(self.shape)
        if len(self.box_offset) != nd or len(self.box_shape) != nd:
            raise InvalidStateDictError(
                f"key {key!r}: global_offset {self.box_offset} / local_shape {self.box_shape} do not match "
                f"the rank of global_shape {self.shape}"
            )
        for o, s, g in zip(self.box_offset, self.box_shape, self.shape):
            if g < 0 or o < 0 or s < 0 or o + s > g:
                raise InvalidStateDictError(
                    f"key {key!r}: local box offset {self.box_offset} shape {self.box_shape} lies outside "
                    f"global shape {self.shape}"
                )

    def single_run(self) -> tuple[int, int] | None:
        """(start, length) when the region is one contiguous global run whose box is the whole tensor (the
        usual case: FSDP's flattened ranges and replicated tensors), else None. Lets planning skip numpy."""
        if self.box_shape != self.shape or any(self.box_offset):
            return None
        if self.flat_range is not None:
            a, b = self.flat_range
            return a, max(0, b - a)
        return 0, self.numel

    def runs(self) -> tuple[np.ndarray, np.ndarray]:
        """(starts, lengths) of the contiguous global flat runs, ascending, in storage order."""
        shape, off, box = self.shape, self.box_offset, self.box_shape
        nd = len(shape)
        empty = (np.zeros(0, np.int64), np.zeros(0, np.int64))
        one = self.single_run()
        if one is not None:
            if one[1] == 0:
                return empty
            return np.array([one[0]], np.int64), np.array([one[1]], np.int64)
        if nd == 0:
            starts, lengths = np.zeros(1, np.int64), np.ones(1, np.int64)
        elif any(s == 0 for s in box):
            return empty
        else:
            strides = [1] * nd
            for j in range(nd - 2, -1, -1):
                strides[j] = strides[j + 1] * shape[j + 1]
            # k: last dim whose box extent is not the full dim (the dims after it are contiguous)
            k = nd - 1
            while k > 0 and box[k] == shape[k]:
                k -= 1
            run_len = box[k] * strides[k]
            starts = np.array([off[k] * strides[k]], dtype=np.int64)
            for j in range(k - 1, -1, -1):
                idx = (off[j] + np.arange(box[j], dtype=np.int64)) * strides[j]
                starts = np.add.outer(idx, starts).ravel()
            lengths = np.full(starts.shape, run_len, dtype=np.int64)
        if self.flat_range is None:
            return starts, lengths
        a, b = self.flat_range
        if a >= b:
            return empty
        ends_local = np.cumsum(lengths)
        first = int(np.searchsorted(ends_local, a, side="right"))
        last = int(np.searchsorted(ends_local, b - 1, side="right"))
        starts = starts[first : last + 1].copy()
        lengths = lengths[first : last + 1].copy()
        begin_local = ends_local[first] - lengths[0]
        skip = a - begin_local
        starts[0] += skip
        lengths[0] -= skip
        end_local = ends_local[last]
        lengths[-1] -= end_local - b
        return starts, lengths


def region_of_piece(shape, piece: PieceMeta) -> Region:
    return Region(tuple(shape), tuple(piece.box_offset), tuple(piece.box_shape), piece.flat_range)


@dataclass
class Segments:
    """Element segments copied from one source piece into one destination record."""

    src: np.ndarray  # element offset inside the source piece
    dst: np.ndarray  # element offset inside the destination record
    length: np.ndarray

    @property
    def total(self) -> int:
        return int(self.length.sum())


def intersect(dst_runs, src_runs) -> Segments:
    """Intersect two sorted, non-overlapping run lists; offsets are local storage offsets of each side."""
    a_s, a_l = dst_runs
    b_s, b_l = src_runs
    if len(a_s) == 0 or len(b_s) == 0:
        z = np.zeros(0, np.int64)
        return Segments(z, z, z)
    a_e = a_s + a_l
    b_e = b_s + b_l
    a_loc = np.cumsum(a_l) - a_l
    b_loc = np.cumsum(b_l) - b_l
    lo = np.searchsorted(b_e, a_s, side="right")
    hi = np.searchsorted(b_s, a_e, side="left")
    counts = np.maximum(hi - lo, 0)
    total = int(counts.sum())
    if total == 0:
        z = np.zeros(0, np.int64)
        return Segments(z, z, z)
    ii = np.repeat(np.arange(len(a_s), dtype=np.int64), counts)
    first_of = np.cumsum(counts) - counts
    jj = np.arange(total, dtype=np.int64) - np.repeat(first_of, counts) + np.repeat(lo, counts)
    seg_s = np.maximum(a_s[ii], b_s[jj])
    seg_e = np.minimum(a_e[ii], b_e[jj])
    keep = seg_e > seg_s
    ii, jj, seg_s, seg_e = ii[keep], jj[keep], seg_s[keep], seg_e[keep]
    return Segments(
        src=b_loc[jj] + (seg_s - b_s[jj]),
        dst=a_loc[ii] + (seg_s - a_s[ii]),
        length=seg_e - seg_s,
    )
