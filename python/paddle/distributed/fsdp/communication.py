"""Every collective FullyShardFusion issues, in one place.

Backend gaps are handled here and nowhere else: gloo (CPU) has no reduce_scatter, so it becomes an
all_reduce followed by a local slice. With ``PADDLE_FSDP_EMULATE_GPU_COLLECTIVES=1`` (or fake-device
mode, see device.py) the reduce_scatter code path itself runs, its collective emulated on gloo, so the
branch GPUs take is exercised on CPU too. A world of one rank issues no collective at all, because a
single-process run (launched with one process, or not launched) has no global group.
"""

from __future__ import annotations

import logging

import paddle
import paddle.distributed as dist

from . import device

logger = logging.getLogger(__name__)


def resolve_sharding_group(group=None):
    """The group FSDP shards over: an explicit group, else fleet's sharding group, else the global group."""
    if group is not None:
        return group
    from paddle.distributed import fleet

    # fleet.init(is_collective=True, ...) sets _hcg; without it fleet has no hybrid group
    hcg = getattr(fleet.fleet, "_hcg", None)
    if hcg is not None and hcg.get_sharding_parallel_world_size() > 1:
        return hcg.get_sharding_parallel_group()
    return None


#: Bytes per rank of the one-shot object exchange (``all_gather_object``): an 8-byte length, then the pickle.
OBJECT_BLOCK_BYTES = 4096


def all_gather_object(obj, group=None) -> list:
    """Every rank's ``obj``, by rank (collective; the objects are pickled, as by ``dist.all_gather_object``).

    Small objects (the exchanges of checkpoint saves and loads: errors, ids, record descriptions) travel in ONE
    all_gather of a fixed block per rank; stock ``dist.all_gather_object`` always issues two (sizes, then the
    padded data) and took 1.8 ms here against 0.45 ms. When any rank's pickle does not fit, every rank sees that
    in the block's length header and a second all_gather carries all pickles, padded to the longest."""
    import pickle

    import numpy as np

    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    room = OBJECT_BLOCK_BYTES - 8
    block = np.zeros(OBJECT_BLOCK_BYTES, np.uint8)
    block[:8] = np.frombuffer(len(data).to_bytes(8, "little"), np.uint8)
    if len(data) <= room:
        block[8 : 8 + len(data)] = np.frombuffer(data, np.uint8)
    gathered: list = []
    dist.all_gather(gathered, paddle.to_tensor(block), group=group)
    blocks = [g.numpy() for g in gathered]
    lengths = [int.from_bytes(b[:8].tobytes(), "little") for b in blocks]
    if max(lengths) <= room:
        return [pickle.loads(b[8 : 8 + n].tobytes()) for b, n in zip(blocks, lengths)]
    padded = np.zeros(max(lengths), np.uint8)
    padded[: len(data)] = np.frombuffer(data, np.uint8)
    gathered = []
    dist.all_gather(gathered, paddle.to_tensor(padded), group=group)
    return [pickle.loads(g.numpy()[:n].tobytes()) for g, n in zip(gathered, lengths)]


#: ``PADDLE_FSDP_CHECK_COLLECTIVE_ORDER=0`` turns off the per-collective order check (on by default).
CHECK_ORDER_ENV = "PADDLE_FSDP_CHECK_COLLECTIVE_ORDER"
#: What an FSDP collective is for, as exchanged by the order check.
GATHER, REDUCE, EXCHANGE = 1, 2, 3
_KIND_NAMES = {GATHER: "gather parameters of buffer", REDUCE: "reduce gradients of buffer", EXCHANGE: "end of backward"}


class CollectiveOrderError(RuntimeError):
    """Ranks were about to issue different FSDP collectives (raised on every rank, before the collective)."""


class ShardingComm:
    """Collectives over the sharding group; ranks are positions inside that group."""

    def __init__(self, group=None) -> None:
        self.group = resolve_sharding_group(group)
        if self.group is not None:
            self.world_size = self.group.nranks
            self.rank = self.group.rank
        elif dist.is_initialized():
            self.world_size = dist.get_world_size()
            self.rank = dist.get_rank()
        else:
            self.world_size, self.rank = 1, 0
        if self.rank < 0:
            raise RuntimeError("this process is not a member of the sharding group it was given")
        self._has_reduce_scatter = self.world_size > 1 and self._backend() not in ("GLOO", "gloo")
        self._emulate_reduce_scatter = (
            self.world_size > 1 and not self._has_reduce_scatter and device.options().emulate_gpu_collectives
        )
        import os

        self.check_order = self.world_size > 1 and os.environ.get(CHECK_ORDER_ENV, "1") != "0"

    def agree(self, kind: int, index: int, describe=None) -> None:
        """Refuse, on every rank at once, a collective that not every rank is issuing.

        A collective issued on some ranks only (a unit that runs on some ranks only, e.g. an expert class listed
        in ``fsdp_unit_layers`` and skipped when idle) pairs with a different collective elsewhere: gloo aborts
        the process or hangs, NCCL hangs or mixes up data. Each FSDP collective is therefore preceded by a tiny
        fixed-size all-gather of (kind, buffer index); any difference raises :class:`CollectiveOrderError` on
        every rank. ``describe(index)`` names a buffer. Off with ``PADDLE_FSDP_CHECK_COLLECTIVE_ORDER=0``.
        """
        if not self.check_order:
            return
        mine = paddle.to_tensor([kind, index], dtype="int64")
        every = paddle.empty([2 * self.world_size], dtype="int64")
        dist.all_gather(every, mine, group=self.group)
        values = every.numpy().reshape([self.world_size, 2]).tolist()
        if all(v == values[0] for v in values):
            return

        def name(k: int, i: int) -> str:
            what = _KIND_NAMES.get(k, f"collective {k}")
            return what if k == EXCHANGE else f"{what} {describe(i) if describe else i}"

        ops = "; ".join(f"rank {r}: {name(k, i)}" for r, (k, i) in enumerate(values))
        raise CollectiveOrderError(
            "FullyShardFusion: ranks are about to issue different collectives (" + ops + "). A layer gathered as "
            "a unit ran on some ranks only: units must run on every rank (an MoE that skips idle experts must not "
            "list the expert class in fsdp_unit_layers; list the MoE block or the decoder layer instead, or leave "
            "the experts to their enclosing unit or the root)"
        )

    def _backend(self) -> str:
        try:
            return dist.get_backend(self.group)
        except Exception:  # older builds: decide by device, CPU tensors mean gloo
            return "GLOO" if paddle.get_device() == "cpu" else "NCCL"

    def all_gather_into(self, full: paddle.Tensor, shard: paddle.Tensor) -> None:
        """Fill ``full`` with every rank's ``shard`` in rank order."""
        if self.world_size == 1:
            paddle.assign(shard, output=full)
            return
        dist.all_gather(full, shard, group=self.group)

    def reduce_scatter_mean(self, full: paddle.Tensor) -> paddle.Tensor:
        """The mean over ranks of ``full``, restricted to this rank's shard (a new tensor)."""
        shard_numel = full.shape[0] // self.world_size
        if self.world_size == 1:
            return full
        full.scale_(1.0 / self.world_size)
        if self._has_reduce_scatter or self._emulate_reduce_scatter:
            out = paddle.empty([shard_numel], dtype=full.dtype)
            reduce_scatter = dist.reduce_scatter if self._has_reduce_scatter else self._emulated_reduce_scatter
            reduce_scatter(out, full, group=self.group)
            return out
        dist.all_reduce(full, group=self.group)
        start = self.rank * shard_numel
        return full._slice(start, start + shard_numel)

    @property
    def reduce_scatter_mode(self) -> str:
        """How gradients are reduce-scattered: "native", "emulated" (GPU path on gloo), "all_reduce", or "none"."""
        if self.world_size == 1:
            return "none"
        if self._has_reduce_scatter:
            return "native"
        return "emulated" if self._emulate_reduce_scatter else "all_reduce"

    def _emulated_reduce_scatter(self, out: paddle.Tensor, full: paddle.Tensor, group=None) -> None:
        """``dist.reduce_scatter(out, full)`` (sum, this rank's equal part) with gloo's all_reduce."""
        summed = full.clone()
        dist.all_reduce(summed, group=group)
        start = self.rank * out.shape[0]
        out.copy_(summed._slice(start, start + out.shape[0]), True)

    def all_reduce_sum(self, tensor: paddle.Tensor) -> paddle.Tensor:
        if self.world_size > 1:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_reduce_sum_data_parallel(self, tensor: paddle.Tensor) -> paddle.Tensor:
        """Sum over every data-parallel rank: the sharding group here; both groups under HSDP (hybrid_comm.py)."""
        return self.all_reduce_sum(tensor)

    def all_gather_object(self, obj) -> list:
        if self.world_size == 1:
            return [obj]
        return all_gather_object(obj, self.group)

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)
