"""Reads of a stored (compressed) data file: the decoded bytes ``[offset, offset + len(buf))`` of the raw file it
stands for, through its chunk table (format/codecs.py).

Why at the FileSet level: every reader (in-place, bounded, resharding, streamed, the tools) already reads whole
checksum chunks of raw files through ``FileSet.pread_into`` / ``pread_span``; a stored file answers the same calls,
so each of them decodes exactly the chunks it would have read, and nothing else changes. Each stored chunk is
checked against its checksum before it is decoded, and decoded into the caller's buffer (or a one-chunk bounce
buffer at a partial end), never into more than its declared size. The decodes of one read run on the checksum
helper pool (zstd releases the GIL), so they scale with ``checksum_threads``.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future

import numpy as np

from .errors import CorruptCheckpointError
from .format.codecs import decode_chunk
from .thread_pools import shared_pool

STORED_BATCH = 16 << 20  # stored bytes fetched per read call (then decoded chunk by chunk)
REMOTE_STORED_BATCH = 64 << 20  # the same from an object store: the backend splits it into parallel requests
SEQUENTIAL_GAP = 1 << 20  # a read that starts at most this far after the last one ended is sequential (a load


# reads its tiny pieces last, so its large ones skip over them)
def _fetch_pool():
    """One thread that fetches the next stored batch of a read while the current one is decoded."""
    return shared_pool("fetch", 1)


def _decode_pool(threads: int):
    """Shared decode pool of ``threads`` workers (None: decode on the reading thread). Not the checksum pool: a
    read may run while that pool's threads wait on it."""
    return shared_pool("decode", threads) if threads > 0 else None


def _stored(files, name: str, offset: int, n: int, handle=None) -> np.ndarray:
    buf = np.empty(n, np.uint8)
    done = (handle or files.handle(name)).read_into(offset, buf)
    if done < n:
        raise CorruptCheckpointError(
            f"checkpoint {files.root}: stored data file {name} ends at byte {offset + done}, expected {offset + n}"
        )
    return buf


def _decode_row(files, name: str, t, i: int, stored: memoryview, out: memoryview) -> None:
    row = t.rows[i]

    def where() -> str:
        return f"checkpoint {files.root}: data file {name} stored chunk {i} (decoded bytes {int(row['doff'])}..)"

    if files.digest is not None and files.digest(stored) != int(row["sum"]):
        raise CorruptCheckpointError(f"{where()}: checksum mismatch")
    decode_chunk(int(row["codec"]), int(row["width"]), stored, out, where)


class Readahead:
    """The stored bytes a FileSet's next sequential read of a stored file will start with, fetched while the
    current read decodes its last batch.

    Why: a load reads a stored file piece by piece (one ``read_decoded`` per tensor, in file order), and each read
    fetched its stored bytes, then decoded them: the decode of one piece and the fetch of the next did not overlap,
    which made compressed loads from an object store slower than raw ones (docs/reports/2026-12-07-codec-speed.md).
    Started only on a read that began where (or up to SEQUENTIAL_GAP after) the previous read of the same file
    ended (a sequential reader), for at most twice the file's largest read so far (and one batch: a load's tensors
    differ in size, a bf16 weight beside its fp32 moments); used by a read that starts inside it. A random reader
    fetches nothing extra, and memory stays at two batches. Only for objects without a descriptor (object
    stores, where a fetch waits on the network): on a local disk the kernel's readahead overlaps already, and a
    cold 128 MiB load was ~15% slower with it (the copies of held ends; docs/reports/2026-12-07-codec-speed.md)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.ends: dict[str, int] = {}  # file -> stored offset where its last read ended
        self.largest: dict[str, int] = {}  # file -> stored bytes of its largest read so far
        self.name: str | None = None
        self.start = self.n = 0
        self.future = None

    def claim(self, name: str, start: int):
        """``(pending fetch, its start)`` when it holds stored byte ``start`` of ``name`` (it is handed over), else
        None."""
        with self.lock:
            fut, hit = self.future, self.name == name and self.start <= start < self.start + self.n
            if hit:
                self.future, self.name = None, None
            return (fut, self.start) if hit else None

    def begin(self, files, name: str, start: int, n: int, held=None) -> None:
        """Fetch stored bytes ``[start, start + n)`` of ``name`` on the fetch thread (any earlier one is dropped);
        ``held``: the first of them, already in memory (the unused end of the last readahead: never fetched
        twice)."""
        handle = files.handle(name)  # (taken here: the fetch thread never opens or closes handles)
        have = 0 if held is None else len(held)
        if have >= n:
            fut = Future()
            fut.set_result(held)
            n = have
        elif have:
            fut = _fetch_pool().submit(_joined_fetch, files, name, held, start + have, n - have, handle)
        else:
            fut = _fetch_pool().submit(_stored, files, name, start, n, handle)
        with self.lock:
            self.future, self.name, self.start, self.n = fut, name, start, n

    def settle(self) -> None:
        """Wait for a pending fetch (its error, if any, is dropped: nobody asked for those bytes); before a handle
        it may read is closed."""
        with self.lock:
            fut, self.future, self.name = self.future, None, None
        if fut is not None:
            fut.exception()


def _joined_fetch(files, name: str, held: np.ndarray, start: int, n: int, handle) -> np.ndarray:
    return np.concatenate([held, _stored(files, name, start, n, handle)])


def read_decoded(files, name: str, buf, offset: int) -> int:
    """Fill ``buf`` with decoded bytes of ``name`` from ``offset`` (``files``: the reader.FileSet asking); returns
    the stored bytes read."""
    out = memoryview(buf).cast("B")
    n = len(out)
    if n == 0:
        return 0
    t = files.table(name)
    i0, i1 = t.span(offset, n)
    pool = _decode_pool(files.checksum_threads)
    remote = getattr(files.handle(name), "fileno", None) is None
    limit = REMOTE_STORED_BATCH if remote else STORED_BATCH
    batches = []  # rows [i, j): one read of at most ``limit`` stored bytes (at least one row)
    i = i0
    while i < i1:
        j = i + 1
        while j < i1 and t.soff[j] + t.slen[j] - t.soff[i] <= limit:
            j += 1
        batches.append((i, j))
        i = j
    s_begin, s_end = int(t.soff[i0]), int(t.soff[i1 - 1] + t.slen[i1 - 1])
    if files.readahead is None:
        files.readahead = Readahead()
    ra = files.readahead
    pending = ra.claim(name, s_begin)
    pre = None  # stored bytes [s_begin, s_begin + len(pre)), fetched ahead
    left = None  # those of them past this read: the start of the next readahead
    if pending is not None:
        fut, start = pending
        pre = fut.result()[s_begin - start :]
        if len(pre) > s_end - s_begin:
            left = pre[s_end - s_begin :]
    sequential = 0 <= s_begin - ra.ends.get(name, 0) <= SEQUENTIAL_GAP  # (a file's first read: near its start)
    ra.ends[name] = s_end
    ahead_bytes = ra.largest[name] = max(ra.largest.get(name, 0), s_end - s_begin)

    def fetch(b: int):
        i, j = batches[b]
        s, e = int(t.soff[i]), int(t.soff[j - 1] + t.slen[j - 1])
        held = len(pre) - (s - s_begin) if pre is not None else 0
        if held >= e - s:
            return pre[s - s_begin : e - s_begin]
        if held > 0:  # the readahead holds the start of the batch: the rest fetched, the two joined
            return np.concatenate([pre[s - s_begin :], _stored(files, name, s + held, e - s - held)])
        return _stored(files, name, s, e - s)

    read = 0
    ahead = _fetch_pool().submit(fetch, 0) if len(batches) > 1 else None
    try:
        for b, (i, j) in enumerate(batches):
            stored = memoryview(ahead.result() if ahead is not None else fetch(b))
            # the next batch is fetched while this one is decoded (an object store's latency hidden)
            ahead = _fetch_pool().submit(fetch, b + 1) if b + 1 < len(batches) else None
            if ahead is None and remote and sequential and s_end < t.stored_size:  # the next read's, during the decode
                ra.begin(files, name, s_end, min(limit, 2 * ahead_bytes, t.stored_size - s_end), left)
            read += len(stored)
            _decode_batch(files, name, t, i, j, stored, out, offset, pool)
    finally:
        if ahead is not None:
            ahead.exception()  # (waited for: nothing runs behind an error)
    return read


def _decode_batch(files, name: str, t, i: int, j: int, stored: memoryview, out: memoryview, offset: int, pool):
    """Decode rows [i, j) (their stored bytes: ``stored``) into ``out`` (decoded bytes from ``offset``)."""
    n = len(out)
    s0 = int(t.soff[i])
    jobs = []
    for r in range(i, j):
        d0, dl = int(t.doff[r]), int(t.dlen[r])
        src = stored[int(t.soff[r]) - s0 : int(t.soff[r] + t.slen[r]) - s0]
        lo, hi = max(d0, offset), min(d0 + dl, offset + n)
        if lo == d0 and hi == d0 + dl:  # the whole chunk is wanted: decoded in place
            jobs.append((r, src, out[d0 - offset : d0 + dl - offset], None))
        else:
            tmp = memoryview(np.empty(dl, np.uint8))
            jobs.append((r, src, tmp, (lo, hi, d0)))
    if pool is None or len(jobs) == 1:
        for r, src, dst, _part in jobs:
            _decode_row(files, name, t, r, src, dst)
    else:
        futs = [pool.submit(_decode_row, files, name, t, r, src, dst) for r, src, dst, _part in jobs]
        first = None
        for f in futs:  # all of them waited for: no helper writes into ``out`` after we return
            e = f.exception()
            if e is not None and first is None:
                first = e
        if first is not None:
            raise first
    for _r, _src, tmp, part in jobs:
        if part is not None:
            lo, hi, d0 = part
            out[lo - offset : hi - offset] = tmp[lo - d0 : hi - d0]
