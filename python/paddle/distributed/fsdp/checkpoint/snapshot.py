"""Async-save snapshot: the host copy of what a rank writes, taken so that the training loop never waits for it.

Zero-stall schedule. The state a rank saves falls into two kinds:

* *deferred*: tensors that change only through an optimizer step or a direct write (trainable parameters,
  optimizer accumulators). Their copy completes on the save's background thread after ``save_state_dict``
  returned, during the next forward and backward. Every writer of such memory waits for the copy first
  (snapshot_guard.py: the optimizer step, in-place Tensor methods, ``set_value``, ``paddle.assign``, loads and
  later saves), so the checkpoint holds each tensor's value at the call.
* *volatile*: everything else (buffers that forward updates, e.g. BatchNorm statistics; tensors the caller did
  not mark), copied before the next forward may touch them. Small in practice.

The caller says which keys are deferred (``save_state_dict(deferred_keys=...)``; FSDP passes its parameter and
optimizer records); by default a key is deferred when its tensor is a trainable paddle Parameter.

Host tensors get a slot in the per-process arena (``host_memory.arena``: kept resident for the next async save):
contiguous ones are copied with one memcpy (deferred ones on the background thread, volatile ones at the call),
strided ones through a contiguous copy. Device tensors are copied once, straight into the process's pinned
staging (``device.HostStaging``, reused by every async save: no allocation per save once grown), whose flat
views are the arrays written; their device-to-host copies are *issued at the call* on a copy stream that first
waits for an event recorded on the compute stream (``device_streams.CopyBatch``): volatile ones first, then the
compute stream waits for those on the device (no host wait), then the deferred ones. The background thread
waits for the copy event by polling it with sleeps (GIL released), never with a device-wide synchronize. What
stays on the compute stream: a ``contiguous()`` copy of strided device tensors and the event waits (it pauses for
the volatile copies only).
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable

import numpy as np

from ..devices import device, device_streams
from . import host_memory, snapshot_guard
from .coordination import aligned

STAGING_CHUNK_BYTES = 64 << 20  # sync saves: device bytes staged together (one copy batch, one wait)


class _StagingSlot:
    """The process's pinned staging for async snapshots: one user at a time (a second one gets fresh memory)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._staging = device.HostStaging()
        self._busy = False

    def acquire(self) -> device.HostStaging:
        with self._lock:
            if self._busy:
                return device.HostStaging()
            self._busy = True
            return self._staging

    def release(self, staging: device.HostStaging) -> None:
        with self._lock:
            if staging is self._staging:
                self._busy = False

    def free(self) -> bool:
        with self._lock:
            if self._busy:
                return False
            self._staging.release()
            return True


snapshot_staging = _StagingSlot()


class _StagingPool:
    """Pinned staging buffers for sync saves, handed back when the last view of a batch is dropped."""

    def __init__(self, keep: int = 2, max_bytes: int = 2 * STAGING_CHUNK_BYTES):
        self._lock = threading.Lock()
        self._free: list[device.HostStaging] = []
        self._keep = keep
        self._max_bytes = max_bytes  # one record larger than a chunk grows a staging: not kept for later saves

    def take(self) -> device.HostStaging:
        with self._lock:
            return self._free.pop() if self._free else device.HostStaging()

    def give(self, staging: device.HostStaging) -> None:
        with self._lock:
            if len(self._free) < self._keep and staging.nbytes() <= self._max_bytes:
                self._free.append(staging)


sync_pool = _StagingPool()


class _Owner:
    """Owns a staging buffer while views of it are alive (the writer drops owners once their bytes are written)."""

    def __init__(self, staging: device.HostStaging):
        self.staging = staging
        weakref.finalize(self, sync_pool.give, staging)


class _LazyGroup:
    """Consecutive device tensors of a sync save, staged together when the first of them is written."""

    def __init__(self, tensors: list):
        self.tensors = tensors
        self.arrays: list | None = None
        self.owner: _Owner | None = None
        self.handed = 0

    def get(self, k: int):
        if self.arrays is None:
            owner = _Owner(sync_pool.take())
            views = device.to_host(self.tensors, owner.staging)
            self.arrays = [host_memory.raw_view(v, allow_copy=False)[0] for v in views]
            self.owner = owner
        out = (self.arrays[k], self.owner)
        self.handed += 1
        if self.handed == len(self.tensors):  # the writer holds the last references from now on
            self.arrays = self.owner = None
            self.tensors = []
        return out


def lazy_views(tensors: list, chunk_bytes: int = STAGING_CHUNK_BYTES) -> list:
    """Piece providers for a sync save's writer, in write order: a host tensor's bytes in place (strided: a
    copy); consecutive device tensors staged together, up to ``chunk_bytes`` (one copy batch, one wait, pinned
    staging from a small pool), when the first of them is written."""
    providers: list = []
    group: list = []
    size = 0

    def flush():
        nonlocal group, size
        if group:
            lazy = _LazyGroup(group)
            providers.extend((lambda k=k, lazy=lazy: lazy.get(k)) for k in range(len(group)))
        group, size = [], 0

    for t in tensors:
        n = _nbytes(t)
        if not n or device.is_host(t):
            flush()
            providers.append(lambda t=t: host_memory.raw_view(t))
            continue
        if group and size + n > chunk_bytes:
            flush()
        group.append(t)
        size += n
    flush()
    return providers


def default_deferred(record) -> bool:
    """Without ``deferred_keys``: trainable paddle Parameters change only through the optimizer step."""
    t = record.tensor
    return bool(getattr(t, "trainable", False)) and not getattr(t, "stop_gradient", True)


class Snapshot:
    """Host copies of the ``records`` this rank writes (TensorRecords, in write order).

    Construction copies the volatile host records, issues every device copy and registers the deferred records
    with the snapshot guard; ``arrays`` are the host arrays to write (complete once ``copy_deferred``, which the
    save's background thread runs first, returned), ``release`` gives the arena and the staging back once the
    arrays are written. ``copy_deferred`` always ends the guard's wait, also on error; ``cancel`` too.
    """

    def __init__(self, records: list, deferred: Callable[[object], bool], hugepages: bool | str = "auto"):
        self.arrays: list[np.ndarray] = []
        self.keep: list = []
        self._jobs: list = []  # (slot, tensor): deferred contiguous host copies (viewed on the background thread)
        self._strided: list = []  # (slot, tensor): deferred strided host copies
        self._batch: device_streams.CopyBatch | None = None
        self._staging: device.HostStaging | None = None
        self.deferred_bytes = 0
        self.volatile_bytes = 0
        self._guard: snapshot_guard.SnapshotInFlight | None = None
        sizes = [_nbytes(r.tensor) for r in records]
        on_device = [bool(n) and not device.is_host(r.tensor) for r, n in zip(records, sizes)]
        need = sum(aligned(n) for n, d in zip(sizes, on_device) if not d)
        buf = host_memory.arena.acquire(need, grow=True, hugepages=hugepages) if need else None
        self.release: Callable[[], None] | None = host_memory.arena.release if buf is not None else None
        try:
            if buf is None and need:
                buf = host_memory.alloc_host(need, hugepages=hugepages)
            self.arrays = [np.zeros(0, np.uint8)] * len(records)
            ranges = self._host_records(records, sizes, on_device, deferred, buf)
            ranges += self._device_records(records, sizes, on_device, deferred)
            if ranges:
                self._guard = snapshot_guard.SnapshotInFlight(ranges)
                snapshot_guard.register(self._guard)
        except BaseException:
            self._give_back()
            raise

    def _host_records(self, records, sizes, on_device, deferred, buf) -> list:
        ranges, pos = [], 0
        for i, (r, n) in enumerate(zip(records, sizes)):
            if not n or on_device[i]:
                continue
            slot = buf[pos : pos + n]
            pos += aligned(n)
            self.arrays[i] = slot
            if deferred(r):  # the caller's clock: only the address range, no view (~4 us a record)
                (self._jobs if r.tensor.is_contiguous() else self._strided).append((slot, r.tensor))
                ranges.append(_address_range(r.tensor))
                self.deferred_bytes += n
            elif r.tensor.is_contiguous():
                np.copyto(slot, host_memory.raw_view(r.tensor, allow_copy=False)[0])
                self.volatile_bytes += n
            else:
                np.copyto(slot, host_memory.raw_view(r.tensor)[0])
                self.volatile_bytes += n
        return ranges

    def _device_records(self, records, sizes, on_device, deferred) -> list:
        """Issue the device copies now, volatile ones first (the compute stream waits for those on the device)."""
        idx = [i for i, d in enumerate(on_device) if d]
        if not idx:
            return []
        self._staging = snapshot_staging.acquire()
        views = device.staging_views([records[i].tensor for i in idx], self._staging)
        pairs = [(i, v, device.flat_source(records[i].tensor)) for i, v in zip(idx, views)]
        late = [deferred(records[i]) for i in idx]
        self._batch = batch = device_streams.begin(device.copy_mode())
        batch.copy((v, src) for (_i, v, src), d in zip(pairs, late) if not d)
        if not all(late):
            batch.fence()
        batch.copy((v, src) for (_i, v, src), d in zip(pairs, late) if d)
        batch.finish()
        ranges = []
        for (i, v, _src), d in zip(pairs, late):
            self.arrays[i] = host_memory.raw_view(v, allow_copy=False)[0]  # pinned staging, in place
            if d:
                ranges.append(_address_range(records[i].tensor))
                self.deferred_bytes += sizes[i]
            else:
                self.volatile_bytes += sizes[i]
        return ranges

    @property
    def pending(self) -> bool:
        return self._guard is not None and not self._guard.done.is_set()

    def copy_deferred(self) -> None:
        """Copy the deferred host tensors and wait for the device copies (background thread), then let the
        writers waiting for them go on."""
        try:
            for slot, tensor in self._jobs:
                np.copyto(slot, host_memory.raw_view(tensor, allow_copy=False)[0])
            for slot, tensor in self._strided:
                np.copyto(slot, host_memory.raw_view(tensor)[0])
            if self._batch is not None:
                self._batch.wait()
        finally:
            self._finish()

    def _finish(self) -> None:
        self._jobs, self._strided = [], []
        guard, self._guard = self._guard, None
        if guard is not None:
            guard.done.set()
            snapshot_guard.unregister(guard)

    def _give_back(self) -> None:
        self._finish()
        batch, self._batch = self._batch, None
        if batch is not None and not batch.query():
            batch.wait()  # the staging must not be reused while copies into it are in flight
        staging, self._staging = self._staging, None
        if staging is not None:
            snapshot_staging.release(staging)
        release, self.release = self.release, None
        if release is not None:
            release()

    def written(self) -> None:
        """The arrays are on disk: give the arena and the staging back (idempotent)."""
        self.arrays, self.keep = [], []
        self._give_back()

    def cancel(self) -> None:
        """The save failed before its background thread started: end the guard's wait, free the arena."""
        self.arrays, self.keep = [], []
        self._give_back()


class StagedInto:
    """Device tensors copied into host arrays the caller owns (``pairs``: ``(dst, tensor)``, ``dst`` a uint8 array
    of the tensor's size, e.g. a memory-tier slot), on the Snapshot's schedule: every copy is issued at the call
    on the calling thread (a GPU's copy stream may not be entered from a background thread: devices/device_streams.py),
    the ``volatile`` ones first (the compute stream waits for those), into the process's pinned staging;
    ``finish`` (the background thread may call it) waits for them and moves the bytes into the arrays. Strided
    tensors are made contiguous on the device before the copies."""

    def __init__(self, volatile: list, deferred: list):
        self._pairs, self._views = volatile + deferred, []
        self._batch: device_streams.CopyBatch | None = None
        self._staging: device.HostStaging | None = snapshot_staging.acquire()
        try:
            sources = [device.flat_source(t) for _dst, t in self._pairs]  # before the batch's start event
            self._views = device.staging_views([t for _dst, t in self._pairs], self._staging)
            self._batch = batch = device_streams.begin(device.copy_mode())
            n = len(volatile)
            try:
                batch.copy(zip(self._views[:n], sources[:n]))
                if n:
                    batch.fence()
                batch.copy(zip(self._views[n:], sources[n:]))
            finally:
                batch.finish()  # also after a failed issue: release() waits for the copies in flight
        except BaseException:
            self.release()
            raise

    def wait(self) -> None:
        """Wait for the device copies (polling the copy event, GIL released): the tensors may change from then on."""
        self._batch.wait()

    def finish(self) -> None:
        """Wait for the copies and copy the staged bytes into the arrays; gives the staging back."""
        try:
            self.wait()
            for (dst, _t), view in zip(self._pairs, self._views):
                np.copyto(dst, host_memory.raw_view(view, allow_copy=False)[0])
        finally:
            self.release()

    def release(self) -> None:
        """Give the staging back once no copy into it is in flight (idempotent)."""
        batch, self._batch = self._batch, None
        if batch is not None and not batch.query():
            batch.wait()
        staging, self._staging = self._staging, None
        if staging is not None:
            snapshot_staging.release(staging)
        self._pairs, self._views = [], []


def _address_range(t) -> tuple[int, int]:
    """The memory a deferred tensor's copy reads, for the guard (a device address on a GPU: compared, never read)."""
    return snapshot_guard.span_of(t) or (0, 0)


def _nbytes(t) -> int:
    return host_memory.numel_of(t) * t.element_size()
