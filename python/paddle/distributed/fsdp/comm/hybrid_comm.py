"""Collectives of hybrid sharding (HSDP): shard inside a shard group, replicate across a replicate group.

Everything ShardingComm does stays over the shard group (gathers, the gradient reduce-scatter, the global-norm
all-reduce of clipping: replicas hold identical shards, so the shard group's sum is the whole norm). Added here:

* gradients: after the reduce-scatter in the shard group, the shard is all-reduced across the replicas, so each
  rank steps the mean over all ``R x S`` ranks (scaled by ``1/R`` before, as ShardingComm scales by ``1/S``);
* the "who received a gradient" flags of the end of backward are summed over both groups (a parameter used on
  one replica only must be stepped on every replica alike);
* the collective-order check also compares the replicas (a unit run on one replica only would pair the
  replica all-reduce with a different collective elsewhere).
"""

from __future__ import annotations

import paddle
import paddle.distributed as dist

from .communication import CollectiveOrderError, CommTask, ShardingComm


class HybridComm(ShardingComm):
    """ShardingComm over ``shard_group``, plus the replica all-reduces over ``replicate_group``."""

    def __init__(self, shard_group, replicate_group) -> None:
        if shard_group is None or replicate_group is None:
            raise ValueError("HybridComm needs both a shard group and a replicate group")
        super().__init__(shard_group)
        self.replicate_group = replicate_group
        self.replicate_size = int(replicate_group.nranks)
        self.replicate_rank = int(replicate_group.rank)

    def reduce_scatter_mean_async(self, full: paddle.Tensor, dtype=None) -> tuple[paddle.Tensor, CommTask]:
        """The mean over every rank of both groups of ``full``, restricted to this rank's shard. The shard
        group's reduce-scatter is issued now; the replica all-reduce runs when the returned task is waited for
        (it needs the reduce-scatter's result)."""
        full.scale_(1.0 / self.replicate_size)
        mode = self.reduce_scatter_mode
        local, task = super().reduce_scatter_mean_async(full, dtype)
        # gloo's all_reduce path returns a view of the reduced buffer: reduce that whole buffer across replicas
        # (the view then reads the result); the other paths return a tensor of their own
        target = task._keep[0] if mode == "all_reduce" else local
        return local, _ReplicaAllReduce(task, target, self.replicate_group)

    def all_reduce_sum_data_parallel(self, tensor: paddle.Tensor) -> paddle.Tensor:
        """Sum over every data-parallel rank (both groups)."""
        self.all_reduce_sum(tensor)
        dist.all_reduce(tensor, group=self.replicate_group)
        return tensor

    def agree(self, kind: int, index: int, describe=None) -> None:
        """ShardingComm's order check in the shard group, then the same (kind, index) across the replicas."""
        super().agree(kind, index, describe)
        if not self.check_order:
            return
        mine = paddle.to_tensor([kind, index], dtype="int64")
        every = paddle.empty([2 * self.replicate_size], dtype="int64")
        dist.all_gather(every, mine, group=self.replicate_group)
        values = every.numpy().reshape([self.replicate_size, 2]).tolist()
        if any(v != values[0] for v in values):
            raise CollectiveOrderError(
                f"FullyShardFusion: replicas are about to issue different collectives ((kind, buffer) by replica: "
                f"{values}): a unit ran on some replicas only; units must run on every rank"
            )


class _ReplicaAllReduce(CommTask):
    """A shard-group reduce-scatter followed, when waited for, by the all-reduce of its result across replicas."""

    def __init__(self, inner: CommTask, target: paddle.Tensor, replicate_group) -> None:
        super().__init__(None, (target,))
        self._inner = inner
        self._target = target
        self._group = replicate_group

    def wait(self) -> None:
        if self._inner is None:
            return
        self._inner.wait()
        self._inner = None
        dist.all_reduce(self._target, group=self._group)
        self._target = None
        self._keep = ()

    @property
    def done(self) -> bool:
        return self._inner is None

    @property
    def completed(self) -> bool:
        return self._inner is None  # the replica all-reduce is still to be issued
