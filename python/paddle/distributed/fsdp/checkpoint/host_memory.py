"""Host memory of the storage layer: fresh page-aligned buffers, the one reusable per-process arena, and uint8
views of tensors' own bytes.

* ``account``: the engine's own account of the host buffers it holds (current bytes, peak), which memory
  bounds are checked against; ``host_empty`` for accounted scratch buffers.
* ``alloc_host``: anonymous page-aligned memory (huge pages for O_DIRECT read buffers), returned to the OS when
  the last view of it is dropped.
* ``HostArena`` / ``arena``: one reusable buffer for async-save snapshots and load staging (save/save.py, load/load.py).
* ``raw_view``: a tensor's bytes as a uint8 numpy array, in place for contiguous host tensors.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import threading
import weakref

import numpy as np

from ..devices import device

# Transparent huge pages (MADV_HUGEPAGE) for buffers filled by O_DIRECT reads: the kernel faults in every page it
# pins, and a 2 -> 3 rank load took 0.61-0.68 s with huge pages against 0.86-1.16 s without. Not for buffers filled
# by memcpy (snapshots, undo copies): with THP defrag "madvise" such faults compact memory synchronously, which
# made those fills 1.4-3x slower here once memory was fragmented. CheckpointOptions.hugepages: "auto" (default:
# as the caller asks), True always, False never.


class HostMemoryAccount:
    """The engine's own accounting of the host buffers it holds: bytes alive now and the peak since
    ``reset_peak``. Every buffer a load or save allocates goes through ``track`` (``alloc_host``, ``host_empty``,
    staging tensors), so a bound on the extra host memory of a load is checked against this account."""

    def __init__(self):
        self._lock = threading.Lock()
        self.current = 0
        self.peak = 0

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.current += nbytes
            self.peak = max(self.peak, self.current)

    def sub(self, nbytes: int) -> None:
        with self._lock:
            self.current -= nbytes

    def track(self, obj, nbytes: int):
        """Count ``nbytes`` until ``obj`` (an array or tensor owning them) is garbage; returns ``obj``."""
        if nbytes > 0:
            self.add(nbytes)
            weakref.finalize(obj, self.sub, nbytes)
        return obj

    def reset_peak(self) -> int:
        """Start a new peak at the current level; returns that level."""
        with self._lock:
            self.peak = self.current
            return self.current


account = HostMemoryAccount()


def host_empty(nbytes: int) -> np.ndarray:
    """An accounted uint8 scratch buffer (bounce buffers and read windows)."""
    return account.track(np.empty(nbytes, np.uint8), nbytes)


def alloc_host(nbytes: int, for_direct_reads: bool = False, hugepages: bool | str = "auto") -> np.ndarray:
    """Fresh uint8 host buffer of ``nbytes`` in its own anonymous mapping (page aligned, returned to the OS when
    the last view of it is dropped); huge pages requested when it is filled by O_DIRECT reads (see above)."""
    if nbytes <= 0:
        return np.empty(0, np.uint8)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    huge = for_direct_reads if hugepages == "auto" else bool(hugepages)
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except (OSError, ValueError):
            pass
    return account.track(np.frombuffer(m, np.uint8), nbytes)


class HostArena:
    """One reusable host buffer (per process) for the async-save snapshot and the load staging.

    Fresh memory is slow to fill (page faults; on a VM whose balloon gives freed pages back to the host, many
    times slower than a copy into memory that is already resident), so the snapshot of every async save goes
    into the same buffer, which stays resident between saves; a load borrows it as its staging when it exists.
    ``acquire`` hands it to one user at a time (None while another one holds it: the caller then uses fresh
    memory); ``grow`` replaces a too small buffer by a larger one (else None). ``free`` drops it.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._buf: np.ndarray | None = None
        self._busy = False

    @property
    def capacity(self) -> int:
        buf = self._buf
        return 0 if buf is None else len(buf)

    def acquire(self, nbytes: int, grow: bool, hugepages: bool | str = "auto") -> np.ndarray | None:
        with self._lock:
            if self._busy:
                return None
            if self._buf is None or len(self._buf) < nbytes:
                if not grow:
                    return None
                self._buf = None  # drop the small one before allocating (lower peak)
                self._buf = alloc_host(nbytes, hugepages=hugepages)
            self._busy = True
            return self._buf[:nbytes]

    def release(self) -> None:
        with self._lock:
            self._busy = False

    def free(self) -> bool:
        """Drop the buffer (its memory goes back to the OS once no view of it is alive); False while in use."""
        with self._lock:
            if self._busy:
                return False
            self._buf = None
            return True


arena = HostArena()


def numel_of(t) -> int:
    """Element count from the shape: ``Tensor.numel()`` is an op (a tensor, then ``int``), ~40x slower."""
    return math.prod(t.shape)


_DTYPE_NAMES: dict = {}  # paddle dtype -> its short name ("float32"); str() of a dtype costs ~1 us


def dtype_name(t) -> str:
    dtype = t.dtype
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).split(".")[-1]
    return name


def is_host_place(place) -> bool:
    return place.is_cpu_place() or (hasattr(place, "is_cuda_pinned_place") and place.is_cuda_pinned_place())


def is_host_contiguous(t) -> bool:
    """Whether the tensor's bytes can be used in place through its data pointer (see raw_view); device memory
    (and, in fake-device mode, every tensor not made as host memory) cannot: see ``fsdp/devices/device.py``."""
    return device.is_host(t) and t.is_contiguous()


def raw_view(t, allow_copy: bool = True):
    """uint8 numpy view of a tensor's bytes (row-major), plus the object that keeps the memory alive.

    Host, contiguous tensors are viewed in place through their data pointer; a device (or non-contiguous)
    tensor is first copied to host, one tensor at a time, with its own place's copy (never ``.cuda()``).
    """
    n = numel_of(t) * t.element_size()
    if n == 0:
        return np.zeros(0, np.uint8), t
    keep = t
    if not device.is_host(t) or not t.is_contiguous():
        if not allow_copy:
            raise ValueError("tensor is not a contiguous host tensor")
        if not t.is_contiguous():
            keep = t.contiguous()
        if not device.is_host(keep):
            keep = device.to_host([keep])[0]
    ptr = device.data_ptr(keep)
    arr = np.frombuffer((ctypes.c_ubyte * n).from_address(ptr), dtype=np.uint8)
    return arr, keep
