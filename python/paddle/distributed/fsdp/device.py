"""Where tensor memory lives, and the only ways across: device-to-host and host-to-device copies.

On a GPU, model and optimizer tensors live in device memory: their data pointer is not readable by the
CPU, ``from_address(t.data_ptr())`` segfaults, and every copy to the host should be batched into a
reusable pinned buffer instead of one ``.cpu()`` per tensor. The checkpoint engine therefore asks this
module, never ``t.place`` directly:

- :func:`is_host` whether a tensor's bytes can be read in place;
- :func:`to_host` copies device tensors into (views of) a reusable pinned :class:`HostStaging` buffer,
  chunk by chunk;
- :func:`host_empty` allocates pinned host memory (``CUDAPinnedPlace``; a logged fallback to pageable
  memory where pinning is unavailable);
- :func:`host_to_device` copies a host tensor into a device tensor in place (``Tensor.copy_`` on the
  destination's place, never ``paddle.assign`` across places);
- :func:`data_ptr` is the only raw-pointer access, refused for device memory.

**Fake-device mode** makes these branches run on a CPU-only machine (CI): with
``PADDLE_FSDP_FAKE_DEVICE=1`` (or ``set_options(DeviceOptions(fake_device=True))``) every tensor counts as
device memory except those this module made as host memory (``host_empty``, ``to_host``, and views of
them), and ``Tensor.data_ptr`` called from the fork's own code raises :class:`DeviceMemoryAccessError` for device
tensors, so any code path of ours that would read device memory through a raw pointer fails loudly here, as
it would crash on a GPU (stock paddle and third-party callers are left alone).
``PADDLE_FSDP_EMULATE_GPU_COLLECTIVES=1`` (implied by fake-device mode) makes ``communication.py`` take
its reduce-scatter path (GPU-only in paddle 3.3.1's gloo) through an emulation on gloo.

Options are read from the environment in one place (:func:`options`), once per process.
"""

from __future__ import annotations

import logging
import os
import sys
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import paddle

logger = logging.getLogger(__name__)

FAKE_DEVICE_ENV = "PADDLE_FSDP_FAKE_DEVICE"
EMULATE_COLLECTIVES_ENV = "PADDLE_FSDP_EMULATE_GPU_COLLECTIVES"
DEFAULT_CHUNK_BYTES = 256 << 20


class DeviceMemoryAccessError(RuntimeError):
    """Raw access (a data pointer) to device memory, which the CPU cannot read."""


@dataclass(frozen=True)
class DeviceOptions:
    """How device memory is treated in this process.

    Attributes:
        fake_device: treat CPU tensors as device memory (see the module docstring); for CI on CPU.
        emulate_gpu_collectives: run the GPU-only collective code paths (reduce_scatter) emulated on gloo.
    """

    fake_device: bool = False
    emulate_gpu_collectives: bool = False

    @classmethod
    def from_env(cls) -> DeviceOptions:
        fake = os.environ.get(FAKE_DEVICE_ENV, "") not in ("", "0", "false", "False")
        emulate = os.environ.get(EMULATE_COLLECTIVES_ENV, "") not in ("", "0", "false", "False")
        return cls(fake_device=fake, emulate_gpu_collectives=emulate or fake)


_options: DeviceOptions | None = None
_original_data_ptr = paddle.Tensor.data_ptr
_host_bases: list[weakref.ref] = []  # fake-device mode: host buffers this module allocated


def options() -> DeviceOptions:
    """The process's device options (from the environment on first use)."""
    global _options
    if _options is None:
        set_options(DeviceOptions.from_env())
    return _options


def set_options(new: DeviceOptions) -> None:
    """Switch device options for this process (tests); installs or removes the fake-device pointer guard."""
    global _options
    _options = new
    if new.fake_device:
        paddle.Tensor.data_ptr = _guarded_data_ptr
        logger.info("fake-device mode: CPU tensors count as device memory unless made by device.host_empty/to_host")
    else:
        paddle.Tensor.data_ptr = _original_data_ptr


def _mark_host(tensor: paddle.Tensor) -> paddle.Tensor:
    tensor._fsdp_host_memory = True
    _host_bases.append(weakref.ref(tensor))
    return tensor


def _is_registered_host(tensor: paddle.Tensor) -> bool:
    if getattr(tensor, "_fsdp_host_memory", False):
        return True
    alive = []
    found = False
    for ref in _host_bases:
        base = ref()
        if base is None:
            continue
        alive.append(ref)
        if not found and base._is_initialized() and tensor._is_initialized() and tensor._is_shared_buffer_with(base):
            found = True
    _host_bases[:] = alive
    return found


def is_host_place(place) -> bool:
    """Whether ``place`` is host memory (CPU or CUDA-pinned), regardless of fake-device mode."""
    return place.is_cpu_place() or (hasattr(place, "is_cuda_pinned_place") and place.is_cuda_pinned_place())


def is_host(tensor: paddle.Tensor) -> bool:
    """Whether the CPU can read ``tensor``'s bytes in place (through its data pointer)."""
    if not is_host_place(tensor.place):
        return False
    if options().fake_device:
        return _is_registered_host(tensor)
    return True


_GUARDED_CALLERS = ("paddle.distributed.fsdp", "bench_ckpt", "ckpt_bench")


def _guarded_data_ptr(self: paddle.Tensor) -> int:
    """``Tensor.data_ptr`` in fake-device mode: refused for device memory when called from the fork (or its
    benchmark). Stock paddle and third-party code keep working: on a real device they copy first by place."""
    caller = sys._getframe(1).f_globals.get("__name__", "")
    if caller.startswith(_GUARDED_CALLERS) and not is_host(self):
        raise DeviceMemoryAccessError(
            f"data_ptr() of a device tensor {getattr(self, 'name', '')!r} (fake-device mode): device memory is not "
            "readable by the CPU; copy it with paddle.distributed.fsdp.device.to_host first"
        )
    return _original_data_ptr(self)


def data_ptr(tensor: paddle.Tensor) -> int:
    """The data pointer of a host tensor; :class:`DeviceMemoryAccessError` for device memory."""
    if not is_host(tensor):
        raise DeviceMemoryAccessError(f"tensor on {tensor.place} is device memory: copy it with to_host first")
    return _original_data_ptr(tensor)


def address(tensor: paddle.Tensor) -> int:
    """The address of a tensor's memory, host or device, for identity and overlap checks only (never read
    through it: on a GPU it is a device address)."""
    return _original_data_ptr(tensor)


_pin_fallback_logged = False


def host_empty(shape: Sequence[int], dtype, pinned: bool = True) -> paddle.Tensor:
    """Uninitialised host memory; pinned (``CUDAPinnedPlace``, what paddle-gpu accepts) when asked and
    available, else pageable memory with a one-time log line saying so."""
    global _pin_fallback_logged
    tensor = None
    if pinned and paddle.is_compiled_with_cuda():
        try:
            tensor = paddle.empty(list(shape), dtype=dtype, device=paddle.CUDAPinnedPlace())
        except Exception as exc:  # noqa: BLE001 - any refusal means: no pinned memory here
            if not _pin_fallback_logged:
                logger.warning("pinned host memory unavailable (%s): staging in pageable memory", exc)
                _pin_fallback_logged = True
    elif pinned and not _pin_fallback_logged:
        logger.info("paddle is built without CUDA: host staging uses pageable memory (no pinning)")
        _pin_fallback_logged = True
    if tensor is None:
        tensor = paddle.empty(list(shape), dtype=dtype, device=paddle.CPUPlace())
    return _mark_host(tensor)


class HostStaging:
    """A reusable host buffer per dtype, grown on demand: device-to-host copies land in views of it, so a
    save needs no allocation per tensor and pins memory once."""

    def __init__(self, pinned: bool = True) -> None:
        self.pinned = pinned
        self._buffers: dict[str, paddle.Tensor] = {}

    def buffer(self, dtype, numel: int) -> paddle.Tensor:
        """A host buffer of ``dtype`` with at least ``numel`` elements (reused when large enough)."""
        key = str(dtype)
        current = self._buffers.get(key)
        if current is None or current.shape[0] < numel:
            current = host_empty([max(numel, 1)], dtype, pinned=self.pinned)
            self._buffers[key] = current
        return current

    def nbytes(self) -> int:
        return sum(b.shape[0] * b.element_size() for b in self._buffers.values())

    def release(self) -> None:
        self._buffers.clear()


def _numel(tensor: paddle.Tensor) -> int:
    n = 1
    for d in tensor.shape:
        n *= d
    return n


def to_host(
    tensors: Iterable[paddle.Tensor],
    staging: HostStaging | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
) -> list[paddle.Tensor]:
    """Copy ``tensors`` to host memory; host tensors are returned as they are (no copy).

    Device tensors are copied into views of one ``staging`` buffer per dtype (a new one when not given),
    ``chunk_bytes`` at a time between synchronisations, so copies are batched rather than one ``.cpu()``
    per tensor. The returned views stay valid until ``staging`` is reused for another call.
    """
    tensors = list(tensors)
    staging = staging if staging is not None else HostStaging()
    totals: dict[str, int] = {}
    for t in tensors:
        if not is_host(t):
            totals[str(t.dtype)] = totals.get(str(t.dtype), 0) + _numel(t)
    offsets = {key: 0 for key in totals}
    bases = {key: staging.buffer(next(t.dtype for t in tensors if str(t.dtype) == key), n) for key, n in totals.items()}
    out: list[paddle.Tensor] = []
    pending = 0
    for t in tensors:
        if is_host(t):
            out.append(t)
            continue
        key, n = str(t.dtype), _numel(t)
        start = offsets[key]
        offsets[key] = start + n
        view = bases[key]._slice(start, start + n).reshape(list(t.shape)) if n else bases[key]._slice(0, 0)
        if n:
            src = t if t.is_contiguous() else t.contiguous()
            pending += n * t.element_size()
            blocking = pending >= chunk_bytes  # synchronise once per chunk, not per tensor
            view.copy_(src, blocking)
            if blocking:
                pending = 0
        out.append(_mark_view(view))
    if pending and paddle.is_compiled_with_cuda():
        paddle.device.synchronize()
    return out


def _mark_view(view: paddle.Tensor) -> paddle.Tensor:
    view._fsdp_host_memory = True
    return view


def host_to_device(src: paddle.Tensor, dst: paddle.Tensor, blocking: bool = True) -> None:
    """Copy host tensor ``src`` into ``dst`` in place, on ``dst``'s own place (same shape and dtype)."""
    if list(src.shape) != list(dst.shape) or src.dtype != dst.dtype:
        raise ValueError(f"host_to_device: {src.dtype}{list(src.shape)} into {dst.dtype}{list(dst.shape)}")
    dst.copy_(src, blocking)


def check_same_place(name: str, tensor: paddle.Tensor, expected_place) -> bool:
    """Whether parameter ``tensor`` must be copied across places into a shard on ``expected_place``.

    False on the same place. True for a parameter in host memory (a model built on the CPU, larger than one
    device) when the shards live on a device: its pieces are copied over (:func:`host_to_device`). Any other
    difference (another device, a device parameter for host shards) is refused, naming both places."""
    # fake-device mode: shards count as device memory, a parameter as host memory when made by host_empty
    host_target = is_host_place(expected_place) and not options().fake_device
    if is_host(tensor) and not host_target:
        return True
    if str(tensor.place) == str(expected_place):
        return False
    raise ValueError(
        f"parameter {name!r} is on {tensor.place}, but FullyShardFusion shards onto {expected_place}: "
        "build the model on that device or on the CPU (or under paddle.LazyGuard) before wrapping"
    )


options()  # read the environment once, at import: the fake-device pointer guard must be in place before any save
