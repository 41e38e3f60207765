"""Saves through a chunk codec (format/codecs.py): which codec a save uses, and the encoded write of a data file.

Which codec a save uses (``auto``: measured, encoder against storage throughput) is codec_choice.py's.

The encode runs on ``codec_threads`` helper threads (zstd and the plane split release the GIL), chunk by chunk in
file order, a bounded number of chunks ahead of the write, so memory stays ~2 chunks per thread; the calling thread
hands the stored bytes to the backend's ordinary ``write_object`` (O_DIRECT, multipart uploads, stop checks:
unchanged) and builds the chunk table, which goes beside the file as ``<file>.chunks``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from .checksums import DigestFn
from .codec_choice import AUTO, CHOICES
from .cores import helper_threads
from .format.codecs import BYTEPLANE_ZSTD, RAW, TABLE_ROW, WIDTHS, codec_named, table_name
from .format.metadata import itemsize
from .io.storage import Storage

BATCH_BYTES = 8 << 20  # stored bytes handed to the backend per write call


def default_threads() -> int:
    """Encode threads when not chosen: this rank's share of the node's cores but one (cores.py)."""
    return helper_threads()


def _encode_chunk(encode, chunk: memoryview, width: int, digest: DigestFn | None):
    """``(stored bytes, codec id, checksum, width)`` of one chunk (raw, width 1, when encoding does not shrink it;
    planes of 1 byte when the chunk is not a whole number of elements, e.g. an odd ``chunk_bytes``)."""
    if width not in WIDTHS or len(chunk) % width:
        width = 1
    stored = encode(chunk, width)
    if stored is None:
        return chunk, 0, (digest(chunk) if digest is not None else 0), 1
    return stored, 1, (digest(stored) if digest is not None else 0), width


def write_encoded(
    storage: Storage,
    location: str,
    name: str,
    header: bytes,
    pieces: Sequence,
    widths: Sequence[int],
    chunk_bytes: int,
    digest: DigestFn | None,
    codec: str,
    threads: int = 0,
    should_stop: Callable[[], None] | None = None,
) -> tuple[int, list[list[int]]]:
    """Write ``header`` + ``pieces`` (as storage.write_object takes them; ``widths``: each piece's element size)
    as the stored file ``name`` and its chunk table; returns what ``write_object`` would for the raw file: its
    (decoded) size and each piece's chunk checksums, here of the stored chunks."""
    encode = codec_named(codec).encode
    n_threads = max(1, threads or default_threads())
    pool = ThreadPoolExecutor(max_workers=n_threads, thread_name_prefix="ckpt-encode")
    rows: list[tuple] = []
    sums: list[list[int]] = []
    state = {"dpos": 0, "spos": 0}

    def add_row(stored_len: int, dlen: int, cid: int, width: int, s: int) -> None:
        rows.append((state["dpos"], state["spos"], s, dlen, stored_len, cid, width, 0, 0))
        state["dpos"] += dlen
        state["spos"] += stored_len

    def stored_batches():
        batch: list = []
        size = 0
        for c in range(0, len(header), chunk_bytes):  # the header: raw rows, so the decoded file is whole
            part = memoryview(header)[c : c + chunk_bytes]
            add_row(len(part), len(part), 0, 1, digest(part) if digest is not None else 0)
            batch.append(np.frombuffer(part, np.uint8))
            size += len(part)
        ahead = 2 * n_threads + 2
        for arr, width in zip(pieces, widths):
            owner = None
            if callable(arr):
                arr, owner = arr()
            mv = memoryview(arr).cast("B")
            piece_sums: list[int] = []
            for dlen, stored, cid, s, w in _encoded(pool, encode, mv, width, chunk_bytes, digest, ahead):
                add_row(len(stored), dlen, cid, w, s)
                piece_sums.append(s)
                batch.append(np.frombuffer(stored, np.uint8))
                size += len(stored)
                if size >= BATCH_BYTES:
                    yield _joined(batch)
                    batch, size = [], 0
            sums.append(piece_sums)
            if batch:  # the piece's memory is released once its stored bytes are handed on
                yield _joined(batch)
                batch, size = [], 0
            del arr, owner, mv
        if batch:
            yield _joined(batch)

    try:
        storage.write_object(location, name, b"", _Once(stored_batches()), chunk_bytes, None, should_stop=should_stop)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
    table = np.array(rows, dtype=TABLE_ROW) if rows else np.zeros(0, TABLE_ROW)
    storage.put(location, table_name(name), table.tobytes())
    return state["dpos"], sums


def write_data_object(
    job, name: str, layout, digest: DigestFn | None, storage: Storage | None = None
) -> tuple[int, list[list[int]]]:
    """The data object ``name`` of a save (``job``: its save.commit.SaveJob; ``layout``: its planner.FileLayout):
    the backend's raw ``write_object``, or a stored file and its chunk table when the job's codec is not raw.
    ``storage``: the job's backend as it is to be written through (codec_choice.MeteredStorage: timed)."""
    storage = job.storage if storage is None else storage
    if job.codec == RAW:
        return storage.write_object(
            job.staging, name, layout.header, job.arrays, job.chunk_bytes, digest, should_stop=job._peer_failure
        )
    widths = [itemsize(job.plan.tensors[k].dtype) for k, _p in layout.pieces]
    return write_encoded(
        storage,
        job.staging,
        name,
        layout.header,
        job.arrays,
        widths,
        job.chunk_bytes,
        digest,
        job.codec,
        job.options.codec_threads,
        job._peer_failure,
    )


def _encoded(pool, encode, mv: memoryview, width: int, chunk_bytes: int, digest, ahead: int):
    """``(decoded length, stored bytes, codec id, checksum, width)`` of each chunk of ``mv`` in order, encoded on
    ``pool`` at most ``ahead`` chunks ahead of the consumer."""
    inflight: deque = deque()
    for c in range(0, len(mv), chunk_bytes):
        chunk = mv[c : c + chunk_bytes]
        inflight.append((len(chunk), pool.submit(_encode_chunk, encode, chunk, width, digest)))
        if len(inflight) >= ahead:
            dlen, fut = inflight.popleft()
            yield (dlen, *fut.result())
    while inflight:
        dlen, fut = inflight.popleft()
        yield (dlen, *fut.result())


def _joined(batch: list) -> np.ndarray:
    return batch[0] if len(batch) == 1 else np.concatenate(batch)


class _Once:
    """An iterable over a generator that a backend iterates once (``for arr in pieces``)."""

    def __init__(self, gen):
        self.gen = gen

    def __iter__(self):
        return self.gen


__all__ = [
    "AUTO",
    "BYTEPLANE_ZSTD",
    "CHOICES",
    "RAW",
    "default_threads",
    "write_data_object",
    "write_encoded",
]
