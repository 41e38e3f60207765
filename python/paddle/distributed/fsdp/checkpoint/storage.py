"""File I/O of the checkpoint engine: rank files, range reads, checksums, durable commit.

* A rank file is a safetensors file written in one sequential pass straight from tensor memory (no
  whole-state copy): the header, then each piece with ``os.writev`` on memoryviews of the tensors' own memory.
  The checksum of every ``chunk_bytes`` chunk of every piece (checksums.py) is computed on the same memory just
  before it is written (no second pass over the state), and the memory of a piece (and its owner, e.g. the host
  copy of a device tensor) stays alive until its bytes are written. Each file is fsynced once.
* Reads use ``os.preadv`` into preallocated buffers, in windows of at most ``window_bytes``; the chunks a window
  touches are read whole and verified before any byte of them is used. Large ranges read straight into the
  caller's staging buffer can be verified on the helper threads while later ranges are read
  (``ChunkVerifier``); the caller waits for all of them (``ChunkVerifier.wait``) before using the bytes.
* ``alloc_host`` and ``HostArena``: page-aligned anonymous host memory (huge pages for O_DIRECT reads), and
  one reusable per-process buffer of it for async-save snapshots and load staging (see save.py, load.py).
* Durability helpers: ``fsync_dir``, ``write_file_durable`` (tmp + fsync + rename + dir fsync) and
  ``replace_dir`` (atomic directory swap with ``renameat2(RENAME_EXCHANGE)`` where the kernel and file system
  support it, otherwise two renames).
"""

from __future__ import annotations

import ctypes
import errno
import math
import mmap
import os
import shutil
import threading
import weakref

import numpy as np

from . import checksums, faults
from .checksums import DigestFn
from .errors import CorruptCheckpointError
from .format.metadata import PieceMeta

WRITE_SLAB = 64 << 20  # bytes handed to the kernel per write call
READ_SLAB_BYTES = int(os.environ.get("PADDLE_FSDP_CKPT_READ_SLAB", 16 << 20))  # pread step of direct reads
DEFAULT_WINDOW = 64 << 20  # read window (bounded host buffer per read)
# Span reads (load) of files that are not in the page cache bypass it with O_DIRECT where the file system allows
# it: the data lands in the staging buffer straight from the device instead of being copied once more out of the
# page cache (less CPU: a 2 -> 3 rank load on 2 cores took a median 0.60 s against 0.79 s buffered). A file mostly
# in the page cache (e.g. just saved) is read buffered: O_DIRECT would go to the device (0.10 s against 0.04 s for
# 170 MB here). PADDLE_FSDP_CKPT_ODIRECT: "auto" (default, by mincore), "1" always, "0" never.
_ODIRECT_MODE = os.environ.get("PADDLE_FSDP_CKPT_ODIRECT", "auto").strip().lower()
ODIRECT: bool | str = ({"1": True, "0": False}.get(_ODIRECT_MODE, "auto")) if hasattr(os, "O_DIRECT") else False
CACHED_FRACTION_FOR_BUFFERED = 0.5
DIRECT_ALIGN = 4096  # offset, length and memory alignment of O_DIRECT reads
_IOV_MAX = 512


CHECKSUM_THREADS = int(os.environ.get("PADDLE_FSDP_CKPT_CHECKSUM_THREADS", "2"))
_pool = None
_pool_lock = threading.Lock()


def _checksum_pool():
    """Shared thread pool that verifies the chunks of one slab while the next one is read (None: inline)."""
    global _pool
    if CHECKSUM_THREADS <= 0:
        return None
    with _pool_lock:
        if _pool is None:
            from concurrent.futures import ThreadPoolExecutor

            _pool = ThreadPoolExecutor(max_workers=CHECKSUM_THREADS, thread_name_prefix="ckpt-checksum")
        return _pool


# ------------------------------------------------------------------------------------------- host memory

# Transparent huge pages (MADV_HUGEPAGE) for buffers filled by O_DIRECT reads: the kernel faults in every page it
# pins, and a 2 -> 3 rank load took 0.61-0.68 s with huge pages against 0.86-1.16 s without. Not for buffers filled
# by memcpy (snapshots, undo copies): with THP defrag "madvise" such faults compact memory synchronously, which
# made those fills 1.4-3x slower here once memory was fragmented. PADDLE_FSDP_CKPT_HUGEPAGES: "auto" (default:
# as the caller asks), "1" always, "0" never.
_HUGEPAGES_MODE = os.environ.get("PADDLE_FSDP_CKPT_HUGEPAGES", "auto").strip().lower()


class HostMemoryAccount:
    """The engine's own accounting of the host buffers it holds: bytes alive now and the peak since
    ``reset_peak``. Every buffer a load or save allocates goes through ``track`` (``alloc_host``, ``host_empty``,
    staging tensors), so a bound on the extra host memory of a load is checked against this account."""

    def __init__(self):
        self._lock = threading.Lock()
        self.current = 0
        self.peak = 0

    def add(self, nbytes: int) -> None:
        with self._lock:
            self.current += nbytes
            self.peak = max(self.peak, self.current)

    def sub(self, nbytes: int) -> None:
        with self._lock:
            self.current -= nbytes

    def track(self, obj, nbytes: int):
        """Count ``nbytes`` until ``obj`` (an array or tensor owning them) is garbage."""
        if nbytes > 0:
            self.add(nbytes)
            weakref.finalize(obj, self.sub, nbytes)
        return obj

    def reset_peak(self) -> int:
        """Start a new peak at the current level; returns that level."""
        with self._lock:
            self.peak = self.current
            return self.current


host_memory = HostMemoryAccount()


def host_empty(nbytes: int) -> np.ndarray:
    """An accounted uint8 scratch buffer (bounce buffers and read windows)."""
    return host_memory.track(np.empty(nbytes, np.uint8), nbytes)


def alloc_host(nbytes: int, for_direct_reads: bool = False) -> np.ndarray:
    """Fresh uint8 host buffer of ``nbytes`` in its own anonymous mapping (page aligned, returned to the OS when
    the last view of it is dropped); huge pages requested when it is filled by O_DIRECT reads (see above)."""
    if nbytes <= 0:
        return np.empty(0, np.uint8)
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    huge = {"1": True, "0": False}.get(_HUGEPAGES_MODE, for_direct_reads)
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            m.madvise(mmap.MADV_HUGEPAGE)
        except (OSError, ValueError):
            pass
    return host_memory.track(np.frombuffer(m, np.uint8), nbytes)


class HostArena:
    """One reusable host buffer (per process) for the async-save snapshot and the load staging.

    Fresh memory is slow to fill (page faults; on a VM whose balloon gives freed pages back to the host, many
    times slower than a copy into memory that is already resident), so the snapshot of every async save goes
    into the same buffer, which stays resident between saves; a load borrows it as its staging when it exists.
    ``acquire`` hands it to one user at a time (None while another one holds it: the caller then uses fresh
    memory); ``grow`` replaces a too small buffer by a larger one (else None). ``free`` drops it.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._buf: np.ndarray | None = None
        self._busy = False

    @property
    def capacity(self) -> int:
        buf = self._buf
        return 0 if buf is None else len(buf)

    def acquire(self, nbytes: int, grow: bool) -> np.ndarray | None:
        with self._lock:
            if self._busy:
                return None
            if self._buf is None or len(self._buf) < nbytes:
                if not grow:
                    return None
                self._buf = None  # drop the small one before allocating (lower peak)
                self._buf = alloc_host(nbytes)
            self._busy = True
            return self._buf[:nbytes]

    def release(self) -> None:
        with self._lock:
            self._busy = False

    def free(self) -> bool:
        """Drop the buffer (its memory goes back to the OS once no view of it is alive); False while in use."""
        with self._lock:
            if self._busy:
                return False
            self._buf = None
            return True


arena = HostArena()


# ------------------------------------------------------------------------------------------- tensor memory


def numel_of(t) -> int:
    """Element count from the shape: ``Tensor.numel()`` is an op (a tensor, then ``int``), ~40x slower."""
    return math.prod(t.shape)


def dtype_name(t) -> str:
    return str(t.dtype).split(".")[-1]


def is_host_place(place) -> bool:
    return place.is_cpu_place() or (hasattr(place, "is_cuda_pinned_place") and place.is_cuda_pinned_place())


def is_host_contiguous(t) -> bool:
    """Whether the tensor's bytes can be used in place through its data pointer (see raw_view)."""
    return is_host_place(t.place) and t.is_contiguous()


def raw_view(t, allow_copy: bool = True):
    """uint8 numpy view of a tensor's bytes (row-major), plus the object that keeps the memory alive.

    Host, contiguous tensors are viewed in place through their data pointer; a device (or non-contiguous)
    tensor is first copied to host, one tensor at a time, with its own place's copy (never ``.cuda()``).
    """
    n = numel_of(t) * t.element_size()
    if n == 0:
        return np.zeros(0, np.uint8), t
    keep = t
    if not is_host_place(t.place) or not t.is_contiguous():
        if not allow_copy:
            raise ValueError("tensor is not a contiguous host tensor")
        if not t.is_contiguous():
            keep = t.contiguous()
        if not is_host_place(keep.place):
            keep = keep.cpu()
    ptr = keep.data_ptr()
    arr = np.frombuffer((ctypes.c_ubyte * n).from_address(ptr), dtype=np.uint8)
    return arr, keep


# ----------------------------------------------------------------------------------------------- writing


def write_all(fd: int, bufs: list) -> None:
    """writev all buffers, handling short writes."""
    bufs = [memoryview(b).cast("B") for b in bufs if len(b)]
    while bufs:
        batch = bufs[:_IOV_MAX]
        n = os.writev(fd, batch)
        total = sum(len(b) for b in batch)
        if n == total:
            bufs = bufs[len(batch) :]
            continue
        # short write: drop what was written and retry the rest
        while n:
            if n >= len(bufs[0]):
                n -= len(bufs[0])
                bufs.pop(0)
            else:
                bufs[0] = bufs[0][n:]
                n = 0


_SYNC_FILE_RANGE_WRITE = 2
KICK_BYTES = 16 << 20


def _sync_file_range():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SFR = _sync_file_range()


class _Writer:
    """Sequential writer that starts disk writeback of every KICK_BYTES written (Linux ``sync_file_range``), so
    the data goes to disk while later data is still being checksummed and copied, and the final fsync is short.

    ``kill_at`` (test-only, see faults.py): write exactly that many bytes of the file, fsync, then SIGKILL."""

    def __init__(self, fd: int, kill_at: int | None = None):
        self.fd = fd
        self.pos = 0
        self.kicked = 0
        self.kill_at = kill_at

    def write(self, bufs: list) -> None:
        if self.kill_at is not None and self.pos + sum(len(b) for b in bufs) >= self.kill_at:
            data = b"".join(bytes(memoryview(b).cast("B")) for b in bufs)
            write_all(self.fd, [data[: self.kill_at - self.pos]])
            os.fsync(self.fd)
            faults.kill("mid_data")
        write_all(self.fd, bufs)
        self.pos += sum(len(b) for b in bufs)
        if _SFR is not None and self.pos - self.kicked >= KICK_BYTES:
            _SFR(self.fd, self.kicked, self.pos - self.kicked, _SYNC_FILE_RANGE_WRITE)
            self.kicked = self.pos


def write_rank_file(
    path: str,
    header: bytes,
    pieces: list[np.ndarray],
    chunk_bytes: int,
    digest: DigestFn | None,
    kill_at: int | None = None,
    batch_bytes: int = WRITE_SLAB,
) -> tuple[int, list[list[int]]]:
    """Write header + pieces to ``path``, fsync once. Returns (size, per-piece chunk checksums).

        A piece is a uint8 array, or a callable returning ``(uint8 array, owner of its memory)``, called just
        before that piece is written (so a device tensor is copied to host one piece at a time; the copy is dropped
        once its bytes are written). Each piece is checksummed with ``digest`` (None: no checksums) by the calling
        thread just before it is queued for writing: xxh3-64 runs at memory speed, far faster than the write, so
        helper threads would only add hand-offs. Pieces smaller than ``batch_bytes`` are batched into one writev (and
    stay alive until it); ``batch_bytes=0`` writes and drops each piece before the next is produced (the tools: one
    tensor in memory). ``kill_at`` is the test-only ``mid_data`` fault (see faults.py).
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    sums: list[list[int]] = []
    size = len(header)
    w = _Writer(fd, kill_at)
    try:
        pending = [header]  # small pieces batched into one writev (with their owners, alive until written)
        pending_owners: list = []
        pending_bytes = len(header)
        for arr in pieces:
            owner = None
            if callable(arr):
                arr, owner = arr()
            mv = memoryview(arr).cast("B")
            sums.append(checksums.chunk_digests(mv, chunk_bytes, digest) if digest is not None else [])
            size += len(mv)
            if len(mv) < WRITE_SLAB:
                pending.append(mv)
                pending_owners.append(owner)
                pending_bytes += len(mv)
                if pending_bytes >= batch_bytes or len(pending) >= _IOV_MAX:
                    w.write(pending)
                    pending, pending_owners, pending_bytes = [], [], 0
                arr = owner = mv = None  # held by `pending` until written, by nothing once written
                continue
            w.write(pending)
            pending, pending_owners, pending_bytes = [], [], 0
            for i in range(0, len(mv), WRITE_SLAB):
                w.write([mv[i : i + WRITE_SLAB]])
            arr = owner = mv = None  # a large piece's memory (e.g. a device's host copy) goes before the next
        w.write(pending)
        pending = pending_owners = []
        os.fsync(fd)
    finally:
        os.close(fd)
    return size, sums


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durable(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically and durably (tmp file, fsync, rename, fsync dir)."""
    write_file(path, data, fsync=True, atomic=True)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_file(path: str, data: bytes, fsync: bool, atomic: bool) -> None:
    """Write a small file; ``atomic`` makes it appear complete or not at all (tmp + rename)."""
    target = f"{path}.part-{os.getpid()}-{threading.get_ident()}" if atomic else path
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        write_all(fd, [data])
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    if atomic:
        os.replace(target, path)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _renameat2_exchange(a: str, b: str) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    rc = fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, getattr(errno, "EOPNOTSUPP", errno.ENOTSUP)):
        return False
    raise OSError(err, f"renameat2({a!r}, {b!r}, RENAME_EXCHANGE): {os.strerror(err)}")


def replace_dir(staging: str, final: str, old_name: str, background_delete: bool = True):
    """Atomically make ``staging`` appear at ``final``; a previous ``final`` is removed afterwards.

    With RENAME_EXCHANGE there is no instant at which ``final`` is missing. Without it, the previous directory
    is first renamed to ``old_name`` (so a crash in between leaves it there, intact) and then removed. The
    removal of the previous checkpoint runs in a non-daemon thread (returned, or None) so it does not delay
    the commit; the interpreter waits for it at exit.
    """
    parent = os.path.dirname(os.path.abspath(final))
    leftover = None
    for _attempt in range(3):
        if os.path.lexists(final):
            if _renameat2_exchange(staging, final):
                leftover = staging  # now holds the previous checkpoint
            else:
                os.rename(final, old_name)
                os.rename(staging, final)
                leftover = old_name
            break
        try:
            os.rename(staging, final)
            break
        except OSError as e:
            # another job committed to ``final`` since the lexists check: replace its checkpoint instead
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or _attempt == 2:
                raise
    fsync_dir(parent)
    if leftover is None:
        return None
    if not background_delete:
        shutil.rmtree(leftover, ignore_errors=True)
        return None
    th = threading.Thread(target=shutil.rmtree, args=(leftover, True), name="ckpt-rm-old", daemon=False)
    th.start()
    return th


# ----------------------------------------------------------------------------------------------- reading


def _libc_mincore():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mm, mc, mu = libc.mmap, libc.mincore, libc.munmap
    except (OSError, AttributeError):
        return None
    mm.restype = ctypes.c_void_p
    mm.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    mc.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    mu.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return mm, mc, mu


_MINCORE = _libc_mincore()


def page_cache_fraction(fd: int, size: int) -> float | None:
    """Fraction of the file's pages resident in the page cache (``mincore`` on a mapping that is never touched,
    so nothing is read); None where that cannot be asked."""
    if _MINCORE is None or size <= 0:
        return None
    mm, mc, mu = _MINCORE
    addr = mm(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == ctypes.c_void_p(-1).value:
        return None
    try:
        pages = -(-size // mmap.PAGESIZE)
        vec = np.zeros(pages, np.uint8)
        if mc(addr, size, vec.ctypes.data) != 0:
            return None
        return float(np.count_nonzero(vec & 1)) / pages
    finally:
        mu(addr, size)


class FileSet:
    """Open-on-demand read-only descriptors for the files of one checkpoint, with size checks, and the checksum
    function its chunks are verified with (None: reads are not verified)."""

    def __init__(self, root: str, sizes: dict[str, int], resolve, digest: DigestFn | None = None):
        self.root = root
        self.sizes = sizes
        self.resolve = resolve
        self.digest = digest
        self.fds: dict[str, int] = {}
        self.bytes_read = 0
        self._direct: dict[str, int | None] = {}

    @classmethod
    def of(cls, root: str, md, resolve, verify: bool) -> FileSet:
        """The files of checkpoint ``md`` at ``root``; verified reads when ``verify`` and it has checksums."""
        digest = checksums.digest_function(md.checksum) if verify and md.checksum != checksums.NONE else None
        return cls(root, {n: f.size for n, f in md.files.items()}, resolve, digest)

    @property
    def verifies(self) -> bool:
        return self.digest is not None

    def fd(self, name: str) -> int:
        fd = self.fds.get(name)
        if fd is not None:
            return fd
        path = self.resolve(self.root, name)
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise CorruptCheckpointError(f"checkpoint {self.root}: data file {name} is missing") from None
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
        fd = self.fd(name)
        mv = memoryview(buf).cast("B")
        done = 0
        while done < len(mv):
            n = os.preadv(fd, [mv[done:]], offset + done)
            if n <= 0:
                raise CorruptCheckpointError(
                    f"checkpoint {self.root}: data file {name} ends at byte {offset + done}, "
                    f"expected at least {offset + len(mv)}"
                )
            done += n
        self.bytes_read += len(mv)

    def direct_fd(self, name: str) -> int | None:
        """An O_DIRECT descriptor of ``name`` (after the size check of ``fd``), or None where unsupported."""
        if name in self._direct:
            return self._direct[name]
        self.fd(name)
        fd = None
        use = ODIRECT
        if use == "auto":
            cached = page_cache_fraction(self.fds[name], self.sizes[name])
            use = cached is not None and cached < CACHED_FRACTION_FOR_BUFFERED
        if use:
            try:
                fd = os.open(self.resolve(self.root, name), os.O_RDONLY | os.O_DIRECT | getattr(os, "O_CLOEXEC", 0))
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
                _verify_chunks(files, key, piece, view, pos, chunk_bytes)
            yield pos, view
            pos = end


def _verify_chunks(files: FileSet, key: str, piece: PieceMeta, buf, pos: int, chunk_bytes: int) -> None:
    """Check the checksum of every chunk of ``buf``, which holds piece bytes [pos, pos+len) (pos chunk-aligned)."""
    mv = memoryview(buf).cast("B")
    digest = files.digest
    for c in range(0, len(mv), chunk_bytes):
        ci = (pos + c) // chunk_bytes
        if digest(mv[c : c + chunk_bytes]) != piece.checksums[ci]:
            raise CorruptCheckpointError(
                f"checkpoint {files.root}: checksum mismatch in file {piece.file} for key {key!r} "
                f"(chunk {ci}, bytes {piece.offset + pos + c}..)"
            )


class ChunkVerifier:
    """Chunk checksum checks queued on the helper pool, so that they overlap the reads that follow.

    ``wait()`` waits for every queued check (all of them, also after a mismatch: once it returns no helper
    thread reads the buffers any more) and raises the first mismatch in submission order. Bytes checked this way
    must not be used before ``wait()`` returned without error.
    """

    def __init__(self):
        self.pool = _checksum_pool()
        self.futures: list = []

    def check(self, files: FileSet, key: str, piece: PieceMeta, buf, pos: int, chunk_bytes: int) -> None:
        if self.pool is None:
            _verify_chunks(files, key, piece, buf, pos, chunk_bytes)
        else:
            self.futures.append(self.pool.submit(_verify_chunks, files, key, piece, buf, pos, chunk_bytes))

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
        _verify_chunks(files, key, piece, tmp, a0, C)
        out[:] = tmp[a - a0 : b - a0]
        return
    if a < A:  # head: partial chunk
        a0 = A - C
        tmp = host_empty(min(C, piece.nbytes - a0))
        files.pread_into(piece.file, tmp, piece.offset + a0)
        _verify_chunks(files, key, piece, tmp, a0, C)
        out[: A - a] = tmp[a - a0 : A - a0]
    slab = max(C, (READ_SLAB_BYTES // C) * C)
    own = verifier is None
    if own:
        verifier = ChunkVerifier()
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
    if B < b:  # tail: partial chunk
        b0 = min(B + C, piece.nbytes)
        tmp = host_empty(b0 - B)
        files.pread_into(piece.file, tmp, piece.offset + B)
        _verify_chunks(files, key, piece, tmp, B, C)
        out[B - a :] = tmp[: b - B]


class SpanRead:
    """An aligned file range ``[start, start + len(buf))`` of ``name`` read into ``buf`` (only the first
    ``need`` bytes matter), and the chunk checks ``(key, piece, a0, b0)`` (piece-relative, chunk-aligned) of
    the pieces inside it, queued as soon as their bytes are in."""

    __slots__ = ("name", "start", "need", "buf", "checks")

    def __init__(self, name: str, start: int, need: int, buf: np.ndarray, checks: list):
        self.name, self.start, self.need, self.buf, self.checks = name, start, need, buf, checks


def read_spans(files: FileSet, spans: list[SpanRead], chunk_bytes: int, verifier: ChunkVerifier | None) -> None:
    """Read every span (in file order, ``READ_SLAB_BYTES`` at a time; O_DIRECT where supported, else buffered,
    relying on the kernel's sequential readahead). The chunk checks go to ``verifier`` (None: no checks) as soon
    as their chunks are in, so checksumming overlaps the reads that follow. The spans' bytes must not be used
    before ``verifier.wait()`` returned."""
    C = chunk_bytes
    spans = sorted(spans, key=lambda sp: (sp.name, sp.start))
    slab = max(DIRECT_ALIGN, (READ_SLAB_BYTES // DIRECT_ALIGN) * DIRECT_ALIGN)

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
