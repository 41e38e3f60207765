"""Streamed reads (checkpoint/streamed.py) and the page-cache path of ranges.read_range_direct: seeded random
ranges (chunk-aligned or not, whole pieces, ranges ending at a piece's end, pieces at unaligned file offsets) of
random files read through rings of every size, with O_DIRECT and buffered, against the file's bytes; a flipped
byte anywhere in a chunk a range touches is found; the reader thread stops on every error."""

from __future__ import annotations

import os
import threading
import zlib

import numpy as np
import paddle.distributed.fsdp.checkpoint as ck
import pytest
import xxhash
from paddle.distributed.fsdp.checkpoint import checksums, ranges, reader, streamed
from paddle.distributed.fsdp.checkpoint.format.metadata import PieceMeta
from paddle.distributed.fsdp.checkpoint.read_ops import RangeRead

KIB = 1 << 10
ALGORITHMS = {checksums.XXH3_64: xxhash.xxh3_64_intdigest, checksums.CRC32: zlib.crc32}


def _checkpoint_file(tmp_path, rng, chunk: int, algorithm: str):
    """A file of random bytes holding 1-4 pieces at unaligned offsets, with their chunk checksums."""
    fn = ALGORITHMS[algorithm]
    offset = int(rng.integers(0, 9000))
    pieces = []
    for i in range(int(rng.integers(1, 5))):
        nbytes = int(rng.integers(1, 12)) * chunk + int(rng.integers(0, chunk))
        pieces.append(PieceMeta("f", f"p{i}", offset, nbytes, (0,), (nbytes,), None))
        offset += nbytes + int(rng.integers(0, 3)) * int(rng.integers(1, 5000))
    data = rng.integers(0, 256, offset + int(rng.integers(0, 3000)), dtype=np.uint8)
    for p in pieces:
        raw = data[p.offset : p.offset + p.nbytes]
        p.checksums = [fn(raw[j : j + chunk]) for j in range(0, p.nbytes, chunk)]
    (tmp_path / "f").write_bytes(data.tobytes())
    return data, pieces


def _files(tmp_path, size: int, algorithm: str, odirect) -> reader.FileSet:
    return reader.FileSet(
        str(tmp_path),
        {"f": size},
        None,
        ALGORITHMS[algorithm],
        odirect=odirect,
    )


def _random_ranges(rng, pieces, chunk: int) -> list:
    """Per piece 1-2 disjoint ranges: whole piece, chunk-aligned, unaligned, ending at the piece's end."""
    out = []
    for p in pieces:
        kind = int(rng.integers(0, 4))
        if kind == 0:
            out.append((p, 0, p.nbytes))
        elif kind == 1 and p.nbytes > 2 * chunk:
            a = int(rng.integers(0, p.nbytes // chunk)) * chunk
            out.append((p, a, p.nbytes))
        else:
            cut = sorted(int(x) for x in rng.integers(0, p.nbytes + 1, 3))
            if cut[1] > cut[0]:
                out.append((p, cut[0], cut[1]))
            if cut[2] > cut[1] + 1 and kind == 3:
                out.append((p, cut[1] + 1, cut[2]))
    return out


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("odirect", [False, True], ids=["buffered", "odirect"])
def test_stream_ranges_delivers_the_file_bytes_of_random_ranges(tmp_path, seed, odirect):
    rng = np.random.default_rng(seed)
    chunk = int(rng.choice([4 * KIB, 64 * KIB, 100_000]))
    algorithm = [checksums.XXH3_64, checksums.CRC32][seed % 2]
    data, pieces = _checkpoint_file(tmp_path, rng, chunk, algorithm)
    ring = int(rng.choice([16 * KIB, 100 * KIB, 1 << 20, 64 << 20]))
    ranges = _random_ranges(rng, pieces, chunk)
    outs = [np.full(b - a, 0xEE, np.uint8) for _p, a, b in ranges]
    files = _files(tmp_path, len(data), algorithm, odirect)
    try:
        streamed.stream_ranges(
            files, [RangeRead(p.name, p, a, b, o) for (p, a, b), o in zip(ranges, outs)], chunk, True, ring
        )
    finally:
        files.close()
    for (p, a, b), o in zip(ranges, outs):
        assert np.array_equal(o, data[p.offset + a : p.offset + b]), (p.name, a, b)


@pytest.mark.parametrize("seed", range(10))
def test_a_flipped_byte_in_any_chunk_a_range_touches_is_found(tmp_path, seed):
    """Also a byte outside the range itself, in the part of its first or last chunk that is not copied."""
    rng = np.random.default_rng(100 + seed)
    chunk = 64 * KIB
    data, pieces = _checkpoint_file(tmp_path, rng, chunk, checksums.XXH3_64)
    p = max(pieces, key=lambda q: q.nbytes)
    a = int(rng.integers(0, p.nbytes // 2))
    b = int(rng.integers(a + 1, p.nbytes + 1))
    first, last = (a // chunk) * chunk, min(-(-b // chunk) * chunk, p.nbytes) - 1
    where = int(rng.choice([first, last, int(rng.integers(first, last + 1))]))
    bad = data.copy()
    bad[p.offset + where] ^= 0x10
    (tmp_path / "f").write_bytes(bad.tobytes())
    threads = threading.active_count()
    files = _files(tmp_path, len(data), checksums.XXH3_64, seed % 2 == 0)
    try:
        with pytest.raises(ck.CorruptCheckpointError, match=f"chunk {where // chunk},"):
            streamed.stream_ranges(
                files, [RangeRead(p.name, p, a, b, np.empty(b - a, np.uint8))], chunk, True, 256 * KIB
            )
        # unverified reads deliver the (damaged) bytes as they are
        out = np.empty(b - a, np.uint8)
        streamed.stream_ranges(files, [RangeRead(p.name, p, a, b, out)], chunk, False, 256 * KIB)
        assert np.array_equal(out, bad[p.offset + a : p.offset + b])
    finally:
        files.close()
    assert threading.active_count() == threads  # the reader thread stopped


def test_a_short_file_is_corrupt_and_the_reader_thread_stops(tmp_path):
    rng = np.random.default_rng(7)
    data, pieces = _checkpoint_file(tmp_path, rng, 64 * KIB, checksums.XXH3_64)
    p = pieces[-1]
    files = _files(tmp_path, len(data), checksums.XXH3_64, True)
    files.fd("f")  # size checked against the metadata while intact, as a load does
    with open(tmp_path / "f", "r+b") as f:
        f.truncate(p.offset + p.nbytes // 2)
    threads = threading.active_count()
    try:
        with pytest.raises(ck.CorruptCheckpointError, match="ends at byte"):
            streamed.stream_ranges(
                files, [RangeRead(p.name, p, 0, p.nbytes, np.empty(p.nbytes, np.uint8))], 64 * KIB, True, 128 * KIB
            )
    finally:
        files.close()
    assert threading.active_count() == threads


def test_an_error_while_copying_stops_the_reader_thread(tmp_path):
    """The calling thread fails (here: a target of the wrong size): the reader thread ends before the call
    returns, so no thread reads a file or fills a buffer after it."""
    rng = np.random.default_rng(8)
    data, pieces = _checkpoint_file(tmp_path, rng, 4 * KIB, checksums.CRC32)
    p = pieces[0]
    threads = threading.active_count()
    files = _files(tmp_path, len(data), checksums.CRC32, False)
    try:
        with pytest.raises(ValueError):
            streamed.stream_ranges(
                files, [RangeRead(p.name, p, 0, p.nbytes, np.empty(3, np.uint8))], 4 * KIB, True, 16 * KIB
            )
    finally:
        files.close()
    assert threading.active_count() == threads


@pytest.mark.parametrize("seed", range(6))
def test_page_cache_reads_check_each_chunk_in_cache_sized_steps(tmp_path, seed, monkeypatch):
    """Files in the page cache: read_range_direct reads CACHE_STEP at a time into the target with a running
    digest per chunk; the bytes are the file's and a flipped byte is found in its chunk."""
    rng = np.random.default_rng(200 + seed)
    chunk = int(rng.choice([reader.CACHE_STEP // 2, 3 * reader.CACHE_STEP + 5, 1 << 20]))
    algorithm = [checksums.XXH3_64, checksums.CRC32][seed % 2]
    data, pieces = _checkpoint_file(tmp_path, rng, chunk, algorithm)
    monkeypatch.setattr(reader.FileSet, "mostly_cached", lambda self, name: True)
    files = _files(tmp_path, len(data), algorithm, "auto")
    try:
        for p, a, b in _random_ranges(rng, pieces, chunk):
            out = np.empty(b - a, np.uint8)
            ranges.read_range_direct(files, p.name, p, a, b, out, chunk, True)
            assert np.array_equal(out, data[p.offset + a : p.offset + b])
    finally:
        files.close()
    p = max(pieces, key=lambda q: q.nbytes)
    where = int(rng.integers(0, p.nbytes))
    bad = data.copy()
    bad[p.offset + where] ^= 1
    (tmp_path / "f").write_bytes(bad.tobytes())
    files = _files(tmp_path, len(data), algorithm, "auto")
    try:
        with pytest.raises(ck.CorruptCheckpointError, match=f"chunk {where // chunk},"):
            ranges.read_range_direct(files, p.name, p, 0, p.nbytes, np.empty(p.nbytes, np.uint8), chunk, True)
    finally:
        files.close()


def test_streamed_loads_of_uncached_files_go_around_the_page_cache(tmp_path):
    """A load of files that are not in the page cache (evicted after the save's fsync) reads them with O_DIRECT
    where the file system allows it, so they stay out of the page cache; values equal the saved ones."""
    import paddle

    paddle.seed(3)
    sd = {f"w{i}": paddle.rand([257 + i, 1031]) for i in range(4)}
    path = tmp_path / "ckpt"
    ck.save_state_dict(sd, str(path), chunk_bytes=64 * KIB)
    data = [p for p in path.iterdir() if p.name.endswith(".safetensors")]
    for p in data:
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    try:
        os.close(os.open(data[0], os.O_RDONLY | os.O_DIRECT))
        direct = True
    except OSError:
        direct = False
    targets = {k: paddle.zeros(v.shape) for k, v in sd.items()}
    ck.load_state_dict(targets, str(path))
    for k, v in sd.items():
        assert np.array_equal(targets[k].numpy(), v.numpy()), k
    from paddle.distributed.fsdp.checkpoint import libc

    for p in data:
        fd = os.open(p, os.O_RDONLY)
        frac = libc.page_cache_fraction(fd, os.path.getsize(p))
        os.close(fd)
        if direct and frac is not None:
            assert frac < 0.5, (p.name, frac)
