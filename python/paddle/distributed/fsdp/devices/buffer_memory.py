"""Where FullyShardFusion's per-step buffers come from, and what its buffers hold (the memory account).

Per step and unit FSDP makes a gathered copy of the unit's parameters and a full-size gradient buffer, and per
backward a gradient shard (``main_grad``, freed again at ``opt.clear_grad()``: FusedBuffer.release_grads, as stock
stage 3 frees gradients). On a device, paddle's caching allocator reuses such blocks: they come from
``paddle.empty`` / ``paddle.zeros``. In host memory (CPU training) they would come from glibc's malloc, which serves
a block above its mmap threshold (128 KiB at start) by a mapping of its own, but raises that threshold to the size of
the first such block freed (up to 32 MiB): from then on every unit-sized block comes from the heap, whose freed
middle is never returned, and the per-step churn grew a rank's RSS by ~250 MiB above its live bytes
(docs/reports/train-memory-2026-12-05.md). So on the host each block is an anonymous mapping of its own (``mmap``,
handed to paddle through DLPack): it is returned to the OS once no tensor references it any more, whoever held it
(at the next release point or allocation: never inside paddle's deleter, host_mappings.py), and fresh pages read
zero. The process's malloc settings are left alone (installing the fork changes nothing for code that does not use it).

Why not a pool of reused blocks: a released block can still be referenced (a view of a parameter saved by
autograd, e.g. ``w.T``, outlives the release that re-points the parameter), and paddle exposes no use count to
tell; a reused block would then feed another unit's weights to that backward. A mapping is freed by its last
reference instead.

:class:`BlockLedger` counts the mapped blocks alive, by kind, and their peaks: :meth:`FullyShardFusion.memory_account`
(buffers/memory_account.py) reports it next to what the buffers reference (parameter shard, gradient shard, gathered units, gradient buffers,
staging), and the tests bound it by ``prefetch_depth + 1`` units.
"""

from __future__ import annotations

import functools
import threading

import numpy as np
import paddle

from . import device, host_mappings

#: the kinds of block: gathered parameters, full-size gradient buffers, the gradient shard (``main_grad``, freed
#: at ``opt.clear_grad()``: fused_buffer.release_grads)
GATHERED, GRADIENT, GRADIENT_SHARD = "gathered", "gradient", "gradient_shard"
KINDS = (GATHERED, GRADIENT, GRADIENT_SHARD)

_NUMPY_DTYPES = {
    paddle.float32: np.float32,
    paddle.float64: np.float64,
    paddle.float16: np.float16,
    paddle.int32: np.int32,
    paddle.int64: np.int64,
    paddle.int8: np.int8,
    paddle.uint8: np.uint8,
}


class BlockLedger:
    """Live mapped blocks of one FullyShardFusion, by kind: bytes, count and peak bytes. A block counts until it is
    unmapped: by the first ``host_mappings.release_unviewed`` after the last tensor viewing it was freed (never
    inside paddle's deleter: host_mappings.py); reading the ledger runs one."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._live = dict.fromkeys(KINDS, 0)
        self._count = dict.fromkeys(KINDS, 0)
        self._peak = {**dict.fromkeys(KINDS, 0), "total": 0}

    def add(self, kind: str, nbytes: int) -> None:
        with self._lock:
            self._live[kind] += nbytes
            self._count[kind] += 1
            self._peak[kind] = max(self._peak[kind], self._live[kind])
            self._peak["total"] = max(self._peak["total"], sum(self._live.values()))

    def drop(self, kind: str, nbytes: int) -> None:
        with self._lock:
            self._live[kind] -= nbytes
            self._count[kind] -= 1

    def _read(self, name: str) -> dict[str, int]:
        host_mappings.release_unviewed()
        with self._lock:
            return dict(getattr(self, name))

    @property
    def live(self) -> dict[str, int]:
        return self._read("_live")

    @property
    def count(self) -> dict[str, int]:
        return self._read("_count")

    @property
    def peak(self) -> dict[str, int]:
        return self._read("_peak")

    def reset_peak(self) -> None:
        host_mappings.release_unviewed()
        with self._lock:
            self._peak = {**self._live, "total": sum(self._live.values())}


def maps_blocks(like: paddle.Tensor) -> bool:
    """Whether transient buffers next to ``like`` (a shard) are mapped blocks: real host memory. Fake-device mode
    models a device, so it takes the allocator's path (and keeps that path exercised on CPU)."""
    return device.is_host_place(like.place) and not device.options().fake_device


def new_block(numel: int, dtype, kind: str, ledger: BlockLedger, mapped: bool, zero: bool = False) -> paddle.Tensor:
    """A 1-D tensor of ``numel`` elements for a transient buffer of ``kind``; zero-filled when ``zero``.

    ``mapped``: a fresh anonymous mapping (zero pages), unmapped once no tensor references it; otherwise (devices, dtypes
    numpy cannot hold, empty blocks) from paddle's allocator."""
    if not mapped or numel == 0 or (dtype not in _NUMPY_DTYPES and dtype != paddle.bfloat16):
        return paddle.zeros([numel], dtype=dtype) if zero else paddle.empty([numel], dtype=dtype)
    np_dtype = _NUMPY_DTYPES.get(dtype, np.uint8)  # bfloat16 (numpy has none): bytes, viewed as bfloat16 below
    nbytes = numel * (2 if dtype == paddle.bfloat16 else np.dtype(np_dtype).itemsize)
    region = host_mappings.anonymous_array(nbytes, on_unmap=functools.partial(ledger.drop, kind, nbytes))
    ledger.add(kind, nbytes)
    tensor = paddle.utils.dlpack.from_dlpack(region.view(np_dtype))
    return tensor.view(paddle.bfloat16) if dtype == paddle.bfloat16 else tensor
