"""Where every parameter lives: which fused buffer, which offsets, which rank owns which range.

This module is pure bookkeeping (no tensors, no communication), so the checkpoint code, the tools and the
tests can all ask the same questions of one object. Offsets are in elements of the buffer's dtype.

A buffer is laid out as ``[param0][pad][param1][pad]...[pad]``: each parameter starts on an aligned
offset and the total is padded to a multiple of the world size, so every rank owns exactly
``padded_numel / world_size`` contiguous elements. Padding elements belong to no parameter; they stay
zero in parameters and gradients, and checkpoints never record them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# Each parameter starts on a multiple of this many bytes: GPU kernels and collectives like aligned
# addresses, and it costs at most a few hundred bytes per parameter.
ALIGNMENT_BYTES = 256


@dataclass(frozen=True)
class ParamSlot:
    """One parameter's place inside a fused buffer."""

    key: str  # structured name, e.g. "blocks.0.attn.q.weight"
    shape: tuple[int, ...]
    offset: int  # first element inside the buffer

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class LocalPiece:
    """The part of one parameter that one rank owns: a contiguous range of its flattened elements."""

    slot: ParamSlot
    param_start: int  # inside the flattened parameter
    param_stop: int
    shard_start: int  # the same elements inside the rank's local shard of the buffer

    @property
    def length(self) -> int:
        return self.param_stop - self.param_start


@dataclass
class BufferLayout:
    """The layout of one fused buffer over ``world_size`` ranks."""

    name: str
    dtype: str
    trainable: bool
    slots: list[ParamSlot]
    padded_numel: int
    world_size: int
    attrs: dict = field(default_factory=dict)  # why the params were grouped (unit, decay policy, tied)

    @classmethod
    def plan(
        cls,
        name: str,
        dtype: str,
        element_size: int,
        trainable: bool,
        params: list[tuple[str, tuple[int, ...]]],
        world_size: int,
        attrs: dict | None = None,
    ) -> BufferLayout:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        align = max(1, ALIGNMENT_BYTES // element_size)
        slots, cursor = [], 0
        for key, shape in params:
            cursor = _round_up(cursor, align)
            slots.append(ParamSlot(key, tuple(int(d) for d in shape), cursor))
            cursor += slots[-1].numel
        padded = _round_up(max(cursor, 1), world_size)
        return cls(name, dtype, trainable, slots, padded, world_size, dict(attrs or {}))

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    @property
    def used_numel(self) -> int:
        return sum(s.numel for s in self.slots)

    def shard_range(self, rank: int) -> tuple[int, int]:
        """The buffer range [start, stop) that ``rank`` owns."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of size {self.world_size}")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def local_pieces(self, rank: int) -> list[LocalPiece]:
        """Every parameter range that ``rank`` owns, in buffer order; parameters it owns none of are absent."""
        start, stop = self.shard_range(rank)
        pieces = []
        for slot in self.slots:
            lo, hi = max(start, slot.offset), min(stop, slot.end)
            if lo < hi:
                pieces.append(LocalPiece(slot, lo - slot.offset, hi - slot.offset, lo - start))
        return pieces

    def local_piece(self, key: str, rank: int) -> LocalPiece | None:
        for piece in self.local_pieces(rank):
            if piece.slot.key == key:
                return piece
        return None

    def describe(self) -> dict:
        """A JSON-friendly summary, for logs, tools and checkpoint metadata."""
        return {
            "name": self.name,
            "dtype": self.dtype,
            "trainable": self.trainable,
            "padded_numel": self.padded_numel,
            "world_size": self.world_size,
            "attrs": self.attrs,
            "slots": [{"key": s.key, "shape": list(s.shape), "offset": s.offset} for s in self.slots],
        }


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple
