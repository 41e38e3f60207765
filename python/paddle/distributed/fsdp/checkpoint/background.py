"""The one save in flight per process: ``SaveHandle``, the background worker thread, ``wait_pending``.

Why: the saves of one process never overlap, whatever thread they come from (a save or a load first waits for
this process's previous save), and the background part of an async save runs on one long-lived thread. Split
from save/save.py so that load/load.py can wait for a pending save without importing the save path.
"""

from __future__ import annotations

import _thread
import atexit
import os
import queue
import threading

from .errors import SaveFailedError


class SaveHandle:
    """Handle of an async save. ``wait()`` blocks until the checkpoint is committed or raises its error."""

    def __init__(self, path: str, checkpoint_id: str):
        self.path = path
        self.checkpoint_id = checkpoint_id
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._reported = False
        self._done = threading.Event()

    def _run(self, fn) -> None:
        try:
            fn()
        except BaseException as e:  # surfaced by wait() or the next save
            self._error = e
        finally:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        if not self._done.wait(timeout):
            raise TimeoutError(f"async save to {self.path} still running after {timeout} s")
        if self._thread is not None:
            self._thread.join()
        if self._error is not None and not self._reported:
            self._reported = True
            raise self._error


_pending: SaveHandle | None = None
_pending_lock = threading.Lock()


class _BackgroundWorker:
    """The one long-lived thread that runs the background part of async saves (one at a time: saves of a
    process never overlap). Handing a save to a thread that already runs costs the caller a queue put; starting
    a ``threading.Thread`` per save made the caller wait until the new thread was scheduled (``start()`` waits for
    it; tens of ms on a busy machine), so the worker is started with ``_thread.start_new_thread``, which does not
    wait. It never keeps the interpreter alive; ``atexit`` waits for a save still in flight, so a checkpoint
    started before exit is still committed. It runs at normal CPU priority: a lower one (nice 10 for the write
    phase) was measured to slow training down, not to spare it: a writer descheduled while it holds the GIL
    blocks the training thread of its process until the kernel runs it again (priority inversion)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._started = False

    def submit(self, fn) -> None:
        with self._lock:
            if not self._started:
                _thread.start_new_thread(self._loop, ())
                atexit.register(wait_pending, False)
                self._started = True
        self._queue.put(fn)

    def _loop(self) -> None:
        threading.current_thread().name = "ckpt-save"
        while True:
            fn = self._queue.get()
            fn()


_worker = _BackgroundWorker()


def _forget_in_child() -> None:
    """A forked child has the worker's objects but not its thread (an async save handed to it would never run),
    and the parent's save in flight is the parent's to finish: the child starts with neither."""
    global _worker, _pending, _pending_lock
    _worker, _pending, _pending_lock = _BackgroundWorker(), None, threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)


def wait_pending(raise_error: bool) -> None:
    """Wait for this process's previous async save. Its uncollected error is raised here when
    ``raise_error`` (the next save), else kept for the next save (a load does not consume it)."""
    global _pending
    with _pending_lock:
        h = _pending
    if h is None:
        return
    h._done.wait()
    if h._thread is not None:
        h._thread.join()
    failed = h._error is not None and not h._reported
    with _pending_lock:
        if _pending is h and (raise_error or not failed):
            _pending = None
    if raise_error and failed:
        h._reported = True
        raise SaveFailedError(f"previous async save to {h.path} failed: {h._error}") from h._error


def start_in_background(handle: SaveHandle, run, cancel) -> SaveHandle:
    """Make ``handle`` this process's pending save and run ``run()`` on the worker (``cancel()`` undoes what the
    caller prepared when the hand-over itself fails)."""
    global _pending
    with _pending_lock:
        _pending = handle
    try:
        _worker.submit(lambda: handle._run(run))
    except BaseException:
        with _pending_lock:
            if _pending is handle:
                _pending = None
        cancel()
        raise
    return handle
