"""One memory copy of a rank's state: a fully allocated, memory-mapped file under the memory root.

Why a file in a tmpfs (``/dev/shm``): its pages belong to the file system, not to the process, so the copy
survives a crash, ``kill -9`` or a launcher restart of the process (not a reboot or the loss of the node).

Layout of a slot file (little endian)::

    [0, 64)           prefix: magic, state (0 writing / 1 valid), header length and capacity, data offset and
                      length, digest of the header
    [4096, 4096+cap)  header: JSON (job id, world size, owner rank, step, checksum algorithm, records with their
                      chunk digests, each record's description in the engine's wire form, the JSON values)
    [data_off, +len)  data: every record's bytes, 64-byte aligned

The header's digest is always BLAKE2b-64 of its bytes, whatever checksum algorithm the data uses: a flipped
bit in the header (its ``algo`` too) is a digest mismatch, so the copy is skipped like any corrupt one. Every
field is then checked (header.py). Files are opened through roots.py: never a symlink, a FIFO or another
user's file.

Safety: the file is grown with ``posix_fallocate`` (every block reserved) before it is mapped, after a check of
the free space, so a full tmpfs is a named error (MemoryTierFullError) here, never a SIGBUS on a later write.
A file opened for reading is mapped only up to its size and every offset in the prefix is checked against it,
so a truncated copy is a named error too. A save marks the slot "writing" first and "valid" last: a copy
interrupted mid-write is never taken as valid. When it marks a slot "writing" it also notes, at ``INTENT_OFF``
(bytes no reader of the older layout looks at), the step it writes and the newest step then known complete on
every rank: a restart tells "this rank never completed a save" (a first save interrupted) from "lost" by it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import struct
import weakref

import numpy as np

from ..checkpoint import checksums
from ..devices import host_mappings
from . import roots
from .errors import InvalidMemoryCopyError, MemoryRootError, MemoryTierFullError
from .header import check_fields

MAGIC = b"FSDPMEM3"  # 2: headers carry the record descriptions (persist.py); 3: BLAKE2b header digest, durable_id
_PREFIX = struct.Struct("<8sIQQQQQ")  # magic, state, header_len, header_cap, data_off, data_len, header_digest
HEADER_OFF = 4096
INTENT_OFF = 64  # after the prefix, before the header: unused by the single-slot layout
_INTENT = struct.Struct("<8sqq")  # magic, step being written, newest step complete on every rank then (-1: none)
INTENT_MAGIC = b"FSDPMINT"
WRITING, VALID = 0, 1
ALIGN = 64


def aligned(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


def slot_size(header_cap: int, data_len: int) -> int:
    return aligned(HEADER_OFF + header_cap, 4096) + data_len


def free_bytes(root: str) -> int:
    st = os.statvfs(root)
    return st.f_bavail * st.f_frsize


def header_digest(raw: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little")


def parse_header(buf, size: int, where: str) -> tuple[dict, int, int]:
    """(header, data offset, data length) from the first bytes ``buf`` (at least prefix and header) of a slot
    file of ``size`` bytes (mapped, or arriving over a socket: wire.py); InvalidMemoryCopyError unless valid."""
    if size < HEADER_OFF or len(buf) < HEADER_OFF:
        raise InvalidMemoryCopyError(f"memory copy {where} is truncated ({size} bytes)")
    magic, state, hlen, hcap, doff, dlen, digest = _PREFIX.unpack_from(buf, 0)
    if magic != MAGIC:
        raise InvalidMemoryCopyError(f"memory copy {where} is not a memory-tier file")
    if state != VALID:
        raise InvalidMemoryCopyError(f"memory copy {where} was being written (interrupted save)")
    if hlen > hcap or HEADER_OFF + hcap > doff or doff + dlen > size or HEADER_OFF + hlen > len(buf):
        raise InvalidMemoryCopyError(
            f"memory copy {where} is truncated or malformed ({size} bytes, needs {doff + dlen})"
        )
    raw = bytes(buf[HEADER_OFF : HEADER_OFF + hlen])
    if header_digest(raw) != digest:
        raise InvalidMemoryCopyError(f"memory copy {where}: header checksum mismatch")
    try:
        header = json.loads(raw)
    except (ValueError, RecursionError):
        raise InvalidMemoryCopyError(f"memory copy {where} has an unreadable header") from None
    return check_fields(header, dlen, f"memory copy {where}"), doff, dlen


class Slot:
    """A mapped slot file. ``data`` is the writable uint8 view of the data region."""

    allocations = 0  # slot files allocated by this process (tests check that saves reuse their slots)

    def __init__(self, path: str, fd: int, size: int, writable: bool, populate: bool = False):
        self.path = path
        self.size = size
        self._fd = fd
        self.data_off = 0
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        self._mm = mmap.mmap(fd, size, flags, prot) if size else None
        self.buf = np.frombuffer(self._mm, np.uint8) if size else np.zeros(0, np.uint8)
        # closed or dropped, the mapping goes to host_mappings: tensors may view it, and it must never be unmapped
        # inside their deleter
        self._hand_over = weakref.finalize(self, host_mappings.keep_until_unviewed, self._mm) if size else None

    # ------------------------------------------------------------------ creation
    @classmethod
    def allocate(cls, path: str, header_cap: int, data_len: int, quota: int | None = None) -> Slot:
        """Create (or reuse) ``path`` with room for the header and ``data_len`` bytes, every block reserved.
        MemoryTierFullError when the root lacks the space (or ``quota`` is exceeded)."""
        size = slot_size(header_cap, data_len)
        root = os.path.dirname(path)
        if quota is not None and size > quota:
            raise MemoryTierFullError(f"memory copy {path} needs {size} bytes, more than the quota of {quota} bytes")
        dfd = roots.open_dir(root, create=True, private=False)  # the job directory: tightened by RankLock
        try:
            fd = roots.open_file(dfd, os.path.basename(path), os.O_RDWR | os.O_CREAT, f"memory copy {path}")
        except InvalidMemoryCopyError as e:  # a symlink, FIFO or foreign file where the copy goes: never written
            raise MemoryRootError(str(e)) from None
        finally:
            os.close(dfd)
        try:
            have, old_size = os.fstat(fd).st_blocks * 512, os.fstat(fd).st_size
            avail = free_bytes(root)
            if size - have > avail:
                raise MemoryTierFullError(
                    f"memory root {root} has {avail} bytes free, memory copy {path} needs {size - have} more"
                )
            if os.fstat(fd).st_size > size:
                os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)
        except MemoryTierFullError:
            os.close(fd)
            raise
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                try:
                    os.unlink(path)
                except OSError:
                    pass
                raise MemoryTierFullError(f"memory copy {path}: cannot reserve {size} bytes: {e}") from None
            raise
        reused = have >= size and old_size == size
        slot = cls(path, fd, size, writable=True)
        Slot.allocations += 1
        slot.data_off = size - data_len
        if not reused:  # a file of this size keeps its copy: it may hold the step a restart needs
            slot.mark_writing()
        return slot

    @classmethod
    def open(cls, path: str, writable: bool = False, populate: bool = False) -> Slot:
        """Map an existing slot file for reading (its size as it is: checked by ``header``). ``populate``: the
        page tables are filled by the kernel at once (a copy that will be read whole: ~10% faster than a fault
        per 4 KiB page, measured here)."""
        fd = roots.open_file(None, path, os.O_RDWR if writable else os.O_RDONLY, f"memory copy {path}")
        try:
            return cls(path, fd, os.fstat(fd).st_size, writable, populate)
        except BaseException:
            os.close(fd)
            raise

    # ------------------------------------------------------------------ prefix and header
    def mark_writing(self, step: int = -1, common: int = -1) -> None:
        """Invalidate the copy (first of a save); note the ``step`` written and the ``common`` step kept."""
        magic, _state, hlen, hcap, doff, dlen, hd = (MAGIC, 0, 0, 0, 0, 0, 0)
        if self.size >= HEADER_OFF:
            _m, _s, hlen, hcap, doff, dlen, hd = _PREFIX.unpack_from(self._mm, 0)
        _PREFIX.pack_into(self._mm, 0, magic, WRITING, hlen, hcap, doff, dlen, hd)
        if self.size >= HEADER_OFF:
            _INTENT.pack_into(self._mm, INTENT_OFF, INTENT_MAGIC, step, common)

    def intent(self) -> tuple[int, int] | None:
        """(step being written, newest common step then) of a slot marked "writing" by a save; None for a
        valid copy, a file of the single-slot layout or one never written."""
        if self.size < HEADER_OFF or _PREFIX.unpack_from(self._mm, 0)[1] != WRITING:
            return None
        magic, step, common = _INTENT.unpack_from(self._mm, INTENT_OFF)
        return (step, common) if magic == INTENT_MAGIC else None

    def data(self, data_off: int, data_len: int) -> np.ndarray:
        return self.buf[data_off : data_off + data_len]

    def write_header(self, header: dict, data_off: int, data_len: int) -> None:
        """Write the header, then mark the slot valid (the data must be in place)."""
        raw = json.dumps(header, separators=(",", ":")).encode()
        cap = data_off - HEADER_OFF
        if len(raw) > cap:
            raise InvalidMemoryCopyError(f"memory copy {self.path}: header of {len(raw)} bytes exceeds {cap}")
        self.buf[HEADER_OFF : HEADER_OFF + len(raw)] = np.frombuffer(raw, np.uint8)
        digest = header_digest(raw)
        _PREFIX.pack_into(self._mm, 0, MAGIC, WRITING, len(raw), cap, data_off, data_len, digest)
        _PREFIX.pack_into(self._mm, 0, MAGIC, VALID, len(raw), cap, data_off, data_len, digest)

    def header(self) -> tuple[dict, int, int]:
        """(header, data offset, data length) of a valid slot; InvalidMemoryCopyError otherwise."""
        return parse_header(self.buf, self.size, self.path)

    def verify(self, header: dict, data_off: int, data_len: int) -> None:
        """Check every record's chunk digests against the data (InvalidMemoryCopyError on a mismatch)."""
        verify_records(header, self.data(data_off, data_len), f"memory copy {self.path}")

    # ------------------------------------------------------------------ end
    def close(self) -> None:
        self.buf = np.zeros(0, np.uint8)
        if self._hand_over is not None:
            self._mm = None
            self._hand_over()  # unmapped now, or by a later release once no view of it is left
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def unlink(self) -> None:
        self.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def digest_fn(header: dict):
    """The data's chunk hash of a checked header (None: ``none``); InvalidMemoryCopyError when this build lacks it."""
    if header["algo"] == checksums.NONE:
        return None
    try:
        return checksums.digest_function(header["algo"])
    except Exception as e:  # noqa: BLE001 - CheckpointError: xxhash missing here
        raise InvalidMemoryCopyError(str(e)) from None


def verify_records(header: dict, data, where: str) -> None:
    """Check the chunk digests of every record of a checked header against ``data`` (the copy's data region)."""
    fn = digest_fn(header)
    if fn is None:
        return
    for rec in header["records"]:
        check_record_bytes(header, rec, data[rec[3] : rec[3] + rec[4]], where, fn)


def check_record_bytes(header: dict, rec: list, buf, where: str, fn=None) -> None:
    """InvalidMemoryCopyError unless ``buf`` (one record's bytes, wherever they are) matches its chunk digests."""
    fn = fn or digest_fn(header)
    if fn is not None and checksums.chunk_digests(buf, header["chunk"], fn) != rec[5]:
        raise InvalidMemoryCopyError(f"{where}: checksum mismatch in record {rec[0]!r}")
