"""Collectives of the expert buffers under expert parallelism (see expert_parallel.py).

An expert buffer is sharded over the expert-data-parallel group (the ranks holding the same experts); its
gathers, reduce-scatters, "who got a gradient" flags and collective-order checks stay inside that group.

Gradient scale: a rank's loss is the mean over its own tokens, and FSDP averages dense gradients over the W ranks
of the world, which makes them the gradient of the global mean. An expert's gradient, once the dispatch's backward
has carried it back, already holds the contributions of every token its EP group routed to it (P ranks' worth);
averaging it over the M = W / P ranks of its expert-data-parallel group would leave it P times too large. So the
reduce-scatter scales by ``1 / W`` (``1 / P`` here, then ``1 / M`` as usual), as Megatron scales expert gradients by
``1 / data_parallel_size``.

Norms: every expert piece is held by exactly one rank of the world (``M x P = W``, enforced), so squared norms of
expert pieces add up over the world like the dense ones; per-parameter norms are summed over the expert shard
group only (the same buffer index holds different experts on different EP ranks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import paddle
import paddle.distributed as dist

from .communication import CommTask, ShardingComm


@dataclass
class _OneRank:
    """Stands for the expert shard group when each expert lives on one rank only (no expert sharding)."""

    nranks: int = 1
    rank: int = 0
    ranks: list = field(default_factory=list)


class ExpertComm(ShardingComm):
    """ShardingComm over the expert shard group, with expert gradients averaged over the whole world."""

    def __init__(self, shard_group, parallel_group, world_size: int) -> None:
        me = dist.get_rank() if dist.is_initialized() else 0
        super().__init__(shard_group if shard_group is not None else _OneRank(ranks=[me]))
        if shard_group is None:
            self.group = None  # no collective ever runs over a one-rank group
        self.parallel_group = parallel_group
        self.ep_degree = int(parallel_group.nranks)
        #: applied before the usual 1 / world_size of the shard group: 1 / ep_degree (see the module docstring)
        self.gradient_scale = 1.0 / self.ep_degree
        if self.world_size * self.ep_degree != world_size:
            raise ValueError(f"expert shard group {self.world_size} x ep {self.ep_degree} != world {world_size}")

    def reduce_scatter_mean_async(self, full: paddle.Tensor, dtype=None) -> tuple[paddle.Tensor, CommTask]:
        full.scale_(self.gradient_scale)
        return super().reduce_scatter_mean_async(full, dtype)

    def all_reduce_sum_experts(self, tensor: paddle.Tensor) -> paddle.Tensor:
        """Sum over the EP group (values already complete inside each expert shard group)."""
        if self.ep_degree > 1:
            self._drain()
            dist.all_reduce(tensor, group=self.parallel_group)
        return tensor

    def all_gather_experts(self, tensor: paddle.Tensor) -> list[paddle.Tensor]:
        """Every EP rank's ``tensor`` (same shape everywhere), by EP rank."""
        if self.ep_degree == 1:
            return [tensor]
        self._drain()
        out: list = []
        dist.all_gather(out, tensor, group=self.parallel_group)
        return out

    def all_gather_object_experts(self, obj) -> list:
        if self.ep_degree == 1:
            return [obj]
        from .communication import all_gather_object

        self._drain()
        return all_gather_object(obj, self.parallel_group)
