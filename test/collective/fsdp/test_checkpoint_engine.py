"""Tests of the checkpoint storage engine (paddle.distributed.fsdp.checkpoint).

Single-process parts run in the pytest process; the multi-process parts launch
``workers/ckpt_engine.py`` (save on 2 ranks, load on 1 (in process), 2 and 3 ranks).
All value comparisons are on raw bytes, element by element.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import paddle
import paddle.distributed.fsdp.checkpoint as ck
import pytest
from crafted import metadata_json, to_format1
from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight
from paddle.distributed.fsdp.checkpoint import host_memory, libc, planner, writer
from paddle.distributed.fsdp.checkpoint.format import coverage

TEST_DIR = Path(__file__).resolve().parent
WORKER = TEST_DIR / "workers" / "ckpt_engine.py"


def _worker_module():
    spec = importlib.util.spec_from_file_location("ckpt_engine_worker", WORKER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def bits(t) -> np.ndarray:
    return np.ascontiguousarray(t.numpy()).view(np.uint8).ravel().copy()


def flat_sw(key, local, shape, start, stop):
    return ShardedWeight(
        key, local, list(shape), list(shape), [0] * len(shape), is_flattened=True, flattened_range=slice(start, stop)
    )


def make_state():
    paddle.seed(7)
    w = paddle.rand([6, 4])
    big = paddle.rand([5, 8])
    return {
        "w": w,
        "i64": paddle.to_tensor(np.arange(-5, 20, dtype=np.int64) * (2**40)),
        "scalar": paddle.to_tensor(np.array(3.25, dtype=np.float32)),
        "bf": paddle.to_tensor(np.linspace(-3, 3, 15, dtype=np.float32).reshape(5, 3)).astype("bfloat16"),
        "box": ShardedWeight("box", big, [5, 8], [5, 8], [0, 0]),
        "flat": flat_sw("flat", paddle.rand([21]), (7, 3), 0, 21),
        "step": 11,
        "cfg": {"lr": 0.5, "betas": [0.9, 0.99], "name": "x", "on": True, "none": None},
    }


@pytest.fixture()
def saved(tmp_path):
    sd = make_state()
    path = tmp_path / "ckpt"
    ck.save_state_dict(sd, str(path))
    return sd, path


def fresh_targets():
    return {
        "w": paddle.full([6, 4], -1.0),
        "i64": paddle.full([25], 9, dtype="int64"),
        "scalar": paddle.to_tensor(np.array(0.0, dtype=np.float32)),
        "bf": paddle.full([5, 3], 1.0).astype("bfloat16"),
        "box": ShardedWeight("box", paddle.full([2, 3], -1.0), [2, 3], [5, 8], [1, 4]),
        "flat": flat_sw("flat", paddle.full([10], -1.0), (7, 3), 5, 15),
        "step": None,
        "cfg": None,
    }


def target_tensors(t):
    return {
        k: (v.local_tensor if isinstance(v, ShardedWeight) else v)
        for k, v in t.items()
        if isinstance(v, (paddle.Tensor, ShardedWeight))
    }


def snapshot(t):
    return {k: bits(v) for k, v in target_tensors(t).items()}


def assert_unchanged(t, before):
    after = snapshot(t)
    for k in before:
        assert np.array_equal(after[k], before[k]), f"target {k} changed although the load failed"


def rewrite_metadata(path: Path, fn):
    """Edit metadata.json with fn(dict) and re-seal the commit record (so only the edit is 'wrong'); a format-2
    checkpoint is rewritten as format 1 first (crafted.to_format1: these edits exercise the format-1 reader)."""
    to_format1(path)
    md = json.loads((path / "metadata.json").read_bytes())
    fn(md)
    data = json.dumps(md).encode()
    (path / "metadata.json").write_bytes(data)
    commit = json.loads((path / "COMMIT").read_bytes())
    commit["metadata_sha256"] = hashlib.sha256(data).hexdigest()
    (path / "COMMIT").write_text(json.dumps(commit))


def data_file(path: Path) -> Path:
    return path / "0_0.safetensors"


# ------------------------------------------------------------------------------------------ planner units


def test_region_runs_and_intersection_match_brute_force():
    rng = np.random.default_rng(0)

    def brute(reg):
        g = np.arange(int(np.prod(reg.shape))).reshape(reg.shape)  # prod(()) == 1: a 0-d tensor
        v = g[tuple(slice(o, o + s) for o, s in zip(reg.box_offset, reg.box_shape))].ravel()
        return v if reg.flat_range is None else v[reg.flat_range[0] : reg.flat_range[1]]

    def rand_region(shape):
        off = tuple(int(rng.integers(0, g + 1)) for g in shape)
        box = tuple(int(rng.integers(0, g - o + 1)) for o, g in zip(off, shape))
        if rng.random() < 0.3:  # the whole tensor as the box (Region.single_run's fast path)
            off, box = (0,) * len(shape), shape
        fr = None
        if rng.random() < 0.5:
            n = int(np.prod(box)) if box else 1
            a = int(rng.integers(0, n + 1))
            fr = (a, int(rng.integers(a, n + 1)))
        return planner.Region(shape, off, box, fr)

    for _ in range(1500):
        shape = tuple(int(x) for x in rng.integers(0, 5, size=int(rng.integers(0, 4))))
        a, b = rand_region(shape), rand_region(shape)
        for r in (a, b):
            s, l = r.runs()
            got = np.concatenate([np.arange(x, x + n) for x, n in zip(s, l)]) if len(s) else np.zeros(0, int)
            assert np.array_equal(got, brute(r)), r
        seg = planner.intersect(a.runs(), b.runs())
        ea, eb = brute(a), brute(b)
        covered = []
        for s, d, n in zip(seg.src, seg.dst, seg.length):
            assert np.array_equal(eb[s : s + n], ea[d : d + n])
            covered += ea[d : d + n].tolist()
        assert sorted(covered) == sorted(np.intersect1d(ea, eb).tolist())


def test_coverage_fast_path_agrees_with_the_general_one():
    """Single-run regions (FSDP flat ranges, whole tensors) are checked without numpy: same verdicts, same
    messages as the run-based check, on random sets of ranges with gaps, overlaps and empty ones."""
    rng = np.random.default_rng(3)
    for _ in range(3000):
        shape = tuple(int(x) for x in rng.integers(0, 5, size=int(rng.integers(0, 3))))
        n = int(np.prod(shape))
        cuts = sorted(int(x) for x in rng.integers(0, n + 1, size=int(rng.integers(0, 4))))
        bounds = [0, *cuts, n]
        ranges = list(zip(bounds, bounds[1:]))
        if ranges and rng.random() < 0.3:
            ranges.pop(int(rng.integers(0, len(ranges))))  # a gap
        if rng.random() < 0.3:
            a = int(rng.integers(0, n + 1))
            ranges.append((a, int(rng.integers(a, n + 1))))  # maybe an overlap
        rng.shuffle(ranges)
        regions = [
            (i, planner.Region(shape, (0,) * len(shape), shape, (a, b) if rng.random() < 0.8 else None))
            for i, (a, b) in enumerate(ranges)
        ]
        total = n if all(s > 0 for s in shape) or not shape else 0
        fast = coverage.coverage_problems("k", shape, regions)
        assert all(r.single_run() is not None for _, r in regions)
        assert fast == coverage.runs_coverage_problems("k", total, regions), (shape, ranges)


def _desc(key, shape, off, box, fr=None, dtype="float32", rep=False):
    return planner.RecordDesc(key, dtype, planner.Region(tuple(shape), tuple(off), tuple(box), fr), rep)


def build_save_plan(per_rank: list, checkpoint_id: str, chunk_bytes: int) -> planner.SavePlan:
    """The save's planning steps in one process: merge the values, assign the writes (dedup replicas, check
    coverage), lay out every file (``chunk_bytes`` unused: the layout does not depend on it)."""
    values = planner.merged_values([vals for _descs, vals in per_rank])
    assignment = planner.assign_writes([[d.to_wire() for d in descs] for descs, _vals in per_rank], values)
    return planner.lay_out_files(assignment, values, checkpoint_id)


def test_save_plan_dedups_replicas_and_rejects_overlap_gap_and_disagreement():
    full = (4, 4)
    rep = [_desc("r", full, (0, 0), full, rep=True)]
    plan = build_save_plan([(rep, {"v": 1}), (rep, {"v": 2})], "id", 1 << 20)
    assert [r for r, lay in plan.files.items() if lay.pieces] == [0]  # lowest rank writes the replica
    assert plan.values == {"v": 1}
    with pytest.raises(ck.InvalidStateDictError, match="overlapping"):
        build_save_plan(
            [([_desc("k", full, (0, 0), (3, 4))], {}), ([_desc("k", full, (2, 0), (2, 4))], {})], "id", 1 << 20
        )
    with pytest.raises(ck.InvalidStateDictError, match="cover 12 of 16"):
        build_save_plan([([_desc("k", full, (0, 0), (3, 4))], {})], "id", 1 << 20)
    with pytest.raises(ck.InvalidStateDictError, match="dtype"):
        build_save_plan(
            [
                ([_desc("k", (8,), (0,), (8,), (0, 4))], {}),
                ([_desc("k", (8,), (0,), (8,), (4, 8), dtype="float16")], {}),
            ],
            "id",
            1 << 20,
        )
    with pytest.raises(ck.InvalidStateDictError, match="global shape"):
        build_save_plan(
            [([_desc("k", (8,), (0,), (8,), (0, 4))], {}), ([_desc("k", (9,), (0,), (9,), (4, 9))], {})], "id", 1 << 20
        )
    # an error is never remembered: the same bad descriptions fail again
    with pytest.raises(ck.InvalidStateDictError, match="cover 12 of 16"):
        build_save_plan([([_desc("k", full, (0, 0), (3, 4))], {})], "id", 1 << 20)


def test_every_save_plan_is_its_own_and_the_assignment_memo_is_bounded():
    """Headers carry each save's id and pieces are fresh objects (the coordinator fills in their checksums); the
    memo of write assignments is named by the descriptions' digests and the value keys, and keeps the newest."""
    per_rank = [
        ([_desc("a", (8, 4), (0, 0), (4, 4)), _desc("s", (), (), (), rep=True)], {"v": 1}),
        ([_desc("a", (8, 4), (4, 0), (4, 4)), _desc("s", (), (), (), rep=True)], {"v": 2}),
    ]
    first = build_save_plan(per_rank, "id-one", 1 << 20)
    second = build_save_plan(per_rank, "id-two", 1 << 20)
    assert b"id-one" in first.files[0].header and b"id-two" in second.files[0].header
    assert [(k, p.offset, p.nbytes) for k, p in first.files[1].pieces] == [
        (k, p.offset, p.nbytes) for k, p in second.files[1].pieces
    ]
    first.tensors["a"].pieces[0].checksums.append(7)
    assert second.tensors["a"].pieces[0].checksums == []
    assert first.tensors["a"].pieces[0] is not second.tensors["a"].pieces[0]

    wires = [[d.to_wire() for d in descs] for descs, _v in per_rank]
    digests = [planner.descs_digest(w) for w in wires]
    assert digests[0] != digests[1] and digests[0] == planner.descs_digest([tuple(x) for x in wires[0]])
    name = planner.assignment_name(digests, {"v": 1})
    assert name == planner.assignment_name(digests, {"v": 99})  # values' contents do not matter, their keys do
    assert name != planner.assignment_name(digests, {"w": 1})
    assert name != planner.assignment_name(digests[::-1], {"v": 1})
    memo = planner.AssignmentMemo(size=2)
    a = planner.assign_writes(wires, {"v": 1})
    assert a.keys_of(0) == ["a", "s"] and a.keys_of(1) == ["a"]  # the replica is written by the lowest rank
    for i in range(3):
        memo.put(bytes([i]) * 16, a)
    assert memo.names() == (b"\x01" * 16, b"\x02" * 16) and memo.get(b"\x00" * 16) is None


# ------------------------------------------------------------------------------------------ round trips


def test_round_trip_all_record_kinds(saved):
    sd, path = saved
    assert sorted(os.listdir(path)) == [
        "0.metadata",
        "0_0.safetensors",
        "0_0.safetensors.sums",
        "COMMIT",
        "index.fences",
        "index.keys",
        "index.pieces",
        "index.starts",
        "metadata.json",
    ]
    t = fresh_targets()
    rep = ck.load_state_dict(t, str(path))
    assert np.array_equal(bits(t["w"]), bits(sd["w"]))
    assert np.array_equal(bits(t["i64"]), bits(sd["i64"]))
    assert t["scalar"].shape == [] and np.array_equal(bits(t["scalar"]), bits(sd["scalar"]))
    assert str(t["bf"].dtype) == "paddle.bfloat16" and np.array_equal(bits(t["bf"]), bits(sd["bf"]))
    box_want = np.ascontiguousarray(sd["box"].local_tensor.numpy()[1:3, 4:7])
    assert np.array_equal(bits(t["box"].local_tensor), box_want.view(np.uint8).ravel())
    flat_want = sd["flat"].local_tensor.numpy()[5:15]
    assert np.array_equal(bits(t["flat"].local_tensor), flat_want.view(np.uint8).ravel())
    assert t["step"] == 11 and t["cfg"] == sd["cfg"]
    assert sorted(rep.loaded_keys) == sorted(t) and not rep.missing_keys and not rep.unexpected_keys
    assert ck.verify_checkpoint(str(path)) == []


@pytest.mark.parametrize("host_fast_path", [True, False], ids=["memcpy", "copy_"])
def test_load_into_views_of_a_fused_buffer_preserves_sharing(saved, host_fast_path, monkeypatch):
    """Both commit paths (memcpy for host targets, Tensor.copy_ as used for device targets)."""
    if not host_fast_path:  # every target takes the device path
        monkeypatch.setattr(host_memory, "is_host_contiguous", lambda t: False)
    options = ck.CheckpointOptions()
    sd, path = saved
    buf = paddle.full([30], -2.0)
    v = buf._slice(2, 12)  # 10 elements of "flat" [5, 15)
    t = {"flat": flat_sw("flat", v, (7, 3), 5, 15)}
    ck.load_state_dict(t, str(path), options=options)
    got = buf.numpy()
    want = np.full(30, -2.0, dtype=np.float32)
    want[2:12] = sd["flat"].local_tensor.numpy()[5:15]
    assert np.array_equal(got.view(np.uint8), want.view(np.uint8))
    # the view still aliases the buffer after the load
    v.fill_(1.5)
    assert np.all(buf.numpy()[2:12] == 1.5)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_strided_tensors_save_and_load_in_place(tmp_path, async_save):
    base = paddle.arange(24, dtype="float32").reshape([4, 6])
    sd = {"t": base.transpose([1, 0]), "cols": base[:, 1:3]}
    assert not sd["t"].is_contiguous() and not sd["cols"].is_contiguous()
    want_t, want_cols = bits(sd["t"]), bits(sd["cols"])
    h = ck.save_state_dict(sd, str(tmp_path / "c"), async_save=async_save)
    if h is not None:
        del sd
        import gc

        gc.collect()  # host copies made for strided tensors must outlive the caller's references
        h.wait()
    big = paddle.zeros([4, 6])
    target = big[:, 1:3]  # strided view: loaded with Tensor.copy_ in place
    t = {"t": paddle.zeros([6, 4]), "cols": target}
    ck.load_state_dict(t, str(tmp_path / "c"))
    assert np.array_equal(bits(t["t"]), want_t)
    want_big = np.zeros((4, 6), np.float32)
    want_big[:, 1:3] = np.arange(24, dtype=np.float32).reshape(4, 6)[:, 1:3]
    assert np.array_equal(bits(big), want_big.view(np.uint8).ravel()) and np.array_equal(bits(target), want_cols)


@pytest.mark.host_memory_path
def test_async_snapshot_holds_save_time_values_of_the_pieces_this_rank_writes():
    """Volatile records are copied at construction, deferred ones by ``copy_deferred`` (the save's background
    thread); either way the arrays hold the values at save time and the arena is given back by ``written``."""
    from paddle.distributed.fsdp.checkpoint.records import collect
    from paddle.distributed.fsdp.checkpoint.snapshot import Snapshot

    records, _ = collect(make_state())
    want = {r.key: bits(r.tensor) for r in records}
    deferred = {"w", "box"}
    snap = Snapshot(records, lambda r: r.key in deferred)
    assert snap.pending and ck.snapshot_in_flight()
    for r in records:
        if r.key not in deferred:
            paddle.assign(paddle.zeros_like(r.tensor), r.tensor)  # training goes on (volatile: copied already)
    snap.copy_deferred()
    assert not snap.pending and not ck.snapshot_in_flight()
    for r in records:
        paddle.assign(paddle.zeros_like(r.tensor), r.tensor)
    for r, arr in zip(records, snap.arrays):
        assert np.array_equal(np.asarray(arr).view(np.uint8).ravel(), want[r.key]), r.key
    assert host_memory.arena.acquire(1, grow=False) is None  # still held for the background write
    snap.written()
    assert host_memory.arena.acquire(1, grow=False) is not None
    host_memory.arena.release()


def test_load_full_state_dict_and_safetensors_readable(saved):
    sd, path = saved
    full = ck.load_full_state_dict(str(path))
    assert sorted(full) == ["bf", "box", "flat", "i64", "scalar", "w"]
    for k in ("w", "i64", "scalar", "bf", "box"):
        want = sd[k].local_tensor if isinstance(sd[k], ShardedWeight) else sd[k]
        assert full[k].shape == want.shape and np.array_equal(bits(full[k]), bits(want)), k
    assert full["flat"].shape == [7, 3]
    assert np.array_equal(bits(full["flat"]), bits(sd["flat"].local_tensor))
    assert ck.load_full_state_dict(str(path), keys=["step"]) == {"step": 11}
    from safetensors import safe_open

    with safe_open(str(data_file(path)), framework="np") as f:
        assert np.array_equal(f.get_tensor("w"), sd["w"].numpy())
        assert np.array_equal(f.get_tensor("flat"), sd["flat"].local_tensor.numpy())


def test_save_replaces_committed_checkpoint_atomically(tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    a = {"x": paddle.full([4], 1.0)}
    ck.save_state_dict(a, str(path))
    first_id = ck.read_metadata(str(path)).checkpoint_id
    ck.save_state_dict({"x": paddle.full([4], 2.0)}, str(path))
    # without renameat2 the two-rename fallback gives the same result
    monkeypatch.setattr(libc, "renameat2_exchange", lambda a, b: False)
    ck.save_state_dict({"x": paddle.full([4], 3.0)}, str(path))
    t = {"x": paddle.zeros([4])}
    ck.load_state_dict(t, str(path))
    assert np.all(t["x"].numpy() == 3.0)
    assert ck.read_metadata(str(path)).checkpoint_id != first_id
    for th in __import__("threading").enumerate():
        if th.name == "ckpt-rm-old":
            th.join()
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no staging or old directories left behind
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("precious")
    ck.save_state_dict(a, str(foreign))  # as stock: a trainer's output directory; its entries are kept
    assert (foreign / "keep.txt").read_text() == "precious"
    assert "COMMIT" in os.listdir(foreign)


def test_async_save_round_trip_and_failure_surfaces(tmp_path, monkeypatch):
    src = paddle.rand([1000])
    want = bits(src)
    h = ck.save_state_dict({"x": src}, str(tmp_path / "a"), async_save=True)
    src.fill_(0.0)  # after return the snapshot is taken: changing the tensor must not matter
    h.wait()
    assert h.done()
    t = {"x": paddle.zeros([1000])}
    ck.load_state_dict(t, str(tmp_path / "a"))
    assert np.array_equal(bits(t["x"]), want)

    def boom(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer, "write_rank_file", boom)
    h = ck.save_state_dict({"x": src}, str(tmp_path / "b"), async_save=True)
    with pytest.raises(ck.SaveFailedError, match="rank 0 failed: OSError: .*No space left"):
        h.wait()
    h.wait()  # reported once
    h = ck.save_state_dict({"x": src}, str(tmp_path / "c"), async_save=True)
    while not h.done():  # let it fail in the background, without collecting the error
        time.sleep(0.01)
    monkeypatch.undo()
    ck.load_state_dict({"x": paddle.zeros([1000])}, str(tmp_path / "a"))  # a load does not consume the error
    with pytest.raises(ck.SaveFailedError, match="No space left"):  # not waited: the next save raises it
        ck.save_state_dict({"x": src}, str(tmp_path / "d"))
    ck.save_state_dict({"x": src}, str(tmp_path / "d"))
    for name in ("b", "c"):  # a failed save commits nothing and leaves nothing behind (issue 29: no staging)
        assert not (tmp_path / name).exists()
        assert not list(tmp_path.glob(f"{name}.tmp-*"))
        with pytest.raises(ck.NotACheckpointError, match="no such directory"):
            ck.read_metadata(str(tmp_path / name))


def test_stock_index_matches_stock_save_and_stock_loader_reads_it(tmp_path):
    from paddle.distributed.flex_checkpoint.dcp.load_state_dict import load_state_dict as stock_load
    from paddle.distributed.flex_checkpoint.dcp.save_state_dict import save_state_dict as stock_save

    w, b = paddle.rand([6, 4]), paddle.rand([10])
    sd = {"w": w, "b": b, "flat": flat_sw("flat", paddle.rand([15]), (5, 3), 0, 15)}
    ck.save_state_dict(sd, str(tmp_path / "ours"))
    stock_save(sd, str(tmp_path / "stock"), safetensors=True)
    ours = paddle.load(str(tmp_path / "ours" / "0.metadata"))  # the test may unpickle; the engine never does
    theirs = paddle.load(str(tmp_path / "stock" / "0.metadata"))
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_metadata == theirs.storage_metadata
    assert ours.flat_mapping == theirs.flat_mapping
    t = {"w": paddle.zeros([6, 4]), "b": paddle.zeros([10])}
    stock_load(t, str(tmp_path / "ours"), safetensors=True)
    assert np.array_equal(bits(t["w"]), bits(w)) and np.array_equal(bits(t["b"]), bits(b))


# ------------------------------------------------------------------------------------------ error cases


@pytest.mark.parametrize(
    "mutate, err, match",
    [
        (lambda t: t.update(nope=paddle.zeros([2])), ck.MissingKeyError, "'nope'"),
        (lambda t: t.update(w=paddle.zeros([4, 6])), ck.ShapeMismatchError, "'w'"),
        (lambda t: t.update(i64=paddle.zeros([25], dtype="int32")), ck.DtypeMismatchError, "'i64'"),
        (lambda t: t.update(bf=paddle.zeros([5, 3], dtype="float16")), ck.DtypeMismatchError, "'bf'"),
    ],
)
def test_mismatch_errors_name_the_key_and_leave_targets_identical(saved, mutate, err, match):
    _, path = saved
    t = fresh_targets()
    mutate(t)
    before = snapshot(t)
    with pytest.raises(err, match=match):
        ck.load_state_dict(t, str(path))
    assert_unchanged(t, before)
    assert t["step"] is None


def test_strict_false_loads_the_matching_subset(saved):
    sd, path = saved
    t = fresh_targets()
    t["nope"] = paddle.zeros([2])
    t["w"] = paddle.zeros([4, 6])
    rep = ck.load_state_dict(t, str(path), strict=False)
    assert rep.missing_keys == ["nope"]
    assert "w" in rep.mismatched_keys and "shape" in rep.mismatched_keys["w"]
    assert "w" not in rep.loaded_keys and "i64" in rep.loaded_keys
    assert np.array_equal(bits(t["i64"]), bits(sd["i64"]))
    assert np.all(t["w"].numpy() == 0)
    rep = ck.load_state_dict({"i64": paddle.zeros([25], dtype="int64")}, str(path))
    assert "w" in rep.unexpected_keys and "step" in rep.unexpected_keys


def _corrupt(kind, path: Path):
    f = data_file(path)
    if kind == "truncated":
        with open(f, "r+b") as fh:
            fh.truncate(f.stat().st_size - 3)
    elif kind == "flipped":
        md = metadata_json(path)
        off = md["tensors"]["w"]["pieces"][0]["offset"] + 5
        raw = bytearray(f.read_bytes())
        raw[off] ^= 0x10
        f.write_bytes(bytes(raw))
    elif kind == "missing_file":
        f.unlink()
    elif kind == "uncommitted":
        (path / "COMMIT").unlink()
    elif kind == "damaged_metadata":
        raw = bytearray((path / "metadata.json").read_bytes())
        raw[40] ^= 0x01
        (path / "metadata.json").write_bytes(bytes(raw))
    elif kind == "traversal":

        def fn(md):
            md["files"]["../evil.safetensors"] = md["files"].pop("0_0.safetensors")
            for tm in md["tensors"].values():
                for p in tm["pieces"]:
                    p["file"] = "../evil.safetensors"

        rewrite_metadata(path, fn)
    elif kind == "absolute":

        def fn(md):
            md["files"]["/etc/passwd"] = md["files"].pop("0_0.safetensors")
            for tm in md["tensors"].values():
                for p in tm["pieces"]:
                    p["file"] = "/etc/passwd"

        rewrite_metadata(path, fn)
    elif kind == "symlink_escape":
        outside = path.parent / "outside.safetensors"
        shutil.copy(f, outside)
        f.unlink()
        os.symlink(outside, f)
    else:
        raise AssertionError(kind)


@pytest.mark.parametrize(
    "kind, err, match",
    [
        ("truncated", ck.CorruptCheckpointError, "0_0.safetensors"),
        ("flipped", ck.CorruptCheckpointError, "checksum mismatch .* key 'w'"),
        ("missing_file", ck.CorruptCheckpointError, "missing"),
        ("uncommitted", ck.IncompleteCheckpointError, "COMMIT"),
        ("damaged_metadata", ck.MetadataError, "metadata.json"),
        ("traversal", ck.UnsafePathError, r"\.\./evil"),
        ("absolute", ck.UnsafePathError, "/etc/passwd"),
        ("symlink_escape", ck.UnsafePathError, "outside"),
    ],
)
@pytest.mark.parametrize("atomic", [False, True], ids=["bounded", "atomic"])
def test_damaged_checkpoint_raises_named_error_and_leaves_targets_identical(saved, kind, err, match, atomic):
    """Everything but damaged data is found before any byte is written (targets identical in both modes);
    damaged data is found while reading: atomic=True restores, the default stops with PartiallyLoadedError."""
    _, path = saved
    _corrupt(kind, path)
    t = fresh_targets()
    before = snapshot(t)
    mid_load = kind == "flipped" and not atomic
    with pytest.raises(ck.PartiallyLoadedError if mid_load else err, match=match):
        ck.load_state_dict(t, str(path), atomic=atomic)
    if not mid_load:
        assert_unchanged(t, before)
    assert t["step"] is None and t["cfg"] is None
    assert ck.verify_checkpoint(str(path)), "verify_checkpoint found nothing wrong"


@pytest.mark.parametrize("algorithm", ["xxh3-64", "crc32"])
def test_checksum_algorithms_verify_and_detect_a_flipped_bit(tmp_path, monkeypatch, algorithm):
    """Both algorithms are written as chosen, recorded, checked against an independent digest of the file's
    bytes, and catch one flipped bit; checkpoints that call the list ``crc32`` (written before xxh3-64) load."""
    import zlib

    import xxhash

    fn = {"xxh3-64": xxhash.xxh3_64_intdigest, "crc32": zlib.crc32}[algorithm]
    monkeypatch.setenv("PADDLE_FSDP_CKPT_CHECKSUM", algorithm)
    sd = make_state()
    path = tmp_path / "ckpt"
    ck.save_state_dict(sd, str(path))
    md = metadata_json(path)
    assert md["checksum"] == algorithm
    raw = data_file(path).read_bytes()
    C = md["chunk_bytes"]
    for key, tm in md["tensors"].items():
        for p in tm["pieces"]:
            piece = raw[p["offset"] : p["offset"] + p["nbytes"]]
            assert p["checksums"] == [fn(piece[i : i + C]) for i in range(0, len(piece), C)], key
    if algorithm == "crc32":

        def legacy(m):  # the field name of checkpoints written before xxh3-64
            for tm in m["tensors"].values():
                for p in tm["pieces"]:
                    p["crc32"] = p.pop("checksums")

        rewrite_metadata(path, legacy)
    monkeypatch.delenv("PADDLE_FSDP_CKPT_CHECKSUM")
    t = fresh_targets()
    ck.load_state_dict(t, str(path))
    assert np.array_equal(bits(t["w"]), bits(sd["w"]))
    assert ck.verify_checkpoint(str(path)) == []
    _corrupt("flipped", path)
    t = fresh_targets()
    before = snapshot(t)
    with pytest.raises(ck.CorruptCheckpointError, match="checksum mismatch .* key 'w'"):
        ck.load_state_dict(t, str(path), atomic=True)
    assert_unchanged(t, before)
    assert any("checksum mismatch" in p for p in ck.verify_checkpoint(str(path)))


def test_checksum_none_is_written_and_loads(tmp_path, monkeypatch):
    """``checksum="none"`` (documented: nothing to verify) is accepted by the option and by the environment
    variable, recorded, written without chunk checksums, and loads back bit-exact."""
    sd = make_state()
    for how in ("option", "env"):
        path = tmp_path / how
        if how == "env":
            monkeypatch.setenv("PADDLE_FSDP_CKPT_CHECKSUM", "none")
            ck.save_state_dict(sd, str(path))
            monkeypatch.delenv("PADDLE_FSDP_CKPT_CHECKSUM")
        else:
            ck.save_state_dict(sd, str(path), options=ck.CheckpointOptions(checksum="none"))
        md = metadata_json(path)
        assert md["checksum"] == "none"
        assert all(not p["checksums"] for tm in md["tensors"].values() for p in tm["pieces"])
        t = fresh_targets()
        ck.load_state_dict(t, str(path))
        assert np.array_equal(bits(t["w"]), bits(sd["w"]))
        assert ck.verify_checkpoint(str(path)) == []


def test_unknown_checksum_algorithm_is_refused_before_writing(tmp_path, monkeypatch):
    monkeypatch.setenv("PADDLE_FSDP_CKPT_CHECKSUM", "md5")
    with pytest.raises(ck.CheckpointError, match="PADDLE_FSDP_CKPT_CHECKSUM='md5'"):
        ck.save_state_dict(make_state(), str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.host_memory_path
def test_whole_pieces_are_read_in_place_and_restored_when_the_atomic_load_fails(tmp_path, monkeypatch):
    """atomic=True: tensors whose bytes are whole saved pieces are read straight into their memory (no staging
    copy after the status exchange); when a later piece is damaged, every one of them gets its previous bytes
    back."""
    from paddle.distributed.fsdp.checkpoint.load import inplace

    paddle.seed(11)
    sd = {f"t{i}": paddle.rand([700, 1000]) for i in range(4)}  # 2.8 MB each: several checksum chunks
    path = tmp_path / "ckpt"
    ck.save_state_dict(sd, str(path))
    seen = {}
    real_init = inplace.InPlaceReads.__init__

    def spy_init(self, regions, undo):
        seen["regions"] = sorted(key for key, _piece, _dst in regions)
        real_init(self, regions, undo)

    monkeypatch.setattr(inplace.InPlaceReads, "__init__", spy_init)
    targets = {k: paddle.full([700, 1000], -1.0) for k in sd}
    ptrs = {k: t.data_ptr() for k, t in targets.items()}
    ck.load_state_dict(targets, str(path), atomic=True)
    assert seen["regions"] == sorted(sd)
    for k in sd:
        assert targets[k].data_ptr() == ptrs[k] and np.array_equal(bits(targets[k]), bits(sd[k])), k

    md = metadata_json(path)
    last = max((tm["pieces"][0]["offset"], k) for k, tm in md["tensors"].items())[1]
    raw = bytearray(data_file(path).read_bytes())
    raw[md["tensors"][last]["pieces"][0]["offset"] + 2_500_000] ^= 0x01  # in the last chunk of the last piece
    data_file(path).write_bytes(bytes(raw))
    seen.clear()
    targets = {k: paddle.full([700, 1000], float(i)) for i, k in enumerate(sd)}
    before = {k: bits(t) for k, t in targets.items()}
    with pytest.raises(ck.CorruptCheckpointError, match=f"checksum mismatch .* key '{last}'"):
        ck.load_state_dict(targets, str(path), atomic=True)
    assert seen["regions"] == sorted(sd)  # all were written in place before the mismatch was known
    for k, t in targets.items():
        assert np.array_equal(bits(t), before[k]), f"{k} not restored"


def test_aliasing_targets_are_not_read_in_place(tmp_path, monkeypatch):
    from paddle.distributed.fsdp.checkpoint.load import atomic as ck_load_mod

    sd = {"a": paddle.rand([4, 300_000]), "b": paddle.rand([4, 300_000])}
    ck.save_state_dict(sd, str(tmp_path / "c"))
    base = paddle.zeros([4, 300_000])
    got = {}
    real = ck_load_mod._in_place_regions

    def spy(reads, *args):
        regions, rest = real(reads, *args)
        got["in_place"] = [key for key, _p, _d in regions]
        return regions, rest

    monkeypatch.setattr(ck_load_mod, "_in_place_regions", spy)
    t = {"a": base, "b": base}  # one memory for both keys: no undo order could restore it safely
    ck.load_state_dict(t, str(tmp_path / "c"), atomic=True)
    assert got["in_place"] == []
    assert np.array_equal(bits(base), bits(sd["b"])) or np.array_equal(bits(base), bits(sd["a"]))


def test_not_a_checkpoint(tmp_path):
    with pytest.raises(ck.NotACheckpointError, match="no such directory"):
        ck.load_state_dict({"x": paddle.zeros([1])}, str(tmp_path / "nothing"))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("hi")
    t = {"x": paddle.full([3], 4.0)}
    with pytest.raises(ck.NotACheckpointError, match="notes.txt"):
        ck.load_state_dict(t, str(tmp_path / "other"))
    assert np.all(t["x"].numpy() == 4.0)
    assert ck.verify_checkpoint(str(tmp_path / "other"))[0].startswith("NotACheckpointError")


def test_interrupted_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ckpt"
    ck.save_state_dict({"x": paddle.full([8], 1.0)}, str(path))

    def crash(*a, **k):
        raise KeyboardInterrupt("killed during commit")

    monkeypatch.setattr(writer, "replace_dir", crash)
    with pytest.raises(KeyboardInterrupt):
        ck.save_state_dict({"x": paddle.full([8], 2.0)}, str(path))
    monkeypatch.undo()
    t = {"x": paddle.zeros([8])}
    ck.load_state_dict(t, str(path))
    assert np.all(t["x"].numpy() == 1.0)
    staging = [p for p in tmp_path.iterdir() if p.name.startswith("ckpt.tmp-")]
    assert len(staging) == 1
    # the staging dir was complete up to the rename: it is loadable on its own, never at `path`
    assert ck.verify_checkpoint(str(staging[0])) == []
    (staging[0] / "COMMIT").unlink()  # as if killed before the commit record
    with pytest.raises(ck.IncompleteCheckpointError, match="COMMIT"):
        ck.load_state_dict({"x": paddle.zeros([8])}, str(staging[0]))
    assert "IncompleteCheckpointError" in ck.verify_checkpoint(str(staging[0]))[0]


def test_verify_checkpoint_finds_problems(saved):
    _, path = saved
    assert ck.verify_checkpoint(str(path)) == []
    backup = data_file(path).read_bytes()
    _corrupt("flipped", path)
    probs = ck.verify_checkpoint(str(path))
    assert len(probs) == 1 and "checksum mismatch" in probs[0] and "'w'" in probs[0]
    data_file(path).write_bytes(backup)
    _corrupt("truncated", path)
    assert any("bytes, expected" in p for p in ck.verify_checkpoint(str(path)))
    data_file(path).write_bytes(backup)
    _corrupt("missing_file", path)
    assert any("missing" in p for p in ck.verify_checkpoint(str(path)))
    data_file(path).write_bytes(backup)
    assert ck.verify_checkpoint(str(path)) == []

    def overlap(md):  # "w" gets a second piece covering rows 2..4 again
        p = dict(md["tensors"]["w"]["pieces"][0])
        p.update(box_offset=[2, 0], box_shape=[2, 4], nbytes=32, checksums=p["checksums"])
        md["tensors"]["w"]["pieces"].append(p)

    rewrite_metadata(path, overlap)
    probs = ck.verify_checkpoint(str(path))
    assert any("overlapping" in p and "'w'" in p for p in probs), probs


def test_save_rejects_bad_records(tmp_path):
    with pytest.raises(ck.InvalidStateDictError, match="'obj'"):
        ck.save_state_dict({"obj": object()}, str(tmp_path / "a"))
    with pytest.raises(ck.InvalidStateDictError, match="'f'.*elements"):
        ck.save_state_dict({"f": flat_sw("f", paddle.zeros([3]), (4,), 0, 4)}, str(tmp_path / "b"))
    with pytest.raises(ck.InvalidStateDictError, match="cover"):  # one rank holding part of a tensor
        ck.save_state_dict({"f": flat_sw("f", paddle.zeros([2]), (4,), 0, 2)}, str(tmp_path / "c"))
    assert not any(p.name.startswith(("a", "b", "c")) for p in tmp_path.iterdir())


def test_range_reads_touch_only_needed_bytes(tmp_path):
    """A rank that needs 1/8 of a 16 MiB param reads about that much (plus chunk alignment), not the file."""
    n = 4 << 20  # 16 MiB of fp32
    src = paddle.rand([n])
    ck.save_state_dict({"p": flat_sw("p", src, (n,), 0, n)}, str(tmp_path / "c"))
    a, b = 3 * n // 8 + 12345, n // 2 + 12345
    t = {"p": flat_sw("p", paddle.zeros([b - a]), (n,), a, b)}
    rep = ck.load_state_dict(t, str(tmp_path / "c"))
    assert np.array_equal(bits(t["p"].local_tensor), src.numpy()[a:b].view(np.uint8))
    need = (b - a) * 4
    assert need <= rep.bytes_read <= need + 2 * (1 << 20), rep.bytes_read


# ------------------------------------------------------------------------------------------ multi-process


def test_multi_process_save_2_load_1_2_3(tmp_path, launch):
    d = tmp_path / "mp"
    d.mkdir()
    r = launch(WORKER, 2, ["save", str(d)], timeout=300)
    for rank in (0, 1):
        res = r.result(rank)
        assert all(v == "ok" for v in res.values()) and len(res) == 7, res
    # 1 process: load in this process (no collectives)
    w = _worker_module()
    full = w.full_arrays()
    for name in ("sync", "async"):
        targets, checks = w.load_targets(0, 1)
        rep = ck.load_state_dict(targets, str(d / name))
        w.check_loaded(targets, checks, full, rep)
    w.case_all_or_nothing(0, 1, str(d), full, ck)
    full_loaded = ck.load_full_state_dict(str(d / "sync"))
    for key in w.SPEC:
        assert np.array_equal(bits(full_loaded[key]), w.expected_bits(full, key)), key
    r = launch(WORKER, 3, ["load", str(d)], timeout=300)
    for rank in (0, 1, 2):
        res = r.result(rank)
        assert all(v == "ok" for v in res.values()) and len(res) == 3, res


def test_options_from_env_are_read_at_call_time_and_validated(tmp_path, monkeypatch):
    """The PADDLE_FSDP_CKPT_* fallback is read when a save/load runs (not at import), malformed values are named
    errors, and explicit options win over the environment."""
    import dataclasses

    monkeypatch.setenv("PADDLE_FSDP_CKPT_COMMIT_TIMEOUT", "12.5")
    monkeypatch.setenv("PADDLE_FSDP_CKPT_ODIRECT", "0")
    monkeypatch.setenv("PADDLE_FSDP_CKPT_IN_PLACE", "0")
    monkeypatch.setenv("PADDLE_FSDP_CKPT_CHECKSUM", "crc32")
    o = ck.CheckpointOptions.from_env()
    assert (o.commit_timeout, o.odirect, o.in_place, o.checksum) == (12.5, False, False, "crc32")
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.trace = True
    ck.save_state_dict({"x": paddle.ones([4])}, str(tmp_path / "env"))
    assert ck.read_metadata(str(tmp_path / "env")).checksum == "crc32"
    ck.save_state_dict({"x": paddle.ones([4])}, str(tmp_path / "opt"), options=ck.CheckpointOptions())
    assert ck.read_metadata(str(tmp_path / "opt")).checksum == "xxh3-64"
    monkeypatch.setenv("PADDLE_FSDP_CKPT_READ_SLAB", "lots")
    with pytest.raises(ck.CheckpointError, match="PADDLE_FSDP_CKPT_READ_SLAB='lots'"):
        ck.load_state_dict({"x": paddle.zeros([4])}, str(tmp_path / "env"))
    with pytest.raises(ck.CheckpointError, match="checksum='md5'"):
        ck.CheckpointOptions(checksum="md5")


def test_trace_hook_receives_the_phases_of_every_save_and_load(tmp_path):
    records = []
    options = ck.CheckpointOptions(trace_hook=records.append)
    ck.save_state_dict({"x": paddle.ones([4])}, str(tmp_path / "c"), options=options)
    ck.load_state_dict({"x": paddle.zeros([4])}, str(tmp_path / "c"), options=options)
    assert [r.what for r in records] == ["save rank 0", "save (calling thread)", "load"]
    assert [name for name, _ in records[0].marks][-1] == "rename"
    assert [name for name, _ in records[2].marks][:2] == ["metadata", "validate"]
    assert all(r.total >= sum(d for _, d in r.marks) - 1e-9 for r in records)
    ck.load_state_dict({"x": paddle.zeros([4])}, str(tmp_path / "c"))  # no hook: nothing recorded
    assert len(records) == 3


def test_strict_json_refuses_long_integers_in_flat_lists_and_parses_the_rest():
    """Integer lists (checksums, RNG words) are bounds-checked in one C-speed pass, both signs."""
    from paddle.distributed.fsdp.checkpoint.format import strict_json

    long = "1" + "0" * strict_json.MAX_INT_DIGITS
    for text in (f"[1, 2, {long}]", f"[1, -{long}]", f'{{"a": [0, {long}]}}', f'{{"a": {long}}}'):
        with pytest.raises(ck.MetadataError, match="digits"):
            strict_json.loads_strict(text.encode(), "t")
    assert strict_json.loads_strict(b'{"a": [1, -2, 18446744073709551615], "b": [1.5, "x", null]}', "t") == {
        "a": [1, -2, 18446744073709551615],
        "b": [1.5, "x", None],
    }


def test_page_cache_fraction_of_a_large_file_is_sampled_and_right(tmp_path):
    """Large files are asked about in evenly spaced windows: half the file evicted reads as about half."""
    data = np.random.default_rng(3).integers(0, 255, 64 << 20, dtype=np.uint8)
    f = tmp_path / "big"
    f.write_bytes(data.tobytes())
    fd = os.open(f, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.read(fd, len(data))
        assert libc.page_cache_fraction(fd, len(data)) > 0.9
        os.posix_fadvise(fd, len(data) // 2, 0, os.POSIX_FADV_DONTNEED)
        assert 0.35 < libc.page_cache_fraction(fd, len(data)) < 0.65
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        assert libc.page_cache_fraction(fd, len(data)) < 0.1
    finally:
        os.close(fd)


def test_commit_timeout_is_an_option_not_a_keyword(tmp_path):
    """Every "how" of a save is in CheckpointOptions (issue #31): ``commit_timeout=`` as a keyword is refused,
    naming it, and nothing is written; the option works."""
    sd = {"w": paddle.ones([2])}
    with pytest.raises(TypeError, match="commit_timeout"):
        ck.save_state_dict(sd, str(tmp_path / "c"), commit_timeout=5)
    assert not (tmp_path / "c").exists()
    ck.save_state_dict(sd, str(tmp_path / "c"), options=ck.CheckpointOptions(commit_timeout=5))
    assert ck.verify_checkpoint(str(tmp_path / "c")) == []
