"""A GPU communication stream, emulated on CPU so that overlap can be measured and misuse caught.

On gloo an "asynchronous" collective runs to completion inside the call (paddle 3.3.1's gloo tasks are
complete when returned), so prefetching cannot overlap anything and a read of an output before its
``wait()`` goes unnoticed. In emulation mode (``PADDLE_FSDP_EMULATE_GPU_COLLECTIVES=1`` or fake-device mode)
the gathers and reduce-scatters of ``communication.ShardingComm`` instead behave like NCCL work on one
communication stream:

- the data moves at issue time (a real gloo collective, into a private staging tensor; a rank that issues
  first blocks there until the others issue, as gloo needs every rank), but the caller's output is filled
  with NaN and receives the data only when the task is waited for: code that reads an output before
  ``wait()`` computes with NaN, whatever the timing;
- each collective occupies the stream for ``delay`` seconds (``PADDLE_FSDP_EMULATE_COLLECTIVE_DELAY_MS``,
  default 0), one after another in issue order: it completes at ``max(issue time, previous completion) +
  delay``. ``wait()`` sleeps until then (releasing the GIL). The host thread plays the compute stream: time
  it spends computing while a collective is in flight is overlapped, time it spends in ``wait()`` is not;
- a synchronous collective (the order check, the end-of-backward exchange) first waits for the stream to
  drain, as a host read of a result queued behind in-flight NCCL work would.

What this shows: the order in which collectives are issued and waited for, and that the schedule lets a
collective's delay run under computation. What it cannot show: real NCCL bandwidth, contention between
communication and compute kernels, or stream-ordering bugs (CUDA events, ``record_stream``).
"""

from __future__ import annotations

import time
from typing import Callable

from .. import env_switches

DELAY_ENV = "PADDLE_FSDP_EMULATE_COLLECTIVE_DELAY_MS"


def delay_from_env() -> float:
    """The emulated duration of one gather or reduce-scatter, in seconds (0 when unset)."""
    return env_switches.read(DELAY_ENV) / 1000.0


class EmulatedStream:
    """One communication stream's timeline: collectives complete in issue order, ``delay`` seconds each."""

    def __init__(self, delay: float = 0.0) -> None:
        if delay < 0:
            raise ValueError(f"EmulatedStream: negative delay {delay}")
        self.delay = delay
        self.free_at = 0.0  # time.monotonic() at which the last issued collective completes

    def submit(self, complete: Callable[[], None], delay: float | None = None) -> EmulatedTask:
        """Queue a collective whose output ``complete()`` fills; returns the task to wait on."""
        start = max(time.monotonic(), self.free_at)
        self.free_at = start + (self.delay if delay is None else delay)
        return EmulatedTask(self.free_at, complete)

    def drain(self) -> None:
        """Block until every issued collective has completed (a synchronous collective queues behind them)."""
        _sleep_until(self.free_at)


class EmulatedTask:
    """An emulated in-flight collective: ``wait()`` sleeps until its completion time, then fills the output."""

    def __init__(self, done_at: float, complete: Callable[[], None]) -> None:
        self.done_at = done_at
        self._complete: Callable[[], None] | None = complete

    def is_completed(self) -> bool:
        return self._complete is None

    def wait(self) -> None:
        if self._complete is None:
            return
        _sleep_until(self.done_at)
        complete, self._complete = self._complete, None
        complete()


def _sleep_until(deadline: float) -> None:
    remaining = deadline - time.monotonic()
    while remaining > 0:
        time.sleep(remaining)
        remaining = deadline - time.monotonic()
