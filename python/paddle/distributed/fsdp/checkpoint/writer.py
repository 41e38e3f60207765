"""Writing: rank files in one sequential pass, small files, and the atomic directory swap of a commit.

* A rank file is a safetensors file written in one sequential pass straight from tensor memory (no
  whole-state copy): the header, then each piece with ``os.writev`` on memoryviews of the tensors' own memory.
  The checksum of every ``chunk_bytes`` chunk of every piece (checksums.py) is computed on the same memory just
  before it is written (no second pass over the state), and the memory of a piece (and its owner, e.g. the host
  copy of a device tensor) stays alive until its bytes are written. Each file is fsynced once; writeback starts
  every KICK_BYTES (``sync_file_range``) so the final fsync is short. Saves write with O_DIRECT instead
  (``direct=True``: direct_write.py), through bounce buffers, where the file system allows it.
* Durability helpers: ``fsync_dir``, ``makedirs_durable`` (new directories fsynced in their parents),
  ``write_file`` / ``write_file_durable`` (tmp + fsync + rename + dir fsync) and ``replace_dir`` (atomic
  directory swap with ``renameat2(RENAME_EXCHANGE)`` where the kernel and file system support it, otherwise
  two renames).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import threading

import numpy as np

from . import checksums, direct_write, libc
from .checksums import DigestFn

WRITE_SLAB = 64 << 20  # bytes handed to the kernel per write call
KICK_BYTES = 16 << 20  # writeback is started every KICK_BYTES written
_IOV_MAX = 512


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


class _Writer:
    """Sequential writer that starts disk writeback of every KICK_BYTES written (Linux ``sync_file_range``), so
    the data goes to disk while later data is still being checksummed and copied, and the final fsync is short."""

    def __init__(self, fd: int, should_stop=None):
        self.fd = fd
        self.pos = 0
        self.kicked = 0
        self.should_stop = should_stop

    def write(self, bufs: list) -> None:
        if self.should_stop is not None:
            self.should_stop()  # raises when the save was given up elsewhere (another rank failed)
        write_all(self.fd, bufs)
        self.pos += sum(len(b) for b in bufs)
        if self.pos - self.kicked >= KICK_BYTES and libc.sync_file_range(self.fd, self.kicked, self.pos - self.kicked):
            self.kicked = self.pos


def write_rank_file(
    path: str,
    header: bytes,
    pieces: list[np.ndarray],
    chunk_bytes: int,
    digest: DigestFn | None,
    batch_bytes: int = WRITE_SLAB,
    should_stop=None,
    direct: bool = False,
) -> tuple[int, list[list[int]]]:
    """Write header + pieces to ``path``, fsync once. Returns (size, per-piece chunk checksums).

        A piece is a uint8 array, or a callable returning ``(uint8 array, owner of its memory)``, called just
        before that piece is written (so a device tensor is copied to host one piece at a time; the copy is dropped
        once its bytes are written). Each piece is checksummed with ``digest`` (None: no checksums) by the calling
        thread just before it is queued for writing: xxh3-64 runs at memory speed, far faster than the write, so
        helper threads would only add hand-offs. Pieces smaller than ``batch_bytes`` are batched into one writev (and
    stay alive until it); ``batch_bytes=0`` writes and drops each piece before the next is produced (the tools: one
    tensor in memory).
    ``should_stop()`` is called before each write call (at most every ``WRITE_SLAB`` bytes) and raises to give
    up (another rank failed): a long write stops within one slab.
    ``direct``: write with O_DIRECT through bounce buffers where the file system allows it (direct_write.py;
    the pieces are then copied and dropped one at a time, whatever ``batch_bytes``).
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    if direct:
        try:
            dfd = direct_write.open_direct(path)
        except BaseException:
            os.close(fd)
            raise
        if dfd is not None:
            try:
                return direct_write.write_pieces(fd, dfd, header, pieces, chunk_bytes, digest, should_stop)
            finally:
                os.close(fd)
    sums: list[list[int]] = []
    size = len(header)
    w = _Writer(fd, should_stop)
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


def fsync_path(path: str, flags: int = 0) -> None:
    """fsync the file (or, with ``O_DIRECTORY`` in ``flags``, the directory) at ``path``."""
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str) -> None:
    fsync_path(path, getattr(os, "O_DIRECTORY", 0))


def makedirs_durable(path: str) -> None:
    """``os.makedirs(path, exist_ok=True)`` whose new directories survive a power loss: the parent of every level
    it creates is fsynced (POSIX makes a new name durable only through its directory's fsync). Nothing is
    fsynced when ``path`` already exists."""
    path = os.path.abspath(path)
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    for level in reversed(missing):
        try:
            os.mkdir(level)
        except FileExistsError:
            if not os.path.isdir(level):
                raise
        fsync_dir(os.path.dirname(level))


def write_file_durable(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically and durably (tmp file, fsync, rename, fsync dir)."""
    write_file(path, data, fsync=True, atomic=True)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_file(path: str, data: bytes, fsync: bool, atomic: bool) -> None:
    """Write a small file; ``atomic`` makes it appear complete or not at all (tmp + rename)."""
    target = f"{path}.part-{os.getpid()}-{threading.get_ident()}" if atomic else path
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        try:
            write_all(fd, [data])
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        if atomic:
            os.replace(target, path)
    except BaseException:
        if atomic:  # a half-written temporary file (a full disk) must not stay behind
            with contextlib.suppress(OSError):
                os.unlink(target)
        raise


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
            if libc.renameat2_exchange(staging, final):
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
