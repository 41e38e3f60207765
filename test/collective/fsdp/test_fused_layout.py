"""The fused layout: every parameter element is owned by exactly one rank, whatever the world size."""

from __future__ import annotations

import json
import math

import pytest
from paddle.distributed.fsdp.buffers.fused_layout import ALIGNMENT_BYTES, BufferLayout

SHAPES = [("a", (3, 5)), ("b", (7,)), ("c", ()), ("d", (2, 3, 4)), ("e", (1,))]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 64, 200])
@pytest.mark.parametrize("element_size", [2, 4, 8])
def test_pieces_tile_every_parameter_exactly_once(world, element_size):
    layout = BufferLayout.plan("buf", "float32", element_size, True, SHAPES, world)
    assert layout.padded_numel == layout.shard_numel * world
    align = ALIGNMENT_BYTES // element_size
    assert all(slot.offset % align == 0 for slot in layout.slots)
    assert all(a.end <= b.offset for a, b in zip(layout.slots, layout.slots[1:])), "slots overlap"
    covered = {key: [0] * math.prod(shape) for key, shape in SHAPES}
    for rank in range(world):
        start, stop = layout.shard_range(rank)
        for piece in layout.local_pieces(rank):
            # the piece sits inside this rank's shard at the same place as inside the buffer
            assert start + piece.shard_start == piece.slot.offset + piece.param_start
            assert piece.shard_start + piece.length <= stop - start
            for i in range(piece.param_start, piece.param_stop):
                covered[piece.slot.key][i] += 1
    assert all(count == 1 for counts in covered.values() for count in counts), covered


def test_describe_is_json_and_queries_agree():
    layout = BufferLayout.plan("buf", "bfloat16", 2, False, SHAPES, 3, {"scope": "unit:blocks.0"})
    described = json.loads(json.dumps(layout.describe()))
    assert [s["key"] for s in described["slots"]] == [k for k, _ in SHAPES]
    assert described["attrs"] == {"scope": "unit:blocks.0"}
    for rank in range(3):
        for piece in layout.local_pieces(rank):
            assert layout.local_piece(piece.slot.key, rank) == piece
    with pytest.raises(ValueError, match="outside world"):
        layout.shard_range(3)
