"""Giving the heap's free pages back to the OS where a training step's live memory is low (``malloc_trim``).

Why: in host memory (CPU training) paddle's activations and autograd's temporaries come from glibc's malloc. Once
freed, their pages stay resident inside the heap (glibc returns only the heap's top, and only past
``M_TRIM_THRESHOLD``), so after a few steps a rank's RSS sits ~90-130 MiB above the bytes it uses (d=512, 2 ranks:
docs/reports/train-memory-2026-12-06.md). Every contender pays that, but it hid what sharding saves.

``malloc_trim(0)`` releases the free pages of every arena (``madvise``), once, where it is called: an action, not a
setting. The process's malloc settings (``mallopt``, ``MALLOC_*`` variables) are left alone: those are the user's
choice. FSDP trims at the two points of a step where the heap's free part is largest before memory grows again: when
the root forward starts (the previous step's activations are freed) and when the backward starts (the forward's
temporaries are freed; the step peaks here, every activation alive). Pages reused later are faulted in again; the
cost of both (a few ms per step at d=512) is counted in :class:`HeapTrim` and reported by the benchmark.

Only where FSDP's blocks live in host memory (buffer_memory.maps_blocks: not on devices, not in fake-device mode,
whose allocators cache blocks themselves) and only on glibc; elsewhere a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import time

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    """glibc's ``malloc_trim`` (None on other C libraries or platforms)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def available() -> bool:
    """Whether this process's C library can trim its heap (glibc)."""
    return _malloc_trim() is not None


def trim_heap() -> bool:
    """Release the free pages of every malloc arena to the OS now; True if any were released."""
    trim = _malloc_trim()
    return bool(trim(0)) if trim is not None else False


class HeapTrim:
    """One FullyShardFusion's trims: whether it trims (host memory, glibc), how often it did and the time it took."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and available()
        self.calls = 0
        self.seconds = 0.0

    def __call__(self, where: str) -> None:
        """Trim at ``where`` (a step boundary: "forward", "backward") if enabled."""
        if not self.enabled:
            return
        start = time.perf_counter()
        released = trim_heap()
        self.seconds += time.perf_counter() - start
        self.calls += 1
        logger.debug("FullyShardFusion: heap trimmed at %s start (released: %s)", where, released)
