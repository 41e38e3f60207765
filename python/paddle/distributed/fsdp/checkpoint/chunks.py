"""Chunk checksum checks of bytes read from a checkpoint: at once (``verify_chunks``), fed in steps while the
bytes are in the CPU cache (``ChunkStream``), or queued on helper threads while later bytes are read
(``ChunkVerifier``). Why its own module: every reader (ranges.py, regions.py, streamed.py, load/inplace.py) checks
chunks the same way, whatever storage the bytes came from."""

from __future__ import annotations

from . import checksums
from .errors import CorruptCheckpointError
from .format.metadata import PieceMeta
from .reader import DEFAULT_CHECKSUM_THREADS, FileSet
from .thread_pools import shared_pool


def _checksum_pool(threads: int):
    """Shared thread pool that verifies the chunks of one slab while the next one is read (None: inline)."""
    return shared_pool("checksum", threads) if threads > 0 else None


def verify_chunks(files: FileSet, key: str, piece: PieceMeta, buf, pos: int, chunk_bytes: int) -> None:
    """Check the checksum of every chunk of ``buf``, which holds piece bytes [pos, pos+len) (pos chunk-aligned).
    Bytes of a stored file were checked against their stored checksums as they were decoded (decoded_read.py)."""
    if files.decodes(piece.file):
        return
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
        self.decoded = files.decodes(piece.file)  # checked as decoded (decoded_read.py)
        self.digests = checksums.ChunkDigests(files.digest, chunk_bytes, piece.nbytes, pos)

    def feed(self, mv: memoryview) -> None:
        """Hash ``mv``, the piece bytes from the last fed one on (CorruptCheckpointError on a mismatch)."""
        if self.decoded:
            return
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
        if self.pool is None or files.decodes(piece.file):
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
