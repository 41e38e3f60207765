"""Async-save snapshot: the host copy of what a rank writes, taken so that the training loop never waits for it.

Zero-stall schedule. The state a rank saves falls into two kinds:

* *deferred*: tensors that change only through an optimizer step or a direct write (trainable parameters,
  optimizer accumulators). Their copy runs on the save's background thread after ``save_state_dict`` returned,
  during the next forward and backward. Every writer of such memory waits for the copy first
  (snapshot_guard.py: the optimizer step, in-place Tensor methods, ``set_value``, ``paddle.assign``, loads and
  later saves), so the checkpoint holds each tensor's value at the call.
* *volatile*: everything else (buffers that forward updates, e.g. BatchNorm statistics; tensors the caller did
  not mark), copied on the calling thread before the call returns. Small in practice.

The caller says which keys are deferred (``save_state_dict(deferred_keys=...)``; FSDP passes its parameter and
optimizer records); by default a key is deferred when its tensor is a trainable paddle Parameter.

Every record gets a slot in the per-process arena (``host_memory.arena``: grown when too small and kept resident
for the next async save; fresh memory when another user holds it). Host-contiguous tensors are copied into their
slot with one memcpy each. Device (and strided) tensors are *staged*: ``device.to_host`` copies them in batches of
up to ``STAGING_CHUNK_BYTES`` into one reusable (pinned where available) staging buffer, and from there into their
slots; never one ``.cpu()`` per tensor and never through a raw pointer to device memory. Staged records follow
the same schedule as host ones: deferred ones on the background thread (the guard covers their device address
range), volatile ones at the call.
"""

from __future__ import annotations

import threading
from typing import Callable

import numpy as np

from .. import device
from . import host_memory, snapshot_guard
from .coordination import aligned

STAGING_CHUNK_BYTES = 64 << 20  # device bytes per to_host batch: bounds the staging buffer, amortises syncs

_staging = device.HostStaging()  # reused by every snapshot of the process: pinned once
_staging_lock = threading.Lock()  # a volatile copy at a call and a background copy may overlap


def copy_to_host(tensor):
    """Host bytes of a device or strided tensor and the object that owns them (one tensor; prefer
    :func:`stage_into`, which batches)."""
    return host_memory.raw_view(tensor)


def stage_into(jobs: list, chunk_bytes: int = STAGING_CHUNK_BYTES) -> None:
    """Copy device or strided tensors into their host slots: ``jobs`` are ``(slot, tensor)`` with ``slot`` a
    uint8 array of the tensor's size. Device tensors go through ``device.to_host`` in batches of at most
    ``chunk_bytes`` (larger ones in flat pieces; one staging buffer, reused); host strided ones are made
    contiguous and copied."""
    with _staging_lock:
        batch: list = []
        size = 0
        for slot, t in _split_large(jobs, chunk_bytes):
            if batch and size + len(slot) > chunk_bytes:  # a batch never exceeds a chunk (pieces are <= one)
                _stage_batch(batch, chunk_bytes)
                batch, size = [], 0
            batch.append((slot, t))
            size += len(slot)
        if batch:
            _stage_batch(batch, chunk_bytes)


def _split_large(jobs: list, chunk_bytes: int):
    """Device tensors larger than a chunk (a fused buffer shard) as chunk-sized flat pieces, so the staging
    buffer stays about ``chunk_bytes`` whatever the tensor sizes."""
    for slot, t in jobs:
        if len(slot) <= chunk_bytes or device.is_host(t):
            yield slot, t
            continue
        flat = (t if t.is_contiguous() else t.contiguous()).reshape([-1])
        size = t.element_size()
        step = max(chunk_bytes // size, 1)
        numel = len(slot) // size
        for start in range(0, numel, step):
            stop = min(start + step, numel)
            yield slot[start * size : stop * size], flat._slice(start, stop)


def _stage_batch(batch: list, chunk_bytes: int) -> None:
    hosts = device.to_host([t for _slot, t in batch], _staging, chunk_bytes=chunk_bytes)
    for (slot, _t), h in zip(batch, hosts):
        arr, _keep = host_memory.raw_view(h)  # a staging view in place (strided host tensors: one copy)
        np.copyto(slot, arr)


def default_deferred(record) -> bool:
    """Without ``deferred_keys``: trainable paddle Parameters change only through the optimizer step."""
    t = record.tensor
    return bool(getattr(t, "trainable", False)) and not getattr(t, "stop_gradient", True)


class Snapshot:
    """Host copies of the ``records`` this rank writes (TensorRecords, in write order).

    Construction copies the volatile records and registers the deferred ones with the snapshot guard;
    ``arrays`` are the host arrays to write (deferred ones filled by ``copy_deferred``, which the save's
    background thread runs first), ``keep`` the owners of device copies, ``release`` gives the arena back once
    the arrays are written. ``copy_deferred`` always ends the guard's wait, also on error; ``cancel`` too.
    """

    def __init__(
        self,
        records: list,
        deferred: Callable[[object], bool],
        hugepages: bool | str = "auto",
        chunk_bytes: int = STAGING_CHUNK_BYTES,
    ):
        self.arrays: list[np.ndarray] = []
        self.keep: list = []
        self.chunk_bytes = chunk_bytes
        self._jobs: list = []  # (slot, tensor): deferred host copies (viewed on the background thread)
        self._staged: list = []  # (slot, tensor): deferred device/strided copies, batched through to_host
        self.deferred_bytes = 0
        self.volatile_bytes = 0
        self._guard: snapshot_guard.SnapshotInFlight | None = None
        sizes = [_nbytes(r.tensor) for r in records]
        need = sum(aligned(n) for n in sizes)
        buf = host_memory.arena.acquire(need, grow=True, hugepages=hugepages) if need else None
        self.release: Callable[[], None] | None = host_memory.arena.release if buf is not None else None
        try:
            if buf is None and need:
                buf = host_memory.alloc_host(need, hugepages=hugepages)
            pos = 0
            ranges = []
            staged_now: list = []  # volatile device/strided copies, batched below
            for r, n in zip(records, sizes):
                if not n:
                    self.arrays.append(np.zeros(0, np.uint8))
                    continue
                slot = buf[pos : pos + n]
                pos += aligned(n)
                self.arrays.append(slot)
                if not host_memory.is_host_contiguous(r.tensor):
                    if deferred(r):
                        self._staged.append((slot, r.tensor))
                        ranges.append(_address_range(r.tensor))
                        self.deferred_bytes += n
                    else:
                        staged_now.append((slot, r.tensor))
                        self.volatile_bytes += n
                    continue
                if deferred(r):  # the caller's clock: only the address range, no view (~4 us a record)
                    self._jobs.append((slot, r.tensor))
                    start = device.address(r.tensor)
                    ranges.append((start, start + n))
                    self.deferred_bytes += n
                else:
                    np.copyto(slot, host_memory.raw_view(r.tensor, allow_copy=False)[0])
                    self.volatile_bytes += n
            if staged_now:
                stage_into(staged_now, chunk_bytes)
            if self._jobs or self._staged:
                self._guard = snapshot_guard.SnapshotInFlight(ranges)
                snapshot_guard.register(self._guard)
        except BaseException:
            self._give_back()
            raise

    @property
    def pending(self) -> bool:
        return self._guard is not None and not self._guard.done.is_set()

    def copy_deferred(self) -> None:
        """Copy the deferred tensors (background thread), then let the writers waiting for them go on."""
        try:
            for slot, tensor in self._jobs:
                np.copyto(slot, host_memory.raw_view(tensor, allow_copy=False)[0])
            if self._staged:
                stage_into(self._staged, self.chunk_bytes)
        finally:
            self._finish()

    def _finish(self) -> None:
        self._jobs, self._staged = [], []
        guard, self._guard = self._guard, None
        if guard is not None:
            guard.done.set()
            snapshot_guard.unregister(guard)

    def _give_back(self) -> None:
        self._finish()
        release, self.release = self.release, None
        if release is not None:
            release()

    def written(self) -> None:
        """The arrays are on disk: give the arena back (idempotent)."""
        self.arrays, self.keep = [], []
        self._give_back()

    def cancel(self) -> None:
        """The save failed before its background thread started: end the guard's wait, free the arena."""
        self.arrays, self.keep = [], []
        self._give_back()


def _address_range(t) -> tuple[int, int]:
    """The memory a deferred tensor's copy reads, for the guard (a device address on a GPU: compared, never read)."""
    return snapshot_guard.span_of(t) or (0, 0)


def _nbytes(t) -> int:
    return host_memory.numel_of(t) * t.element_size()
