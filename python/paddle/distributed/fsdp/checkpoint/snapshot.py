"""Async-save snapshot: the host copy of what a rank writes, taken while the ranks agree on the save plan.

An async save blocks the training loop for the descriptor exchange, the plan and the copy of the rank's state.
The copy is memory-bound numpy work that releases the GIL, so it runs on a helper thread while the calling
thread exchanges descriptors and plans: the caller is blocked about as long as the copy alone. Only this rank's
own shards (records that are not replicated) are copied early; a replicated tensor is written by its
lowest-ranked holder only, which the plan decides, so it is copied (by the rank that writes it) afterwards.

Host tensors go into the per-process arena (``host_memory.arena``: grown when too small and kept resident for the
next async save; fresh memory when another user holds it). A device (or strided) tensor's host copy, made by
``raw_view`` on the calling thread (paddle calls stay off helper threads), is its snapshot already.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np

from . import host_memory
from .coordination import aligned


def _copy_all(jobs: list) -> None:
    for dst, src in jobs:
        np.copyto(dst, src)


class Snapshot:
    """Host copies of ``records`` (TensorRecords), started at construction, finished by ``arrays_for``.

    ``arrays_for(keys)`` waits for the early copies, copies the replicated records among ``keys`` and returns
    ``(arrays in keys order, owners to keep alive, release)``; ``release`` (or None) gives the arena back once
    the arrays are written. ``cancel()`` (on an error before that) waits for the copy thread and releases.
    """

    def __init__(self, records: list, hugepages: bool | str = "auto"):
        self._records = {r.key: r for r in records}
        self._slots: dict[str, np.ndarray] = {}  # key -> its place in the host buffer
        self._done: dict[str, tuple[np.ndarray, Any]] = {}  # key -> (array, owner): snapshot taken
        self._error: BaseException | None = None
        host = [r for r in records if _nbytes(r.tensor) and host_memory.is_host_contiguous(r.tensor)]
        need = sum(aligned(_nbytes(r.tensor)) for r in host)
        buf = host_memory.arena.acquire(need, grow=True, hugepages=hugepages) if need else None
        self._release: Callable[[], None] | None = host_memory.arena.release if buf is not None else None
        try:
            if buf is None and need:
                buf = host_memory.alloc_host(need, hugepages=hugepages)
            pos = 0
            for r in host:
                n = _nbytes(r.tensor)
                self._slots[r.key] = buf[pos : pos + n]
                pos += aligned(n)
            jobs = []
            for r in records:
                if r.replicated:
                    continue
                arr, owner = host_memory.raw_view(r.tensor)
                if r.key in self._slots:
                    jobs.append((self._slots[r.key], arr))
                    self._done[r.key] = (self._slots[r.key], None)
                else:  # device or strided: raw_view made a private host copy
                    self._done[r.key] = (arr, owner)
            self._thread = threading.Thread(target=self._run, args=(jobs,), name="ckpt-snapshot", daemon=True)
            self._thread.start()
        except BaseException:
            self._give_back()
            raise

    def _run(self, jobs: list) -> None:
        try:
            _copy_all(jobs)
        except BaseException as e:  # pragma: no cover - a copy between valid host buffers does not fail
            self._error = e

    def _give_back(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()

    def arrays_for(self, keys: list[str]) -> tuple[list, list, Callable[[], None] | None]:
        try:
            self._thread.join()
            if self._error is not None:
                raise self._error
            arrays, keep, late = [], [], []
            for key in keys:
                got = self._done.get(key)
                if got is None:  # a replicated record this rank writes
                    arr, owner = host_memory.raw_view(self._records[key].tensor)
                    slot = self._slots.get(key)
                    if slot is not None:
                        late.append((slot, arr))
                        got = (slot, None)
                    else:
                        got = (arr, owner)
                arrays.append(got[0])
                if got[1] is not None:
                    keep.append(got[1])
            _copy_all(late)
        except BaseException:
            self._give_back()
            raise
        release, self._release = self._release, None
        return arrays, keep, release

    def cancel(self) -> None:
        self._thread.join()
        self._give_back()


def _nbytes(t) -> int:
    return host_memory.numel_of(t) * t.element_size()
