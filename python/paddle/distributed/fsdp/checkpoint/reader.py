"""Reading: checked, bounded reads of byte ranges of a checkpoint's data files, with chunk checksum verification.

* ``FileSet``: open-on-demand descriptors of one checkpoint's files, with size checks against the metadata, the
  checksum function, and the read settings (O_DIRECT mode, read slab, checksum threads) of CheckpointOptions.
* Reads use ``os.preadv`` into preallocated buffers, in windows of at most ``window_bytes``
  (``read_piece_windows``); the chunks a window touches are read whole and verified before any byte of them is
  used. Large ranges read straight into the caller's buffer (``read_range_direct``, ``read_spans``) are verified
  on helper threads while later ranges are read (``ChunkVerifier``); the caller waits for all of them
  (``ChunkVerifier.wait``) before using the bytes. Ranges of a file in the page cache are read in CACHE_STEP
  steps, each hashed (running digest of its chunk) while it is in the CPU cache. Memory-bounded loads stream the
  large ranges of files not in the page cache through bounce buffers instead (streamed.py).
"""

from __future__ import annotations

import errno
import os
import threading
from collections import OrderedDict

import numpy as np

from . import checksums, libc
from .checksums import DigestFn
from .errors import CorruptCheckpointError
from .format.metadata import PieceMeta
from .host_memory import host_empty

DEFAULT_WINDOW = 64 << 20  # read window (bounded host buffer per read)
DEFAULT_READ_SLAB = 16 << 20  # pread step of large ranges (CheckpointOptions.read_slab_bytes)
DEFAULT_CHECKSUM_THREADS = 2  # CheckpointOptions.checksum_threads
# Span reads (load) of files that are not in the page cache bypass it with O_DIRECT where the file system allows
# it: the data lands in the staging buffer straight from the device instead of being copied once more out of the
# page cache (less CPU: a 2 -> 3 rank load on 2 cores took a median 0.60 s against 0.79 s buffered). A file mostly
# in the page cache (e.g. just saved) is read buffered: O_DIRECT would go to the device (0.10 s against 0.04 s for
# 170 MB here). CheckpointOptions.odirect: "auto" (default, by mincore), True always, False never.
HAVE_ODIRECT = hasattr(os, "O_DIRECT")
CACHED_FRACTION_FOR_BUFFERED = 0.5
DIRECT_ALIGN = 4096  # offset, length and memory alignment of O_DIRECT reads
# Descriptors a reader keeps open at once (least recently used ones are closed): any number of data files can
# be read under a low RLIMIT_NOFILE.
MAX_OPEN_FILES = 64  # CheckpointOptions.max_open_files
# Bytes read, then hashed, at a time where a chunk is checked right after it is read: they are still in the CPU's
# L2 cache for the hash (a page-cache read of 1 MiB, then its hash, ran at 0.77x a plain read here; 256 KiB
# steps with a running digest of the chunk at 0.91-0.94x).
CACHE_STEP = 256 << 10


_pools: dict[int, object] = {}
_pool_lock = threading.Lock()


def _checksum_pool(threads: int):
    """Shared thread pool (one per size) that verifies the chunks of one slab while the next one is read
    (None: inline)."""
    if threads <= 0:
        return None
    with _pool_lock:
        pool = _pools.get(threads)
        if pool is None:
            from concurrent.futures import ThreadPoolExecutor

            pool = _pools[threads] = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ckpt-checksum")
        return pool


def pread_full(fd: int, buf, offset: int) -> int:
    """Read ``len(buf)`` bytes of ``fd`` at ``offset`` into ``buf`` (a contiguous buffer), over as many short
    reads as it takes; returns the bytes read, fewer only where the file ends. The one buffered read loop of the
    engine and the tools (callers name the short read in their own error)."""
    mv = memoryview(buf).cast("B")
    done = 0
    while done < len(mv):
        n = os.preadv(fd, [mv[done:]], offset + done)
        if n <= 0:
            break
        done += n
    return done


class FileSet:
    """Open-on-demand read-only descriptors for the files of one checkpoint, with size checks, and the checksum
    function its chunks are verified with (None: reads are not verified)."""

    def __init__(
        self,
        root: str,
        sizes: dict[str, int],
        resolve,
        digest: DigestFn | None = None,
        odirect: bool | str = "auto",
        read_slab: int = DEFAULT_READ_SLAB,
        checksum_threads: int = DEFAULT_CHECKSUM_THREADS,
        checkpoint_id: str | None = None,
        max_open: int = MAX_OPEN_FILES,
    ):
        self.root = root
        self.checkpoint_id = checkpoint_id
        self.max_open = max(2, max_open)
        self.odirect = odirect if HAVE_ODIRECT else False
        self.read_slab = read_slab
        self.checksum_threads = checksum_threads
        self.sizes = sizes
        self.resolve = resolve
        self.digest = digest
        self.fds: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self.bytes_read = 0
        self._direct: dict[str, int | None] = {}
        self._cached: dict[str, bool] = {}

    @classmethod
    def of(cls, root: str, md, resolve, verify: bool, options=None) -> FileSet:
        """The files of checkpoint ``md`` at ``root``; verified reads when ``verify`` and it has checksums;
        O_DIRECT and the read slab as ``options`` (a CheckpointOptions; None: the defaults)."""
        if options is None:
            from .options import CheckpointOptions  # options.py takes its defaults from this module

            options = CheckpointOptions()
        digest = checksums.digest_function(md.checksum) if verify and md.checksum != checksums.NONE else None
        return cls(
            root,
            {n: f.size for n, f in md.files.items()},
            resolve,
            digest,
            odirect=options.odirect,
            read_slab=options.read_slab_bytes,
            checksum_threads=options.checksum_threads,
            checkpoint_id=md.checkpoint_id,
            max_open=options.max_open_files,
        )

    @property
    def verifies(self) -> bool:
        return self.digest is not None

    def _open(self, name: str, flags: int = 0) -> int:
        """A regular-file descriptor of ``name`` (never blocks on a FIFO or device); a missing file is a removed
        checkpoint when its commit record went too (directory.py), else corruption."""
        from .directory import removed_or
        from .format.strict_json import open_regular

        path = self.resolve(self.root, name)
        try:
            return open_regular(path, flags)
        except FileNotFoundError:
            raise removed_or(
                self.root,
                CorruptCheckpointError(f"checkpoint {self.root}: data file {name} is missing"),
                self.checkpoint_id,
            ) from None

    def _make_room(self) -> None:
        """Close least recently used descriptors so that one more stays within ``max_open``."""
        while len(self.fds) + sum(fd is not None for fd in self._direct.values()) >= self.max_open and self.fds:
            old, fd = self.fds.popitem(last=False)
            os.close(fd)
            dfd = self._direct.pop(old, None)
            if dfd is not None:
                os.close(dfd)

    def fd(self, name: str) -> int:
        fd = self.fds.get(name)
        if fd is not None:
            self.fds.move_to_end(name)
            return fd
        self._make_room()
        fd = self._open(name)
        size = os.fstat(fd).st_size
        if size != self.sizes[name]:
            os.close(fd)
            raise CorruptCheckpointError(
                f"checkpoint {self.root}: data file {name} has {size} bytes, metadata says "
                f"{self.sizes[name]} (truncated or replaced)"
            )
        self.fds[name] = fd
        return fd

    def pread_into(self, name: str, buf: np.ndarray, offset: int) -> None:
        want = memoryview(buf).nbytes
        done = pread_full(self.fd(name), buf, offset)
        if done < want:
            raise CorruptCheckpointError(
                f"checkpoint {self.root}: data file {name} ends at byte {offset + done}, expected at least {offset + want}"
            )
        self.bytes_read += done

    def mostly_cached(self, name: str) -> bool:
        """Whether most of ``name`` is in the page cache (mincore, asked once per file): reads of it are then
        memory copies, and checksums are best computed right after each chunk is copied, while it is in the CPU
        cache, instead of on helper threads from main memory later."""
        got = self._cached.get(name)
        if got is None:
            fd = self.fd(name)
            frac = libc.page_cache_fraction(fd, self.sizes[name])
            got = self._cached[name] = frac is not None and frac >= CACHED_FRACTION_FOR_BUFFERED
        return got

    def direct_fd(self, name: str) -> int | None:
        """An O_DIRECT descriptor of ``name`` (after the size check of ``fd``), or None where unsupported."""
        if name in self._direct and name in self.fds:
            self.fds.move_to_end(name)
            return self._direct[name]
        self.fd(name)
        fd = None
        use = self.odirect
        if use == "auto":
            cached = libc.page_cache_fraction(self.fds[name], self.sizes[name])
            use = cached is not None and cached < CACHED_FRACTION_FOR_BUFFERED
        if use:
            try:
                fd = self._open(name, os.O_DIRECT)
            except OSError:
                fd = None
        self._direct[name] = fd
        return fd

    def _no_direct(self, name: str) -> None:
        fd = self._direct.get(name)
        self._direct[name] = None
        if fd is not None:
            os.close(fd)

    def pread_span(self, name: str, buf: np.ndarray, offset: int, need: int) -> None:
        """Read file bytes [offset, offset + need) into ``buf[:need]``; with O_DIRECT where possible, which reads
        all of ``buf`` (page aligned, ``offset`` and ``len(buf)`` multiples of DIRECT_ALIGN; bytes past ``need``
        or past the end of the file are not meaningful). Falls back to buffered reads."""
        fd = self.direct_fd(name)
        done = 0
        if fd is not None:
            mv = memoryview(buf).cast("B")
            try:
                while done < need:
                    n = os.preadv(fd, [mv[done:]], offset + done)
                    if n <= 0:
                        break
                    done += n
                    if n % DIRECT_ALIGN:  # end of file: an unaligned continuation is not allowed
                        break
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                    raise
                self._no_direct(name)  # not supported here after all: buffered from now on
            done = min(done, need)
            self.bytes_read += done
        if done < need:
            self.pread_into(name, buf[done:need], offset + done)

    def close(self) -> None:
        for fd in list(self.fds.values()) + [fd for fd in self._direct.values() if fd is not None]:
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds.clear()
        self._direct.clear()


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


def verify_chunks(files: FileSet, key: str, piece: PieceMeta, buf, pos: int, chunk_bytes: int) -> None:
    """Check the checksum of every chunk of ``buf``, which holds piece bytes [pos, pos+len) (pos chunk-aligned)."""
    mv = memoryview(buf).cast("B")
    digest = files.digest
    for c in range(0, len(mv), chunk_bytes):
        ci = (pos + c) // chunk_bytes
        if digest(mv[c : c + chunk_bytes]) != piece.checksums[ci]:
            raise checksum_mismatch(files, key, piece, ci, chunk_bytes)


def checksum_mismatch(files: FileSet, key: str, piece: PieceMeta, ci: int, chunk_bytes: int) -> CorruptCheckpointError:
    """The error for chunk ``ci`` of ``piece`` whose bytes do not match their checksum."""
    return CorruptCheckpointError(
        f"checkpoint {files.root}: checksum mismatch in file {piece.file} for key {key!r} "
        f"(chunk {ci}, bytes {piece.offset + ci * chunk_bytes}..)"
    )


class ChunkStream:
    """Chunk checks of consecutive piece bytes fed in any steps (checksums.ChunkDigests): each chunk is compared
    with its checksum once its last byte is in. Starts at ``pos``, a chunk boundary of ``piece``."""

    def __init__(self, files: FileSet, key: str, piece: PieceMeta, pos: int, chunk_bytes: int):
        self.files, self.key, self.piece, self.chunk = files, key, piece, chunk_bytes
        self.digests = checksums.ChunkDigests(files.digest, chunk_bytes, piece.nbytes, pos)

    def feed(self, mv: memoryview) -> None:
        """Hash ``mv``, the piece bytes from the last fed one on (CorruptCheckpointError on a mismatch)."""
        for ci, got in self.digests.feed(mv):
            if got != self.piece.checksums[ci]:
                raise checksum_mismatch(self.files, self.key, self.piece, ci, self.chunk)


class ChunkVerifier:
    """Chunk checksum checks queued on the helper pool, so that they overlap the reads that follow.

    ``wait()`` waits for every queued check (all of them, also after a mismatch: once it returns no helper
    thread reads the buffers any more) and raises the first mismatch in submission order. Bytes checked this way
    must not be used before ``wait()`` returned without error.
    """

    def __init__(self, threads: int = DEFAULT_CHECKSUM_THREADS):
        self.pool = _checksum_pool(threads)
        self.futures: list = []

    def check(self, files: FileSet, key: str, piece: PieceMeta, buf, pos: int, chunk_bytes: int) -> None:
        if self.pool is None:
            verify_chunks(files, key, piece, buf, pos, chunk_bytes)
        else:
            self.futures.append(self.pool.submit(verify_chunks, files, key, piece, buf, pos, chunk_bytes))

    def drain(self) -> BaseException | None:
        """Wait for every queued check; the first mismatch (in submission order) or None."""
        futs, self.futures = self.futures, []
        first = None
        for f in futs:
            e = f.exception()
            if e is not None and first is None:
                first = e
        return first

    def wait(self) -> None:
        first = self.drain()
        if first is not None:
            raise first


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
        # non-temporal stores (native code) gained ~10% with two ranks at once (README, what bounds the figures),
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
    slab = max(C, (files.read_slab // C) * C)
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
    slab = max(DIRECT_ALIGN, (files.read_slab // DIRECT_ALIGN) * DIRECT_ALIGN)

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
