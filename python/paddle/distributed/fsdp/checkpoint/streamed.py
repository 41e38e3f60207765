"""Streamed reads: large file ranges of a load read in file order through a small ring of bounce buffers, each
chunk checksummed and copied into its target while it is in the CPU cache.

Why (measured on this 2-core VM, 2 ranks x 512 MiB, page cache dropped): O_DIRECT reads of a few MiB into a small
reused buffer, then a copy into the target, took 0.36-0.69 s, against 0.7-2.2 s for buffered 16 MiB reads straight
into the target (page cache copy; the first pass into fresh page cache pages is the slow one) and 0.84-0.92 s for
O_DIRECT straight into the target; this module's load of 2 x 504 MiB took 0.75-0.88 s with O_DIRECT and
1.87-2.33 s with buffered reads (``odirect=False``). 4 MiB slabs beat 8 and 16 MiB ones, and four of them beat
two or eight (fresh memory is slow to fill on this VM, so the ring is kept small). A reader thread keeps the
device busy (the next slabs are read while the calling thread works on the current one); the calling thread
hashes each slab 256 KiB at a time, then copies those bytes into the target: both passes read the bytes from the
CPU cache, so verifying costs the hash's compute only (~38 GB/s for xxh3 from L2 here), not another pass over
main memory (~11 GB/s), and no helper pool is needed.

What is verified: every chunk a copied byte comes from, whole (ranges are widened to whole chunks), before the
function returns; a mismatch raises CorruptCheckpointError. Bytes of a chunk may be copied into the target before
that chunk's last bytes are hashed: callers that must not expose unverified bytes read into staging (atomic loads),
or say that the targets were partly written (memory-bounded loads, PartiallyLoadedError).

Files mostly in the page cache are not streamed (reader.read_range_direct reads them straight into the target in
cache-sized steps): a bounce buffer would add a copy to a load whose cost is the copy.
"""

from __future__ import annotations

import queue
import threading

import numpy as np

from .chunks import ChunkStream
from .format.metadata import PieceMeta
from .host_memory import alloc_host
from .reader import DIRECT_ALIGN, FileSet

STEP = 256 << 10  # bytes hashed, then copied, at a time: they stay in L2 between the two passes
RING_BYTES = 16 << 20  # bounce buffers in all (at most; the caller's window may make it smaller)
RING_SLABS = 4  # the reader thread works up to RING_SLABS - 1 slabs ahead of the hashing and copying


class _Range:
    """A large read: piece bytes ``[a, b)`` into ``out``; ``[a0, b0)`` are the bytes hashed (whole chunks), and
    ``[start, end)`` the file bytes read (``[a0, b0)`` widened to DIRECT_ALIGN)."""

    __slots__ = ("key", "piece", "a", "b", "out", "a0", "b0", "start", "end")

    def __init__(self, key: str, piece: PieceMeta, a: int, b: int, out: np.ndarray, chunk: int, verify: bool):
        self.key, self.piece, self.a, self.b, self.out = key, piece, a, b, out
        if verify:
            self.a0, self.b0 = (a // chunk) * chunk, min(-(-b // chunk) * chunk, piece.nbytes)
        else:
            self.a0, self.b0 = a, b
        A = DIRECT_ALIGN
        self.start = ((piece.offset + self.a0) // A) * A
        self.end = -(-(piece.offset + self.b0) // A) * A


def stream_ranges(files: FileSet, ranges: list, chunk_bytes: int, verify: bool, ring_bytes: int) -> None:
    """Read every ``RangeRead`` (read_ops.py: piece bytes ``[a, b)`` into the uint8 buffer ``out``), in the order
    given, through a ring of at most ``ring_bytes`` of bounce buffers (module docstring). Every chunk a byte of
    ``out`` comes from is verified (``verify``, when ``files`` verifies) before this returns."""
    verify = verify and files.verifies
    todo = [_Range(r.key, r.piece, r.a, r.b, r.out, chunk_bytes, verify) for r in ranges]
    if not todo:
        return
    A = DIRECT_ALIGN
    slab = max(A, (min(ring_bytes, RING_BYTES) // RING_SLABS // A) * A)
    ring = alloc_host(slab * RING_SLABS, for_direct_reads=True)
    free: queue.SimpleQueue = queue.SimpleQueue()
    for i in range(RING_SLABS):
        free.put(ring[i * slab : (i + 1) * slab])
    filled: queue.SimpleQueue = queue.SimpleQueue()
    stop = threading.Event()
    thread = threading.Thread(
        target=_read_slabs, args=(files, todo, slab, free, filled, stop), name="ckpt-read", daemon=True
    )
    thread.start()
    try:
        for rng in todo:
            check = ChunkStream(files, rng.key, rng.piece, rng.a0, chunk_bytes) if verify else None
            lo, hi = rng.piece.offset + rng.a0, rng.piece.offset + rng.b0  # file bytes hashed
            dlo, dhi = rng.piece.offset + rng.a, rng.piece.offset + rng.b  # file bytes copied into out
            pos = rng.start
            while pos < rng.end:
                item = filled.get()
                if isinstance(item, BaseException):
                    raise item
                got, buf = item
                mv = memoryview(buf)
                s = max(pos, lo)
                e = min(pos + got, hi)
                while s < e:
                    t = min(e, lo + ((s - lo) // STEP + 1) * STEP)  # steps aligned from lo: whole chunks, mostly
                    if check is not None:
                        check.feed(mv[s - pos : t - pos])
                    c0, c1 = max(s, dlo), min(t, dhi)
                    if c1 > c0:
                        rng.out[c0 - dlo : c1 - dlo] = buf[c0 - pos : c1 - pos]
                    s = t
                pos += slab
                free.put(buf)
    finally:
        stop.set()
        for _ in range(RING_SLABS):  # a reader waiting for a free slab wakes up and sees the stop
            free.put(None)
        thread.join()


def _read_slabs(files: FileSet, todo: list, slab: int, free, filled, stop: threading.Event) -> None:
    """Reader thread: every range's file bytes in slabs, O_DIRECT where the file allows it (else buffered), into
    free bounce buffers; ``(bytes that matter, buffer)`` per slab, or the exception that stopped it, into ``filled``."""
    try:
        for rng in todo:
            name = rng.piece.file
            for pos in range(rng.start, rng.end, slab):
                buf = free.get()
                if buf is None or stop.is_set():
                    return
                n = min(slab, rng.end - pos)
                need = min(n, rng.piece.offset + rng.b0 - pos)  # bytes past the hashed ones need not be there
                files.pread_span(name, buf[:n], pos, need)  # O_DIRECT where the file allows it, else buffered
                filled.put((need, buf))
    except BaseException as e:  # the calling thread raises it
        filled.put(e)
