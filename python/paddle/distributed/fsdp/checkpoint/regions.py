"""Reading a region of a saved tensor: the one function every reader of checkpoint data goes through.

``read_region`` fills a caller's uint8 buffer with the elements of a region (a box, or a flat range of one) of a
saved tensor, whatever pieces the saving ranks wrote: the planner intersects the region's flat runs with each
piece (``region_segments``), large segments are read straight into the buffer (checksummed slab by slab on
helper threads while later slabs are read), small scattered ones (rows of a box) through bounded windows of
whole checksum chunks that are verified before any byte of them is copied. Used by ``load_state_dict`` (staged
targets), ``load_full_state_dict`` and the tools' ``CheckpointReader``; ``verify_checkpoint`` streams whole
pieces through ``iter_piece`` (the same windowed, verified reader, without a destination buffer).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from . import ranges, streamed
from .chunks import ChunkVerifier, verify_chunks
from .errors import CorruptCheckpointError
from .format.metadata import DTYPES, CheckpointMetadata, PieceMeta
from .geometry import Region
from .host_memory import host_empty
from .planner import plan_reads
from .read_ops import RangeRead, ScatterRead, Segments
from .reader import DEFAULT_WINDOW, FileSet


def region_segments(root: str, md: CheckpointMetadata, key: str, region: Region) -> list[Segments]:
    """Where the bytes of ``region`` of ``key`` are: one ``Segments`` per saved piece it touches (read_ops.py).
    Raises CorruptCheckpointError when the saved pieces do not cover the region."""
    tm = md.tensors[key]
    items, covered = plan_reads(key, tm, region)
    if covered != region.numel:
        raise CorruptCheckpointError(
            f"checkpoint {root}: key {key!r}: saved pieces cover {covered} of the {region.numel} requested elements"
        )
    isz = DTYPES[tm.dtype][0]
    out = []
    for it in items:
        seg = it.segments
        if len(seg.src) > 1:
            order = np.argsort(seg.src, kind="stable")
            src, dst, length = seg.src[order], seg.dst[order], seg.length[order]
        else:  # one run (FSDP's flat pieces, whole tensors): already sorted
            src, dst, length = seg.src, seg.dst, seg.length
        len_b = length * isz
        out.append(Segments(it.piece, src * isz, dst * isz, len_b, len_b >= 2 * md.chunk_bytes))
    return out


def clip_segments(segments: list[Segments], w0: int, w1: int, chunk_bytes: int) -> list[Segments]:
    """The parts of ``segments`` whose destination lies in ``[w0, w1)``, destinations made relative to ``w0``
    (a window of a region, for readers that fill a bounded staging buffer one window at a time)."""
    out = []
    for sg in segments:
        src_b, dst_b, len_b = sg.src, sg.dst, sg.length
        lo = np.maximum(dst_b, w0)
        hi = np.minimum(dst_b + len_b, w1)
        keep = hi > lo
        if not keep.any():
            continue
        length = (hi - lo)[keep]
        out.append(Segments(sg.piece, (src_b + (lo - dst_b))[keep], lo[keep] - w0, length, length >= 2 * chunk_bytes))
    return out


def read_region(
    files: FileSet,
    md: CheckpointMetadata,
    key: str,
    region: Region,
    out: np.ndarray,
    verify: bool,
    verifier: ChunkVerifier | None = None,
    deferred: list | None = None,
    window_bytes: int = DEFAULT_WINDOW,
    segments: list[Segments] | None = None,
) -> None:
    """Read every element of ``region`` of ``key`` into ``out`` (uint8, region storage order).

    ``segments``: the region's ``region_segments`` when the caller has them (or a part of them from
    ``clip_segments``: then only those bytes are read, their destinations relative to ``out``).

    ``verify`` checks every chunk a byte comes from (when the checkpoint has checksums and ``files`` verifies).
    With ``verifier``, checks of large ranges are queued on it: ``out`` is verified only after its ``wait()``;
    without one every check passed when this returns. With ``deferred``, nothing is read here: the reads are
    appended to it for ``read_deferred``, which does them all in file order. Small scattered ranges go through
    windows of at most ``window_bytes``.
    """
    verify = verify and files.verifies
    if segments is None:
        segments = region_segments(files.root, md, key, region)
    for sg in segments:
        piece, src_b, dst_b, len_b, big = sg.piece, sg.src, sg.dst, sg.length, sg.big
        one = len(src_b) == 1  # one run (FSDP's flat pieces, whole tensors): no masks
        if one:
            large = [(int(src_b[0]), int(dst_b[0]), int(len_b[0]))] if big[0] else []
        else:
            large = zip(src_b[big].tolist(), dst_b[big].tolist(), len_b[big].tolist())
        # large segments: read straight into the destination (verified in place)
        for a, d, n in large:
            if deferred is not None:
                deferred.append(RangeRead(key, piece, a, a + n, out[d : d + n]))
                continue
            ranges.read_range_direct(
                files, key, piece, a, a + n, out[d : d + n], md.chunk_bytes, verify, window_bytes, verifier
            )
        if big[0] if one else big.all():
            continue
        masked = not one and big.any()
        small = (src_b[~big], dst_b[~big], len_b[~big]) if masked else (src_b, dst_b, len_b)
        scatter = ScatterRead(key, piece, *small, out, window_bytes)
        if deferred is not None:
            deferred.append(scatter)
            continue
        _scatter_small(files, md, scatter, verify)


def _scatter_small(files: FileSet, md: CheckpointMetadata, op: ScatterRead, verify: bool) -> None:
    """Small segments (e.g. rows of a box): read the enclosing windows once, verify, scatter."""
    key, piece, src_b, dst_b, len_b, out, window_bytes = op.key, op.piece, op.src, op.dst, op.length, op.out, op.window
    merged: list[tuple[int, int]] = []
    for a, b in zip(src_b.tolist(), (src_b + len_b).tolist()):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    si = 0
    n = len(src_b)
    for wpos, buf in ranges.read_piece_windows(files, key, piece, merged, md.chunk_bytes, verify, window_bytes):
        wend = wpos + len(buf)
        # segments are sorted by source offset and disjoint, so finished ones form a prefix
        j = si
        while j < n and src_b[j] < wend:
            a = int(src_b[j])
            b = a + int(len_b[j])
            lo, hi = max(a, wpos), min(b, wend)
            if hi > lo:
                d = int(dst_b[j]) + (lo - a)
                out[d : d + (hi - lo)] = buf[lo - wpos : hi - wpos]
            if b <= wend and j == si:
                si += 1
            j += 1


TINY_READ = 64 << 10  # deferred reads smaller than this go after the sequential pass (read_deferred)
TINY_GAP = 4096  # tiny reads whose file bytes lie closer than this are read together (_read_tiny)


def read_deferred(
    files: FileSet,
    md: CheckpointMetadata,
    reads: list,
    verify: bool,
    verifier: ChunkVerifier | None,
    window_bytes: int = DEFAULT_WINDOW,
) -> None:
    """Do the reads collected by ``read_region(deferred=...)`` in file order, tiny ones (under ``TINY_READ``
    bytes, e.g. optimizer scalars) last: the kernel's readahead then sees one sequential pass per file. Tiny reads
    ahead of a sequential pass (this rank's or another rank's reading the same file) cache scattered pages in its
    way and break its readahead into small requests: here 2x the I/O requests and a cold load 1.4x slower.
    (Requesting readahead with POSIX_FADV_WILLNEED was measured slower.) Large ranges of files not in the page
    cache are streamed through bounce buffers of at most ``window_bytes`` (streamed.py); objects without a descriptor
    (object stores) are read straight into their targets in large reads the backend parallelizes. Tiny reads of
    neighbouring file bytes share one read (``_read_tiny``)."""
    verify = verify and files.verifies
    reads.sort(key=lambda r: (r.nbytes < TINY_READ, r.piece.file, r.piece.offset + r.first))
    first_tiny = next((i for i, r in enumerate(reads) if r.nbytes < TINY_READ), len(reads))
    reads, tiny = reads[:first_tiny], reads[first_tiny:]
    run: list = []  # consecutive large reads of files not in the page cache, streamed together

    def flush() -> None:
        streamed.stream_ranges(files, run, md.chunk_bytes, verify, window_bytes)
        run.clear()

    for op in reads:
        name = op.piece.file
        if isinstance(op, RangeRead) and files.local(name) and not files.mostly_cached(name):
            run.append(op)
            continue
        flush()
        _read_deferred_entry(files, md, op, verify, DEFAULT_WINDOW, verifier)
    flush()
    _read_tiny(files, md, tiny, verify, window_bytes)


def _tiny_span(op: RangeRead | ScatterRead, chunk_bytes: int, verify: bool) -> tuple[int, int]:
    """The piece bytes ``[a0, b0)`` a tiny deferred read needs: its bytes, widened to whole chunks to verify."""
    if isinstance(op, ScatterRead):  # from the first to the end of the last (sorted by source offset)
        a, b = int(op.src[0]), int((op.src + op.length).max())
    else:
        a, b = op.a, op.b
    if not verify:
        return a, b
    return (a // chunk_bytes) * chunk_bytes, min(-(-b // chunk_bytes) * chunk_bytes, op.piece.nbytes)


def _read_tiny(files: FileSet, md: CheckpointMetadata, tiny: list, verify: bool, window_bytes: int) -> None:
    """The tiny deferred reads (under TINY_READ bytes each: optimizer scalars, small tensors), in file order: reads
    whose file bytes lie within TINY_GAP of each other are read together into one buffer of at most
    ``window_bytes``; every chunk an entry's bytes come from is verified before they are copied into its target.

    Why: a model with many small tensors (a mixture of experts: ~10^5 keys) paid one pread and one buffer per tiny
    tensor; 8000 keys of 256 bytes took ~40 us each to read here."""
    C = md.chunk_bytes
    span_limit = min(window_bytes, TINY_READ + 2 * C)  # a contiguous tiny read, widened to whole chunks
    entries = []
    for e in tiny:
        a0, b0 = _tiny_span(e, C, verify)
        if b0 - a0 > span_limit:  # a few rows scattered over a large piece: only the chunks they touch, alone
            _read_deferred_entry(files, md, e, verify, window_bytes, None)
            continue
        entries.append((e.piece.file, e.piece.offset + a0, e.piece.offset + b0, a0, e))
    entries.sort(key=lambda x: (x[0], x[1]))
    i, buf = 0, None
    while i < len(entries):
        name, start, end = entries[i][0], entries[i][1], entries[i][2]
        j = i + 1
        while j < len(entries) and entries[j][0] == name and entries[j][1] <= end + TINY_GAP:
            if max(end, entries[j][2]) - start > window_bytes:
                break
            end = max(end, entries[j][2])
            j += 1
        if buf is None or len(buf) < end - start:
            buf = host_empty(max(end - start, min(window_bytes, TINY_READ)))
        view = buf[: end - start]
        files.pread_into(name, view, start)
        for _name, fstart, fend, a0, op in entries[i:j]:
            got = view[fstart - start : fend - start]  # piece bytes [a0, a0 + len(got))
            if verify:
                verify_chunks(files, op.key, op.piece, got, a0, C)
            if isinstance(op, RangeRead):
                op.out[:] = got[op.a - a0 : op.b - a0]
                continue
            for s, d, n in zip((op.src - a0).tolist(), op.dst.tolist(), op.length.tolist()):
                op.out[d : d + n] = got[s : s + n]
        i = j


def _read_deferred_entry(
    files: FileSet, md: CheckpointMetadata, op: RangeRead | ScatterRead, verify: bool, window_bytes: int, verifier
) -> None:
    """One deferred read on its own: small scattered segments through windows, a range straight into its target
    (its checks queued on ``verifier`` when given)."""
    if isinstance(op, ScatterRead):
        _scatter_small(files, md, op, verify)
    else:
        ranges.read_range_direct(
            files, op.key, op.piece, op.a, op.b, op.out, md.chunk_bytes, verify, window_bytes, verifier
        )


def iter_piece(
    files: FileSet, md: CheckpointMetadata, key: str, piece: PieceMeta, verify: bool
) -> Iterator[np.ndarray]:
    """The bytes of a whole saved piece as bounded windows, each verified before it is yielded (``verify``)."""
    for _pos, window in ranges.read_piece_windows(files, key, piece, [(0, piece.nbytes)], md.chunk_bytes, verify):
        yield window
