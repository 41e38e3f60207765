"""Chunk codecs (format/codecs.py): compressed checkpoints load bit-exactly against raw ones in every door
(in-place, resharded 2->1 and 1->2, windowed with small chunks, one process, S3), verify checks their stored
checksums and decoding, and crafted stored chunks (seeded fuzz, zstd bombs, wrong codec names) are named errors
that never allocate more than the declared chunk size."""

from __future__ import annotations

import json
import os
import shutil
import tracemalloc
from pathlib import Path

import numpy as np
import paddle
import paddle.distributed.fsdp.checkpoint as ck
import pytest
import zstandard
from _results import assert_case_ok
from crafted import reseal
from launch_util import beside_one_rank, run_launch
from paddle.distributed.fsdp.checkpoint.errors import CorruptCheckpointError, MetadataError
from paddle.distributed.fsdp.checkpoint.format import codecs, versions
from paddle.distributed.fsdp.checkpoint.options import CheckpointOptions

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "codec_ckpt.py")
RAW = CheckpointOptions(codec="raw")
ZSTD = CheckpointOptions(codec="byteplane-zstd", codec_threads=2)
LOADS = {1: ["2"], 2: ["1", "2"]}  # loading world -> saving worlds


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The 1-rank launches beside the 2-rank ones (CI time): both saves at once, then both loads at once (each load
    reads the other world's checkpoints, so the loads start after both saves)."""
    workdir = tmp_path_factory.mktemp("codec")
    logs = {name: tmp_path_factory.mktemp(name) for name in ("s1", "s2", "l1", "l2")}

    def launch(n: int, args: list[str], log: str):
        return lambda: run_launch(WORKER, n, [args[0], str(workdir), *args[1:]], log_dir=logs[log])

    saves = dict(zip((1, 2), beside_one_rank(launch(1, ["save"], "s1"), launch(2, ["save"], "s2"))))
    loads = dict(
        zip((1, 2), beside_one_rank(launch(1, ["load", *LOADS[1]], "l1"), launch(2, ["load", *LOADS[2]], "l2")))
    )
    return workdir, saves, loads


@pytest.mark.parametrize("small", [False, True], ids=["save_checkpoint", "1KiB-chunks"])
@pytest.mark.parametrize("load_world,source", [(m, s) for m, src in LOADS.items() for s in src], ids=str)
def test_compressed_loads_bit_exact_against_raw_at_any_world(runs, load_world, source, small):
    _, saves, loads = runs
    assert_case_ok(saves[int(source)], "save", int(source))
    assert_case_ok(loads[load_world], f"{source}->{load_world}{'-small' if small else ''}", load_world)


@pytest.mark.parametrize("world", [1, 2])
def test_auto_codec_is_the_coordinators_on_every_rank(runs, world):
    """Ranks whose measurements disagree (codec_choice: one rank's encoder fast, the others' slow) save one
    codec, the coordinator's: every file of the checkpoint names it and it loads bit for bit."""
    _, saves, _ = runs
    assert_case_ok(saves[world], "auto-agree", world)


def _data_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.name.endswith(".safetensors"))


def test_compressed_checkpoint_on_disk_one_process_and_verify(runs):
    """Format 4 with codecs, smaller, no stock index; the one-process reader and verify agree with the raw."""
    workdir, saves, _ = runs
    assert_case_ok(saves[2], "save", 2)
    raw, zst, env = (Path(workdir) / f"n2-{c}" for c in ("raw", "zstd", "env"))
    mz = json.loads((zst / "metadata.json").read_bytes())
    assert mz["version"] == 4 and mz["codecs"] == {
        "0_0.safetensors": "byteplane-zstd",
        "1_0.safetensors": "byteplane-zstd",
    }
    mr = json.loads((raw / "metadata.json").read_bytes())  # a raw save: no codecs; format 3 unless another
    assert "codecs" not in mr and mr["version"] == versions.write_version(mr)  # format-4 field (derived weights)
    assert json.loads((env / "metadata.json").read_bytes())["codecs"] == mz["codecs"]  # PADDLE_FSDP_CKPT_CODEC
    assert not (zst / "0.metadata").exists() and (raw / "0.metadata").exists()
    assert _data_bytes(zst) < 0.9 * _data_bytes(raw), (_data_bytes(zst), _data_bytes(raw))
    keys = sorted(ck.read_metadata(str(raw)).tensors)
    a, b = ck.load_full_state_dict(str(raw), keys), ck.load_full_state_dict(str(zst), keys)
    for k in keys:
        assert a[k].numpy().tobytes() == b[k].numpy().tobytes(), k
    assert ck.verify_checkpoint(str(zst)) == [] and ck.verify_checkpoint(str(workdir / "n2-small-zstd")) == []


def test_tools_read_compressed_like_raw(runs, tmp_path):
    """diff (raw vs compressed: identical, windowed) and to-hf (the same output bytes) through the decoding reader."""
    from paddle.distributed.fsdp.tools.cli import main as cli_main

    workdir, saves, _ = runs
    assert_case_ok(saves[2], "save", 2)
    raw, zst = Path(workdir) / "n2-small-raw", Path(workdir) / "n2-small-zstd"
    assert cli_main(["diff", str(raw), str(zst), "--window", "4KB", "--no-progress"]) == 0
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps({"rename": []}))
    outs = []
    for src in (raw, zst):
        out = tmp_path / f"hf-{src.name}"
        assert (
            cli_main(["to-hf", str(src), str(out), "--rules", str(rules), "--include-optimizer", "--no-progress"]) == 0
        )
        outs.append({p.name: p.read_bytes() for p in sorted(out.iterdir())})
    assert outs[0] == outs[1] and any(n.endswith(".safetensors") for n in outs[0])


def _save_pair(tmp_path: Path, chunk: int = 4096):
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((300, 97)) * 0.02).astype(np.float32)
    sd = {
        "w": paddle.to_tensor(w),
        "bf": paddle.to_tensor(w[:50]).astype("bfloat16"),
        "h": paddle.to_tensor(w[:9].astype(np.float16)),
        "i": paddle.arange(777),
        "zeros": paddle.zeros([5000]),  # planes that shrink to nothing
        "noise": paddle.to_tensor(rng.integers(0, 255, 7000, dtype=np.uint8)),  # stored raw: nothing shrinks
    }
    paths = {}
    for name, opts in (("raw", RAW), ("zstd", ZSTD)):
        paths[name] = tmp_path / name
        ck.save_state_dict(sd, str(paths[name]), chunk_bytes=chunk, options=opts)
    return sd, paths


def _table(path: Path, name: str = "0_0.safetensors") -> np.ndarray:
    return np.frombuffer((path / codecs.table_name(name)).read_bytes(), codecs.TABLE_ROW).copy()


def test_windowed_reads_and_damage(tmp_path):
    """Bounded (windowed) loads decode the chunks they need; a flipped stored byte is a checksum mismatch in the
    load and in verify; a truncated stored file and a missing chunk table are named."""
    sd, paths = _save_pair(tmp_path)
    rows = _table(paths["zstd"])
    assert set(rows["codec"].tolist()) == {0, 1}  # noise stored raw, the rest byte planes
    for kw in ({"max_host_bytes": 5000}, {"atomic": True}, {}, {"verify_checksums": False}):
        tgt = {k: paddle.zeros_like(v) for k, v in sd.items()}
        ck.load_state_dict(tgt, str(paths["zstd"]), **kw)
        for k in sd:
            assert tgt[k].numpy().tobytes() == sd[k].numpy().tobytes(), (k, kw)
    bad = tmp_path / "bad"
    shutil.copytree(paths["zstd"], bad)
    f = bad / "0_0.safetensors"
    data = bytearray(f.read_bytes())
    r = rows[np.nonzero(rows["codec"] == 1)[0][2]]
    data[int(r["soff"]) + int(r["slen"]) // 2] ^= 0x20
    f.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        ck.load_full_state_dict(str(bad), list(sd))
    assert any("checksum mismatch" in m for m in ck.verify_checkpoint(str(bad)))
    f.write_bytes(bytes(data[:-10]))
    with pytest.raises(CorruptCheckpointError):
        ck.load_full_state_dict(str(bad), list(sd))
    assert ck.verify_checkpoint(str(bad))
    (bad / codecs.table_name("0_0.safetensors")).unlink()
    assert any("chunk table" in m for m in ck.verify_checkpoint(str(bad)))


def test_chunks_that_split_elements(tmp_path):
    """chunk_bytes not a multiple of the element sizes (1001): chunks fall back to one plane, still lossless."""
    sd, paths = _save_pair(tmp_path, chunk=1001)
    got = ck.load_full_state_dict(str(paths["zstd"]), list(sd))
    for k in sd:
        assert got[k].numpy().tobytes() == sd[k].numpy().tobytes(), k
    assert set(_table(paths["zstd"])["width"].tolist()) <= {1, 2, 4, 8}
    assert ck.verify_checkpoint(str(paths["zstd"])) == []


def test_unknown_codec_name_is_named(tmp_path):
    _sd, paths = _save_pair(tmp_path)
    md = json.loads((paths["zstd"] / "metadata.json").read_bytes())
    md["codecs"]["0_0.safetensors"] = "lzma-9000"
    reseal(paths["zstd"], json.dumps(md).encode())
    with pytest.raises(codecs.UnknownCodecError, match="lzma-9000"):
        ck.read_metadata(str(paths["zstd"]))
    assert issubclass(codecs.UnknownCodecError, MetadataError)
    assert issubclass(codecs.CodecDataError, CorruptCheckpointError)


def _where() -> str:
    return "fuzz"


def test_zstd_bombs_never_allocate_more_than_declared():
    """A plane that declares (or inflates to) more than the chunk's declared size is refused before it is
    decoded: the peak memory stays near the chunk size."""
    n, width = 4096, 4
    big = zstandard.ZstdCompressor(level=19).compress(bytes(256 << 20))  # 256 MiB of zeros in a few KiB
    no_size = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(bytes(1 << 20))
    for plane in (big, no_size):
        stored = np.array([len(plane)] + [n // width] * 3, "<u4").tobytes() + plane + bytes(3 * n // width)
        out = memoryview(bytearray(n))
        tracemalloc.start()
        try:
            with pytest.raises(codecs.CodecDataError):
                codecs.decode_chunk(1, width, memoryview(stored), out, _where)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20, peak


def test_seeded_fuzz_of_stored_chunks():
    """Random damage to valid stored chunks (bit flips, truncation, appended bytes, length fields): each decode
    either raises CodecDataError / UnknownCodecError or fills exactly the declared bytes (never more)."""
    rng = np.random.default_rng(52)
    n = 8192
    src = (rng.standard_normal(n // 4) * 0.01).astype(np.float32).tobytes()
    good = codecs.encode_byteplanes(memoryview(src), 4)
    assert good is not None and len(good) < n
    out = memoryview(bytearray(n))
    codecs.decode_chunk(1, 4, memoryview(good), out, _where)
    assert bytes(out) == src
    outcomes = {"refused": 0, "decoded": 0}
    for _ in range(400):
        b = bytearray(good)
        kind = rng.integers(0, 5)
        if kind == 0:
            for _ in range(rng.integers(1, 4)):
                b[rng.integers(0, len(b))] ^= 1 << int(rng.integers(0, 8))
        elif kind == 1:
            b = b[: rng.integers(0, len(b))]
        elif kind == 2:
            b += rng.bytes(int(rng.integers(1, 64)))
        elif kind == 3:
            j = int(rng.integers(0, 4))
            b[4 * j : 4 * j + 4] = int(rng.integers(0, 1 << 32)).to_bytes(4, "little")
        else:
            b = bytearray(rng.bytes(len(b)))
        width = int(rng.choice([1, 2, 4, 8, 3])) if rng.random() < 0.1 else 4
        codec_id = int(rng.choice([0, 1, 7])) if rng.random() < 0.1 else 1
        dst = bytearray(n + 16)  # guard bytes after the declared size must stay untouched
        try:
            codecs.decode_chunk(codec_id, width, memoryview(bytes(b)), memoryview(dst)[:n], _where)
            outcomes["decoded"] += 1
        except (codecs.CodecDataError, codecs.UnknownCodecError):
            outcomes["refused"] += 1
        assert dst[n:] == bytes(16)
    assert outcomes["refused"] > 300, outcomes


def test_crafted_chunk_in_a_checkpoint_is_named(tmp_path):
    """A stored chunk replaced by a zstd bomb whose table row (checksum, length) was updated to match: the
    load names a CodecDataError; a table row declaring more than chunk_bytes is refused before any read."""
    sd, paths = _save_pair(tmp_path)
    ckp = paths["zstd"]
    rows = _table(ckp)
    i = int(np.nonzero(rows["codec"] == 1)[0][0])
    width, dlen = int(rows[i]["width"]), int(rows[i]["dlen"])
    bomb = zstandard.ZstdCompressor(level=19).compress(bytes(64 << 20))
    planes = [bomb] + [bytes(dlen // width)] * (width - 1)
    lens = [len(bomb)] + [(dlen // width) | (1 << 31)] * (width - 1)
    chunk = np.array(lens, "<u4").tobytes() + b"".join(planes)
    f = ckp / "0_0.safetensors"
    data = f.read_bytes()
    s0, s1 = int(rows[i]["soff"]), int(rows[i]["soff"] + rows[i]["slen"])
    f.write_bytes(data[:s0] + chunk + data[s1:])
    import xxhash

    delta = len(chunk) - (s1 - s0)
    rows[i]["slen"], rows[i]["sum"] = len(chunk), xxhash.xxh3_64_intdigest(chunk)
    rows["soff"][i + 1 :] += delta
    (ckp / codecs.table_name("0_0.safetensors")).write_bytes(rows.tobytes())
    with pytest.raises(codecs.CodecDataError):
        ck.load_full_state_dict(str(ckp), list(sd))
    rows2 = rows.copy()
    rows2["dlen"][i] = 1 << 30
    (ckp / codecs.table_name("0_0.safetensors")).write_bytes(rows2.tobytes())
    with pytest.raises(CorruptCheckpointError, match="chunk table"):
        ck.load_full_state_dict(str(ckp), list(sd))


def test_crafted_decoded_size_and_table_rows_are_named_before_reading(tmp_path):
    """A metadata.json declaring a stored file's decoded size far beyond what its table decodes to, a table of
    rows that store no byte, and a table far larger than its stored file are each a named error, the last one
    before it is read (it was read whole: its limit grew with the declared size, 48 bytes per declared byte)."""
    sd, paths = _save_pair(tmp_path)
    keys = sorted(sd)
    name = "0_0.safetensors"
    stored = (paths["zstd"] / name).stat().st_size
    lie = tmp_path / "lie"
    shutil.copytree(paths["zstd"], lie)
    md = json.loads((lie / "metadata.json").read_bytes())
    md["files"]["sizes"][0] = 1 << 40
    reseal(lie, json.dumps(md).encode())
    with pytest.raises(CorruptCheckpointError, match="the metadata says 1099511627776"):
        ck.load_full_state_dict(str(lie), keys)
    assert any("the metadata says" in m for m in ck.verify_checkpoint(str(lie)))

    empty = tmp_path / "empty"  # rows that store nothing: a fetch of zero bytes raised a bare TypeError
    shutil.copytree(paths["zstd"], empty)
    decoded = json.loads((empty / "metadata.json").read_bytes())["files"]["sizes"][0]
    n = stored // 2  # (within the limit of one row per stored byte)
    rows = np.zeros(n, codecs.TABLE_ROW)
    rows["doff"] = np.arange(n) * decoded // n
    rows["dlen"], rows["codec"], rows["width"] = np.diff(rows["doff"], append=decoded), 1, 1
    rows["slen"][-1], rows["soff"] = stored, 0
    (empty / codecs.table_name(name)).write_bytes(rows.tobytes())
    with pytest.raises(CorruptCheckpointError, match="rows are not ordered, bounded chunks"):
        ck.load_full_state_dict(str(empty), keys)

    both = tmp_path / "both"  # a declared terabyte and a table of 48 x the stored file: refused unread
    shutil.copytree(lie, both)
    big = np.zeros(stored + 2, codecs.TABLE_ROW)
    (both / codecs.table_name(name)).write_bytes(big.tobytes())
    tracemalloc.start()
    try:
        with pytest.raises(MetadataError, match="more than the limit"):
            ck.load_full_state_dict(str(both), keys)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < big.nbytes // 4, peak


def test_s3_compressed_by_default_loads_like_local_raw(tmp_path, s3_server, s3_bucket):
    """``auto`` compresses on the S3 backend (real SeaweedFS): the stored objects are smaller, the load equals
    the local raw save bit for bit, and verify passes over S3."""
    from paddle.distributed.fsdp.checkpoint.s3.storage import S3Storage
    from s3_fixtures import s3_options_for

    storage = S3Storage(s3_options_for(s3_server.endpoint))
    opts = CheckpointOptions(storage=storage)  # codec "auto"
    sd, paths = _save_pair(tmp_path, chunk=64 << 10)
    url = f"s3://{s3_bucket}/ck"
    ck.save_state_dict(sd, url, options=opts)
    md = ck.read_metadata(url, options=opts)
    assert md.version == 4 and md.codecs == {"0_0.safetensors": "byteplane-zstd"}
    keys = sorted(sd)
    got = ck.load_full_state_dict(url, keys, options=opts)
    local = ck.load_full_state_dict(str(paths["raw"]), keys)
    for k in keys:
        assert got[k].numpy().tobytes() == local[k].numpy().tobytes() == sd[k].numpy().tobytes(), k
    tgt = {k: paddle.zeros_like(v) for k, v in sd.items()}
    ck.load_state_dict(tgt, url, options=opts)
    for k in keys:
        assert tgt[k].numpy().tobytes() == sd[k].numpy().tobytes(), k
    assert ck.verify_checkpoint(url, options=opts) == []
    stored = storage.open_read(url, "0_0.safetensors")
    try:
        assert stored.size < 0.9 * md.files["0_0.safetensors"].size
    finally:
        stored.close()


def test_compressed_checkpoints_are_picked_rotated_and_torn_like_raw(tmp_path, caplog):
    """Resume and rotation (lineage.examine) see a compressed checkpoint as complete: its data files' sizes are
    their chunk tables', not the decoded sizes metadata.json lists (they were taken for torn, so a root on S3,
    compressed by default, never resumed). A stored file cut short or without its table is still torn."""
    from paddle.distributed.fsdp.checkpoint.directory import step_dir_name
    from paddle.distributed.fsdp.checkpoint.format.codecs import table_name

    zstd = ck.CheckpointOptions(codec="byteplane-zstd")

    def state(step: int) -> dict:
        rng = np.random.default_rng(step)
        return {"w": paddle.to_tensor(rng.standard_normal(3000).astype("float32"))}

    root = tmp_path / "root"
    mgr = ck.CheckpointManager(str(root), keep_last=1)
    for step in (1, 2, 3):
        mgr.save(step, state(step), options=zstd)
        assert ck.latest_checkpoint(str(root)) == str(root / step_dir_name(step))
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step_")) == [step_dir_name(3)]  # rotated
    got = {"w": paddle.zeros([3000], "float32")}
    ck.load_state_dict(got, ck.latest_checkpoint(str(root)))
    assert np.array_equal(got["w"].numpy(), state(3)["w"].numpy())

    data = sorted((root / step_dir_name(3)).glob("*.safetensors"))
    assert data and all((root / step_dir_name(3) / table_name(f.name)).exists() for f in data)
    keep_all = ck.CheckpointManager(str(root))  # (no rotation: step 3 stays the one to fall back to)
    for damage in ("cut", "no table"):
        keep_all.save(4, state(4), options=zstd)
        assert ck.latest_checkpoint(str(root)) == str(root / step_dir_name(4))
        victim = root / step_dir_name(4) / data[0].name
        if damage == "cut":
            with open(victim, "r+b") as f:
                f.truncate(victim.stat().st_size - 1)
        else:
            os.unlink(victim.parent / table_name(victim.name))
        caplog.clear()
        assert ck.latest_checkpoint(str(root)) == str(root / step_dir_name(3)), damage  # torn: never picked
        assert step_dir_name(4) in caplog.text, damage  # and named in a warning
        shutil.rmtree(root / step_dir_name(4))
