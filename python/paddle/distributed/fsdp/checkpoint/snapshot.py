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

Host tensors are copied into the per-process arena (``host_memory.arena``: grown when too small and kept resident
for the next async save; fresh memory when another user holds it). A device (or strided) tensor is copied to
host on the calling thread (``copy_to_host``: the one place a pinned, side-stream device copy would go).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from . import host_memory, snapshot_guard
from .coordination import aligned


def copy_to_host(tensor):
    """Host bytes of a device or strided tensor and the object that owns them (calling thread only)."""
    return host_memory.raw_view(tensor)


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

    def __init__(self, records: list, deferred: Callable[[object], bool], hugepages: bool | str = "auto"):
        self.arrays: list[np.ndarray] = []
        self.keep: list = []
        self._jobs: list[tuple[np.ndarray, np.ndarray]] = []  # (slot, source view): deferred copies
        self._sources: list = []  # the deferred tensors, alive until copied
        self.deferred_bytes = 0
        self.volatile_bytes = 0
        self._guard: snapshot_guard.SnapshotInFlight | None = None
        host = [r for r in records if _nbytes(r.tensor) and host_memory.is_host_contiguous(r.tensor)]
        need = sum(aligned(_nbytes(r.tensor)) for r in host)
        buf = host_memory.arena.acquire(need, grow=True, hugepages=hugepages) if need else None
        self.release: Callable[[], None] | None = host_memory.arena.release if buf is not None else None
        try:
            if buf is None and need:
                buf = host_memory.alloc_host(need, hugepages=hugepages)
            host_ids = {id(r) for r in host}
            pos = 0
            ranges = []
            for r in records:
                if id(r) not in host_ids:
                    arr, owner = copy_to_host(r.tensor) if _nbytes(r.tensor) else (np.zeros(0, np.uint8), None)
                    self.arrays.append(arr)
                    if owner is not None:
                        self.keep.append(owner)
                    self.volatile_bytes += len(arr)
                    continue
                n = _nbytes(r.tensor)
                slot = buf[pos : pos + n]
                pos += aligned(n)
                src, _ = host_memory.raw_view(r.tensor, allow_copy=False)
                self.arrays.append(slot)
                if deferred(r):
                    self._jobs.append((slot, src))
                    self._sources.append(r.tensor)
                    ranges.append((src.ctypes.data, src.ctypes.data + n))
                    self.deferred_bytes += n
                else:
                    np.copyto(slot, src)
                    self.volatile_bytes += n
            if self._jobs:
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
            for slot, src in self._jobs:
                np.copyto(slot, src)
        finally:
            self._finish()

    def _finish(self) -> None:
        self._jobs, self._sources = [], []
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


def _nbytes(t) -> int:
    return host_memory.numel_of(t) * t.element_size()
