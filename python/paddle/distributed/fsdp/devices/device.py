"""Where tensor memory lives, and the only ways across: device-to-host and host-to-device copies.

On a GPU, model and optimizer tensors live in device memory: their data pointer is not readable by the
CPU, ``from_address(t.data_ptr())`` segfaults, and every copy to the host should be batched into a
reusable pinned buffer instead of one ``.cpu()`` per tensor. The checkpoint engine therefore asks this
module, never ``t.place`` directly:

- :func:`is_host` whether a tensor's bytes can be read in place;
- :func:`to_host` / :func:`stage` copy device tensors into flat views of a reusable pinned
  :class:`HostStaging` buffer, on a copy stream (``device_streams``), waited for without holding the GIL;
- :func:`host_empty` allocates host memory as host memory and pins it explicitly (``Tensor.pin_memory()``),
  checking the place it got (:class:`HostAllocationError`; a logged fallback to pageable memory where pinning
  is unavailable). No op but slices and copies ever runs on host staging memory (paddle would move a pinned
  input to the device);
- :func:`host_to_device` copies a host tensor into a device tensor in place (``Tensor.copy_`` on the
  destination's place, never ``paddle.assign`` across places);
- :func:`data_ptr` is the only raw-pointer access, refused for device memory.

**Fake-device mode** makes these branches run on a CPU-only machine (CI): with
``PADDLE_FSDP_FAKE_DEVICE=1`` (or ``set_options(DeviceOptions(fake_device=True))``) every tensor counts as
device memory except those this module made as host memory (``host_empty``, ``to_host``, and views of
them), and ``Tensor.data_ptr`` called from the fork's own code raises :class:`DeviceMemoryAccessError` for device
tensors, so any code path of ours that would read device memory through a raw pointer fails loudly here, as
it would crash on a GPU (stock paddle and third-party callers are left alone). The rules of
``device_rules.py`` apply too: pinning is emulated and checked, ops on host staging memory other than slices
and copies raise, device synchronisations are logged with their thread and whether they hold the GIL; copy
streams and events are emulated (``device_streams.py``).
``PADDLE_FSDP_EMULATE_GPU_COLLECTIVES=1`` (implied by fake-device mode) makes ``comm/communication.py`` take
its reduce-scatter path (GPU-only in paddle 3.3.1's gloo) through an emulation on gloo.

Options are read from the environment in one place (:func:`options`), once per process.
"""

from __future__ import annotations

import logging
import sys
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import paddle

from .. import env_switches
from . import device_rules, device_streams

logger = logging.getLogger(__name__)

FAKE_DEVICE_ENV = "PADDLE_FSDP_FAKE_DEVICE"
EMULATE_COLLECTIVES_ENV = "PADDLE_FSDP_EMULATE_GPU_COLLECTIVES"


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
        fake = env_switches.read(FAKE_DEVICE_ENV)
        emulate = env_switches.read(EMULATE_COLLECTIVES_ENV)
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
        device_rules.install(lambda t: not is_host(t))
        logger.info("fake-device mode: CPU tensors count as device memory unless made by device.host_empty/to_host")
    else:
        paddle.Tensor.data_ptr = _original_data_ptr
        device_rules.uninstall()


def _mark_host(tensor: paddle.Tensor, staging: bool = False) -> paddle.Tensor:
    tensor._fsdp_host_memory = True
    if staging:  # pinned staging memory: only slices and copies (device_rules, fake-device mode)
        setattr(tensor, device_rules.STAGING_TAG, True)
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
            "readable by the CPU; copy it with paddle.distributed.fsdp.devices.device.to_host first"
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


class HostAllocationError(RuntimeError):
    """A host (pinned) allocation returned memory the CPU cannot read in place (e.g. device memory)."""


def host_empty(shape: Sequence[int], dtype, pinned: bool = True) -> paddle.Tensor:
    """Uninitialised host memory, allocated as host memory (``device="cpu"``) and, when asked and available,
    pinned explicitly with ``Tensor.pin_memory()`` (a copy to ``CUDAPinnedPlace``). Never a creation op on a
    pinned place: in paddle 3.3.1 that runs on the GPU backend and returns device memory without an error
    (``FLAGS_pinned_memory_as_cpu_backend`` defaults to False; Paddle issue #77537). The place obtained is
    checked: not host memory is :class:`HostAllocationError`; pinning refused or not pinned is a logged
    fallback to pageable memory."""
    tensor = paddle.empty(list(shape), dtype=dtype, device=paddle.CPUPlace())
    _check_host(tensor, "paddle.empty(device='cpu')")
    if pinned:
        tensor = _pin(tensor)
    return _mark_host(tensor, staging=pinned)


def _check_host(tensor: paddle.Tensor, what: str) -> None:
    fake_unpinned = options().fake_device and what.startswith("pin") and not device_rules.is_fake_pinned(tensor)
    if not is_host_place(tensor.place) or fake_unpinned:
        raise HostAllocationError(
            f"{what} returned memory on {tensor.place}{' (device memory in fake-device mode)' if fake_unpinned else ''}"
            " for a host staging request: the CPU cannot read it in place"
        )


def _fallback(message: str, *args, level: int = logging.WARNING) -> None:
    global _pin_fallback_logged
    if not _pin_fallback_logged:
        logger.log(level, message, *args)
        _pin_fallback_logged = True


def _pin(tensor: paddle.Tensor) -> paddle.Tensor:
    if not (paddle.is_compiled_with_cuda() or options().fake_device):
        _fallback("paddle is built without CUDA: host staging uses pageable memory (no pinning)", level=logging.INFO)
        return tensor
    try:
        pinned = tensor.pin_memory()
    except Exception as exc:  # noqa: BLE001 - any refusal means: no pinned memory here
        _fallback("pinned host memory unavailable (%s): host staging falls back to pageable memory", exc)
        return tensor
    _check_host(pinned, "pin_memory()")
    if not (pinned.place.is_cuda_pinned_place() or device_rules.is_fake_pinned(pinned)):
        _fallback("pin_memory() returned %s, not pinned memory: host staging uses pageable memory", pinned.place)
    return pinned


class HostStaging:
    """Reusable host buffers, one per dtype, grown on demand: device-to-host copies land in flat views of them,
    so a save needs no allocation per tensor and pins memory once."""

    def __init__(self, pinned: bool = True) -> None:
        self.pinned = pinned
        self._buffers: dict[str, paddle.Tensor] = {}
        self.allocations = 0  # buffers allocated so far (reuse is checked against it)

    def buffer(self, dtype, numel: int) -> paddle.Tensor:
        """A flat host buffer of ``dtype`` with at least ``numel`` elements (reused when large enough)."""
        key = str(dtype)
        current = self._buffers.get(key)
        if current is None or current.shape[0] < numel:
            self._buffers.pop(key, None)  # drop the small one first (lower peak)
            current = host_empty([max(numel, 1)], dtype, pinned=self.pinned)
            self._buffers[key] = current
            self.allocations += 1
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


def copy_mode() -> str:
    """How device-to-host copies run here: "fake" (fake-device mode, emulated streams), "cuda" (a copy stream)
    or "host" (no device memory, or a device without the stream API: blocking copies)."""
    if options().fake_device:
        return "fake"
    return "cuda" if paddle.is_compiled_with_cuda() else "host"


def flat_source(tensor: paddle.Tensor) -> paddle.Tensor:
    """A contiguous 1-D view (or copy) of a device tensor, made on the device: the staging side stays flat."""
    src = tensor if tensor.is_contiguous() else tensor.contiguous()
    return src if len(src.shape) == 1 else src.reshape([-1])


def staging_views(tensors: Sequence[paddle.Tensor], staging: HostStaging) -> list[paddle.Tensor]:
    """Flat host views of ``staging``, one per tensor (its element count, its dtype; packed per dtype)."""
    totals: dict[str, int] = {}
    dtypes: dict[str, object] = {}
    for t in tensors:
        key = str(t.dtype)
        totals[key] = totals.get(key, 0) + _numel(t)
        dtypes[key] = t.dtype
    bases = {key: staging.buffer(dtypes[key], n) for key, n in totals.items()}
    offsets = dict.fromkeys(totals, 0)
    views = []
    for t in tensors:
        key, n = str(t.dtype), _numel(t)
        start = offsets[key]
        offsets[key] = start + n
        views.append(_mark_view(bases[key]._slice(start, start + n)))
    return views


def stage(tensors: Iterable[paddle.Tensor], staging: HostStaging):
    """Issue the device-to-host copies of ``tensors`` into flat views of ``staging`` (host tensors are returned
    as they are, not copied). Returns ``(views, batch)``: the views are valid once ``batch`` completed
    (``batch.wait()``). The flat sources are made before the batch's start event is recorded, so the copy
    stream waits for any ``contiguous()`` kernel they need."""
    tensors = list(tensors)
    on_device = [i for i, t in enumerate(tensors) if not is_host(t)]
    sources = [flat_source(tensors[i]) for i in on_device]
    views = staging_views([tensors[i] for i in on_device], staging)
    batch = device_streams.begin(copy_mode())
    batch.copy((v, src) for v, src in zip(views, sources) if v.shape[0])
    batch.finish()
    out = list(tensors)
    for i, v in zip(on_device, views):
        out[i] = v
    return out, batch


def to_host(tensors: Iterable[paddle.Tensor], staging: HostStaging | None = None) -> list[paddle.Tensor]:
    """Copy ``tensors`` to host memory and wait; host tensors are returned as they are (no copy).

    Device tensors are copied on the copy stream (``device_streams``) into *flat* (1-D) views of one
    ``staging`` buffer per dtype (a new one when not given): no op runs on the host side but the copy, so the
    caller keeps the shape. The wait polls an event (GIL released). The views stay valid until ``staging`` is
    reused.
    """
    out, batch = stage(tensors, staging if staging is not None else HostStaging())
    batch.wait()
    return out


def _mark_view(view: paddle.Tensor) -> paddle.Tensor:
    view._fsdp_host_memory = True
    setattr(view, device_rules.STAGING_TAG, True)
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
