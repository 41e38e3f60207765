"""What waits for an async save's background snapshot before tensor memory it copies is written.

An async save returns before its shards are copied (snapshot.py): the copy runs during the next forward and
backward. Whatever writes one of those tensors first has to wait for the copy, else the checkpoint would hold
the new value (or a mix) instead of the value at the call. The writers that wait:

* the optimizer step: ``Optimizer._apply_optimize`` (every paddle optimizer's ``step``/``minimize`` funnels into
  it; FSDP's optimizer integration calls :func:`wait_for_snapshot` as well);
* a direct write through a Tensor method: every public in-place method (``add_``, ``copy_``, ``fill_``,
  ``zero_``, ``scale_``, ..., names ending in ``_``), ``set_value`` and ``__setitem__`` (``p[...] = x``), and
  ``paddle.assign(x, output=p)``. These wait only when the tensor written overlaps memory being copied, so
  in-place ops of forward and backward on activations never wait;
* the engine itself: ``load_state_dict`` and every later save wait for the whole previous save;
* code that writes shards by other means calls :func:`wait_for_snapshot` first (FSDP's ``summon_full_params``
  writeback does).

The method wrappers are installed at the first async save of the process (never for code that does not use
async saves) and cost a global check per call while no snapshot is in flight.

NOT intercepted (documented limits; call ``wait_for_snapshot()`` before them): writes by kernels that paddle
calls without going through a Python Tensor method (``paddle._C_ops.*_`` called directly, functional in-place
APIs such as ``paddle.add_(x, y)`` / ``paddle.nn.functional.*`` with in-place semantics, an op's ``out=``
outputs), and writes through raw memory (``data_ptr``, DLPack, numpy views of a tensor's memory). A tensor
that shares memory with a copied one (a view, ``_share_buffer_to``) is caught: the check is by memory address.
"""

from __future__ import annotations

import bisect
import functools
import logging
import threading

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_inflight: list = []  # snapshots whose background copy runs (objects with ranges, done: threading.Event)
_installed = False

# in-place methods that change a tensor's metadata or autograd flags, never its bytes
_NOT_WRITES = {
    "requires_grad_",
    "detach_",
    "grad_",
    "reshape_",
    "squeeze_",
    "unsqueeze_",
    "flatten_",
    "transpose_",
    "t_",
    "register_hook_",
}
_EXTRA_WRITES = ("set_value", "__setitem__", "copy_", "set_")


class SnapshotInFlight:
    """One background copy: the sorted host address ranges ``[(start, end)]`` it reads, and its done event."""

    def __init__(self, ranges: list[tuple[int, int]]):
        self.ranges = sorted(r for r in ranges if r[1] > r[0])
        self._starts = [r[0] for r in self.ranges]
        self._max_len = max((e - s for s, e in self.ranges), default=0)
        self.done = threading.Event()

    def overlaps(self, start: int, end: int) -> bool:
        i = bisect.bisect_left(self._starts, end)
        # candidates begin before ``end``; walk back while a range could still reach ``start``
        while i > 0:
            i -= 1
            s, e = self.ranges[i]
            if e > start:
                return True
            if s + self._max_len <= start:
                return False
        return False


def register(snap: SnapshotInFlight) -> None:
    """Make writers wait for ``snap`` until its ``done`` is set (then call :func:`unregister`)."""
    _install()
    with _lock:
        _inflight.append(snap)


def unregister(snap: SnapshotInFlight) -> None:
    with _lock:
        if snap in _inflight:
            _inflight.remove(snap)


def snapshot_in_flight() -> bool:
    """True while an async save of this process is still copying tensors it must save."""
    return bool(_inflight)


def wait_for_snapshot(tensor=None) -> None:
    """Wait until no async save is copying ``tensor`` (any tensor when None) any more.

    Call it before writing shard memory by means the engine cannot see (see the module docstring). Returns at
    once when no async snapshot is in flight. Never raises for a failed copy: the save reports that itself.
    """
    if not _inflight:
        return
    with _lock:
        pending = list(_inflight)
    if tensor is not None:
        span = span_of(tensor)
        if span is None:
            return
        pending = [s for s in pending if s.overlaps(*span)]
    for snap in pending:
        if not snap.done.is_set():
            logger.debug("waiting for the async checkpoint snapshot before a write")
        snap.done.wait()


def span_of(t) -> tuple[int, int] | None:
    """Address range of a tensor's bytes, host or device (None when it has none): a device tensor's copy is
    staged by the background snapshot too, so its device range is guarded like a host one (compared, never
    read: ``device.address``)."""
    from ..devices import device

    try:
        n = 1
        for d in t.shape:
            n *= int(d)
        if n == 0:
            return None
        ptr = int(device.address(t))
    except Exception:  # noqa: BLE001 - an uninitialised tensor has no memory to overlap
        return None
    return ptr, ptr + n * t.element_size()


def _guard_method(orig):
    @functools.wraps(orig)
    def method(self, *args, **kwargs):
        if _inflight:
            wait_for_snapshot(self)
        return orig(self, *args, **kwargs)

    method.__snapshot_guard__ = True
    return method


def _guard_assign(orig):
    @functools.wraps(orig)
    def assign(x, output=None, *args, **kwargs):
        if _inflight and output is not None:
            wait_for_snapshot(output)
        return orig(x, output, *args, **kwargs)

    assign.__snapshot_guard__ = True
    return assign


def _guard_apply_optimize(orig):
    @functools.wraps(orig)
    def _apply_optimize(self, *args, **kwargs):
        if _inflight:
            wait_for_snapshot()
        return orig(self, *args, **kwargs)

    _apply_optimize.__snapshot_guard__ = True
    return _apply_optimize


def _install() -> None:
    """Wrap the writers listed in the module docstring (once per process)."""
    global _installed
    if _installed:
        return
    with _lock:
        if _installed:
            return
        import paddle
        from paddle.optimizer import Optimizer

        cls = paddle.Tensor
        names = [n for n in dir(cls) if n.endswith("_") and not n.startswith("_") and n not in _NOT_WRITES]
        for name in list(dict.fromkeys(names + list(_EXTRA_WRITES))):
            orig = getattr(cls, name, None)
            if orig is None or not callable(orig) or getattr(orig, "__snapshot_guard__", False):
                continue
            try:
                setattr(cls, name, _guard_method(orig))
            except (AttributeError, TypeError):  # pragma: no cover - a read-only slot
                logger.debug("cannot guard Tensor.%s against writes during async snapshots", name)
        for mod in (paddle, paddle.tensor, paddle.tensor.creation):
            orig = getattr(mod, "assign", None)
            if orig is not None and not getattr(orig, "__snapshot_guard__", False):
                mod.assign = _guard_assign(orig)
        if not getattr(Optimizer._apply_optimize, "__snapshot_guard__", False):
            wrapped = _guard_apply_optimize(Optimizer._apply_optimize)
            Optimizer._apply_optimize = wrapped
        _installed = True


def copies_in_flight() -> int:
    """Snapshots whose background copy is still running."""
    with _lock:
        return len(_inflight)
