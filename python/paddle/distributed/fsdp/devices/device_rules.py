"""Fake-device rules for host staging memory, pinning and device synchronisations (CPU-only CI).

A GPU breaks three things a CPU forgives, so fake-device mode (``device.py``) makes each of them an error or a
counted event while it is on:

* **Pinning.** ``Tensor.pin_memory`` fails on a CPU build; in fake-device mode it is emulated (a host copy tagged
  as pinned), so the pinning path of ``device.host_empty`` runs, and ``host_empty`` refuses a result that is not
  tagged (the way a real GPU build would hand back device memory for a pinned request: paddle 3.3.1's creation
  ops with ``device=CUDAPinnedPlace()``, Paddle issue #77537).
* **No op on host staging memory.** Paddle moves a pinned op input to the device (``NeedTransformPlace``;
  Paddle issue #78835), so a ``reshape`` of a pinned view is a device temporary and the copy that follows lands
  on the device. Any op on a tensor tagged as host staging (``_fsdp_staging``: a pinned request of
  ``device.host_empty`` and the views ``device.to_host`` returns) other than slicing
  (``_slice``), copies (``copy_``, ``_copy_to``, ``cpu``, ``numpy``, ``pin_memory``) and metadata raises
  :class:`HostStagingOpError`: every public ``paddle._C_ops`` function and every ``paddle.Tensor`` method is
  checked (functions imported by name elsewhere, and ops reached only from C++, are not).
* **Device syncs held with the GIL.** ``paddle.device.synchronize`` (``core._device_synchronize`` holds the GIL
  through ``cudaDeviceSynchronize``), blocking ``_copy_to``/``cpu`` of device tensors and fake event/stream
  synchronisations are logged with the thread and whether the GIL is held (``numpy()`` and ``copy_`` release
  it in paddle's bindings); :func:`syncs` returns the log, so a test asserts that a background thread did none.
"""

from __future__ import annotations

import functools
import inspect
import threading
from dataclasses import dataclass

import paddle

_Tensor = paddle.Tensor
STAGING_TAG = "_fsdp_staging"  # pinned (or pinned-requested) host staging memory: slices and copies only
PINNED_TAG = "_fsdp_fake_pinned"

# Tensor methods allowed on host staging memory: views by slicing, copies, metadata, raw access.
_ALLOWED = frozenset(
    {
        "_slice",
        "copy_",
        "_copy_to",
        "cpu",
        "numpy",
        "pin_memory",
        "data_ptr",
        "is_contiguous",
        "element_size",
        "_is_initialized",
        "_is_shared_buffer_with",
        "dim",
        "ndimension",
        "_md5sum",
        "get_tensor",
        "value",
        "is_dense",
        "_is_dense_tensor_hold_allocation",
        "_share_buffer_to",
        "_numel",
    }
)
_DUNDERS = (
    "__add__ __radd__ __sub__ __rsub__ __mul__ __rmul__ __truediv__ __rtruediv__ __matmul__ __neg__ __pow__ "
    "__getitem__ __setitem__ __iadd__ __isub__ __imul__ __itruediv__ __mod__ __floordiv__"
).split()


class CopyOrderError(RuntimeError):
    """An op ran on the calling thread between a copy batch's start event and its copies (fake-device mode): on
    a GPU the copy stream would not wait for that op, e.g. the ``contiguous()`` making a copy's source."""


class HostStagingOpError(RuntimeError):
    """An op other than slicing or a copy ran on host staging (pinned) memory: on a GPU, paddle moves such an
    input to the device, so the result is a device temporary (fake-device mode)."""


@dataclass(frozen=True)
class SyncRecord:
    """One device synchronisation seen in fake-device mode."""

    kind: str
    thread: str
    main_thread: bool
    gil_held: bool


_sync_log: list[SyncRecord] = []
_sync_lock = threading.Lock()
_originals: dict[tuple[object, str], object] = {}
_is_device = None  # device.py's predicate: is this tensor device memory (fake-device mode)
_active = False  # the wrappers stay installed once patched (others may have patched on top); this switches them


_tls = threading.local()


def ops_issued() -> int:
    """Ops (``paddle._C_ops`` functions and Tensor methods) this thread ran while the rules were on."""
    return getattr(_tls, "ops", 0)


def _count() -> None:
    _tls.ops = getattr(_tls, "ops", 0) + 1


def record_sync(kind: str, gil_held: bool) -> None:
    """Log a device synchronisation (fake-device mode and real waits alike; the log is what tests read)."""
    th = threading.current_thread()
    with _sync_lock:
        _sync_log.append(SyncRecord(kind, th.name, th is threading.main_thread(), gil_held))


def syncs(reset: bool = False) -> list[SyncRecord]:
    """The device synchronisations logged so far (optionally clearing the log)."""
    with _sync_lock:
        out = list(_sync_log)
        if reset:
            _sync_log.clear()
    return out


def is_staging(t) -> bool:
    return type(t) is _Tensor and getattr(t, STAGING_TAG, False)


def is_fake_pinned(t) -> bool:
    return getattr(t, PINNED_TAG, False)


def original(owner, name: str):
    """The unguarded attribute (a paddle.Tensor method or paddle._C_ops function)."""
    return _originals.get((owner, name), getattr(owner, name))


def _refuse(name: str) -> None:
    raise HostStagingOpError(
        f"{name} on host staging memory (fake-device mode): on a GPU paddle moves a pinned input to the device; "
        "stage through flat views and copies only (device.to_host)"
    )


def _guard_method(name: str, fn):
    @functools.wraps(fn)
    def guarded(self, *args, **kwargs):
        if _active:
            _count()
            if is_staging(self) or any(is_staging(a) for a in args):
                _refuse(f"Tensor.{name}")
        return fn(self, *args, **kwargs)

    return guarded


def _guard_op(name: str, fn):
    @functools.wraps(fn)
    def guarded(*args, **kwargs):
        if _active:
            _count()
        for a in args if _active else ():
            if is_staging(a) or (type(a) in (list, tuple) and any(is_staging(x) for x in a)):
                _refuse(f"paddle._C_ops.{name}")
        return fn(*args, **kwargs)

    return guarded


def _fake_pin_memory(self, blocking: bool = True):
    """``Tensor.pin_memory`` emulated: a host copy tagged as pinned (the real one copies to CUDAPinnedPlace)."""
    if not _active:
        return _originals[(_Tensor, "pin_memory")](self, blocking)
    out = paddle.empty(list(self.shape), dtype=self.dtype, device=paddle.CPUPlace())
    original(_Tensor, "copy_")(out, self, True)
    setattr(out, PINNED_TAG, True)
    return out


def _tagging_slice(fn):
    @functools.wraps(fn)
    def _slice(self, *args, **kwargs):
        out = fn(self, *args, **kwargs)
        if is_staging(self):
            setattr(out, STAGING_TAG, True)  # a view of staging memory is staging memory
        return out

    return _slice


def _counting_cpu(fn):
    @functools.wraps(fn)
    def cpu(self):
        if _active and _is_device(self):
            record_sync("Tensor.cpu", gil_held=True)  # a blocking device-to-host copy (conservatively: GIL held)
        return fn(self)

    return cpu


def _counting_copy_to(fn):
    @functools.wraps(fn)
    def copy_to(self, place, blocking=True, *args, **kwargs):
        if _active and blocking and _is_device(self):
            record_sync("Tensor._copy_to(blocking)", gil_held=True)  # conservatively: binding not checked
        return fn(self, place, blocking, *args, **kwargs)

    return copy_to


def _counting_synchronize(fn):
    @functools.wraps(fn)
    def synchronize(*args, **kwargs):
        if _active:
            record_sync("paddle.device.synchronize", gil_held=True)  # core._device_synchronize keeps the GIL
        if (
            paddle.is_compiled_with_cuda() or not _active
        ):  # a CPU build has no device to wait for (and raises TypeError)
            return fn(*args, **kwargs)
        return None

    return synchronize


def _patch(owner, name: str, new) -> None:
    _originals.setdefault((owner, name), getattr(owner, name))
    setattr(owner, name, new)


def install(is_device) -> None:
    """Switch the rules on (patches once); ``is_device(t)``: whether ``t`` counts as device memory."""
    global _is_device, _active
    _is_device, _active = is_device, True
    if _originals:
        return
    for name in dir(_Tensor):
        if name in _ALLOWED or (name.startswith("__") and name not in _DUNDERS):
            continue
        static = inspect.getattr_static(_Tensor, name, None)
        if type(static).__name__ not in ("function", "method_descriptor", "wrapper_descriptor"):
            continue
        _patch(_Tensor, name, _guard_method(name, getattr(_Tensor, name)))
    ops = paddle._C_ops
    for name in dir(ops):
        fn = getattr(ops, name)
        if not name.startswith("_") and callable(fn) and not inspect.isclass(fn):
            _patch(ops, name, _guard_op(name, fn))
    _patch(_Tensor, "pin_memory", _fake_pin_memory)
    _patch(_Tensor, "_slice", _tagging_slice(_Tensor._slice))
    _patch(_Tensor, "cpu", _counting_cpu(_Tensor.cpu))
    _patch(_Tensor, "_copy_to", _counting_copy_to(_Tensor._copy_to))
    _patch(paddle.device, "synchronize", _counting_synchronize(paddle.device.synchronize))


def uninstall() -> None:
    """Switch the rules off. The wrappers stay (a pass-through now): other code (snapshot_guard) may have
    patched the same methods on top of them, and restoring ours would drop theirs."""
    global _active
    _active = False
