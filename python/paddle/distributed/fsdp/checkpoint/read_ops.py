"""The typed read operations of a load: where a region's bytes lie in a saved piece (``Segments``), the two
reads that fetch them (``RangeRead``: one contiguous range straight into its destination; ``ScatterRead``: small
scattered segments of one piece, through bounded windows), and an atomic load's reads into host targets
(``TargetRead``) grouped into file spans (``SpanPlan``). Why: the read path passed these as positional 4- and
5-tuples (a ``None`` marking the scattered kind) between regions.py, streamed.py and the load jobs; named fields
say what each number is, as PyTorch DCP's ``ReadItem`` does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .format.metadata import PieceMeta


@dataclass(frozen=True, eq=False)
class Segments:
    """The bytes of a region in one saved ``piece``: byte offsets (piece-relative ``src``, region-relative
    ``dst``) and ``length``, sorted by source; ``big`` marks the segments of at least two checksum chunks (read
    straight into the destination, no window buffer)."""

    piece: PieceMeta
    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray
    big: np.ndarray

    @property
    def all_big(self) -> bool:
        return bool(self.big.all())

    @property
    def first_byte(self) -> int:
        """The file offset of the first byte read (for reading in file order)."""
        return self.piece.offset + int(self.src[0])


@dataclass(frozen=True, eq=False)
class RangeRead:
    """Piece bytes ``[a, b)`` of ``key`` into ``out`` (uint8, ``b - a`` bytes)."""

    key: str
    piece: PieceMeta
    a: int
    b: int
    out: np.ndarray

    @property
    def nbytes(self) -> int:
        return self.b - self.a

    @property
    def first(self) -> int:
        return self.a


@dataclass(frozen=True, eq=False)
class ScatterRead:
    """Small segments of one piece of ``key``: piece bytes ``src[i] .. src[i] + length[i]`` into
    ``out[dst[i] ..]``, read through windows of at most ``window`` bytes (sorted by source, disjoint)."""

    key: str
    piece: PieceMeta
    src: np.ndarray
    dst: np.ndarray
    length: np.ndarray
    out: np.ndarray
    window: int

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())

    @property
    def first(self) -> int:
        return int(self.src[0])


@dataclass(frozen=True, eq=False)
class TargetRead:
    """Piece bytes ``[a, b)`` into a host target's own memory at byte ``dst`` (an atomic load's fast path:
    staged in a span buffer and copied at commit, or read in place)."""

    target: Any  # load/job.py's Target
    piece: PieceMeta
    a: int
    b: int
    dst: int

    @property
    def whole_piece(self) -> bool:
        return self.a == 0 and self.b == self.piece.nbytes


@dataclass(eq=False)
class SpanPlan:
    """File bytes ``[start, end)`` of the data object ``name`` read as one span, and the reads inside it, each with
    the piece range ``[a0, b0)`` it is verified over (whole chunks)."""

    name: str
    start: int
    end: int
    members: list[tuple[TargetRead, int, int]]
