"""Reads of byte ranges of saved pieces into the caller's buffers, each chunk verified: bounded windows
(``read_piece_windows``), a range straight into its destination (``read_range_direct``: page-cache steps hashed in
the CPU cache, or slabs checked on helper threads while the next slab is read), and aligned file spans for
atomic loads (``read_spans``, O_DIRECT where the file allows it). The slab of a data object without a descriptor
(an object store) is ``FileSet.slab``: large, so that the backend reads it with parallel requests.
"""

from __future__ import annotations

import os

import numpy as np

from .chunks import ChunkStream, ChunkVerifier, checksum_mismatch, verify_chunks
from .format.metadata import PieceMeta
from .host_memory import host_empty
from .reader import CACHE_STEP, DEFAULT_WINDOW, DIRECT_ALIGN, FileSet


def read_piece_windows(
    files: FileSet,
    key: str,
    piece: PieceMeta,
    byte_ranges: list[tuple[int, int]],
    chunk_bytes: int,
    verify: bool,
    window_bytes: int = DEFAULT_WINDOW,
):
    """Yield (piece_byte_offset, uint8 buffer) windows that cover ``byte_ranges`` (piece-relative, sorted).

    With ``verify``, windows are widened to whole checksum chunks and each chunk's checksum is checked before the
    window is yielded. The buffer is reused between windows (at most ``window_bytes`` + 2 chunks).
    """
    align = chunk_bytes if verify else 1
    window_bytes = max(window_bytes, align)
    # merge ranges into aligned spans
    spans: list[list[int]] = []
    for a, b in byte_ranges:
        a0 = (a // align) * align
        b0 = min(-(-b // align) * align, piece.nbytes)
        if spans and a0 <= spans[-1][1]:
            spans[-1][1] = max(spans[-1][1], b0)
        else:
            spans.append([a0, b0])
    buf = None
    for a, b in spans:
        pos = a
        while pos < b:
            end = min(b, pos + window_bytes)
            if verify and end < b:
                end = max(pos + align, (end // align) * align)
            n = end - pos
            if buf is None or len(buf) < n:
                buf = host_empty(min(window_bytes + 2 * align, max(n, b - a)))
            view = buf[:n]
            files.pread_into(piece.file, view, piece.offset + pos)
            if verify:
                verify_chunks(files, key, piece, view, pos, chunk_bytes)
            yield pos, view
            pos = end


def read_range_direct(
    files: FileSet,
    key: str,
    piece: PieceMeta,
    a: int,
    b: int,
    out: np.ndarray,
    chunk_bytes: int,
    verify: bool,
    window_bytes: int = DEFAULT_WINDOW,
    verifier: ChunkVerifier | None = None,
) -> None:
    """Read piece bytes [a, b) straight into ``out`` (uint8, len b-a), verifying every chunk they touch.

    Chunk-aligned interior bytes are read into ``out`` itself and checksummed there (on the helper threads,
    slab by slab, while the next slab is read); only the partial chunks at both ends go through a one-chunk
    bounce buffer (checked at once). Without ``verifier`` the call returns after every check passed; with one,
    the interior checks are queued on it and ``out`` must not be used before ``verifier.wait()`` returned.
    """
    if not verify:
        for pos in range(a, b, window_bytes):
            end = min(b, pos + window_bytes)
            files.pread_into(piece.file, out[pos - a : end - a], piece.offset + pos)
        return
    C = chunk_bytes
    A = -(-a // C) * C  # first chunk boundary >= a
    B = b if b == piece.nbytes else (b // C) * C  # last boundary <= b (piece end counts as a boundary)
    if A >= B:  # no whole chunk inside: read the enclosing chunks
        a0 = (a // C) * C
        b0 = min(-(-b // C) * C, piece.nbytes)
        tmp = host_empty(b0 - a0)
        files.pread_into(piece.file, tmp, piece.offset + a0)
        verify_chunks(files, key, piece, tmp, a0, C)
        out[:] = tmp[a - a0 : b - a0]
        return
    if a < A:  # head: partial chunk
        a0 = A - C
        tmp = host_empty(min(C, piece.nbytes - a0))
        files.pread_into(piece.file, tmp, piece.offset + a0)
        verify_chunks(files, key, piece, tmp, a0, C)
        out[: A - a] = tmp[a - a0 : A - a0]
    if files.mostly_cached(piece.file):
        # page cache: read CACHE_STEP bytes straight into ``out``, hash them while they are in the CPU cache
        # (steps of exactly one chunk, the default, are hashed in one shot each: no running-digest bookkeeping,
        # which cost ~40% of the checks' time on a warm 500 MiB load). Not mmap: a mapping copied out with
        # non-temporal stores (native code) gained ~10% with two ranks at once (docs/performance.md, what bounds the figures),
        # and a file truncated under the load would kill the process with SIGBUS instead of a named error
        check = None if C == CACHE_STEP else ChunkStream(files, key, piece, A, C)
        digest, sums = files.digest, piece.checksums
        fd, dst = files.fd(piece.file), memoryview(out)
        for s in range(A, B, CACHE_STEP):
            view = dst[s - a : min(B, s + CACHE_STEP) - a]
            got = os.preadv(fd, [view], piece.offset + s)  # (thousands of calls: no per-call helpers)
            if got < len(view):  # a short read: the loop that names a file that ends early
                files.pread_into(piece.file, out[s - a + got : s - a + len(view)], piece.offset + s + got)
            files.bytes_read += got
            if check is not None:
                check.feed(view)
            elif digest(view) != sums[s // C]:
                raise checksum_mismatch(files, key, piece, s // C, C)
        if B < b:
            _read_tail(files, key, piece, B, b, a, out, C)
        return
    slab = max(C, (files.slab(piece.file) // C) * C)
    own = verifier is None
    if own:
        verifier = ChunkVerifier(files.checksum_threads)
    try:
        for pos in range(A, B, slab):
            end = min(B, pos + slab)
            view = out[pos - a : end - a]
            files.pread_into(piece.file, view, piece.offset + pos)
            verifier.check(files, key, piece, view, pos, C)  # checksummed while the next slab is read
    except BaseException:
        if own:
            verifier.drain()
        raise
    if own:
        verifier.wait()
    if B < b:
        _read_tail(files, key, piece, B, b, a, out, C)


def _read_tail(files: FileSet, key: str, piece: PieceMeta, B: int, b: int, a: int, out: np.ndarray, C: int) -> None:
    """The partial chunk at the end of a range ``[a, b)`` (from the chunk boundary ``B``): through a one-chunk
    bounce buffer, checked before its bytes are copied into ``out``."""
    b0 = min(B + C, piece.nbytes)
    tmp = host_empty(b0 - B)
    files.pread_into(piece.file, tmp, piece.offset + B)
    verify_chunks(files, key, piece, tmp, B, C)
    out[B - a :] = tmp[: b - B]


class SpanRead:
    """An aligned file range ``[start, start + len(buf))`` of ``name`` read into ``buf`` (only the first
    ``need`` bytes matter), and the chunk checks ``(key, piece, a0, b0)`` (piece-relative, chunk-aligned) of
    the pieces inside it, queued as soon as their bytes are in."""

    __slots__ = ("name", "start", "need", "buf", "checks")

    def __init__(self, name: str, start: int, need: int, buf: np.ndarray, checks: list):
        self.name, self.start, self.need, self.buf, self.checks = name, start, need, buf, checks


def read_spans(files: FileSet, spans: list[SpanRead], chunk_bytes: int, verifier: ChunkVerifier | None) -> None:
    """Read every span (in file order, ``files.read_slab`` bytes at a time; O_DIRECT where supported, else buffered,
    relying on the kernel's sequential readahead). The chunk checks go to ``verifier`` (None: no checks) as soon
    as their chunks are in, so checksumming overlaps the reads that follow. The spans' bytes must not be used
    before ``verifier.wait()`` returned."""
    C = chunk_bytes
    spans = sorted(spans, key=lambda sp: (sp.name, sp.start))

    def submit(sp: SpanRead, c: list, end: int) -> None:
        key, piece, _a0, cur, _b0 = c
        lo = piece.offset + cur - sp.start
        verifier.check(files, key, piece, sp.buf[lo : lo + (end - cur)], cur, C)
        c[3] = end

    for sp in spans:
        # [key, piece, first byte, next unchecked byte, end] (piece-relative, chunk-aligned), by file position
        todo = (
            sorted(([k, p, a0, a0, b0] for k, p, a0, b0 in sp.checks), key=lambda c: c[1].offset + c[2])
            if verifier is not None
            else []
        )
        pos = 0
        slab = max(DIRECT_ALIGN, (files.slab(sp.name) // DIRECT_ALIGN) * DIRECT_ALIGN)
        while pos < sp.need:
            n = min(slab, len(sp.buf) - pos)
            files.pread_span(sp.name, sp.buf[pos : pos + n], sp.start + pos, min(n, sp.need - pos))
            pos += n
            frontier = sp.start + min(pos, sp.need)
            for c in todo:
                piece, cur, b0 = c[1], c[3], c[4]
                if piece.offset + c[2] >= frontier:
                    break  # sorted by first byte: nothing of the rest is in yet
                if cur >= b0:
                    continue
                # whole chunks that are in (all the rest once the range's end is in)
                end = b0 if piece.offset + b0 <= frontier else cur + ((frontier - piece.offset - cur) // C) * C
                if end > cur:
                    submit(sp, c, end)
            todo = [c for c in todo if c[3] < c[4]]
        for c in todo:  # pragma: no cover - every range ends inside its span, so all were submitted above
            submit(sp, c, c[4])
