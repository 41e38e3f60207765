"""Checkpoints of many small tensors (a mixture of experts has ~10^5 keys): the bookkeeping paths.

* Tiny reads (optimizer scalars, small tensors, a few rows of a box) of neighbouring file bytes share one read,
  every chunk they come from still verified: exact values, few reads, a flipped byte named by its key.
* The fast path of the metadata parser accepts exactly what the field by field checks accept (seeded mutations
  of every field of a piece entry), so every refusal still names its field.
* The fast path of state-dict records (FSDP's flattened whole-tensor ShardedWeights) gives the general path's
  record or error for seeded mutations of every field; FSDP's cached piece views are reused only while they
  still cover their piece of the shard.
* The garbage collector pause nests, overlaps across threads and never turns on a collector the application
  turned off.
"""

from __future__ import annotations

import copy
import gc
import threading

import numpy as np
import paddle
import paddle.distributed.fsdp.checkpoint as ck
import pytest
from crafted import metadata_json
from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight
from paddle.distributed.fsdp import FullyShardFusion
from paddle.distributed.fsdp.checkpoint import reader, records, regions
from paddle.distributed.fsdp.checkpoint.errors import MetadataError
from paddle.distributed.fsdp.checkpoint.format import metadata as md_format
from paddle.distributed.fsdp.checkpoint.format import schema, versions
from paddle.distributed.fsdp.checkpoint.gc_pause import gc_paused

CHUNK = 4096


@pytest.fixture(scope="module")
def small_tensors(tmp_path_factory):
    """300 tensors of 1-40 floats, a [64, 8] matrix and a [2048, 8] one, saved whole in one file."""
    rng = np.random.default_rng(3)
    sd = {
        f"t{i}": paddle.to_tensor(rng.standard_normal(int(rng.integers(1, 41))).astype("float32")) for i in range(300)
    }
    sd["rows"] = paddle.to_tensor(rng.standard_normal((64, 8)).astype("float32"))
    sd["tall"] = paddle.to_tensor(rng.standard_normal((2048, 8)).astype("float32"))
    path = tmp_path_factory.mktemp("many") / "ckpt"
    ck.save_state_dict(sd, str(path), chunk_bytes=CHUNK)
    return path, {k: v.numpy() for k, v in sd.items()}


def _box(full: np.ndarray, cols: slice) -> ShardedWeight:
    """A target of some columns of a saved matrix: rows of a few bytes each, scattered over the piece."""
    n = cols.stop - cols.start
    return ShardedWeight(
        key="",
        local_tensor=paddle.zeros([full.shape[0], n]),
        local_shape=(full.shape[0], n),
        global_shape=full.shape,
        global_offset=(0, cols.start),
    )


def _targets(full: dict) -> dict:
    out = {k: paddle.zeros(v.shape) for k, v in full.items() if k.startswith("t")}
    out["rows"] = _box(full["rows"], slice(2, 5))  # 64 segments of 12 bytes: one tiny scattered read
    out["tall"] = _box(full["tall"], slice(0, 1))  # 8 KiB of data spread over 64 KiB: beyond a small window
    return out


def _value(t) -> np.ndarray:
    return (t.local_tensor if isinstance(t, ShardedWeight) else t).numpy()


def _count_reads(monkeypatch) -> list:
    seen: list = []
    real = reader.os.preadv

    def counting(fd, buffers, offset, *flags):
        seen.append(offset)
        return real(fd, buffers, offset, *flags)

    monkeypatch.setattr(reader.os, "preadv", counting)
    return seen


@pytest.mark.parametrize("budget", [None, 64 << 10], ids=["default-budget", "24KiB-windows"])
def test_tiny_reads_share_reads_and_load_exact_values(small_tensors, monkeypatch, budget):
    path, full = small_tensors
    targets = _targets(full)
    seen = _count_reads(monkeypatch)
    report = ck.load_state_dict(targets, str(path), max_host_bytes=budget)
    for k, want in full.items():
        got = _value(targets[k])
        expect = want[:, 2:5] if k == "rows" else want[:, 0:1] if k == "tall" else want
        np.testing.assert_array_equal(got, expect, err_msg=k)
    # 300 tensors and the 3 columns of "rows" lie next to each other: a few reads, not one per tensor ("tall",
    # wider than a 24 KiB window, is read on its own through windows)
    assert len(seen) <= (6 if budget is None else 12), len(seen)
    assert report.peak_host_bytes <= report.host_budget


@pytest.mark.parametrize("verify", [True, False])
def test_a_flipped_byte_in_one_tiny_tensor_is_named(small_tensors, tmp_path, verify):
    import shutil

    path, full = small_tensors
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    md = ck.read_metadata(str(bad))
    piece = md.tensors["t150"].pieces[0]
    data = bad / piece.file
    raw = bytearray(data.read_bytes())
    raw[piece.offset + piece.nbytes - 1] ^= 0x20
    data.write_bytes(bytes(raw))
    targets = _targets(full)
    if not verify:  # unverified: the damaged bytes arrive as they are, every other tensor exact
        ck.load_state_dict(targets, str(bad), verify_checksums=False)
        got = targets["t150"].numpy().view(np.uint8).ravel()
        assert got[-1] == full["t150"].view(np.uint8).ravel()[-1] ^ 0x20
        np.testing.assert_array_equal(targets["t149"].numpy(), full["t149"])
        return
    with pytest.raises(ck.PartiallyLoadedError, match="checksum mismatch .*'t150'"):
        ck.load_state_dict(targets, str(bad))
    before = {k: _value(v).copy() for k, v in _targets(full).items()}
    atomic_targets = _targets(full)
    with pytest.raises(ck.CorruptCheckpointError, match="checksum mismatch .*'t150'"):
        ck.load_state_dict(atomic_targets, str(bad), atomic=True)
    for k, v in atomic_targets.items():  # all-or-nothing: every target as it was
        np.testing.assert_array_equal(_value(v), before[k], err_msg=k)


def test_tiny_gap_keeps_reads_apart_that_are_far_apart(tmp_path, monkeypatch):
    """Scalars stored after large pieces are far apart in the file: each is read alone (nothing in between)."""
    sd = {}
    for i in range(4):
        sd[f"b{i}.big"] = paddle.rand([64, 1024])
        sd[f"b{i}.scalar"] = paddle.rand([1])
    path = tmp_path / "ckpt"
    ck.save_state_dict(sd, str(path), chunk_bytes=64 << 10, options=ck.CheckpointOptions(odirect=False))
    md = ck.read_metadata(str(path))
    scalar_offsets = sorted(md.tensors[f"b{i}.scalar"].pieces[0].offset for i in range(4))
    seen = _count_reads(monkeypatch)
    targets = {k: paddle.zeros(v.shape) for k, v in sd.items()}
    ck.load_state_dict(targets, str(path))
    for k, v in sd.items():
        np.testing.assert_array_equal(targets[k].numpy(), v.numpy(), err_msg=k)
    assert [o for o in seen if o in scalar_offsets] == scalar_offsets
    assert regions.TINY_GAP < min(b - a for a, b in zip(scalar_offsets, scalar_offsets[1:]))


# ------------------------------------------------------------------------------------------ metadata fast path

# values of the wrong type or out of bounds for some field (bools are not integers; 2**62 is the largest dim)
_ODD_VALUES = [None, True, False, -1, 0, 1, 1.0, "3", [], [1], [-1], [1.5], [True], {}, [[1]], [1, 2], [0, 1, 2]]
_ODD_VALUES += [1 << 62, (1 << 62) + 1, 1 << 64, (1 << 64) - 1, "x" * 256, "x" * 70000, [0] * 65]
_FIELDS = ["file", "name", "offset", "nbytes", "box_offset", "box_shape", "flat_range", "checksums"]


def _parse(d: dict, fast: bool, monkeypatch):
    with monkeypatch.context() as m:
        if not fast:
            m.setattr(schema, "_well_formed_piece", lambda pd, cls: None)
        try:
            got = schema.parse_metadata(copy.deepcopy(d), "m.json", md_format.FORMAT_NAME, versions.SINGLE_FILE_VERSION)
        except MetadataError as e:
            return "error", str(e)
        return "ok", got.to_json()


def test_the_parser_fast_path_accepts_exactly_what_the_field_checks_accept(small_tensors, monkeypatch):
    path, _full = small_tensors
    base = metadata_json(path)
    assert _parse(base, True, monkeypatch) == _parse(base, False, monkeypatch)
    rng = np.random.default_rng(17)
    keys = sorted(base["tensors"])
    outcomes = set()
    for _ in range(600):
        d = copy.deepcopy(base)
        pd = d["tensors"][keys[int(rng.integers(0, len(keys)))]]["pieces"][0]
        for _k in range(int(rng.integers(1, 3))):
            field = _FIELDS[int(rng.integers(0, len(_FIELDS)))]
            if rng.random() < 0.15:
                pd.pop(field, None)
            else:
                pd[field] = copy.deepcopy(_ODD_VALUES[int(rng.integers(0, len(_ODD_VALUES)))])
        if rng.random() < 0.1:  # the older spelling of the checksums field
            pd["crc32"] = pd.pop("checksums", [])
        fast, careful = _parse(d, True, monkeypatch), _parse(d, False, monkeypatch)
        assert fast == careful, (pd, fast, careful)
        outcomes.add(fast[0])
    assert outcomes == {"ok", "error"}  # both verdicts were exercised


# ------------------------------------------------------------------------------------------ record fast path

_SHAPES = [(4, 6), [4, 6], (4.0, 6), (True, 6), (-1, 6), (4,), (), (24,), (4, 6, 1), (np.int64(4), 6), None, "46"]
_OFFSETS = [(0, 0), (0.0, 0), [0, 0], (1, 0), (0,), (), (0, 0, 0), np.array([0, 0]), (False, 0), None]
_RANGES = [slice(0, 24), slice(2, 10), slice(None, 8), slice(0, 25), slice(-1, 7), slice(3, 2), slice(0, 8, 1)]
_RANGES += [slice(0, 8, 2), (2, 10), [0, 8], None, slice(0.0, 8), slice(np.int64(2), 10), slice(True, 9)]


def _record_or_error(key: str, sw, fast: bool, monkeypatch):
    with monkeypatch.context() as m:
        if not fast:
            m.setattr(records, "_whole_box_flattened", lambda *args: None)
        try:
            r = records.to_record(key, sw)
        except ck.CheckpointError as e:
            return "error", type(e).__name__, str(e)
        return "ok", r.key, repr(r.region), r.dtype, r.replicated, id(r.tensor)


def test_the_record_fast_path_gives_the_general_paths_record_or_error(monkeypatch):
    tensors = [paddle.zeros([n], dtype=d) for n in (8, 24, 22, 0) for d in ("float32", "bfloat16", "complex64")]
    rng = np.random.default_rng(23)
    outcomes = set()
    for i in range(600):
        sw = ShardedWeight(f"w{i}", tensors[0], (4, 6), (4, 6), (0, 0), True, slice(2, 10))
        for _k in range(int(rng.integers(0, 3))):
            field = int(rng.integers(0, 5))
            if field == 0:
                sw.global_shape = copy.copy(_SHAPES[int(rng.integers(0, len(_SHAPES)))])
            elif field == 1:
                sw.local_shape = copy.copy(_SHAPES[int(rng.integers(0, len(_SHAPES)))])
            elif field == 2:
                sw.global_offset = copy.copy(_OFFSETS[int(rng.integers(0, len(_OFFSETS)))])
            elif field == 3:
                sw.flattened_range = _RANGES[int(rng.integers(0, len(_RANGES)))]
            else:
                sw.local_tensor = tensors[int(rng.integers(0, len(tensors)))]
        fast, careful = (
            _record_or_error(sw.key, sw, True, monkeypatch),
            _record_or_error(sw.key, sw, False, monkeypatch),
        )
        assert fast == careful, (vars(sw), fast, careful)
        outcomes.add(fast[0])
    assert outcomes == {"ok", "error"}  # both verdicts were exercised


def test_piece_views_are_reused_only_while_they_cover_their_piece():
    paddle.seed(3)
    model = paddle.nn.Sequential(paddle.nn.Linear(4, 4), paddle.nn.Linear(4, 2))
    fsdp = FullyShardFusion(model)
    buffer = fsdp.buffers[0]
    index = next(iter(buffer.pieces))
    view = buffer.local_view(index)
    assert buffer.local_view(index) is view  # no new _slice per save or load
    key = next(k for k, _p, b, i in fsdp.managed_parameters() if b is buffer and i == index)
    expected = fsdp.sharded_state_dict()[key].local_tensor.numpy().copy()
    paddle.full(view.shape, 7.0)._share_buffer_to(view)  # someone re-points the handed-out view
    fresh = buffer.local_view(index)
    assert fresh is not view
    np.testing.assert_array_equal(fresh.numpy(), expected)  # the shard's bytes, not the re-pointed memory
    np.testing.assert_array_equal(fsdp.sharded_state_dict()[key].local_tensor.numpy(), expected)
    with paddle.no_grad():
        fresh.scale_(2.0)  # still the shard's memory: the parameter sees it
    np.testing.assert_array_equal(fsdp.sharded_state_dict()[key].local_tensor.numpy(), expected * 2)


# ------------------------------------------------------------------------------------------ gc pause


def test_gc_pause_nests_overlaps_threads_and_keeps_an_application_choice():
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()

    entered, leave = threading.Event(), threading.Event()

    def other_thread():
        with gc_paused():
            entered.set()
            leave.wait(10)

    t = threading.Thread(target=other_thread)
    t.start()
    entered.wait(10)
    with gc_paused():
        pass
    assert not gc.isenabled()  # the other thread's pause is still in progress
    leave.set()
    t.join()
    assert gc.isenabled()

    @gc_paused()
    def decorated():
        return gc.isenabled()

    gc.disable()
    try:
        assert decorated() is False
        assert not gc.isenabled()  # the application turned it off: it stays off
    finally:
        gc.enable()
    with pytest.raises(ValueError), gc_paused():
        raise ValueError("an error inside the pause")
    assert gc.isenabled()
