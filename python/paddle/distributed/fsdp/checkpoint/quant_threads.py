"""The lossy moments' numpy work (format/quant.py) on a thread pool: each moment's flat span cut into ranges that
start on global block boundaries, each range quantized (dequantized) on its own into its slice of the output.

Why it is bit-identical to one thread: every block lies in one range (the cuts are block boundaries), so its
maximum, scale and codes are computed from the same elements by the same element-wise operations; 4-bit codes
pack two a byte, and a block boundary is even (blocks are even), so no byte is shared by two ranges.
Why ranges and not whole tensors: numpy releases the GIL inside large operations, so threads scale with cores;
and the temporaries (magnitudes, the padded block rows, int16 codes) are a range's, not a tensor's: a thread
holds about ``RANGE_ELEMS * 4 * 6`` bytes of them at once, whatever the moment's size.

Threads: ``CheckpointOptions.codec_threads`` (0: encoded_write.default_threads(), the rank's share of the cores but one), the
same knob as the chunk encoder's, since both are the save's CPU work on checkpoint bytes and never run at once
(a save waits for the previous one's background part). One thread runs the ranges inline, with no pool.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import numpy as np

from .format.quant import (
    Scheme,
    block_maxima,
    code_span,
    dequantize_range,
    element_codes,
    nblocks,
    pack,
    read_spans,
)
from .thread_pools import shared_pool

RANGE_ELEMS = 1 << 18  # elements a task works on (1 MiB of fp32): large enough that numpy drops the GIL


def thread_count(codec_threads: int) -> int:
    """Threads for ``codec_threads`` (the option; 0 chooses)."""
    from .encoded_write import default_threads

    return max(1, codec_threads or default_threads())


def _pool(threads: int) -> ThreadPoolExecutor | None:
    """The shared pool of ``threads`` threads (one per size, kept for the process); None for one thread."""
    return shared_pool("quant", threads) if threads > 1 else None


def ranges(lo: int, hi: int, block: int, elems: int | None = None) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut at the multiples of a whole number of blocks (about ``elems`` elements a range, default
    ``RANGE_ELEMS``)."""
    if hi <= lo:
        return []
    step = max(1, (elems or RANGE_ELEMS) // block) * block
    step *= 1 + step % 2  # even cuts: two 4-bit codes share a byte (blocks a checkpoint names are even anyway)
    cuts = [lo, *range((lo // step + 1) * step, hi, step), hi]
    return list(zip(cuts[:-1], cuts[1:], strict=True))


class Pending:
    """An output array being filled by range tasks; ``result()`` waits for them and raises the first range's
    error (in range order, so alike on every run)."""

    def __init__(self, out: np.ndarray, futures: list[Future]) -> None:
        self.out, self._futures = out, futures

    def result(self) -> np.ndarray:
        errors = []
        for f in self._futures:
            try:
                f.result()
            except Exception as e:  # noqa: BLE001 - every task is waited for before one error is raised
                errors.append(e)
        if errors:
            raise errors[0]
        return self.out


def _run(threads: int, tasks: list[Callable[[], None]], out: np.ndarray) -> Pending:
    pool = _pool(threads)
    futures = []
    for task in tasks:
        if pool is not None:
            futures.append(pool.submit(task))
            continue
        f: Future = Future()
        try:
            task()
            f.set_result(None)
        except Exception as e:  # noqa: BLE001 - raised by result(), like a pool's
            f.set_exception(e)
        futures.append(f)
    return Pending(out, futures)


def block_maxima_async(x: np.ndarray, lo: int, block: int, scheme: Scheme, threads: int) -> Pending:
    """``quant.block_maxima(x, lo, block, scheme)`` by ranges (NonFiniteError from ``result()``)."""
    hi, b0 = lo + x.size, lo // block
    out = np.zeros(nblocks(hi, block) - b0 if hi > lo else 0, np.float32)

    def task(r0: int, r1: int) -> None:
        m = block_maxima(x[r0 - lo : r1 - lo], r0, block, scheme)
        out[r0 // block - b0 : r0 // block - b0 + m.size] = m

    return _run(threads, [lambda r=r: task(*r) for r in ranges(lo, hi, block)], out)


def packed_codes_async(
    x: np.ndarray, lo: int, scales: np.ndarray, block: int, scheme: Scheme, next_code: int, threads: int
) -> Pending:
    """``pack(element_codes(x, lo, scales, lo // block, block, scheme), lo, scheme, next_code)`` by ranges:
    each range's codes packed into its slice of the stored bytes (only the last range can end mid-byte)."""
    hi, first_block = lo + x.size, lo // block
    c0, c1 = code_span(lo, hi, scheme)
    out = np.empty(c1 - c0, scheme.codes_dtype)

    def task(r0: int, r1: int) -> None:
        codes = element_codes(x[r0 - lo : r1 - lo], r0, scales, first_block, block, scheme)
        b0, b1 = code_span(r0, r1, scheme)
        out[b0 - c0 : b1 - c0] = pack(codes, r0, scheme, next_code if r1 == hi else 0)

    return _run(threads, [lambda r=r: task(*r) for r in ranges(lo, hi, block)], out)


def dequantize_async(
    stored: np.ndarray, byte_lo: int, scales: np.ndarray, first_block: int, a: int, b: int, block: int,
    scheme: Scheme, threads: int,
) -> Pending:  # fmt: skip
    """``quant.dequantize_range(stored, byte_lo, scales, first_block, a, b, block, scheme)`` by ranges, each
    unpacking only its own bytes."""
    out = np.empty(max(0, b - a), np.float32)

    def task(r0: int, r1: int) -> None:
        s0, s1 = read_spans(r0, r1, block, scheme)[0]
        part = stored[s0 - byte_lo : s1 - byte_lo]
        out[r0 - a : r1 - a] = dequantize_range(part, s0, scales, first_block, r0, r1, block, scheme)

    return _run(threads, [lambda r=r: task(*r) for r in ranges(a, b, block)], out)
