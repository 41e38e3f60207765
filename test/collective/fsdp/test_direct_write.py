"""O_DIRECT rank-file writes (checkpoint/direct_write.py): seeded random headers and pieces (empty, tiny, unaligned,
spanning several bounce buffers) of random chunk sizes give the same bytes and checksums as the buffered writer;
files on a file system without O_DIRECT are written buffered; a failing write, a peer failure and the mid_data
fault stop the writer thread and say so; saves write their data with O_DIRECT and bypass the page cache."""

from __future__ import annotations

import errno
import os
import threading
import zlib

import fault_storage
import numpy as np
import pytest
import xxhash
from paddle.distributed.fsdp.checkpoint import direct_write, writer
from paddle.distributed.fsdp.checkpoint.io.local import LocalStorage

KIB, MIB = 1 << 10, 1 << 20
DIGESTS = {"xxh3": xxhash.xxh3_64_intdigest, "crc32": zlib.crc32, "none": None}


def _pieces(rng) -> list[np.ndarray]:
    sizes = [int(rng.choice([0, 1, 4095, 4096, 100 * KIB + 3, 3 * MIB + 7, 9 * MIB + 123])) for _ in range(6)]
    return [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]


def _writer_threads() -> int:
    return sum(t.name == "ckpt-write" for t in threading.enumerate())


def _expected_sums(pieces, chunk, fn):
    return [[fn(p[j : j + chunk]) for j in range(0, len(p), chunk)] if fn else [] for p in pieces]


@pytest.mark.parametrize("seed", range(8))
def test_direct_writes_equal_buffered_writes_bytes_and_checksums(tmp_path, seed):
    rng = np.random.default_rng(seed)
    header = rng.integers(0, 256, int(rng.integers(0, 20000)), dtype=np.uint8).tobytes()
    pieces = _pieces(rng)
    chunk = int(rng.choice([4 * KIB, 100 * KIB + 1, direct_write.STEP, 1 * MIB, 5 * MIB + 3]))
    fn = DIGESTS[str(rng.choice(list(DIGESTS)))]
    # producers like a device tensor's host copy: (view, owner)
    lazy = [(lambda p=p: (p, None)) if i % 2 else p for i, p in enumerate(pieces)]
    got = writer.write_rank_file(str(tmp_path / "direct"), header, lazy, chunk, fn, direct=True)
    want = writer.write_rank_file(str(tmp_path / "buffered"), header, pieces, chunk, fn, direct=False)
    data = (tmp_path / "direct").read_bytes()
    assert data == (tmp_path / "buffered").read_bytes() == header + b"".join(p.tobytes() for p in pieces)
    assert got == want == (len(data), _expected_sums(pieces, chunk, fn))
    assert _writer_threads() == 0


def test_the_file_system_without_o_direct_gets_buffered_writes(tmp_path, monkeypatch):
    """open(O_DIRECT) refused (tmpfs before Linux 6.6) or the first O_DIRECT write refused: same bytes, buffered."""
    rng = np.random.default_rng(11)
    pieces = _pieces(rng)
    monkeypatch.setattr(direct_write, "open_direct", lambda path: None)
    writer.write_rank_file(str(tmp_path / "a"), b"h", pieces, MIB, zlib.crc32, direct=True)
    monkeypatch.undo()

    real = os.pwrite
    calls = {"direct": 0}

    def refuse_direct(fd, data, offset):
        if fcntl_flags(fd) & os.O_DIRECT:
            calls["direct"] += 1
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", refuse_direct)
    writer.write_rank_file(str(tmp_path / "b"), b"h", pieces, MIB, zlib.crc32, direct=True)
    want = b"h" + b"".join(p.tobytes() for p in pieces)
    assert (tmp_path / "a").read_bytes() == (tmp_path / "b").read_bytes() == want
    assert calls["direct"] == 1  # refused once, at offset 0; everything after went buffered


def fcntl_flags(fd: int) -> int:
    import fcntl

    return fcntl.fcntl(fd, fcntl.F_GETFL)


def test_a_failing_write_is_raised_and_the_writer_thread_stops(tmp_path, monkeypatch):
    real = os.pwrite
    seen = {"n": 0}

    def full_disk(fd, data, offset):
        seen["n"] += 1
        if seen["n"] == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", full_disk)
    pieces = [np.zeros(20 * MIB, np.uint8)]
    with pytest.raises(OSError) as ei:
        writer.write_rank_file(str(tmp_path / "f"), b"h", pieces, MIB, zlib.crc32, direct=True)
    assert ei.value.errno == errno.ENOSPC
    assert _writer_threads() == 0


def test_a_peer_failure_stops_a_long_write_within_a_few_buffers(tmp_path):
    class PeerFailed(Exception):
        pass

    asked = []

    def should_stop():
        asked.append(1)
        if len(asked) == 2:
            raise PeerFailed

    with pytest.raises(PeerFailed):
        writer.write_rank_file(
            str(tmp_path / "f"), b"h", [np.zeros(200 * MIB, np.uint8)], MIB, None, should_stop=should_stop, direct=True
        )
    # asked at the first buffer, then every STOP_CHECK_BYTES: stopped after ~16 MiB of 200
    assert (
        os.path.getsize(tmp_path / "f") <= direct_write.STOP_CHECK_BYTES + direct_write.RING_SLABS * direct_write.SLAB
    )
    assert _writer_threads() == 0


def test_a_small_file_still_asks_should_stop(tmp_path):
    asked = []
    writer.write_rank_file(
        str(tmp_path / "g"), b"h", [np.zeros(10, np.uint8)], MIB, None, should_stop=lambda: asked.append(1), direct=True
    )
    assert asked == [1]


def test_mid_data_fault_writes_exactly_half_then_fails(tmp_path, monkeypatch):
    """The tests' mid_data fault (fault_storage.py) over O_DIRECT writes: exactly half of the object (an unaligned
    length, 9 MiB + 77) durable through the direct writer, then the injected error; no writer thread left."""
    monkeypatch.setenv(fault_storage.ENV, "mid_data:0:EIO")
    fault_storage.reset()
    rng = np.random.default_rng(5)
    pieces = [rng.integers(0, 256, 18 * MIB + 151, dtype=np.uint8)]
    half = 9 * MIB + 77  # (3 header bytes + 18 MiB + 151) // 2
    storage = fault_storage.FaultStorage(LocalStorage(odirect=True))
    with pytest.raises(OSError) as ei:
        storage.write_object(str(tmp_path), "0_0.safetensors", b"hdr", pieces, MIB, None)
    assert ei.value.errno == errno.EIO
    assert (tmp_path / "0_0.safetensors").read_bytes() == (b"hdr" + pieces[0].tobytes())[:half]
    assert _writer_threads() == 0


def test_a_save_writes_its_data_around_the_page_cache(tmp_path):
    """A one-process save (odirect default): the data file is not in the page cache afterwards, and loads back."""
    import paddle
    from paddle.distributed.fsdp.checkpoint import libc, load_state_dict, save_state_dict

    def cached(path) -> float | None:
        fd = os.open(path, os.O_RDONLY)
        try:
            return libc.page_cache_fraction(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)

    # control: can this file system write around the page cache at all (tmpfs cannot)?
    control = tmp_path / "control"
    control.touch()
    bypasses = False
    dfd = direct_write.open_direct(str(control))
    if dfd is not None:
        import mmap

        try:
            os.pwrite(dfd, mmap.mmap(-1, MIB), 0)
            frac = cached(control)
            bypasses = frac is not None and frac < 0.1
        except OSError:
            pass
        finally:
            os.close(dfd)
    t = paddle.to_tensor(np.random.default_rng(0).standard_normal(3 * MIB // 4).astype("float32"))
    save_state_dict({"w": t}, str(tmp_path / "ck"))
    data = [f for f in os.listdir(tmp_path / "ck") if f.endswith(".safetensors")]
    if bypasses:
        assert cached(tmp_path / "ck" / data[0]) < 0.1
    out = paddle.zeros_like(t)
    load_state_dict({"w": out}, str(tmp_path / "ck"))
    assert np.array_equal(out.numpy(), t.numpy())
