"""What the layers above the training core read of a FullyShardFusion model, as a structural type.

Why: full-parameter access (full_params.py) and the checkpoint records (state/records.py) are handed the model
by FullyShardFusion's own methods (``fsdp.full_state_dict()``, ``fsdp.sharded_state_dict()``, ...), so they
cannot import its class without an import circle. They name here what they use of it; FullyShardFusion has it.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Protocol

import paddle

from ..buffers.fused_buffer import FusedBuffer


class ShardedModel(Protocol):
    """A model sharded by FullyShardFusion (fully_shard_fusion.py), as full_params.py and state/ see it."""

    model: paddle.nn.Layer  # the wrapped model
    buffers: list[FusedBuffer]  # one fused buffer per unit, in model order
    _optimizers: weakref.WeakSet  # optimizers whose master weights follow writebacks (summon_full_params)
    _summoned: bool  # inside summon_full_params

    @property
    def world_size(self) -> int: ...

    @property
    def _checkpoint_rank(self) -> int: ...

    def managed_parameters(self) -> Iterator[tuple[str, paddle.Tensor, FusedBuffer, int]]:
        """(structured key, parameter, buffer, index in buffer) for every parameter, in model order."""
        ...
