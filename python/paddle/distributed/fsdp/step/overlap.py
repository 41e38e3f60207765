"""When gathers and reduce-scatters are issued and waited for: prefetching and the reduce-scatter queue. A reduce-scatter that has finished already when issued (gloo completes ``sync_op=False``
collectives inside the call; emulated and device tasks are never taken as finished) is waited for at once instead
of queued: there is nothing to overlap, and its full-size gradient buffer is freed a unit earlier.

With ``prefetch_depth=0`` every collective is synchronous, issued when its unit needs it (the behaviour before
this module). With ``prefetch_depth=k >= 1`` a unit's computation runs while the next ``k`` units' all-gathers
and the previous units' reduce-scatters are in flight. The arithmetic is unchanged: the same collectives
on the same tensors, each waited for before its result is read, so parameters and gradients are
bit-identical to ``prefetch_depth=0``.

Default depth (``prefetch_depth=None``): 1 where a collective can run while a unit computes (NCCL and other
device backends, the emulated GPU stream of fake-device and emulation modes), 0 where every collective of FSDP's
groups finishes inside its call (paddle's plain gloo, CPU training): there a prefetch overlaps nothing and only
holds one more gathered unit at the step's peak (:func:`default_prefetch_depth`).

Order. The units' order is recorded, not declared: the forward order is the sequence of unit forwards seen in
the last root forward (``model(...)``), the backward order the sequence of unit backwards seen in the last
backward pass (consecutive repeats of a unit counted once). The first forward and the first backward of a
run therefore run without prefetching (reduce-scatters are still queued). A unit is found in the recorded
order from where the previous one was found (wrapping once); a unit not found prefetches nothing. Every rank
sees the same units in the same order (a condition of FSDP anyway, see the order check), and what to prefetch
is decided from that order and the gathers in flight only, never from local state (a buffer released early
on one rank because all its gradients arrived there still joins a prefetch), so every rank issues the same
collectives. On NCCL ``wait()`` makes the compute stream wait for the communication stream; the host runs on.

Schedule for units ``U0..Un-1`` (forward order; backward order ``Un-1..U0``), depth ``k``. ``AG(i)`` is unit
i's all-gather, ``RS(i)`` its reduce-scatter; ``issue``/``wait`` are what the trace records (``schedule.trace``)::

    forward, unit i:     issue AG(i) unless in flight; issue AG(i+1..i+k) not in flight; wait AG(i);
                         compute U(i); release U(i)
    backward, unit i:    issue RS of every unit whose backward is over (see gradient_sync.py), first waiting
                         for the oldest reduce-scatter in flight while k are; issue AG(i) unless in flight;
                         issue AG(i-1..i-k) not in flight; wait AG(i); compute U(i)'s backward
    end of backward:     issue the remaining RS (same queue rule); wait for every RS in flight, oldest first;
                         the small exchange of who got gradients; bind ``.grad``

e.g. k=1, three units (``wait`` names what is waited for; ``F``/``B`` are the units' computations)::

    AG0 AG1 waitAG0 F0 AG2 waitAG1 F1 waitAG2 F2 | AG2 AG1 waitAG2 B2 RS2 AG0 waitAG1 B1 waitRS2 RS1 waitAG0 B0
    waitRS1 RS0 waitRS0

test_fully_shard_overlap.py checks recorded traces against this schedule (depths 0, 1, 2; the first step
with no recorded order: nothing prefetched, reduce-scatters queued). A prefetch its unit did not use (the
forward took another path) is waited for and dropped (``drop``) at the end of the root forward or of the
backward, so outside a forward or backward nothing is in flight: optimizer steps and checkpoints see settled
shards and gradients.

What stays exposed: the first unit's gather in forward and in backward (nothing computes before them), and
the last reduce-scatter of each backward, which is waited for there so that ``.grad`` is complete when
``backward()`` returns (gradient clipping, GradScaler and user code read it before ``step()``). Memory:
up to ``k`` units' parameters are gathered ahead, and up to ``k`` full-size gradient buffers wait in the
reduce-scatter queue. A reduce-scatter that has finished already when issued (gloo completes ``sync_op=False``
collectives inside the call; emulated and device tasks are never taken as finished) is waited for at once instead
of queued: there is nothing to overlap, and its full-size gradient buffer is freed a unit earlier.

Reduce dtype. ``reduce_dtype="bfloat16"`` reduce-scatters fp32 gradients in bf16 (scaled by 1/world first,
then cast; half the bytes); the result is added to the fp32 ``main_grad``, so accumulation across
micro-batches stays fp32. fp64 gradients are always reduced in fp64; a one-rank world reduces nothing.

Order check. ``check_collective_order=N`` runs the collective-order check (``ShardingComm.agree``: a host
round trip before every collective) during the first backward pass and every N-th after it (each pass
spans the forward before it); 0, the default, never.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

import paddle

if TYPE_CHECKING:
    from ..buffers.fused_buffer import FusedBuffer

_REDUCE_DTYPES = {"float32": paddle.float32, "bfloat16": paddle.bfloat16}


def _check_int(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"FullyShardFusion: {name} must be an int >= {low}, got {value!r}")
    return value


def parse_reduce_dtype(value):
    """None (reduce in the gradient dtype), "float32"/"bfloat16" or the paddle dtype -> a paddle dtype or None."""
    if value is None:
        return None
    for name, dtype in _REDUCE_DTYPES.items():
        if value == name or value == dtype:
            return dtype
    raise ValueError(f"FullyShardFusion: reduce_dtype must be None, 'float32' or 'bfloat16', got {value!r}")


def default_prefetch_depth(comms) -> int:
    """The depth ``prefetch_depth=None`` means: 0 when every multi-rank group among ``comms`` (ShardingComm and
    subclasses; None skipped) runs plain gloo, whose collectives finish inside the call, so nothing would
    overlap; else 1 (one rank only: 1, which gathers nothing anyway)."""
    multi = [comm for comm in comms if comm is not None and comm.world_size > 1]
    return 0 if multi and all(comm.completes_inside_call for comm in multi) else 1


class _Order:
    """One direction's recorded unit order and where the running pass is in it."""

    def __init__(self) -> None:
        self.recorded: list[tuple[int, ...]] = []
        self.events: list[tuple[int, ...]] = []
        self.cursor = 0

    def start(self) -> None:
        self.events, self.cursor = [], 0

    def finish(self) -> None:
        if self.events:
            self.recorded = self.events
        self.events = []

    def step(self, key: tuple[int, ...], depth: int) -> list[tuple[int, ...]] | None:
        """Note unit ``key``; the units to prefetch (None for a repeat of the previous unit)."""
        if self.events and self.events[-1] == key:
            return None
        self.events.append(key)
        n = len(self.recorded)
        for offset in range(n):
            position = (self.cursor + offset) % n
            if self.recorded[position] == key:
                self.cursor = position + 1
                return self.recorded[position + 1 : position + 1 + depth]
        return []


class OverlapSchedule:
    """Issues and waits for one FullyShardFusion's gathers and reduce-scatters (see the module docstring)."""

    def __init__(
        self, owner, prefetch_depth: int | None = 1, reduce_dtype=None, check_collective_order: int = 0
    ) -> None:
        self.owner = owner
        if prefetch_depth is None:
            prefetch_depth = default_prefetch_depth((owner.comm, getattr(owner, "expert_comm", None)))
        self.depth = _check_int("prefetch_depth", prefetch_depth, 0)
        self.reduce_dtype = parse_reduce_dtype(reduce_dtype)
        self.check_interval = _check_int("check_collective_order", check_collective_order, 0)
        #: set to a list to record ("AG"|"RS", buffer index, "issue"|"wait"|"drop") events (tests, debugging)
        self.trace: list[tuple] | None = None
        self.passes = 0  # backward passes completed (the same on every rank)
        self._forward, self._backward = _Order(), _Order()
        self._in_forward = self._in_backward = False
        self._reduces: deque[FusedBuffer] = deque()
        self._set_check()

    def record(self, op: str, index, what: str) -> None:
        if self.trace is not None:
            self.trace.append((op, index, what))

    def _set_check(self) -> None:
        for comm in (self.owner.comm, getattr(self.owner, "expert_comm", None)):
            if comm is not None:
                on = self.check_interval > 0 and self.passes % self.check_interval == 0
                comm.check_order = comm.world_size > 1 and on

    # ---- forward ---------------------------------------------------------------------------------
    def root_pre_forward(self, layer, inputs) -> None:
        if self._in_forward:  # the previous root forward raised: settle what it left in flight
            self.drop_gathers()
        self._in_forward = True
        self._forward.start()
        self.owner.heap_trim("forward")  # the last step's activations are freed (devices/heap_trim.py)

    def root_post_forward(self, layer, inputs, outputs) -> None:
        self._in_forward = False
        self._forward.finish()
        self.drop_gathers()

    def before_forward(self, buffers: list[FusedBuffer]) -> None:
        """A unit's forward is about to run: its buffers gathered, the next units' gathers issued."""
        if self.depth and self._in_forward and not self.owner._summoned:
            for buffer in buffers:
                if not buffer.is_gathered:
                    buffer.start_gather()
            self._prefetch(self._forward.step(_key(buffers), self.depth))
        for buffer in buffers:
            buffer.gather()

    # ---- backward ----------------------------------------------------------------------------------
    def before_backward(self, buffers: list[FusedBuffer], finished: list[FusedBuffer]) -> None:
        """A unit's backward is about to run: reduce ``finished`` (units whose backward is over), gather
        ``buffers`` (waiting for a prefetch), issue the next units' gathers."""
        if not self._in_backward:
            self._in_backward = True
            self._backward.start()
            self.owner.heap_trim("backward")  # the forward's temporaries are freed; the step's peak is here
        for buffer in finished:
            self.reduce(buffer)
        if self.depth and not self.owner._summoned:
            for buffer in buffers:
                if not buffer.is_gathered:
                    buffer.start_gather()
            self._prefetch(self._backward.step(_key(buffers), self.depth))
        for buffer in buffers:
            buffer.prepare_for_backward()

    def reduce(self, buffer: FusedBuffer) -> None:
        """Issue ``buffer``'s reduce-scatter: queued (at most ``depth`` in flight), or waited for at depth 0."""
        dtype = self.reduce_dtype if buffer.grad_dtype == paddle.float32 else None
        if not self.depth:
            buffer.start_reduce(dtype)
            buffer.finish_reduce()
            return
        self._reduces = deque(b for b in self._reduces if b.reduce_in_flight)
        while len(self._reduces) >= self.depth:
            self._reduces.popleft().finish_reduce()
        buffer.start_reduce(dtype)
        if buffer.reduce_completed:  # gloo: finished inside the call; its full-size buffer goes now
            buffer.finish_reduce()
        elif buffer.reduce_in_flight:
            self._reduces.append(buffer)

    def reduce_now(self, buffer: FusedBuffer) -> None:
        """Reduce ``buffer`` and wait (the late reductions of the end of backward)."""
        buffer.start_reduce(self.reduce_dtype if buffer.grad_dtype == paddle.float32 else None)
        buffer.finish_reduce()

    def finish_reduces(self) -> None:
        """Wait for every reduce-scatter in flight, oldest first, adding each to its ``main_grad``."""
        while self._reduces:
            self._reduces.popleft().finish_reduce()

    def end_backward(self) -> None:
        """The backward pass ended (after its reductions and exchange): settle prefetches, count the pass."""
        self._in_backward = False
        self._backward.finish()
        self.drop_gathers()
        self.passes += 1
        self._set_check()

    # ---- both --------------------------------------------------------------------------------------
    def _prefetch(self, targets: list[tuple[int, ...]] | None) -> None:
        for key in targets or ():
            for index in key:
                buffer = self.owner.buffers[index]
                if not buffer.gather_in_flight:
                    # forced: whether to prefetch is decided from what every rank saw, never from local state
                    buffer.start_gather(force=True)

    def drop_gathers(self) -> None:
        """Wait for and drop every gather in flight that no unit consumed."""
        for buffer in self.owner.buffers:
            buffer.drop_gather()

    def settle(self) -> None:
        """Nothing left in flight (before an optimizer step): reductions landed, unused prefetches dropped."""
        self.finish_reduces()
        self.drop_gathers()


def _key(buffers: list[FusedBuffer]) -> tuple[int, ...]:
    return tuple(buffer.index for buffer in buffers)
