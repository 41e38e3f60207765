"""File I/O of the checkpoint engine: rank files, range reads, checksums, durable commit.

* A rank file is a safetensors file written in one sequential pass straight from tensor memory (no
  whole-state copy): the header, then each piece with ``os.writev`` on memoryviews of the tensors' own memory.
  CRC-32 of every ``chunk_bytes`` chunk of every piece is computed on the same memory during that pass (no second
  read). Each file is fsynced once.
* Reads use ``os.preadv`` into preallocated buffers, in windows of at most ``window_bytes``; the chunks a window
  touches are read whole and verified before any byte of them is used.
* Durability helpers: ``fsync_dir``, ``write_file_durable`` (tmp + fsync + rename + dir fsync) and
  ``replace_dir`` (atomic directory swap with ``renameat2(RENAME_EXCHANGE)`` where the kernel and file system
  support it, otherwise two renames).
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import zlib

import numpy as np

from .errors import CorruptCheckpointError
from .metadata import PieceMeta

WRITE_SLAB = 64 << 20  # bytes handed to the kernel per write call
DEFAULT_WINDOW = 64 << 20  # read window (bounded host buffer per read)
_IOV_MAX = 512


# ------------------------------------------------------------------------------------------- tensor memory


def dtype_name(t) -> str:
    return str(t.dtype).split(".")[-1]


def _is_host(place) -> bool:
    return place.is_cpu_place() or (hasattr(place, "is_cuda_pinned_place") and place.is_cuda_pinned_place())


def raw_view(t, allow_copy: bool = True):
    """uint8 numpy view of a tensor's bytes (row-major), plus the object that keeps the memory alive.

    Host, contiguous tensors are viewed in place through their data pointer; a device (or non-contiguous)
    tensor is first copied to host, one tensor at a time, with its own place's copy (never ``.cuda()``).
    """
    n = int(t.numel()) * t.element_size()
    if n == 0:
        return np.zeros(0, np.uint8), t
    keep = t
    if not _is_host(t.place) or not t.is_contiguous():
        if not allow_copy:
            raise ValueError("tensor is not a contiguous host tensor")
        if not t.is_contiguous():
            keep = t.contiguous()
        if not _is_host(keep.place):
            keep = keep.cpu()
    ptr = keep.data_ptr()
    arr = np.frombuffer((ctypes.c_ubyte * n).from_address(ptr), dtype=np.uint8)
    return arr, keep


# ----------------------------------------------------------------------------------------------- writing


def _write_all(fd: int, bufs: list) -> None:
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


def write_rank_file(
    path: str, header: bytes, pieces: list[np.ndarray], chunk_bytes: int, checksum: bool = True
) -> tuple[int, list[list[int]]]:
    """Write header + pieces (uint8 arrays) to ``path``, fsync once. Returns (size, per-piece chunk CRCs)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    crcs: list[list[int]] = []
    size = len(header)
    try:
        pending = [header]
        pending_bytes = len(header)
        for arr in pieces:
            mv = memoryview(arr).cast("B")
            piece_crcs = []
            if checksum:
                for i in range(0, len(mv), chunk_bytes):
                    piece_crcs.append(zlib.crc32(mv[i : i + chunk_bytes]))
            crcs.append(piece_crcs)
            size += len(mv)
            if len(mv) >= WRITE_SLAB:
                _write_all(fd, pending)
                pending, pending_bytes = [], 0
                for i in range(0, len(mv), WRITE_SLAB):
                    _write_all(fd, [mv[i : i + WRITE_SLAB]])
            else:
                pending.append(mv)
                pending_bytes += len(mv)
                if pending_bytes >= WRITE_SLAB or len(pending) >= _IOV_MAX:
                    _write_all(fd, pending)
                    pending, pending_bytes = [], 0
        _write_all(fd, pending)
        os.fsync(fd)
    finally:
        os.close(fd)
    return size, crcs


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_durable(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically and durably (tmp file, fsync, rename, fsync dir)."""
    tmp = f"{path}.part-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, [data])
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


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


def replace_dir(staging: str, final: str, old_name: str) -> None:
    """Atomically make ``staging`` appear at ``final``; a previous ``final`` is removed afterwards.

    With RENAME_EXCHANGE there is no instant at which ``final`` is missing. Without it, the previous directory
    is first renamed to ``old_name`` (so a crash in between leaves it there, intact) and then removed.
    """
    parent = os.path.dirname(os.path.abspath(final))
    if os.path.lexists(final):
        if _renameat2_exchange(staging, final):
            fsync_dir(parent)
            shutil.rmtree(staging, ignore_errors=True)  # now holds the previous checkpoint
            return
        os.rename(final, old_name)
        os.rename(staging, final)
        fsync_dir(parent)
        shutil.rmtree(old_name, ignore_errors=True)
    else:
        os.rename(staging, final)
        fsync_dir(parent)


# ----------------------------------------------------------------------------------------------- reading


class FileSet:
    """Open-on-demand read-only descriptors for the files of one checkpoint, with size checks."""

    def __init__(self, root: str, sizes: dict[str, int], resolve):
        self.root = root
        self.sizes = sizes
        self.resolve = resolve
        self.fds: dict[str, int] = {}
        self.bytes_read = 0

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

    def close(self) -> None:
        for fd in self.fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        self.fds.clear()


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

    With ``verify``, windows are widened to whole checksum chunks and each chunk's CRC is checked before the
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
                buf = np.empty(min(window_bytes + 2 * align, max(n, b - a)), np.uint8)
            view = buf[:n]
            files.pread_into(piece.file, view, piece.offset + pos)
            if verify:
                mv = memoryview(view)
                for c in range(0, n, chunk_bytes):
                    ci = (pos + c) // chunk_bytes
                    got = zlib.crc32(mv[c : c + chunk_bytes])
                    if got != piece.crc32[ci]:
                        raise CorruptCheckpointError(
                            f"checkpoint {files.root}: checksum mismatch in file {piece.file} for key {key!r} "
                            f"(chunk {ci}, bytes {piece.offset + pos + c}..)"
                        )
            yield pos, view
            pos = end
