"""Chunk checksums of checkpoint data: which algorithm a checkpoint uses, and computing it.

Every piece's bytes are checksummed per ``chunk_bytes`` chunk (see metadata.py). The algorithm is recorded in
``metadata.json`` (``"checksum"``), so readers dispatch on it:

* ``xxh3-64`` (default for writing): XXH3, 64-bit, from the ``xxhash`` package. It detects corruption (it is not
  a cryptographic hash, and need not be) at ~30 GB/s per core here, against ~4 GB/s for zlib's CRC-32, which made
  checksumming about a third of the CPU time of a save on 2 cores.
* ``crc32``: zlib's CRC-32. Checkpoints written before xxh3-64 use it; they stay readable without ``xxhash``.
  It is written only when ``xxhash`` cannot be imported (logged once) or when chosen with
  ``CheckpointOptions(checksum="crc32")`` (``PADDLE_FSDP_CKPT_CHECKSUM=crc32``).
* ``none``: nothing to verify (sizes, metadata hash and COMMIT are still checked).

Both hash functions release the GIL, so helper threads can checksum while the calling thread reads or writes.
"""

from __future__ import annotations

import logging
import zlib
from typing import Callable, Protocol

from .errors import CheckpointError
from .format.algorithms import CRC32, KNOWN, NONE, XXH3_64  # noqa: F401 - the names, re-exported

logger = logging.getLogger(__name__)


DigestFn = Callable[[memoryview], int]


class RunningDigest(Protocol):
    """The digest of bytes fed in pieces: equal to the one-shot digest of their concatenation."""

    def update(self, data: memoryview) -> None: ...

    def intdigest(self) -> int: ...


class _RunningCrc32:
    __slots__ = ("value",)

    def __init__(self):
        self.value = 0

    def update(self, data: memoryview) -> None:
        self.value = zlib.crc32(data, self.value)

    def intdigest(self) -> int:
        return self.value


_FUNCS: dict[str, DigestFn] = {CRC32: zlib.crc32}
_RUNNING: dict[DigestFn, Callable[[], RunningDigest]] = {zlib.crc32: _RunningCrc32}  # by one-shot function
try:
    import xxhash

    _FUNCS[XXH3_64] = xxhash.xxh3_64_intdigest
    _RUNNING[xxhash.xxh3_64_intdigest] = xxhash.xxh3_64
except ImportError:  # pragma: no cover - xxhash is a dependency of the package; see default_algorithm
    xxhash = None

_warned_fallback = False


def default_algorithm(chosen: str | None = None) -> str:
    """Algorithm for new checkpoints: ``chosen`` (CheckpointOptions.checksum) if set, else xxh3-64 (crc32
    without xxhash)."""
    global _warned_fallback
    if chosen:
        if chosen not in KNOWN:
            raise CheckpointError(f"checksum {chosen!r}: expected one of {', '.join(KNOWN)}")
        if chosen != NONE:
            digest_function(chosen)  # refuse xxh3-64 without xxhash here, not after the data was written
        return chosen
    if XXH3_64 in _FUNCS:
        return XXH3_64
    if not _warned_fallback:
        _warned_fallback = True
        logger.warning(
            "the xxhash package is missing: checkpoints are checksummed with the slower CRC-32 (pip install xxhash)"
        )
    return CRC32


def digest_function(algorithm: str) -> DigestFn:
    """The per-chunk hash of ``algorithm``; a clear error when it is unknown or its module is not installed."""
    fn = _FUNCS.get(algorithm)
    if fn is not None:
        return fn
    if algorithm == XXH3_64:
        raise CheckpointError(
            "this checkpoint's checksums are xxh3-64, which needs the xxhash package (pip install xxhash); "
            "or load with verify_checksums=False"
        )
    raise CheckpointError(f"unknown checksum algorithm {algorithm!r} (this build knows {', '.join(KNOWN)})")


def running_digest(fn: DigestFn) -> Callable[[], RunningDigest]:
    """The factory of running digests that equal the one-shot ``fn`` (a function of ``digest_function``), for
    chunks hashed in cache-sized steps (ChunkDigests)."""
    running = _RUNNING.get(fn)
    if running is None:
        raise CheckpointError(f"no running form of the digest function {fn!r}")
    return running


class ChunkDigests:
    """The digest of every ``chunk_bytes`` chunk of a piece of ``nbytes`` bytes whose bytes arrive in order in any
    steps, from ``pos`` (a chunk boundary) on: a chunk inside one step is hashed in one shot, one split across
    steps with a running digest. ``feed`` returns ``[(chunk index, digest)]`` of the chunks it completed. Used
    while bytes are in the CPU cache: right after a read (reader.ChunkStream) or a copy (direct_write.py)."""

    def __init__(self, fn: DigestFn, chunk_bytes: int, nbytes: int, pos: int = 0):
        self.fn, self.chunk, self.nbytes, self.pos = fn, chunk_bytes, nbytes, pos
        self.running = running_digest(fn)
        self.state: RunningDigest | None = None

    def feed(self, mv: memoryview) -> list[tuple[int, int]]:
        done = []
        i = 0
        while i < len(mv):
            ci = self.pos // self.chunk
            chunk_end = min((ci + 1) * self.chunk, self.nbytes)
            take = min(len(mv) - i, chunk_end - self.pos)
            if self.state is None and self.pos + take == chunk_end:  # the whole chunk in this step: one shot
                done.append((ci, self.fn(mv[i : i + take])))
            else:
                if self.state is None:
                    self.state = self.running()
                self.state.update(mv[i : i + take])
                if self.pos + take == chunk_end:
                    done.append((ci, self.state.intdigest()))
                    self.state = None
            i += take
            self.pos += take
        return done


def chunk_digests(buf, chunk_bytes: int, fn: DigestFn) -> list[int]:
    """Digest of every ``chunk_bytes`` chunk of ``buf`` (the last one may be shorter)."""
    mv = memoryview(buf).cast("B")
    return [fn(mv[j : j + chunk_bytes]) for j in range(0, len(mv), chunk_bytes)]
