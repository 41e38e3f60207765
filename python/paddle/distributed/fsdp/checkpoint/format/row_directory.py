"""The row directory of format 3 (``index.starts``, ``index.fences``): a loading rank fetches only the rows of a
key that overlap the elements it loads, however many ranks the key was split over.

Why: in format 2 a rank read every row of each key it loads, and a key split over more ranks has more rows: the
per-rank index read grew as world^0.53 (Qwen3-235B-A22B, 512 -> 8192 ranks; an embedding of 2.5 GB has ~4000
rows at 8192 ranks, one or two of which a rank needs). Format 3 sorts a key's rows by their first flat element
and writes, u64 little-endian::

    index.starts    start[i] = first global row-major element of row i of index.pieces (the same order);
                    NO_START for every row of a key that has a piece which is a box of the tensor (not a flat
                    range of it: their spans interleave)
    index.fences    for each key of more than FENCE rows, in key order: the start of its rows 0, FENCE, 2*FENCE..

A rank loading ``[lo, hi)`` of a key with more than SMALL_KEY_ROWS rows reads the key's fences (if it has any)
and the blocks of FENCE starts they bracket, bisects those starts and fetches rows ``[i0, i1)``: the last
starting at or before ``lo`` to the last starting before ``hi``. A block must begin at its fence, and the
fetched rows must match their starts and cover ``[lo, hi)`` exactly once (``check_window``: the coverage check
of a window), so a damaged directory fails the load with a named error, never wrong bytes.
``verify_checkpoint`` checks both objects against their SHA-256 and the rows.

Pure: reads go through ``fetch(name, offset, length) -> bytes``.
"""

from __future__ import annotations

import numpy as np

from ..errors import CorruptCheckpointError

STARTS_FILE = "index.starts"
FENCES_FILE = "index.fences"
FENCE = 16  # index.fences holds every FENCE-th start of a key with more rows: its starts are read by blocks
NO_START = np.uint64(2**64 - 1)
SMALL_KEY_ROWS = 8  # keys with at most this many rows are read whole (448 bytes): no directory round trip
COALESCE_GAP = 4096  # ranges of an index object closer than this may be fetched as one range (one page)
MIN_GAP = 256  # ... and always when closer than this


def coalesce(spans: list[tuple[int, int, object]], itemsize: int) -> list[tuple[int, int, list]]:
    """``(a, b, [payloads])`` item ranges to fetch for the ascending ``spans`` ``(a, b, payload)``: a neighbour
    is merged into the previous fetch when the gap between them is at most COALESCE_GAP bytes and at most the
    bytes wanted so far in that fetch (what is read beyond the wanted items stays below what is wanted, plus
    one gap)."""
    out: list[list] = []
    for a, b, x in spans:
        gap = (a - out[-1][1]) * itemsize if out else 0
        if out and gap <= COALESCE_GAP and gap <= max(out[-1][3], MIN_GAP):
            out[-1][1] = max(out[-1][1], b)
            out[-1][2].append(x)
            out[-1][3] += (b - a) * itemsize
        else:
            out.append([a, b, [x], (b - a) * itemsize])
    return [(a, b, xs) for a, b, xs, _wanted in out]


def fetch_items(fetch, name: str, a: int, b: int, dtype: np.dtype, where: str) -> np.ndarray:
    """Items ``[a, b)`` of the array object ``name`` (CorruptCheckpointError when it ends early)."""
    n = (b - a) * dtype.itemsize
    raw = fetch(name, a * dtype.itemsize, n) if b > a else b""
    if len(raw) != n:
        raise CorruptCheckpointError(f"{where}: {name} ends early (truncated)")
    return np.frombuffer(raw, dtype)


def fences_of(starts: np.ndarray, key_rows: np.ndarray) -> np.ndarray:
    """index.fences: for each key of more than FENCE rows (in key order), the start of every FENCE-th row."""
    counts = np.diff(key_rows)
    kid = np.repeat(np.arange(len(counts)), counts)
    within = np.arange(len(starts)) - key_rows[:-1][kid]
    return starts[(within % FENCE == 0) & (counts[kid] > FENCE)]


def fence_offsets(key_rows: list[int]) -> np.ndarray:
    """Where each key's fences begin in index.fences (keys of FENCE rows or fewer have none)."""
    n = np.diff(np.asarray(key_rows, dtype=np.int64))
    per_key = np.where(n > FENCE, -(-n // FENCE), 0)
    return np.concatenate([[0], np.cumsum(per_key)])


def _bracket(fetch, where: str, rows: list[int], want: dict, fences: np.ndarray | None) -> dict[int, tuple[int, int]]:
    """key id -> the rows ``[a, b)`` (relative to the key) whose starts to read: all of them, or, for a key with
    fences, the blocks of FENCE rows that may hold its span (one coalesced pass over index.fences)."""
    out = {k: (0, rows[k + 1] - rows[k]) for k in want}
    if fences is None:
        return out
    big = [(int(fences[k]), int(fences[k + 1]), k) for k in sorted(want) if fences[k + 1] > fences[k]]
    for a, b, kids in coalesce(big, 8):
        arr = fetch_items(fetch, FENCES_FILE, a, b, np.dtype("<u8"), where)
        for k in kids:
            f = arr[int(fences[k]) - a : int(fences[k + 1]) - a]
            if f[0] == NO_START:
                continue  # box pieces: every start (and row) of the key
            lo, hi = want[k]
            j0 = max(0, int(np.searchsorted(f, lo, side="right")) - 1)
            j1 = max(j0 + 1, int(np.searchsorted(f, hi, side="left")))
            out[k] = (j0 * FENCE, min(rows[k + 1] - rows[k], j1 * FENCE), int(f[j0]))
    return out


def windows(
    fetch, where: str, rows: list[int], want: dict[int, tuple[int, int]], fences: np.ndarray | None = None
) -> dict[int, tuple]:
    """key id -> ``(first row, stop row, starts of those rows)`` to fetch for the element span ``want[kid]``
    (``starts`` None: the key has box pieces, its rows are all fetched). ``fences``: ``fence_offsets`` when the
    checkpoint has index.fences (then only the starts of the blocks that may hold the span are read)."""
    out: dict[int, tuple] = {}
    bracket = _bracket(fetch, where, rows, want, fences)
    spans = [(rows[k] + bracket[k][0], rows[k] + bracket[k][1], k) for k in sorted(want)]
    for a, b, kids in coalesce(spans, 8):
        arr = fetch_items(fetch, STARTS_FILE, a, b, np.dtype("<u8"), where)
        for k in kids:
            first = rows[k] + bracket[k][0]
            st = arr[first - a : rows[k] + bracket[k][1] - a]
            if st[0] == NO_START:
                out[k] = (rows[k], rows[k + 1], None)
                continue
            if len(bracket[k]) == 3 and int(st[0]) != bracket[k][2]:
                raise CorruptCheckpointError(f"{where}: {FENCES_FILE} does not match {STARTS_FILE} (damaged)")
            if (np.diff(st.astype(np.int64)) < 0).any() or int(st[-1]) >= 1 << 62:
                raise CorruptCheckpointError(f"{where}: {STARTS_FILE} is not ascending for a key (damaged)")
            lo, hi = want[k]
            i0 = max(0, int(np.searchsorted(st, lo, side="right")) - 1)
            i1 = max(i0 + 1, int(np.searchsorted(st, hi, side="left")))
            out[k] = (first + i0, first + i1, st[i0:i1])
    return out


def check_window(arr: np.ndarray, starts, span, numel: int, where: str, key: str) -> None:
    """The fetched rows ``arr`` (PIECE_ROW) of a window begin where the directory says, are flat ranges of the
    whole tensor, and cover the element span ``[lo, hi)`` exactly once (the coverage check of a window: a
    damaged directory or row is named here, before a byte of data is read)."""
    if starts is None:
        return
    a = np.where(arr["flat_a"] >= 0, arr["flat_a"], 0).astype(np.int64)
    b = np.where(arr["flat_a"] >= 0, arr["flat_b"], numel).astype(np.int64)
    if len(a) != len(starts) or (a.astype(np.uint64) != starts).any() or (arr["box"] >= 0).any():
        raise CorruptCheckpointError(f"{where}: {STARTS_FILE} does not match the rows of key {key!r} (damaged)")
    lo, hi = span
    if hi > lo and (a[0] > lo or (b[:-1] != a[1:]).any() or b[-1] < hi):
        raise CorruptCheckpointError(
            f"{where}: key {key!r}: the saved pieces do not cover elements [{lo}, {hi}) exactly once"
        )


def check_order(keys: list[tuple[np.ndarray, int, str]], where: str) -> None:
    """Whole keys' rows (``(PIECE_ROW rows, numel, key)`` each) in the order of the directory: flat ranges of the
    whole tensor, one after the other from 0 to ``numel`` (what ``check_window`` asks of a window, and what a save
    writes); keys with a box piece have no directory and any order. Whole-key loads and verify ask it too, so
    that every load and verify agree on a checkpoint whose rows of a key are out of order. One vectorised pass
    over all the keys (a load of 10^5 keys pays no per-key numpy calls)."""
    keys = [k for k in keys if len(k[0])]
    if not keys:
        return
    rows = np.concatenate([r for r, _n, _k in keys])
    lens = np.asarray([len(r) for r, _n, _k in keys], dtype=np.int64)
    kid = np.repeat(np.arange(len(keys)), lens)
    numel = np.asarray([n for _r, n, _k in keys], dtype=np.int64)
    flat = rows["flat_a"] >= 0
    a = np.where(flat, rows["flat_a"], 0).astype(np.int64)
    b = np.where(flat, rows["flat_b"], numel[kid]).astype(np.int64)
    first = np.concatenate([[0], np.cumsum(lens)[:-1]])
    last = first + lens - 1
    bad = (a[first] != 0) | (b[last] != numel)
    bad[kid[:-1][(b[:-1] != a[1:]) & (kid[:-1] == kid[1:])]] = True
    boxed = np.zeros(len(keys), bool)
    boxed[kid[rows["box"] >= 0]] = True
    bad &= ~boxed
    if bad.any():
        key = keys[int(np.nonzero(bad)[0][0])][2]
        raise CorruptCheckpointError(
            f"{where}: the rows of key {key!r} are not its flat ranges in order (damaged index.pieces)"
        )


def problem(
    fetch, rows_arr: np.ndarray, key_rows: list[int], sha256: str, fences_sha256: str | None = None
) -> str | None:
    """What is wrong with index.starts or index.fences (verify_checkpoint): a SHA-256, or an entry the rows do
    not imply."""
    import hashlib

    n = len(rows_arr) * 8
    raw = fetch(STARTS_FILE, 0, n + 1)
    if len(raw) != n or hashlib.sha256(raw).hexdigest() != sha256:
        return f"{STARTS_FILE} does not match its SHA-256 in metadata.json (damaged)"
    first = np.where(rows_arr["flat_a"] >= 0, rows_arr["flat_a"], 0).astype(np.uint64)
    boxed = rows_arr["box"] >= 0
    if boxed.any():  # every row of a key with a box piece: NO_START
        kid = rows_arr["key"].astype(np.int64)
        has_box = np.zeros(len(key_rows), bool)
        has_box[kid[boxed]] = True
        first[has_box[kid]] = NO_START
    if (np.frombuffer(raw, "<u8") != first).any():
        return f"{STARTS_FILE} does not match the rows of index.pieces"
    if fences_sha256 is not None:
        want = fences_of(first, np.asarray(key_rows, dtype=np.int64)).astype("<u8").tobytes()
        got = fetch(FENCES_FILE, 0, len(want) + 1)
        if got != want or hashlib.sha256(got).hexdigest() != fences_sha256:
            return f"{FENCES_FILE} does not match its SHA-256 in metadata.json or the row directory (damaged)"
    return None
