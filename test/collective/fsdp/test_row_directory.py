"""The row directory of format 3 (checkpoint/format/row_directory.py), on its own: a key split into many rows.

What a rank reads to find the rows of its span is bounded (a block of starts and the key's fences), the rows it
gets are exactly those a scan of every row would pick, and damaged fences or starts are named. Seeded fuzz over
row counts and spans; the bytes are counted at the fetch.
"""

from __future__ import annotations

import numpy as np
import pytest
from paddle.distributed.fsdp.checkpoint.errors import CorruptCheckpointError
from paddle.distributed.fsdp.checkpoint.format import row_directory as rd


def _objects(counts: list[int], seed: int):
    """index.starts / index.fences of keys split into ``counts`` flat rows of random lengths."""
    rng = np.random.default_rng(seed)
    starts, key_rows, ends = [], [0], []
    for n in counts:
        lengths = rng.integers(1, 1000, n)
        s = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        starts.append(s)
        ends.append(int(lengths.sum()))
        key_rows.append(key_rows[-1] + n)
    starts = np.concatenate(starts).astype("<u8")
    fences = rd.fences_of(starts, np.asarray(key_rows, np.int64)).astype("<u8")
    return {rd.STARTS_FILE: starts.tobytes(), rd.FENCES_FILE: fences.tobytes()}, key_rows, ends, starts


class _Fetch:
    def __init__(self, objects):
        self.objects, self.bytes = objects, {}

    def __call__(self, name, offset, length):
        out = self.objects[name][offset : offset + length]
        self.bytes[name] = self.bytes.get(name, 0) + len(out)
        return out


@pytest.mark.parametrize("seed", range(4))
def test_windows_pick_the_overlapping_rows_reading_a_bounded_part_of_the_directory(seed):
    counts = [3, 10_000, 70, 200, 65]
    objects, key_rows, ends, starts = _objects(counts, seed)
    rng = np.random.default_rng(100 + seed)
    for _ in range(20):
        want = {}
        for k in (1, 2, 3, 4):
            lo = int(rng.integers(0, ends[k]))
            want[k] = (lo, min(ends[k], lo + int(rng.integers(1, 5000))))
        fetch = _Fetch(objects)
        got = rd.windows(fetch, "ck", key_rows, want, rd.fence_offsets(key_rows))
        for k, (lo, hi) in want.items():
            st = starts[key_rows[k] : key_rows[k + 1]].astype(np.int64)
            end = np.append(st[1:], ends[k])
            overlap = np.nonzero((st < hi) & (end > lo))[0]  # every row a scan would pick
            a, b, s = got[k]
            assert (a - key_rows[k], b - key_rows[k]) == (overlap[0], overlap[-1] + 1), (k, lo, hi)
            assert (s == st[overlap[0] : overlap[-1] + 1]).all()
        # the keys of more than FENCE rows: their fences, and the blocks of starts the span touches (at most 3
        # a key; coalescing reads at most as much again), not the 10,000-row key's 80 KB of starts
        assert fetch.bytes[rd.FENCES_FILE] == 8 * sum(-(-n // rd.FENCE) for n in counts if n > rd.FENCE)
        assert fetch.bytes[rd.STARTS_FILE] <= 2 * 8 * rd.FENCE * 3 * len(want)


def _rows(starts: np.ndarray, end: int, a: int, b: int) -> np.ndarray:
    """The true PIECE_ROW rows ``[a, b)`` of a one-key directory (what index.pieces would hold)."""
    from paddle.distributed.fsdp.checkpoint.format.index import PIECE_ROW

    st = starts.astype(np.int64)
    out = np.zeros(b - a, PIECE_ROW)
    out["box"], out["flat_a"], out["flat_b"] = -1, st[a:b], np.append(st[1:], end)[a:b]
    return out


def test_damaged_fences_or_starts_are_named():
    """Every fence damaged in turn, with a span at that fence: the window is refused, by the directory itself
    or by the exact-coverage check of the rows it selects (what IndexSource.load runs); never a silent gap."""
    objects, key_rows, ends, starts = _objects([10_000], 7)
    fences = np.frombuffer(objects[rd.FENCES_FILE], "<u8")
    for j in range(len(fences)):
        one = bytearray(objects[rd.FENCES_FILE])
        one[8 * j] ^= 0x01
        lo = int(fences[j])
        fetch = _Fetch(dict(objects, **{rd.FENCES_FILE: bytes(one)}))
        with pytest.raises(CorruptCheckpointError, match="index.fences does not match|do not cover"):
            a, b, s = rd.windows(fetch, "ck", key_rows, {0: (lo, lo + 1)}, rd.fence_offsets(key_rows))[0]
            rd.check_window(_rows(starts, ends[0], a, b), s, (lo, lo + 1), ends[0], "ck", "k")
    want = {0: (int(starts[5000]), int(starts[5000]) + 10)}
    descending = bytearray(objects[rd.STARTS_FILE])
    descending[8 * 5000 + 7] = 0x7F  # a huge start in the block the span is in
    with pytest.raises(CorruptCheckpointError, match="index.starts"):
        rd.windows(_Fetch(dict(objects, **{rd.STARTS_FILE: bytes(descending)})), "ck", key_rows, want,
                   rd.fence_offsets(key_rows))  # fmt: skip
