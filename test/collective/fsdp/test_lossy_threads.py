"""Lossy moments on a thread pool (checkpoint/quant_threads.py): block-aligned ranges on several threads give
the bytes one thread gives, for sizes not a multiple of the block, odd int4 counts and pieces starting mid-block;
one process, no launch."""

from __future__ import annotations

import numpy as np
import pytest
from paddle.distributed.fsdp.checkpoint import quant_threads
from paddle.distributed.fsdp.checkpoint.format import quant
from paddle.distributed.fsdp.checkpoint.format.quant import SCHEMES

BLOCK = 16
RANGE = 48  # three blocks a range: the zoo below is cut into many ranges
# (piece start, piece length): whole tensors, sizes not a multiple of the block, odd counts, mid-block starts
ZOO = [(0, 1), (0, 15), (0, 16), (0, 17), (0, 47), (0, 48), (0, 49), (0, 1001), (5, 1), (5, 200), (7, 1000),
       (16, 96), (31, 333), (33, 32), (47, 2), (95, 97), (1, 4097)]  # fmt: skip


def _values(rng, n: int, signed: bool) -> np.ndarray:
    x = rng.standard_normal(n).astype(np.float32) * np.float32(10.0) ** rng.integers(-6, 2, n).astype(np.float32)
    x[rng.random(n) < 0.05] = 0.0  # whole zero blocks and zeros among others
    return x if signed else x * x


@pytest.fixture
def small_ranges(monkeypatch):
    monkeypatch.setattr(quant_threads, "RANGE_ELEMS", RANGE)


def test_ranges_start_on_block_boundaries_and_cover_once(small_ranges):
    for lo, n in ZOO:
        cuts = quant_threads.ranges(lo, lo + n, BLOCK)
        assert cuts[0][0] == lo and cuts[-1][1] == lo + n
        assert all(a < b for a, b in cuts) and all(cuts[i][1] == cuts[i + 1][0] for i in range(len(cuts) - 1))
        assert all(a % BLOCK == 0 for a, _ in cuts[1:]), (lo, n, cuts)
    assert len(quant_threads.ranges(0, 1001, BLOCK)) == 21  # the zoo is really cut: ceil(1001 / 48)
    assert quant_threads.ranges(5, 5, BLOCK) == []
    odd = quant_threads.ranges(1, 1000, 15)  # an odd block (no checkpoint names one): cuts stay even
    assert all(a % 30 == 0 for a, _ in odd[1:]) and len(odd) > 10


def test_int4_codes_of_an_odd_block_are_bit_identical_on_threads(small_ranges):
    scheme = SCHEMES["int4-absmax"]
    x = _values(np.random.default_rng(3), 1001, True)
    for lo in (0, 1, 14):
        scales = quant.block_maxima(x, lo, 15, scheme)
        want = quant.pack(quant.element_codes(x, lo, scales, lo // 15, 15, scheme), lo, scheme, 3)
        got = quant_threads.packed_codes_async(x, lo, scales, 15, scheme, 3, 3).result()
        assert got.tobytes() == want.tobytes(), lo


@pytest.mark.parametrize("scheme_name", sorted(SCHEMES))
def test_threaded_quantize_and_dequantize_are_bit_identical_to_one_thread(scheme_name, small_ranges):
    """Scales, packed codes (next piece's first code in a last odd byte) and dequantized values: the bytes of
    format/quant.py's one-call functions on the whole piece, for 1 and 3 threads."""
    scheme = SCHEMES[scheme_name]
    rng = np.random.default_rng(52)
    for lo, n in ZOO:
        x = _values(rng, n, scheme.signed)
        hi = lo + n
        want_max = quant.block_maxima(x, lo, BLOCK, scheme)
        scales = want_max * np.float32(1.01)  # as if another piece's part of an edge block were larger
        next_code = 5 if scheme.bits == 4 and hi % 2 else 0
        want_codes = quant.pack(quant.element_codes(x, lo, scales, lo // BLOCK, BLOCK, scheme), lo, scheme, next_code)
        c0 = quant.code_span(lo, hi, scheme)[0]
        for threads in (1, 3):
            got_max = quant_threads.block_maxima_async(x, lo, BLOCK, scheme, threads).result()
            assert got_max.tobytes() == want_max.tobytes(), (lo, n, threads)
            got = quant_threads.packed_codes_async(x, lo, scales, BLOCK, scheme, next_code, threads).result()
            assert got.dtype == want_codes.dtype and got.tobytes() == want_codes.tobytes(), (lo, n, threads)
        # a reader of [a, b) inside the piece: its bytes and blocks (read_spans), dequantized alike
        for a, b in ((lo + (lo % 2 == 0), hi), (lo, hi), (hi - 1, hi)):
            if a >= b or (scheme.bits == 4 and a // 2 < c0):
                continue  # (the byte holding an odd piece start belongs to the piece before)
            (s0, s1), (f0, f1) = quant.read_spans(a, b, BLOCK, scheme)
            stored, sc = want_codes[s0 - c0 : s1 - c0], scales[f0 - lo // BLOCK : f1 - lo // BLOCK]
            want = quant.dequantize_range(stored, s0, sc, f0, a, b, BLOCK, scheme)
            for threads in (1, 3):
                got = quant_threads.dequantize_async(stored, s0, sc, f0, a, b, BLOCK, scheme, threads).result()
                assert got.tobytes() == want.tobytes(), (lo, n, a, b, threads)


def test_a_non_finite_value_in_any_range_is_named(small_ranges):
    """NaN in a middle range, a negative second moment in a later one: the first range's error in range order
    (the saver then stores the moment exactly: lossy.py)."""
    x = np.ones(1000, np.float32)
    x[500], x[900] = np.nan, -1.0
    for threads in (1, 3):
        pending = quant_threads.block_maxima_async(x, 3, BLOCK, SCHEMES["uint8-sqrt"], threads)
        with pytest.raises(quant.NonFiniteError, match="NaN"):
            pending.result()


def test_a_forked_child_runs_on_pools_of_its_own(small_ranges):
    """The parent's pools exist at the fork; the child's threads do not: the child makes pools of its own
    instead of queueing work that no thread would run (it would wait forever; the parent waits up to 120 s).
    Every shared pool of the engine (thread_pools.py): quantize, the derived weights' check, checksum, decode."""
    import os
    import signal
    import time

    from paddle.distributed.fsdp.checkpoint import chunks, decoded_read
    from paddle.distributed.fsdp.checkpoint.format import derived

    x = np.arange(1000, dtype=np.float32)
    scheme = SCHEMES["int8-absmax"]

    def work() -> tuple:
        return (
            quant_threads.block_maxima_async(x, 0, BLOCK, scheme, 2).result(),
            derived._pool().submit(sum, (1, 2)).result(),
            chunks._checksum_pool(2).submit(sum, (3, 4)).result(),
            decoded_read._decode_pool(2).submit(sum, (5, 6)).result(),
            decoded_read._fetch_pool().submit(sum, (7, 8)).result(),
        )

    want = work()  # the parent's pools exist
    pid = os.fork()
    if pid == 0:  # the child: exit status 0 when it computed the same results
        try:
            got = work()
            same = np.array_equal(got[0], want[0]) and got[1:] == want[1:]
            os._exit(0 if same else 3)
        finally:
            os._exit(4)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's quantize never finished (the parent's pool, without threads, took its work)")
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
