"""Tests of the checkpoint engine's fast I/O paths (single process).

* load of large ranges: span reads into one staging buffer (buffered, and O_DIRECT when enabled), checksums
  verified on helper threads before the status exchange; a mismatch anywhere leaves every target untouched;
* the per-process host arena: async-save snapshots reuse it, a load borrows it, ``release_host_buffers``;
* write_rank_file keeps the owner of a lazily produced piece alive until its bytes are written and checksummed.
All value comparisons are on raw bytes.
"""

from __future__ import annotations

import ctypes
import zlib

import numpy as np
import paddle
import paddle.distributed.fsdp.checkpoint as ck
import pytest
import xxhash
from crafted import metadata_json
from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight
from paddle.distributed.fsdp.checkpoint import chunks, host_memory, libc, ranges, reader, writer
from paddle.distributed.fsdp.checkpoint.load import atomic as load_atomic

MIB = 1 << 20


def bits(t) -> np.ndarray:
    return np.ascontiguousarray(t.numpy()).view(np.uint8).ravel().copy()


def flat_sw(key, local, shape, start, stop):
    return ShardedWeight(
        key, local, list(shape), list(shape), [0] * len(shape), is_flattened=True, flattened_range=slice(start, stop)
    )


def big_state(seed: int = 3) -> dict:
    """Tensors of several checksum chunks (span path), one small (staged path) and a flat shard."""
    paddle.seed(seed)
    return {
        "a": paddle.rand([3 * MIB // 4 + 17]),  # ~3 MiB, not a whole number of chunks
        "b": paddle.rand([1024, 1200]),  # ~4.7 MiB
        "small": paddle.rand([5, 7]),
        "flat": flat_sw("flat", paddle.rand([MIB]), (1024, 1024), 0, MIB),
        "step": 3,
    }


def zero_targets() -> dict:
    return {
        "a": paddle.zeros([3 * MIB // 4 + 17]),
        "b": paddle.zeros([1024, 1200]),
        "small": paddle.zeros([5, 7]),
        # a flat shard that starts and ends inside checksum chunks
        "flat": flat_sw("flat", paddle.zeros([MIB // 2]), (1024, 1024), MIB // 8 + 3, MIB // 8 + 3 + MIB // 2),
        "step": None,
    }


def want_bits(sd: dict, key: str) -> np.ndarray:
    if key == "flat":
        return sd["flat"].local_tensor.numpy()[MIB // 8 + 3 : MIB // 8 + 3 + MIB // 2].view(np.uint8).ravel()
    return bits(sd[key])


def tensor_bits(t) -> np.ndarray:
    return bits(t.local_tensor if isinstance(t, ShardedWeight) else t)


@pytest.fixture(params=["buffered", "odirect"])
def io_mode(request) -> ck.CheckpointOptions:
    """Options for the loads of a test: span reads buffered, or with O_DIRECT where the file system allows it."""
    return ck.CheckpointOptions(odirect=request.param == "odirect")


@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "bounded"])
def test_span_load_is_exact(tmp_path, io_mode, atomic):
    sd = big_state()
    ck.save_state_dict(sd, str(tmp_path / "c"))
    t = zero_targets()
    rep = ck.load_state_dict(t, str(tmp_path / "c"), atomic=atomic, options=io_mode)
    for k in ("a", "b", "small", "flat"):
        assert np.array_equal(tensor_bits(t[k]), want_bits(sd, k)), k
    assert t["step"] == 3 and sorted(rep.loaded_keys) == sorted(t)


@pytest.mark.parametrize("where", ["a", "b", "flat", "small"])
def test_checksum_mismatch_anywhere_leaves_every_target_untouched_when_atomic(tmp_path, io_mode, where):
    sd = big_state()
    path = tmp_path / "c"
    ck.save_state_dict(sd, str(path))
    md = metadata_json(path)
    piece = md["tensors"][where]["pieces"][0]
    # a byte inside the last chunk of the piece (for "flat": a chunk the target's range touches)
    off = piece["offset"] + ((MIB // 8 + 3) * 4 + 100 if where == "flat" else piece["nbytes"] - 5)
    with open(path / piece["file"], "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x10]))
    t = zero_targets()
    before = {k: tensor_bits(v) for k, v in t.items() if k != "step"}
    with pytest.raises(ck.CorruptCheckpointError, match="checksum mismatch"):
        ck.load_state_dict(t, str(path), atomic=True, options=io_mode)
    for k, v in before.items():
        assert np.array_equal(tensor_bits(t[k]), v), f"{k} changed by a failed load"
    assert t["step"] is None
    # the default (memory-bounded) load says the targets were written in part
    with pytest.raises(ck.PartiallyLoadedError, match="checksum mismatch"):
        ck.load_state_dict(t, str(path))
    assert t["step"] is None
    # without verification the damaged byte is loaded (the check is what caught it)
    ck.load_state_dict(t, str(path), verify_checksums=False, options=io_mode)
    got = tensor_bits(t[where])
    assert int((got != want_bits(sd, where)).sum()) == 1


def test_failure_on_another_key_after_large_reads_changes_nothing(tmp_path, monkeypatch):
    """A failure after the spans were read (here: a missing data file for a staged key) must not commit them."""
    sd = big_state()
    path = tmp_path / "c"
    ck.save_state_dict(sd, str(path))
    real = ranges.read_spans

    def spans_then_fail(*a, **k):
        real(*a, **k)
        raise ck.CorruptCheckpointError("injected after the span reads")

    monkeypatch.setattr(load_atomic, "read_spans", spans_then_fail)
    t = zero_targets()
    with pytest.raises(ck.CorruptCheckpointError, match="injected"):
        ck.load_state_dict(t, str(path), atomic=True)
    assert all(not tensor_bits(t[k]).any() for k in ("a", "b", "small", "flat"))


def test_load_full_state_dict_verifies_before_returning(tmp_path):
    sd = big_state()
    path = tmp_path / "c"
    ck.save_state_dict(sd, str(path))
    full = ck.load_full_state_dict(str(path), keys=["a", "b"])
    assert np.array_equal(bits(full["a"]), bits(sd["a"])) and np.array_equal(bits(full["b"]), bits(sd["b"]))
    md = metadata_json(path)
    piece = md["tensors"]["b"]["pieces"][0]
    with open(path / piece["file"], "r+b") as f:
        f.seek(piece["offset"] + 2 * MIB + 1)
        b = f.read(1)
        f.seek(piece["offset"] + 2 * MIB + 1)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(ck.CorruptCheckpointError, match="checksum mismatch.*'b'"):
        ck.load_full_state_dict(str(path), keys=["b"])


@pytest.mark.host_memory_path
def test_async_snapshots_reuse_one_arena_and_an_atomic_load_borrows_it(tmp_path, monkeypatch):
    ck.release_host_buffers()
    allocs = []
    real_alloc = host_memory.alloc_host
    monkeypatch.setattr(host_memory, "alloc_host", lambda n, **kw: allocs.append(n) or real_alloc(n, **kw))
    sd = big_state()
    ck.save_state_dict(sd, str(tmp_path / "s1"), async_save=True).wait()
    assert len(allocs) == 1 and host_memory.arena.capacity >= allocs[0]
    buf_id = id(host_memory.arena._buf)
    # the snapshot is taken at call time: a change right after the call is not saved
    want_a = bits(sd["a"])
    h = ck.save_state_dict(sd, str(tmp_path / "s2"), async_save=True)
    sd["a"].fill_(7.0)
    h.wait()
    assert len(allocs) == 1 and id(host_memory.arena._buf) == buf_id, "the second async save allocated again"
    t = zero_targets()
    ck.load_state_dict(t, str(tmp_path / "s2"), atomic=True)
    assert len(allocs) == 1, "the load did not borrow the arena"
    assert np.array_equal(tensor_bits(t["a"]), want_a)
    assert np.array_equal(tensor_bits(t["b"]), bits(sd["b"]))
    # busy arena: fresh memory instead (the arena is never shared)
    held = host_memory.arena.acquire(1, grow=False)
    assert held is not None
    try:
        t2 = zero_targets()
        ck.load_state_dict(t2, str(tmp_path / "s2"), atomic=True)
        assert len(allocs) == 2 and np.array_equal(tensor_bits(t2["b"]), bits(sd["b"]))
        assert ck.release_host_buffers() is False
    finally:
        host_memory.arena.release()
    assert ck.release_host_buffers() is True and host_memory.arena.capacity == 0
    # a memory-bounded load (the default) needs no staging at all: it reads straight into the targets
    ck.load_state_dict(zero_targets(), str(tmp_path / "s2"))
    assert host_memory.arena.capacity == 0 and len(allocs) == 2
    # without an arena a load uses fresh memory and does not keep it
    ck.load_state_dict(zero_targets(), str(tmp_path / "s2"), atomic=True)
    assert host_memory.arena.capacity == 0


def test_failed_async_save_gives_the_arena_back(tmp_path, monkeypatch):
    ck.release_host_buffers()
    monkeypatch.setattr(writer, "write_rank_file", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "full")))
    h = ck.save_state_dict(big_state(), str(tmp_path / "s"), async_save=True)
    with pytest.raises(ck.SaveFailedError, match="rank 0 failed: OSError"):
        h.wait()
    assert not host_memory.arena._busy
    assert ck.release_host_buffers() is True


class _Owner:
    """Owner of a piece's memory; when dropped it scribbles over it (as a freed host copy may be reused)."""

    def __init__(self, data: np.ndarray):
        self.data = data

    def __del__(self):
        self.data[:] = 0xEE


def test_write_rank_file_keeps_lazy_owners_alive_until_written_and_checksummed(tmp_path):
    rng = np.random.default_rng(0)
    sources = [rng.integers(0, 255, n, dtype=np.uint8) for n in (3 * MIB + 5, 100, 2 * MIB, 70 * MIB + 1)]

    def piece(src):
        def make():
            data = src.copy()
            # a view that does not keep ``data`` alive (like the raw pointer view of a tensor's host copy):
            # only the returned owner does, and nothing else holds the owner
            arr = np.frombuffer((ctypes.c_ubyte * len(data)).from_address(data.ctypes.data), np.uint8)
            return arr, _Owner(data)

        return make

    header = b"\x00" * 8
    path = tmp_path / "f"
    size, sums = writer.write_rank_file(str(path), header, [piece(s) for s in sources], MIB, xxhash.xxh3_64_intdigest)
    data = path.read_bytes()
    assert size == len(data) == 8 + sum(len(s) for s in sources)
    pos = 8
    for src, piece_sums in zip(sources, sums):
        assert data[pos : pos + len(src)] == src.tobytes()
        assert piece_sums == [xxhash.xxh3_64_intdigest(src[i : i + MIB]) for i in range(0, len(src), MIB)]
        pos += len(src)


class _Recorder:
    """A ChunkVerifier stand-in that records which chunks of which piece were checked (and checks them)."""

    def __init__(self):
        self.seen: dict[str, list[int]] = {}

    def check(self, files, key, piece, buf, pos, chunk_bytes):
        assert pos % chunk_bytes == 0 and len(buf) % chunk_bytes in (0, (piece.nbytes - pos) % chunk_bytes)
        chunks.verify_chunks(files, key, piece, buf, pos, chunk_bytes)
        self.seen.setdefault(key, []).extend(range(pos // chunk_bytes, -(-(pos + len(buf)) // chunk_bytes)))


def test_auto_odirect_reads_cached_files_buffered_and_uncached_files_direct(tmp_path):
    """mincore decides (odirect="auto", the default): a file in the page cache is read buffered, one that is not
    with O_DIRECT (where the file system accepts it)."""
    import os

    data = np.random.default_rng(2).integers(0, 255, 8 * MIB, dtype=np.uint8)
    f = tmp_path / "f"
    f.write_bytes(data.tobytes())
    fd = os.open(f, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.read(fd, len(data))  # in the page cache now
        assert libc.page_cache_fraction(fd, len(data)) > 0.9
        files = reader.FileSet(str(tmp_path), {"f": len(data)}, None)
        assert files.direct_fd("f") is None
        files.close()
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert libc.page_cache_fraction(fd, len(data)) < 0.1
    finally:
        os.close(fd)
    try:
        os.close(os.open(f, os.O_RDONLY | os.O_DIRECT))
        supported = True
    except OSError:
        supported = False
    files = reader.FileSet(str(tmp_path), {"f": len(data)}, None)
    try:
        assert (files.direct_fd("f") is not None) == supported
        buf = host_memory.alloc_host(len(data))
        files.pread_span("f", buf, 0, len(data))
        assert np.array_equal(buf, data)
    finally:
        files.close()


@pytest.mark.parametrize("odirect", [False, True], ids=["buffered", "odirect"])
def test_read_spans_checks_every_chunk_of_every_range_once_read(tmp_path, odirect):
    """Ranges larger than a read slab, overlapping ranges of one piece, a range ending at a piece's end."""
    from paddle.distributed.fsdp.checkpoint.format.metadata import PieceMeta

    rng = np.random.default_rng(1)
    data = rng.integers(0, 255, 45 * MIB + 12345, dtype=np.uint8)
    (tmp_path / "f").write_bytes(data.tobytes())
    p1 = PieceMeta("f", "p1", 100, 40 * MIB + 7, (0,), (40 * MIB + 7,), None)
    p2 = PieceMeta("f", "p2", 100 + 40 * MIB + 7, 3 * MIB, (0,), (3 * MIB,), None)
    for p in (p1, p2):
        raw = data[p.offset : p.offset + p.nbytes]
        p.checksums = [zlib.crc32(raw[i : i + MIB]) for i in range(0, p.nbytes, MIB)]
    files = reader.FileSet(str(tmp_path), {"f": len(data)}, None, zlib.crc32, odirect=odirect)
    start = 0
    need = p2.offset + p2.nbytes
    buf = host_memory.alloc_host(-(-need // reader.DIRECT_ALIGN) * reader.DIRECT_ALIGN)
    checks = [("p1", p1, 0, p1.nbytes), ("p1b", p1, 5 * MIB, 9 * MIB), ("p2", p2, MIB, 3 * MIB)]
    rec = _Recorder()
    try:
        ranges.read_spans(files, [ranges.SpanRead("f", start, need, buf, checks)], MIB, rec)
    finally:
        files.close()
    assert np.array_equal(buf[:need], data[:need])
    assert sorted(rec.seen["p1"]) == list(range(41))
    assert sorted(rec.seen["p1b"]) == list(range(5, 9))
    assert sorted(rec.seen["p2"]) == [1, 2]
    # a damaged chunk in the middle of the large range is reported
    bad = data.copy()
    bad[p1.offset + 20 * MIB + 3] ^= 1
    (tmp_path / "f").write_bytes(bad.tobytes())
    files = reader.FileSet(str(tmp_path), {"f": len(data)}, None, zlib.crc32, odirect=odirect)
    verifier = chunks.ChunkVerifier()
    try:
        ranges.read_spans(files, [ranges.SpanRead("f", start, need, buf, checks[:1])], MIB, verifier)
        with pytest.raises(ck.CorruptCheckpointError, match="chunk 20"):
            verifier.wait()
    finally:
        verifier.drain()
        files.close()
