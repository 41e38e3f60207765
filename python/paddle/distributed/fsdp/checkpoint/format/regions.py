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

from .. import reader, streamed
from ..errors import CorruptCheckpointError
from ..planner import Region, plan_reads
from .metadata import DTYPES, CheckpointMetadata, PieceMeta


def region_segments(root: str, md: CheckpointMetadata, key: str, region: Region) -> list:
    """Where the bytes of ``region`` of ``key`` are: per saved piece ``(piece, src, dst, length, big)``, byte
    offsets (piece-relative source, region-relative destination) sorted by source; ``big`` marks the segments of
    at least two checksum chunks (read straight, without a window buffer). Raises CorruptCheckpointError when the
    saved pieces do not cover the region."""
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
        order = np.argsort(seg.src, kind="stable")
        len_b = seg.length[order] * isz
        out.append((it.piece, seg.src[order] * isz, seg.dst[order] * isz, len_b, len_b >= 2 * md.chunk_bytes))
    return out


def clip_segments(segments: list, w0: int, w1: int, chunk_bytes: int) -> list:
    """The parts of ``segments`` whose destination lies in ``[w0, w1)``, destinations made relative to ``w0``
    (a window of a region, for readers that fill a bounded staging buffer one window at a time)."""
    out = []
    for piece, src_b, dst_b, len_b, _big in segments:
        lo = np.maximum(dst_b, w0)
        hi = np.minimum(dst_b + len_b, w1)
        keep = hi > lo
        if not keep.any():
            continue
        length = (hi - lo)[keep]
        out.append((piece, (src_b + (lo - dst_b))[keep], lo[keep] - w0, length, length >= 2 * chunk_bytes))
    return out


def read_region(
    files: reader.FileSet,
    md: CheckpointMetadata,
    key: str,
    region: Region,
    out: np.ndarray,
    verify: bool,
    verifier: reader.ChunkVerifier | None = None,
    deferred: list | None = None,
    window_bytes: int = reader.DEFAULT_WINDOW,
    segments: list | None = None,
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
    for piece, src_b, dst_b, len_b, big in segments:
        # large segments: read straight into the destination (verified in place)
        for a, d, n in zip(src_b[big].tolist(), dst_b[big].tolist(), len_b[big].tolist()):
            if deferred is not None:
                deferred.append((key, piece, a, a + n, out[d : d + n]))
                continue
            reader.read_range_direct(
                files, key, piece, a, a + n, out[d : d + n], md.chunk_bytes, verify, window_bytes, verifier
            )
        if big.all():
            continue
        small = (src_b[~big], dst_b[~big], len_b[~big], out, window_bytes)
        if deferred is not None:  # b=None marks small segments; a = their first byte, for the file order
            deferred.append((key, piece, int(small[0][0]), None, small))
            continue
        _scatter_small(files, md, key, piece, *small[:4], verify, window_bytes)


def _scatter_small(files, md, key, piece, src_b, dst_b, len_b, out, verify: bool, window_bytes: int) -> None:
    """Small segments (e.g. rows of a box): read the enclosing windows once, verify, scatter."""
    merged: list[tuple[int, int]] = []
    for a, b in zip(src_b.tolist(), (src_b + len_b).tolist()):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    si = 0
    n = len(src_b)
    for wpos, buf in reader.read_piece_windows(files, key, piece, merged, md.chunk_bytes, verify, window_bytes):
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


def _read_bytes(entry: tuple) -> int:
    """Bytes a deferred read entry reads (before chunk widening)."""
    _key, _piece, a, b, out = entry
    return int(out[2].sum()) if b is None else b - a


def read_deferred(
    files: reader.FileSet,
    md: CheckpointMetadata,
    reads: list,
    verify: bool,
    verifier: reader.ChunkVerifier | None,
    window_bytes: int = reader.DEFAULT_WINDOW,
) -> None:
    """Do the reads collected by ``read_region(deferred=...)`` in file order, tiny ones (under ``TINY_READ``
    bytes, e.g. optimizer scalars) last: the kernel's readahead then sees one sequential pass per file. Tiny reads
    ahead of a sequential pass (this rank's or another rank's reading the same file) cache scattered pages in its
    way and break its readahead into small requests: here 2x the I/O requests and a cold load 1.4x slower.
    (Requesting readahead with POSIX_FADV_WILLNEED was measured slower.) Large ranges of files not in the page
    cache are streamed through bounce buffers of at most ``window_bytes`` (streamed.py)."""
    verify = verify and files.verifies
    reads.sort(key=lambda r: (_read_bytes(r) < TINY_READ, r[1].file, r[1].offset + r[2]))
    run: list = []  # consecutive large reads of files not in the page cache, streamed together

    def flush() -> None:
        streamed.stream_ranges(files, run, md.chunk_bytes, verify, window_bytes)
        run.clear()

    for key, piece, a, b, out in reads:
        if b is not None and b - a >= TINY_READ and not files.mostly_cached(piece.file):
            run.append((key, piece, a, b, out))
            continue
        flush()
        if b is None:  # small scattered segments of one piece: (src, dst, length, out, window)
            src_b, dst_b, len_b, dst, window = out
            _scatter_small(files, md, key, piece, src_b, dst_b, len_b, dst, verify, window)
            continue
        reader.read_range_direct(files, key, piece, a, b, out, md.chunk_bytes, verify, verifier=verifier)
    flush()


def iter_piece(
    files: reader.FileSet, md: CheckpointMetadata, key: str, piece: PieceMeta, verify: bool
) -> Iterator[np.ndarray]:
    """The bytes of a whole saved piece as bounded windows, each verified before it is yielded (``verify``)."""
    for _pos, window in reader.read_piece_windows(files, key, piece, [(0, piece.nbytes)], md.chunk_bytes, verify):
        yield window
