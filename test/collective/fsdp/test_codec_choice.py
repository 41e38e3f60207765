"""Codec ``auto`` by measured throughput (checkpoint/codec_choice.py): a save compresses when this process's
encoder (its threads) outruns the write rate its earlier saves measured at the same storage root; before any
measurement, local disks save raw and object stores compress; explicit codecs and the switch win. The storage
rates are real (a real disk, a real S3 server, a disk whose writes really sleep); the encoder's rate is posed
through ``set_encode_rate`` where a test needs a host slower or faster than this one."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import paddle
import paddle.distributed.fsdp.checkpoint as ck
import pytest
from paddle.distributed.fsdp.checkpoint import codec_choice
from paddle.distributed.fsdp.checkpoint.io.local import LocalStorage
from paddle.distributed.fsdp.checkpoint.options import CheckpointOptions

ZSTD = "byteplane-zstd"
SLOW_BYTES_PER_S = 8e6  # the sleeping disk's ceiling: far below any encoder


class SleepingDisk(LocalStorage):
    """A local disk whose data writes take at least ``size / SLOW_BYTES_PER_S`` (a slow network file system)."""

    def write_object(self, location, name, header, pieces, chunk_bytes, digest, **kw):
        result = super().write_object(location, name, header, pieces, chunk_bytes, digest, **kw)
        time.sleep(result[0] / SLOW_BYTES_PER_S)
        return result


@pytest.fixture(autouse=True)
def fresh_measurements(monkeypatch):
    """No figures from earlier tests; writes of 1 MiB and more count as measurements here (the product's
    ``MIN_MEASURED_BYTES`` is 64 MiB: these tests' disks are really slowed, so small saves measure their rate)."""
    codec_choice.forget()
    monkeypatch.setattr(codec_choice, "MIN_MEASURED_BYTES", 1 << 20)
    yield
    codec_choice.forget()


def test_small_writes_are_not_measurements(monkeypatch):
    """A data file under the product's MIN_MEASURED_BYTES (64 MiB) does not count: its time is fixed costs."""
    monkeypatch.undo()
    root = ("local", "/r")
    codec_choice.record_write(root, codec_choice.Write("raw", 8 << 20, 8 << 20, 1.0, 1.0))
    assert codec_choice.storage_rate(root) is None
    codec_choice.record_write(root, codec_choice.Write("raw", 64 << 20, 64 << 20, 1.0, 1.0))
    assert codec_choice.storage_rate(root) == 64 << 20


def _state() -> dict:
    rng = np.random.default_rng(52)
    w = (rng.standard_normal(300_000) * 0.02).astype(np.float32)  # 2.6 MB in all: above MIN_MEASURED_BYTES
    return {
        "w": paddle.to_tensor(w),
        "bf": paddle.to_tensor(w[:100_000]).astype("bfloat16"),
        "z": paddle.zeros([300_000]),  # compressible: the measured compressed saves clearly pay on a slow disk
    }


def _save(sd: dict, path: Path, opts: CheckpointOptions) -> str:
    """The codec the save at ``path`` stored its data with (raw: none named), after a bit-exact load of it."""
    ck.save_state_dict(sd, str(path), options=opts)
    got = ck.load_full_state_dict(str(path), sorted(sd), options=opts)
    for k, v in sd.items():
        assert got[k].numpy().tobytes() == v.numpy().tobytes(), k
    codecs = set(ck.read_metadata(str(path), options=opts).codecs.values())
    assert len(codecs) <= 1, codecs
    return codecs.pop() if codecs else "raw"


def test_first_local_save_is_raw_then_a_slow_disk_is_compressed(tmp_path):
    """No measurement yet: raw (today's behaviour); the sleeping disk's measured rate then makes auto compress."""
    opts = CheckpointOptions(storage=SleepingDisk())
    sd = _state()
    assert _save(sd, tmp_path / "ck1", opts) == "raw"
    root = codec_choice.storage_root(opts.storage, str(tmp_path / "ck1"))
    assert codec_choice.storage_rate(root) <= SLOW_BYTES_PER_S
    assert _save(sd, tmp_path / "ck2", opts) == ZSTD  # the model: encoder against the disk's rate
    assert codec_choice.storage_rate(root) <= SLOW_BYTES_PER_S  # a compressed save measures the disk, not the encoder
    assert _save(sd, tmp_path / "ck3", opts) == ZSTD  # measured both ways: the compressed saves were faster


def test_choice_follows_the_encoder_against_a_real_disk(tmp_path):
    """The same real disk: raw for a host whose encoder is slower than it, compressed for one far faster; the
    measurements are per storage root (another directory starts from the prior again)."""
    opts = CheckpointOptions()
    sd = _state()
    codec_choice.set_encode_rate(1e3)  # 1 KB/s a thread: slower than any disk
    assert _save(sd, tmp_path / "a" / "ck1", opts) == "raw"
    assert _save(sd, tmp_path / "a" / "ck2", opts) == "raw"
    codec_choice.set_encode_rate(1e13)  # faster than any disk
    assert _save(sd, tmp_path / "a" / "ck3", opts) == ZSTD
    assert _save(sd, tmp_path / "b" / "ck1", opts) == "raw"  # a new root: no history, the local prior


def test_measured_saves_both_ways_overrule_the_model(tmp_path):
    """Saved both ways at a root: the measured whole-write throughputs decide, whatever the encoder model says
    (a host whose encode threads got no core: the compressed saves were slower than their encoder promised)."""
    root = codec_choice.storage_root(LocalStorage(), str(tmp_path / "ck"))
    mb = 1 << 20
    codec_choice.record_write(root, codec_choice.Write("raw", 100 * mb, 100 * mb, 1.0, 1.0))
    codec_choice.set_encode_rate(1e13)  # the model: compress
    assert codec_choice.choose_codec("auto", LocalStorage(), str(tmp_path / "ck"), 1) == ZSTD
    codec_choice.record_write(root, codec_choice.Write(ZSTD, 100 * mb, 80 * mb, 0.8, 1.5))  # slower in all
    assert codec_choice.choose_codec("auto", LocalStorage(), str(tmp_path / "ck"), 1) == "raw"
    codec_choice.set_encode_rate(1e3)  # the model: raw
    codec_choice.record_write(root, codec_choice.Write(ZSTD, 100 * mb, 80 * mb, 0.08, 0.1))  # faster, all in all
    assert codec_choice.choose_codec("auto", LocalStorage(), str(tmp_path / "ck"), 1) == ZSTD


def test_measured_saves_without_a_clear_winner_leave_the_model_its_answer(tmp_path):
    """Measured saves within PAYS of each other (the noise of a shared host): the encoder model decides."""
    path = str(tmp_path / "ck")
    root = codec_choice.storage_root(LocalStorage(), path)
    mb = 1 << 20
    codec_choice.record_write(root, codec_choice.Write("raw", 100 * mb, 100 * mb, 1.0, 1.0))
    codec_choice.record_write(root, codec_choice.Write(ZSTD, 100 * mb, 80 * mb, 0.8, 1.05))
    codec_choice.set_encode_rate(1e13)
    assert codec_choice.choose_codec("auto", LocalStorage(), path, 1) == ZSTD
    codec_choice.set_encode_rate(1e3)
    assert codec_choice.choose_codec("auto", LocalStorage(), path, 1) == "raw"


def test_explicit_codec_and_the_switch_win(tmp_path, monkeypatch):
    sd = _state()
    slow = CheckpointOptions(storage=SleepingDisk())
    _save(sd, tmp_path / "ck0", slow)  # measured: auto would now compress here
    assert _save(sd, tmp_path / "ck1", CheckpointOptions(storage=slow.storage, codec="raw")) == "raw"
    monkeypatch.setenv("PADDLE_FSDP_CKPT_CODEC", "raw")
    env = CheckpointOptions.from_env()
    assert _save(sd, tmp_path / "ck2", CheckpointOptions(storage=slow.storage, codec=env.codec)) == "raw"
    codec_choice.set_encode_rate(1e3)  # auto would save raw on this host
    assert _save(sd, tmp_path / "fast" / "ck0", CheckpointOptions(codec=ZSTD)) == ZSTD
    monkeypatch.setenv("PADDLE_FSDP_CKPT_CODEC", ZSTD)
    assert _save(sd, tmp_path / "fast" / "ck1", CheckpointOptions.from_env()) == ZSTD


def test_s3_compresses_first_then_by_measurement(s3_server, s3_bucket):
    """A real SeaweedFS: the first save to a bucket compresses (the object-store prior), the next ones follow the
    upload rate the saves measured (posed against an encoder slower than any upload: raw)."""
    from paddle.distributed.fsdp.checkpoint.s3.storage import S3Storage
    from s3_fixtures import s3_options_for

    storage = S3Storage(s3_options_for(s3_server.endpoint))
    opts = CheckpointOptions(storage=storage)
    sd = _state()
    url = f"s3://{s3_bucket}"
    codec_choice.set_encode_rate(1e3)
    assert _save(sd, f"{url}/ck1", opts) == ZSTD
    assert codec_choice.storage_rate(codec_choice.storage_root(storage, f"{url}/ck1")) is not None
    assert _save(sd, f"{url}/ck2", opts) == "raw"


def test_figures_of_many_storage_roots_stay_bounded():
    """A job that saves each step under a new parent makes a new storage root per save: only the last
    ``MAX_ROOTS`` roots keep figures (least recently used forgotten), and a root in use keeps its own."""
    kept = ("LocalStorage", "/run/kept")
    codec_choice.record_write(kept, codec_choice.Write("raw", 64 << 20, 64 << 20, 1.0, 1.0))
    for i in range(3 * codec_choice.MAX_ROOTS):
        root = ("LocalStorage", f"/run/step_{i}")
        codec_choice.record_write(root, codec_choice.Write("raw", 64 << 20, 64 << 20, 1.0, 1.0))
        codec_choice.choose_codec("auto", LocalStorage(), f"/run/step_{i}/model", 1)
        if i % 8 == 0:
            assert codec_choice.storage_rate(kept) is not None
            codec_choice.choose_codec("auto", LocalStorage(), "/run/kept/model", 1)  # in use: kept
    assert len(codec_choice._storage_history) <= codec_choice.MAX_ROOTS
    assert len(codec_choice._last_choice) <= codec_choice.MAX_ROOTS
    assert codec_choice.storage_rate(kept) == 64 << 20
    assert codec_choice.storage_rate(("LocalStorage", "/run/step_0")) is None  # the oldest forgotten


@pytest.mark.parametrize("threads", [10**6, -1, 1.5, True, "4"])
def test_codec_threads_out_of_range_or_not_an_integer_is_named(threads):
    """codec_threads=10**6 started a thread per chunk of a piece and held the piece encoded at once."""
    with pytest.raises(ck.CheckpointError, match="codec_threads=.*expected an integer from 0"):
        CheckpointOptions(codec_threads=threads)
    assert CheckpointOptions(codec_threads=1024).codec_threads == 1024


@pytest.mark.parametrize("text", ["99999999999", "1025", "-1", "1e9", "four"])
def test_codec_threads_switch_out_of_range_is_named(text):
    from paddle.distributed.fsdp.checkpoint.errors import CheckpointEnvError

    with pytest.raises(CheckpointEnvError, match="PADDLE_FSDP_CKPT_CODEC_THREADS.*<= 1024"):
        CheckpointOptions.from_env({"PADDLE_FSDP_CKPT_CODEC_THREADS": text})


def test_another_disk_at_the_same_path_starts_from_the_prior(tmp_path):
    """The figures of a disk are not those of another disk later mounted (here: linked) at the same path name:
    a slow disk measured there made every later save compress, whatever the new disk was."""
    import shutil
    import tempfile

    shm = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        (tmp_path / "disk").mkdir()
        assert shm.stat().st_dev != (tmp_path / "disk").stat().st_dev  # two devices (tmpfs and the test disk)
        link = tmp_path / "mnt"
        link.symlink_to(shm)
        path = str(link / "ck")
        codec_choice.set_encode_rate(1e9)
        codec_choice.record_write(
            codec_choice.storage_root(LocalStorage(), path), codec_choice.Write("raw", 64 << 20, 64 << 20, 64.0, 64.0)
        )
        assert codec_choice.choose_codec("auto", LocalStorage(), path, 1) == ZSTD  # measured slow: compressed
        link.unlink()
        link.symlink_to(tmp_path / "disk")  # another disk at the same path name
        assert codec_choice.storage_rate(codec_choice.storage_root(LocalStorage(), path)) is None
        assert codec_choice.choose_codec("auto", LocalStorage(), path, 1) == "raw"  # the local prior
    finally:
        shutil.rmtree(shm)


@pytest.mark.parametrize("name", ["ZSTD", " auto ", "byteplane_zstd", "", "Auto", None, 1])
def test_codec_spellings_are_named_with_the_accepted_ones(name):
    with pytest.raises(ck.CheckpointError, match="expected one of auto, raw, byteplane-zstd"):
        CheckpointOptions(codec=name)


@pytest.mark.parametrize("text,codec", [(" auto ", "auto"), ("RAW", "raw"), ("Byteplane-Zstd", ZSTD), ("", "auto")])
def test_codec_switch_takes_any_case_and_blanks(text, codec):
    assert CheckpointOptions.from_env({"PADDLE_FSDP_CKPT_CODEC": text}).codec == codec
    from paddle.distributed.fsdp.checkpoint.errors import CheckpointEnvError

    with pytest.raises(CheckpointEnvError, match="expected auto, raw, byteplane-zstd"):
        CheckpointOptions.from_env({"PADDLE_FSDP_CKPT_CODEC": text + "_zstd"})
