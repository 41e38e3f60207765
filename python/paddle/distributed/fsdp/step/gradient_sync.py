"""When gradients are reduced: only at events every rank sees in the same order.

A reduction is a collective, so the order of reductions must be the same on every rank, whatever data
each rank saw. Ranks may leave different parameters unused (an MoE layer skipping idle experts, a branch
on the rank), so "all gradients of a buffer arrived here" is a local fact and must never trigger one.
The triggers used instead:

1. the next pre-backward gather: when a layer's backward is about to start, every buffer gathered for an
   earlier backward and not reduced yet is reduced first, in buffer order. Pre-backward gathers are
   themselves collectives issued in graph order, so every rank passes them in the same order;
2. the end of backward (paddle's backward-final hook): the remaining buffers are reduced, then one small
   all-reduce tells every rank which parameters received a gradient anywhere (so a parameter used on
   another rank only still gets its averaged gradient stepped here) and which buffers received gradients
   after their reduction; those are reduced once more, in buffer order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import paddle
from paddle.base import core

if TYPE_CHECKING:
    from ..buffers.fused_buffer import FusedBuffer


def before_backward_gather(buffers: list[FusedBuffer], still_running: set[int] = frozenset()) -> None:
    """A layer's backward is about to run: reduce the buffers whose backward is over, then gather ``buffers``.

    ``still_running`` holds the buffers of layers enclosing this one (the root's, an outer unit's): their
    backward continues after this layer's, so they are reduced later (at the end of backward at the latest).
    Every rank passes the same set for the same layer, so the order of reductions stays rank-independent.
    """
    if not buffers:
        return
    owner = buffers[0].owner
    current = {id(b) for b in buffers} | set(still_running)
    finished = [b for b in owner.buffers if b.reduce_pending and id(b) not in current]
    owner.schedule.before_backward(buffers, finished)  # reduces, gathers, prefetches (overlap.py)
    arm_backward_end(owner)


#: Python entry points of a backward pass (``Tensor.backward``, ``paddle.autograd.backward``).
_BACKWARD_ENTRIES = (("tensor_patch_methods.py", "backward"), ("backward_mode.py", "backward"))


def _nested_backward_depth() -> int:
    """How many backward passes are running on this thread's Python stack. Reentrant recompute
    (``recompute(..., use_reentrant=True)``) runs a backward inside the backward of the enclosing graph;
    paddle runs (and clears) the final hooks at the end of the inner one too."""
    import sys

    depth, frame = 0, sys._getframe()
    while frame is not None:
        code = frame.f_code
        if code.co_name == "backward" and any(code.co_filename.endswith(f) for f, _ in _BACKWARD_ENTRIES):
            depth += 1
        frame = frame.f_back
    return depth


def arm_backward_end(owner) -> None:
    """Run :func:`end_of_backward` when the running backward pass ends (paddle clears final hooks after each).

    The end of a backward nested in another (reentrant recompute) is not the end: buffers of enclosing scopes
    (the root's) still get gradients afterwards. There nothing is done but asking for the outer end: the
    next gradient arriving (or pre-backward gather) arms it again (hooks cannot be added while paddle runs
    them), and ``opt.step()`` finishes whatever is still pending (the pending state is set by collective
    gathers, so every rank agrees on it).
    """
    owner._rearm_backward_end = False
    if not owner._backward_end_armed:
        owner._backward_end_armed = True

        def hook() -> None:
            owner._backward_end_armed = False
            if _nested_backward_depth() > 1:
                owner._rearm_backward_end = True
                return
            end_of_backward(owner)

        core.eager._add_backward_final_hook(hook)


def _exchange_received(owner) -> tuple[list[set[int]], list[bool]]:
    """Per buffer: parameters that received a gradient on any rank; whether any rank has gradients left
    unreduced. One all-reduce of a small vector per group of buffers (the dense buffers' group; under expert
    parallelism also the expert buffers' shard group, whose members hold the same experts); none in a one-rank
    world."""
    buffers = owner.buffers
    received: list[set[int]] = [set() for _ in buffers]
    late = [False] * len(buffers)
    comms = [owner.comm] + ([owner.expert_comm] if getattr(owner, "expert_comm", None) is not None else [])
    for comm in comms:
        mine = [k for k, b in enumerate(buffers) if b.comm is comm]
        got, pending = _exchange_over(comm, [buffers[k] for k in mine], comm is owner.comm)
        for k, g, p in zip(mine, got, pending):
            received[k], late[k] = g, p
    return received, late


def _exchange_over(comm, buffers: list, checked: bool) -> tuple[list[set[int]], list[bool]]:
    sizes = [len(b.params) for b in buffers]
    if comm.world_size == 1:
        return [set(b.received) for b in buffers], [b.full_grad is not None for b in buffers]
    flags = [0.0] * (sum(sizes) + len(buffers))
    offset = 0
    for k, buffer in enumerate(buffers):
        for index in buffer.received:
            flags[offset + index] = 1.0
        offset += sizes[k]
        flags[sum(sizes) + k] = 1.0 if buffer.full_grad is not None else 0.0
    from ..comm.communication import EXCHANGE

    if checked:
        comm.agree(EXCHANGE, 0)
    vector = paddle.to_tensor(flags, dtype="float32")
    comm.all_reduce_sum_data_parallel(vector)  # every replica binds and steps the same parameters
    values = vector.numpy().tolist()
    received, offset = [], 0
    for size in sizes:
        received.append({i for i in range(size) if values[offset + i] > 0})
        offset += size
    late = [v > 0 for v in values[sum(sizes) :]]
    return received, late


def end_of_backward(owner) -> list[tuple]:
    """Reduce what is left, agree on who got gradients, bind ``.grad``; release gathered buffers.
    Collective: every rank runs it at the end of each backward. Returns the (param, grad) pairs bound."""
    schedule = owner.schedule
    for buffer in owner.buffers:
        if buffer.reduce_pending:
            schedule.reduce(buffer)
    schedule.finish_reduces()  # queued reduce-scatters land in main_grad before .grad is bound
    received, late = _exchange_received(owner)
    bound = []
    for buffer, got, is_late in zip(owner.buffers, received, late):
        if is_late:  # gradients that arrived after their buffer's reduction (rare: autograd ran them late)
            schedule.reduce_now(buffer)
        buffer.received.clear()
        buffer.has_grad |= got
        if buffer.layout.trainable:
            bound.extend(buffer.bind_grads())
        if buffer.is_gathered:
            buffer.release()
    schedule.end_backward()
    return bound


def flush_before_step(owner) -> list[tuple]:
    """Safety net at ``opt.step()``: finish a backward whose end was not seen (every rank agrees, since the
    pending state is set by collective gathers); anything else pending here alone is refused."""
    owner.schedule.settle()
    if any(b.reduce_pending for b in owner.buffers):
        return end_of_backward(owner)
    if any(b.full_grad is not None or b.received for b in owner.buffers):
        raise RuntimeError(
            "FullyShardFusion: gradients arrived outside a tracked backward pass (no pre-backward gather ran); "
            "they cannot be reduced without risking different collective orders on different ranks"
        )
    for buffer in owner.buffers:
        if buffer.is_gathered and buffer.held_for_backward:
            buffer.release()
    return []
