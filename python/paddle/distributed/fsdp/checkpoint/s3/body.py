"""Request bodies made of memoryview slices: a part of an upload is sent straight from the caller's buffers.

Why: a multipart upload of a rank's pieces must not copy them into part-sized staging buffers (memory bounded by
part size x concurrency at worst, nothing at best). A part is a list of slices of the pieces; ``ChainBody`` is the
file-like object botocore sends from (it reads, seeks back for a retry, and asks the length), and ``part_checksum``
computes the part's checksum over the slices in place (``S3Options.part_checksum``: CRC32 or SHA-256, as the store
names them, base64 of the big-endian digest).
"""

from __future__ import annotations

import base64
import hashlib
import io
import zlib
from collections.abc import Sequence

from .errors import S3ConfigError


def as_views(pieces: Sequence[object]) -> list[memoryview]:
    """Byte views of bytes-like pieces (C-contiguous buffers: bytes, bytearray, memoryview, numpy arrays)."""
    if isinstance(pieces, (bytes, bytearray, memoryview)):
        pieces = [pieces]
    views = []
    for i, p in enumerate(pieces):
        try:
            v = memoryview(p)
        except TypeError as exc:
            raise S3ConfigError(f"piece {i} is not a bytes-like object ({type(p).__name__})") from exc
        if not v.c_contiguous:
            raise S3ConfigError(f"piece {i} is not C-contiguous")
        views.append(v.cast("B") if v.format != "B" or v.ndim != 1 else v)
    return views


def split_parts(views: list[memoryview], part_size: int) -> list[list[memoryview]]:
    """Consecutive parts of ``part_size`` bytes (the last may be shorter), each a list of slices."""
    parts: list[list[memoryview]] = [[]]
    room = part_size
    for v in views:
        off = 0
        while off < len(v):
            if room == 0:
                parts.append([])
                room = part_size
            n = min(room, len(v) - off)
            parts[-1].append(v[off : off + n])
            off += n
            room -= n
    return parts


def sha256_b64(slices: Sequence[memoryview]) -> str:
    h = hashlib.sha256()
    for s in slices:
        h.update(s)
    return base64.b64encode(h.digest()).decode()


def crc32_b64(slices: Sequence[memoryview]) -> str:
    value = 0
    for s in slices:
        value = zlib.crc32(s, value)
    return base64.b64encode(value.to_bytes(4, "big")).decode()


# S3Options.part_checksum -> (the store's algorithm name, the request/response field, the function)
PART_CHECKSUMS = {"crc32": ("CRC32", "ChecksumCRC32", crc32_b64), "sha256": ("SHA256", "ChecksumSHA256", sha256_b64)}


def part_checksum(algorithm: str, slices: Sequence[memoryview]) -> tuple[str, str]:
    """(field name, base64 value) of the checksum of ``slices`` that a request carries and the store verifies."""
    _, field, fn = PART_CHECKSUMS[algorithm]
    return field, fn(slices)


class ChainBody(io.RawIOBase):
    """A seekable, read-only file over a list of memoryview slices (no copy until ``read`` hands out bytes)."""

    def __init__(self, slices: Sequence[memoryview]) -> None:
        super().__init__()
        self._slices = list(slices)
        self._size = sum(len(s) for s in self._slices)
        self._pos = 0

    def __len__(self) -> int:
        return self._size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = min(max(0, base + offset), self._size)
        return self._pos

    def readinto(self, buf) -> int:
        out = memoryview(buf).cast("B")
        done, pos = 0, self._pos
        start = 0
        for s in self._slices:
            end = start + len(s)
            if pos < end and done < len(out):
                n = min(end - pos, len(out) - done)
                out[done : done + n] = s[pos - start : pos - start + n]
                done += n
                pos += n
            start = end
            if done == len(out):
                break
        self._pos = pos
        return done
