"""Device-to-host copies off the compute stream: one copy stream, events, and waits that release the GIL.

A :class:`CopyBatch` is opened at a save's call: an event recorded on the compute stream there, which the copy
stream waits for (everything queued before the call is ordered before the copies; nothing after it is). Copies
are issued with ``Tensor.copy_(src, False)`` under ``paddle.device.stream_guard(copy stream)``; ``fence``
makes the compute stream wait (on the device, not the host) for the copies issued so far, for tensors that the
next forward rewrites; ``finish`` records the event that :meth:`CopyBatch.wait` polls with ``Event.query()``
and ``time.sleep`` (which releases the GIL), never ``paddle.device.synchronize`` (``core._device_synchronize``
holds the GIL through a device-wide ``cudaDeviceSynchronize``).

Copies are *issued on the calling thread* on purpose: in paddle 3.3.1 ``stream_guard`` swaps the stream of the
process-wide ``GPUContext`` of the place (``set_current_stream`` -> ``GPUContext::SetCUDAStream``), so a
background thread entering it would send the training thread's kernels to the copy stream as well. Issuing is
a launch per tensor (microseconds); the background thread only waits. Sources stay referenced by the batch
until its wait returned (the allocator must not hand a temporary's memory to a compute kernel while the copy
stream still reads it).

Fake-device mode emulates the streams (and refuses an op run on the calling thread between ``begin`` and a
``copy``: the copy stream would not wait for it, :class:`device_rules.CopyOrderError`): issued copies are queued and run when the batch is fenced (on the
calling thread: the compute stream may not pass that point before them) or when its first ``query`` finds them
pending (the copies are "in flight": query returns False once, then they have run on the querying thread), so
tests count polls and synchronisations (``device_rules.syncs``) and compare bytes with sync saves. On a CPU
build without fake-device mode there is no device memory: copies run at once.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

import paddle

from . import device_rules

POLL_FIRST_S = 20e-6  # first sleep between event queries; doubles up to POLL_MAX_S
POLL_MAX_S = 1e-3

_streams: dict[str, object] = {}
_streams_lock = threading.Lock()


def _copy_stream():
    """The process's copy stream for the current device (created once)."""
    place = paddle.framework._current_expected_place_()
    key = str(place)
    with _streams_lock:
        stream = _streams.get(key)
        if stream is None:
            stream = _streams[key] = paddle.device.Stream(place)
        return stream


class CopyBatch:
    """Device-to-host copies of one save (or one staging call), ordered after the work queued before it."""

    def __init__(self, mode: str):
        if mode not in ("cuda", "fake", "host"):
            raise ValueError(f"CopyBatch mode must be 'cuda', 'fake' or 'host', not {mode!r}")
        self.mode = mode
        self._keep: list = []  # sources (and destinations) alive until the copies are known to be done
        self._pending: list = []  # fake mode: queued copies
        self._done_event = None
        self._finished = False
        self._complete = False
        self.polls = 0
        self._ops_at_start = device_rules.ops_issued()
        if mode == "cuda":
            self._compute = paddle.device.current_stream()
            self._stream = _copy_stream()
            start = paddle.device.Event()
            start.record(self._compute)
            self._stream.wait_event(start)

    def copy(self, pairs: Iterable[tuple]) -> None:
        """Issue ``dst.copy_(src)`` for ``(dst, src)`` pairs: host destination views, device sources of the same
        shape and dtype (flat on both sides)."""
        pairs = list(pairs)
        if not pairs:
            return
        if self.mode == "fake" and device_rules.ops_issued() != self._ops_at_start:
            raise device_rules.CopyOrderError(
                "an op ran on the calling thread between the copy batch's start event and its copies: on a GPU "
                "the copy stream would not wait for it (make the copies' sources before device_streams.begin)"
            )
        self._keep.append(pairs)
        if self.mode == "cuda":
            with paddle.device.stream_guard(self._stream):
                for dst, src in pairs:
                    dst.copy_(src, False)
        elif self.mode == "fake":
            self._pending.extend(pairs)
        else:
            _run(pairs)

    def fence(self) -> None:
        """The compute stream waits (on the device) for the copies issued so far."""
        if self.mode == "cuda":
            event = paddle.device.Event()
            event.record(self._stream)
            self._compute.wait_event(event)
        elif self.mode == "fake":
            pending, self._pending = self._pending, []
            _run(pending)

    def finish(self) -> CopyBatch:
        """Record the completion event (after the last ``copy``); returns self."""
        if self.mode == "cuda":
            self._done_event = paddle.device.Event()
            self._done_event.record(self._stream)
        self._finished = True
        return self

    def query(self) -> bool:
        """Whether every copy has completed (never blocks)."""
        if not self._finished:
            raise RuntimeError("CopyBatch.query before finish()")
        if self._complete:
            return True
        if self.mode == "cuda":
            done = self._done_event.query()
        elif self._pending:  # fake: in flight on the first query, then run
            pending, self._pending = self._pending, []
            _run(pending)
            done = False
        else:
            done = True
        if done:
            self._complete = True
            self._keep = []
        return done

    def wait(self) -> None:
        """Block until the copies completed: event queries with sleeps in between (the GIL is released while
        sleeping), never a device-wide synchronisation."""
        delay = POLL_FIRST_S
        while not self.query():
            self.polls += 1
            device_rules.record_sync("copy event poll", gil_held=False)
            time.sleep(delay)
            delay = min(delay * 2, POLL_MAX_S)


def _run(pairs: list) -> None:
    copy_ = device_rules.original(paddle.Tensor, "copy_")
    for dst, src in pairs:
        copy_(dst, src, True)


def begin(mode: str) -> CopyBatch:
    """Open a batch: ``mode`` "cuda" (a real device), "fake" (fake-device mode) or "host" (copies run at once)."""
    return CopyBatch(mode)
