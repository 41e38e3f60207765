"""Every collective FullyShardFusion issues, in one place.

Backend gaps are handled here and nowhere else: gloo (CPU) has no reduce_scatter, so it becomes an
all_reduce followed by a local slice. With ``PADDLE_FSDP_EMULATE_GPU_COLLECTIVES=1`` (or fake-device
mode, see devices/device.py) the reduce_scatter code path itself runs, its collective emulated on gloo, so the
branch GPUs take is exercised on CPU too. A world of one rank issues no collective at all, because a
single-process run (launched with one process, or not launched) has no global group.

Gathers and reduce-scatters can be issued asynchronously (``async_op`` / ``reduce_scatter_mean_async``):
they return a :class:`CommTask` to ``wait()`` on before the output is read (step/overlap.py decides when). In
emulation mode they run on an emulated GPU communication stream (comm_emulation.py), whose outputs read NaN
until waited for and whose delays the host can overlap; synchronous collectives wait for that stream first.
"""

from __future__ import annotations

import logging

import paddle
import paddle.distributed as dist
from paddle.base import core

from .. import env_switches
from ..devices import device
from .comm_emulation import EmulatedStream, delay_from_env

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


#: ``PADDLE_FSDP_CHECK_COLLECTIVE_ORDER=N``: the order check's default interval (0 off, 1 every backward pass,
#: N every N-th); FullyShardFusion(check_collective_order=...) overrides it.
CHECK_ORDER_ENV = "PADDLE_FSDP_CHECK_COLLECTIVE_ORDER"


def check_interval_from_env() -> int:
    """The order check's interval from ``PADDLE_FSDP_CHECK_COLLECTIVE_ORDER`` (unset: 0, off)."""
    return env_switches.read(CHECK_ORDER_ENV)


#: What an FSDP collective is for, as exchanged by the order check.
GATHER, REDUCE, EXCHANGE = 1, 2, 3
_KIND_NAMES = {GATHER: "gather parameters of buffer", REDUCE: "reduce gradients of buffer", EXCHANGE: "end of backward"}


class CommTask:
    """An issued collective. ``wait()`` before reading its output; until then the task keeps the tensors it
    reads and writes alive (paddle records only the input on NCCL's stream, so an output freed early could be
    reused by the compute stream while the collective still writes it)."""

    def __init__(self, task=None, keep: tuple = ()) -> None:
        self._task = task
        self._keep = keep

    def wait(self) -> None:
        if self._task is not None:
            self._task.wait()
            self._task = None
        self._keep = ()

    @property
    def done(self) -> bool:
        return self._task is None

    @property
    def completed(self) -> bool:
        """Whether the collective has finished already, so waiting costs nothing (gloo completes ``sync_op=False``
        collectives inside the call). Only backend tasks are asked: emulated ones model a device stream."""
        return self._task is None or (isinstance(self._task, core.task) and self._task.is_completed())


#: A task with nothing in flight (one-rank worlds, synchronous fallbacks).
DONE = CommTask()


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
        # emulation mode on gloo: gathers and reduce-scatters run on an emulated GPU comm stream (comm_emulation.py)
        self.emulation = EmulatedStream(delay_from_env()) if self._emulate_reduce_scatter else None
        # whether agree() checks; the schedule (step/overlap.py) switches it per backward pass
        self.check_order = self.world_size > 1 and check_interval_from_env() > 0

    @property
    def completes_inside_call(self) -> bool:
        """Whether this group's collectives finish inside the call, ``sync_op=False`` ones too (paddle's plain gloo;
        not the emulated GPU stream): nothing can overlap them (overlap.default_prefetch_depth)."""
        return self.world_size > 1 and not self._has_reduce_scatter and self.emulation is None

    def agree(self, kind: int, index: int, describe=None) -> None:
        """Refuse, on every rank at once, a collective that not every rank is issuing.

        A collective issued on some ranks only (a unit that runs on some ranks only, e.g. an expert class listed
        in ``fsdp_unit_layers`` and skipped when idle) pairs with a different collective elsewhere: gloo aborts
        the process or hangs, NCCL hangs or mixes up data. Each FSDP collective is therefore preceded by a tiny
        fixed-size all-gather of (kind, buffer index); any difference raises :class:`CollectiveOrderError` on
        every rank. ``describe(index)`` names a buffer. Off unless enabled (``check_collective_order``, step/overlap.py).
        """
        if not self.check_order:
            return
        self._drain()
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

    def _drain(self) -> None:
        """Emulation only: a synchronous collective waits for the emulated stream's queue (see comm_emulation)."""
        if self.emulation is not None:
            self.emulation.drain()

    def all_gather_into(self, full: paddle.Tensor, shard: paddle.Tensor, async_op: bool = False) -> CommTask:
        """Fill ``full`` with every rank's ``shard`` in rank order; with ``async_op`` read ``full`` only after
        the returned task's ``wait()``."""
        if self.world_size == 1:
            paddle.assign(shard, output=full)
            return DONE
        if self.emulation is not None:
            staging = paddle.empty_like(full)
            dist.all_gather(staging, shard, group=self.group)
            task = self._emulated(full, lambda: full.copy_(staging, True))
        else:
            task = CommTask(dist.all_gather(full, shard, group=self.group, sync_op=not async_op), (full, shard))
        if not async_op:
            task.wait()
        return task

    def reduce_scatter_mean(self, full: paddle.Tensor) -> paddle.Tensor:
        """The mean over ranks of ``full``, restricted to this rank's shard (a new tensor)."""
        local, task = self.reduce_scatter_mean_async(full)
        task.wait()
        return local

    def reduce_scatter_mean_async(self, full: paddle.Tensor, dtype=None) -> tuple[paddle.Tensor, CommTask]:
        """Start the mean over ranks of ``full`` restricted to this rank's shard; returns (result, task), the
        result readable after ``task.wait()``. ``dtype``: reduce in that dtype (``full`` is scaled first, then
        cast); the result has that dtype. ``full`` is consumed (scaled in place)."""
        shard_numel = full.shape[0] // self.world_size
        if self.world_size == 1:
            return full, DONE
        full.scale_(1.0 / self.world_size)
        if dtype is not None and full.dtype != dtype:
            full = full.astype(dtype)
        if self.emulation is not None:
            summed = full.clone()
            dist.all_reduce(summed, group=self.group)
            start = self.rank * shard_numel
            out = paddle.empty([shard_numel], dtype=full.dtype)
            return out, self._emulated(out, lambda: out.copy_(summed._slice(start, start + shard_numel), True))
        if self._has_reduce_scatter:
            out = paddle.empty([shard_numel], dtype=full.dtype)
            task = dist.reduce_scatter(out, full, group=self.group, sync_op=False)
            return out, CommTask(task, (out, full))
        task = dist.all_reduce(full, group=self.group, sync_op=False)
        start = self.rank * shard_numel
        return full._slice(start, start + shard_numel), CommTask(task, (full,))

    def _emulated(self, output: paddle.Tensor, complete) -> CommTask:
        """Emulation: ``output`` reads NaN until the task, queued on the emulated stream, is waited for."""
        paddle.assign(paddle.full(output.shape, float("nan"), dtype=output.dtype), output=output)
        return CommTask(self.emulation.submit(complete), (output,))

    @property
    def reduce_scatter_mode(self) -> str:
        """How gradients are reduce-scattered: "native", "emulated" (GPU path on gloo), "all_reduce", or "none"."""
        if self.world_size == 1:
            return "none"
        if self._has_reduce_scatter:
            return "native"
        return "emulated" if self._emulate_reduce_scatter else "all_reduce"

    def all_reduce_sum(self, tensor: paddle.Tensor) -> paddle.Tensor:
        if self.world_size > 1:
            self._drain()
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def all_reduce_sum_data_parallel(self, tensor: paddle.Tensor) -> paddle.Tensor:
        """Sum over every data-parallel rank: the sharding group here; both groups under HSDP (hybrid_comm.py)."""
        return self.all_reduce_sum(tensor)

    def all_gather_object(self, obj) -> list:
        if self.world_size == 1:
            return [obj]
        self._drain()
        return all_gather_object(obj, self.group)

    def barrier(self) -> None:
        if self.world_size > 1:
            self._drain()
            dist.barrier(group=self.group)
