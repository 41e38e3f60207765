"""Lossy, opt-in moments (issue 52): int8/int4 codes with per-block scales (checkpoint/format/quant.py), the save
transform and load doors (checkpoint/lossy.py), the "quant" field of format 4.

Classes kept here: codec error bounds over a zoo of shapes, block sizes and offsets (odd sizes, zeros, one
element, huge/tiny magnitudes), NaN/inf named; pieces cut anywhere (as ranks cut a fused buffer) give the same
codes and scales as one process quantizing the whole tensor; crafted "quant" fields are named MetadataErrors
(seeded fuzz); a lossy load warns, or is refused under exact=True; the env switch; the 2-rank save read back at 2
ranks, at 1 rank through load_checkpoint, and by load_full_state_dict, all identical (reshard 2 -> 1).
"""

from __future__ import annotations

import json
import sys
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest
from _results import assert_case_ok
from crafted import reseal
from launch_util import run_launch
from paddle.distributed.fsdp.checkpoint.format import quant
from paddle.distributed.fsdp.checkpoint.format.quant import SCHEMES

WORKER = Path(__file__).parent / "workers" / "lossy_moments.py"
if str(WORKER.parent) not in sys.path:  # the workers' models (TinyLM), lossy_drift.py, as other tests import them
    sys.path.insert(0, str(WORKER.parent))


def _values(rng, n: int, kind: str, signed: bool) -> np.ndarray:
    if kind == "zeros":
        x = np.zeros(n, np.float32)
    elif kind == "wide":  # magnitudes over 12 decades in one block: the small ones quantize to 0
        x = (10.0 ** rng.uniform(-14, -2, n)).astype(np.float32)
    else:
        x = rng.standard_normal(n).astype(np.float32) * np.float32(10.0 ** rng.uniform(-8, 2))
    if signed:
        return x * rng.choice([-1, 1], n).astype(np.float32)
    return np.abs(x) ** 2


ZOO = [(n, kind) for n in (1, 2, 3, 127, 128, 129, 255, 1000, 4097) for kind in ("normal", "zeros", "wide")]


@pytest.mark.parametrize("scheme_name", sorted(SCHEMES))
@pytest.mark.parametrize("block", [2, 128, 130])
def test_roundtrip_error_is_bounded_per_block(scheme_name, block):
    """Every element's error is within half a quantization step of its block: |x - x'| <= m / (2 levels) for
    signed codes, |sqrt(v) - sqrt(v')| <= m / (2 levels) for moment2 (one step where a v > 0 below half a step
    keeps the smallest code: never 0); a zero block comes back zero; the sizes."""
    scheme = SCHEMES[scheme_name]
    rng = np.random.default_rng(7)
    for n, kind in ZOO:
        x = _values(rng, n, kind, scheme.signed)
        stored, scales = quant.quantize_whole(x, scheme, block)
        assert stored.dtype == np.dtype(scheme.codes_dtype) and stored.size == scheme.codes_len(n)
        assert scales.dtype == np.float32 and scales.size == quant.nblocks(n, block)
        y = quant.dequantize_range(stored, 0, scales, 0, 0, n, block, scheme)
        assert y.shape == (n,) and y.dtype == np.float32
        mag_x = np.abs(x) if scheme.signed else np.sqrt(x)
        mag_y = np.abs(y) if scheme.signed else np.sqrt(y)
        step = np.repeat(scales, block)[:n] / scheme.levels
        bound = step / 2
        if not scheme.signed:  # a second moment > 0 never comes back 0 (Adam would step by m / eps): at least 1 step
            assert (y[x > 0] > 0).all(), (n, kind)
            bound = np.where((mag_x > 0) & (mag_x < step / 2), step, bound)
        assert (np.abs(mag_x - mag_y) <= bound * (1 + 1e-5) + 1e-30).all(), (n, kind)
        if scheme.signed:
            assert (np.sign(y) * np.sign(x) >= 0).all()
        if kind == "zeros":
            assert not y.any()
        # any window of it reads the same values as the whole (what a resharding reader does)
        for a, b in ((0, n), (n // 3, n - n // 4), (n - 1, n)):
            (c0, c1), (s0, s1) = quant.read_spans(a, b, block, scheme)
            part = quant.dequantize_range(stored[c0:c1], c0, scales[s0:s1], s0, a, b, block, scheme)
            assert np.array_equal(part, y[a:b])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_moments_are_named(bad):
    x = np.ones(300, np.float32)
    x[200] = bad
    for scheme in SCHEMES.values():
        with pytest.raises(quant.NonFiniteError, match="NaN or infinity"):
            quant.quantize_whole(x, scheme)
    with pytest.raises(quant.NonFiniteError, match="negative"):
        quant.quantize_whole(-np.ones(3, np.float32), SCHEMES["uint8-sqrt"])


class ThreadComm:
    """``all_gather_object`` among threads standing for ranks: the save transform's exchange, in one process."""

    def __init__(self, world: int) -> None:
        self.world, self.slots, self.barrier = world, [None] * world, threading.Barrier(world)
        self.local = threading.local()

    def all_gather_object(self, obj):
        self.slots[self.local.rank] = obj
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out


def _quantize_as_ranks(full: dict[str, np.ndarray], cuts: list[int], mode: str, pool_threads: int = 0) -> list[dict]:
    """Each 'rank' holds flat range [cuts[r], cuts[r+1]) of every tensor (ShardedWeights, as FSDP saves them)."""
    import paddle
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight
    from paddle.distributed.fsdp.checkpoint import lossy

    world = len(cuts) - 1
    comm, outs, errors = ThreadComm(world), [None] * world, []

    def rank_main(r: int) -> None:
        comm.local.rank = r
        state = {}
        for key, x in full.items():
            lo, hi = min(cuts[r], x.size), min(cuts[r + 1], x.size)
            if hi > lo:
                t = paddle.to_tensor(x[lo:hi])
                state[key] = ShardedWeight(key, t, x.shape, x.shape, (0,), True, slice(lo, hi))
        state["w.master_weight"] = ShardedWeight(
            "w.master_weight", paddle.ones([2]), (2,), (2,), (0,), True, slice(0, 2)
        )
        try:
            outs[r] = lossy.quantize_state(state, mode, comm, block=16, threads=pool_threads)[0]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
            comm.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return outs


def _assemble(outs: list[dict], key: str, n: int, dtype) -> np.ndarray:
    """The global 1-D tensor ``key`` as the ranks' ShardedWeights cover it; each element exactly once."""
    out, seen = np.zeros(n, dtype), np.zeros(n, np.int64)
    for state in outs:
        v = state.get(key)
        if v is None:
            continue
        fr = v.flattened_range
        out[fr.start : fr.stop] = v.local_tensor.numpy()
        seen[fr.start : fr.stop] += 1
    assert (seen == 1).all(), f"{key}: covered {sorted(set(seen.tolist()))} times"
    return out


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_pieces_cut_anywhere_quantize_like_the_whole_tensor(mode, threads, monkeypatch):
    """Ranks cut a tensor anywhere (odd offsets, inside a block, pieces shorter than a block, a rank holding
    nothing): the codes and scales they store together are those of one process quantizing the whole tensor,
    every code and scale stored exactly once; master weights and other keys pass untouched. Also with each
    piece cut into ranges of two blocks on 3 threads (quant_threads.py)."""
    from paddle.distributed.fsdp.checkpoint import quant_threads

    monkeypatch.setattr(quant_threads, "RANGE_ELEMS", 32)
    rng = np.random.default_rng(11)
    full = {"a.moment1": _values(rng, 101, "normal", True), "a.moment2": _values(rng, 101, "normal", False)}
    for cuts in ([0, 101], [0, 50, 101], [0, 33, 34, 35, 101], [0, 17, 17, 64, 101], [0, 1, 2, 3, 99, 101]):
        outs = _quantize_as_ranks(full, cuts, mode, threads)
        described = outs[0]["__fsdp__.quant"]
        assert all(o["__fsdp__.quant"] == described for o in outs)
        parsed = quant.parse_field(json.loads(json.dumps(described)), "test")
        assert sorted(parsed) == ["a.moment1", "a.moment2"]
        for key, x in full.items():
            q = parsed[key]
            assert all(key not in o for o in outs) and all("w.master_weight" in o for o in outs)
            codes = _assemble(outs, q.codes, q.scheme.codes_len(x.size), q.scheme.codes_dtype)
            scales = _assemble(outs, q.scales, quant.nblocks(x.size, 16), np.float32)
            want_codes, want_scales = quant.quantize_whole(x, q.scheme, 16)
            assert np.array_equal(codes, want_codes), (cuts, key)
            assert np.array_equal(scales, want_scales), (cuts, key)


def test_non_finite_moment_is_stored_exactly_on_every_rank():
    x = np.ones(40, np.float32)
    x[30] = np.nan  # only the second 'rank' sees it: both must keep the key exact
    outs = _quantize_as_ranks({"p.moment1": x, "p.moment2": np.ones(40, np.float32)}, [0, 20, 40], "int8")
    for o in outs:
        assert "p.moment1" in o and "p.moment1@qcodes" not in o and "p.moment2@qcodes" in o
        assert list(o["__fsdp__.quant"]["keys"]) == ["p.moment2"]


def test_a_rank_failing_in_the_transform_fails_every_rank_without_a_hang():
    """One 'rank' holds a malformed moment record: every rank raises the same CheckpointError (the failing one
    still joins the exchange, so no rank waits forever)."""
    import paddle
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight
    from paddle.distributed.fsdp.checkpoint import lossy
    from paddle.distributed.fsdp.checkpoint.errors import CheckpointError

    comm, raised = ThreadComm(2), [None, None]

    def rank_main(r: int) -> None:
        comm.local.rank = r
        n = 3 if r == 1 else 2  # rank 1: 3 elements in a record of 2
        state = {
            "p.moment1": ShardedWeight("p.moment1", paddle.ones([n]), (4,), (4,), (0,), True, slice(2 * r, 2 * r + 2))
        }
        try:
            lossy.quantize_state(state, "int8", comm)
        except Exception as e:  # noqa: BLE001 - compared below
            raised[r] = e

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert all(isinstance(e, CheckpointError) for e in raised), raised
    assert str(raised[0]) == str(raised[1]) and "elements" in str(raised[0])


def test_mode_is_checked():
    from paddle.distributed.fsdp.checkpoint import lossy

    for bad in ("int2", "INT8", "", "None", 8, True, 0):
        with pytest.raises(ValueError, match="'none', 'int8' or 'int4'"):
            lossy.check_mode(bad)
    assert [lossy.check_mode(m) for m in (None, "none", "int8", "int4")] == [None, None, "int8", "int4"]


def test_none_asks_one_save_for_exact_moments_against_the_environment(tmp_path, monkeypatch):
    """``quantize_moments="none"`` (what CheckpointOptions, the env switch and MemoryTier accept) at
    save_checkpoint and CheckpointManager.save: exact moments although PADDLE_FSDP_CKPT_QUANTIZE_MOMENTS=int8
    (it used to be a ValueError at these two doors: no way to ask one save for exact moments)."""
    import paddle.distributed.fsdp.checkpoint as ck

    monkeypatch.setenv("PADDLE_FSDP_CKPT_QUANTIZE_MOMENTS", "int8")
    _model, fsdp, opt = _train_and_save(tmp_path / "exact", "none")
    assert "quant" not in json.loads((tmp_path / "exact" / "metadata.json").read_bytes())
    state = {**fsdp.sharded_state_dict(), **fsdp.optimizer_sharded_state_dict(opt)}
    ck.CheckpointManager(str(tmp_path / "root")).save(1, state, quantize_moments="none")
    assert "quant" not in json.loads((tmp_path / "root" / "step_00000001" / "metadata.json").read_bytes())


# ----------------------------------------------------------------------------------- one process, real saves


def _train_and_save(path: Path, mode, seed: int = 1, **kwargs):
    import paddle
    from models import global_batches, make_model
    from paddle.distributed.fsdp import FullyShardFusion

    model = make_model(seed)
    fsdp = FullyShardFusion(model)
    opt = paddle.optimizer.AdamW(1e-2, parameters=model.parameters())
    for x, y in global_batches(2, 4):
        model(paddle.to_tensor(x), paddle.to_tensor(y)).backward()
        opt.step()
        opt.clear_grad()
    fsdp.save_checkpoint(str(path), optimizer=opt, quantize_moments=mode, **kwargs)
    return model, fsdp, opt


def _fresh(seed: int = 5):
    import paddle
    from models import make_model
    from paddle.distributed.fsdp import FullyShardFusion

    model = make_model(seed)
    fsdp = FullyShardFusion(model)
    return fsdp, paddle.optimizer.AdamW(1e-2, parameters=model.parameters())


@pytest.fixture(scope="module")
def int8_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("lossy") / "int8"
    _train_and_save(path, "int8")
    return path


def test_lossy_load_warns_and_exact_refuses(int8_ckpt):
    from paddle.distributed.fsdp.checkpoint.errors import CheckpointError, LossyCheckpointError
    from paddle.distributed.fsdp.checkpoint.lossy import LossyCheckpointWarning

    md = json.loads((int8_ckpt / "metadata.json").read_bytes())
    assert md["version"] == 4 and "__fsdp__.quant" not in md["values"]
    assert all(k.endswith((".moment1", ".moment2")) for k in md["quant"]["keys"])
    fsdp, opt = _fresh()
    with pytest.warns(LossyCheckpointWarning, match="not bit-exact"):
        fsdp.load_checkpoint(str(int8_ckpt), optimizer=opt)
    fsdp, opt = _fresh()
    before = {k: v.local_tensor.numpy().copy() for k, v in fsdp.sharded_state_dict().items()}
    with pytest.raises(LossyCheckpointError, match="cannot resume bit-exactly") as e:
        fsdp.load_checkpoint(str(int8_ckpt), optimizer=opt, exact=True)
    assert isinstance(e.value, CheckpointError)
    after = {k: v.local_tensor.numpy() for k, v in fsdp.sharded_state_dict().items()}
    assert all(np.array_equal(before[k], after[k]) for k in before)  # refused before anything was written
    fsdp, _ = _fresh()
    with warnings.catch_warnings():
        warnings.simplefilter("error", LossyCheckpointWarning)
        fsdp.load_checkpoint(str(int8_ckpt), model_only=True)  # no moments restored: nothing lossy, no warning


def test_env_switch_quantizes(tmp_path, monkeypatch):
    monkeypatch.setenv("PADDLE_FSDP_CKPT_QUANTIZE_MOMENTS", "int4")
    _train_and_save(tmp_path / "env", None)
    md = json.loads((tmp_path / "env" / "metadata.json").read_bytes())
    assert {q["scheme"] for q in md["quant"]["keys"].values()} == {"int4-absmax", "uint4-sqrt"}
    monkeypatch.setenv("PADDLE_FSDP_CKPT_QUANTIZE_MOMENTS", "none")
    _train_and_save(tmp_path / "off", None)
    md = json.loads((tmp_path / "off" / "metadata.json").read_bytes())
    assert md["version"] == 3 and "quant" not in md
    monkeypatch.setenv("PADDLE_FSDP_CKPT_QUANTIZE_MOMENTS", "int3")
    with pytest.raises(Exception, match="PADDLE_FSDP_CKPT_QUANTIZE_MOMENTS"):
        _train_and_save(tmp_path / "bad", None)


def _mutations(rng, d: dict) -> list[tuple[str, dict]]:
    """Crafted "quant" fields, each with a word its MetadataError must hold."""
    key = sorted(d["quant"]["keys"])[int(rng.integers(len(d["quant"]["keys"])))]
    entry = d["quant"]["keys"][key]
    other = sorted(k for k in d["quant"]["keys"] if k != key)[0]
    out = []

    def with_entry(word, **changes):
        e = {**entry, **changes}
        out.append((word, {"keys": {**d["quant"]["keys"], key: e}}))

    with_entry("unknown scheme", scheme="int3-absmax")
    with_entry("unknown scheme", scheme=7)
    with_entry("block", block=int(rng.choice([0, 1, 3, -128, 1 << 20])))
    with_entry("block", block=128.0)
    with_entry("shape", shape=[-1])
    with_entry("shape", shape="[4]")
    with_entry("too many elements", shape=[1 << 40, 1 << 40])
    with_entry("expected", shape=[int(np.prod(entry["shape"])) + int(rng.integers(1, 300))])
    with_entry("float dtype", dtype="int8")
    with_entry("not in the checkpoint", codes=entry["codes"] + "x")
    with_entry("another key", scales=key)
    with_entry("same key", scales=entry["codes"])
    with_entry("expected", scheme="int4-absmax" if entry["scheme"] == "int8-absmax" else "uint4-sqrt")
    with_entry("share a stored key", codes=d["quant"]["keys"][other]["codes"])
    with_entry("exactly", extra=1)
    out.append(("must be", {"keys": []}))
    out.append(("must be", {"keys": {}, "more": 1}))
    out.append(("must be", [1]))
    param = key.rsplit(".", 1)[0]  # a tensor of the checkpoint (the parameter) declared quantized too
    moved = {k: v for k, v in d["quant"]["keys"].items() if k != key}
    out.append(("both quantized and as a tensor", {"keys": {**moved, param: entry}}))
    return out


def test_crafted_quant_fields_are_named_metadata_errors(int8_ckpt, tmp_path):
    """Seeded fuzz of the "quant" field of a real int8 checkpoint: every crafted field is a MetadataError naming
    the field and what is wrong (never a crash later in a load); a "quant" field in a format-3 checkpoint too."""
    import shutil

    from paddle.distributed.fsdp.checkpoint import read_metadata
    from paddle.distributed.fsdp.checkpoint.errors import MetadataError

    original = json.loads((int8_ckpt / "metadata.json").read_bytes())
    for seed in range(3):
        rng = np.random.default_rng(seed)
        for word, field in _mutations(rng, original):
            path = tmp_path / f"c{seed}"
            shutil.rmtree(path, ignore_errors=True)
            shutil.copytree(int8_ckpt, path)
            reseal(path, json.dumps({**original, "quant": field}).encode())
            with pytest.raises(MetadataError, match="quant") as e:
                read_metadata(str(path))
            assert word in str(e.value), (word, str(e.value))
    path = tmp_path / "v3"
    shutil.copytree(int8_ckpt, path)
    reseal(path, json.dumps({**original, "version": 3}).encode())
    with pytest.raises(MetadataError, match="needs format 4"):
        read_metadata(str(path))


# ------------------------------------------------------------------------------------------- 2 ranks -> 1


@pytest.fixture(scope="module")
def two_rank_saves(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("lossy2")
    result = run_launch(WORKER, 2, [str(workdir)], timeout=600, log_dir=workdir / "logs")
    return workdir, result


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_two_rank_save_reads_back_alike_at_two_ranks_one_rank_and_whole(two_rank_saves, mode):
    """Saved at 2 ranks: what each rank loads back, what one process loads through load_checkpoint (2 -> 1), and
    load_full_state_dict are the same dequantized values, bit for bit; they equal one process quantizing the
    exact moments whole; moments stay within the bound, everything else is bit-exact."""
    from paddle.distributed.fsdp.checkpoint import load_full_state_dict

    workdir, result = two_rank_saves
    assert_case_ok(result, "save_and_reload", 2)
    exact = load_full_state_dict(str(workdir / "exact"))
    lossy = load_full_state_dict(str(workdir / mode))
    assert sorted(exact) == sorted(lossy)
    fsdp, opt = _fresh()
    with pytest.warns(Warning):
        fsdp.load_checkpoint(str(workdir / mode), optimizer=opt)
    one = {
        k: getattr(v, "local_tensor", v).numpy().reshape(-1) for k, v in fsdp.optimizer_sharded_state_dict(opt).items()
    }
    md = json.loads((workdir / mode / "metadata.json").read_bytes())
    cut_inside = 0
    for key in exact:
        x, y = exact[key].numpy().reshape(-1), lossy[key].numpy().reshape(-1)
        name = key.rsplit(".", 1)[-1]
        if name not in ("moment1", "moment2"):
            assert np.array_equal(x, y), key
            continue
        q = quant.parse_field(md["quant"], "t")[key]
        stored, scales = quant.quantize_whole(x, q.scheme, q.block)
        want = quant.dequantize_range(stored, 0, scales, 0, 0, x.size, q.block, q.scheme)
        assert np.array_equal(y, want), key
        assert np.array_equal(one[key], y), key
        for rank in (0, 1):
            piece = np.load(workdir / f"{mode}_rank{rank}.npz")
            if key in piece.files:
                lo = int(piece[key + ":lo"])
                cut_inside += lo % 128 != 0
                assert np.array_equal(piece[key], y[lo : lo + piece[key].size]), (key, rank)
    assert cut_inside > 0  # a rank boundary fell inside a block: the edge exchange was exercised


# ------------------------------------------------------------------------------ drift on a real model (Qwen3)


def test_drift_after_int8_resume_is_small_on_qwen3(tmp_path):
    """PaddleFormers' Qwen3 (tiny random config), AdamW: saved at step 20 exactly and with int8 moments, then 100
    steps after each resume. The int8 resume differs from the exact one (the moments really were quantized) by at
    most 0.02 (measured 4.5e-4 max, 6.8e-5 final; the exact resume repeats the uninterrupted run bit for bit:
    lossy_drift.py run directly, test_checkpoint_resume.py; docs/reports/2026-12-07-lossy-moments.md)."""
    import logging

    from lossy_drift import drift, summary

    curves = drift(("int8",), k=20, steps=100, workdir=str(tmp_path), uninterrupted=False)
    figures = summary(curves)
    logging.getLogger(__name__).info("lossy drift against the exact resume: %s", figures)
    assert len(curves["int8"]) == len(curves["reference"]) == 100
    assert 0 < figures["int8"]["max_abs_diff"] < 0.02, figures
    assert figures["int8"]["final_abs_diff"] < 0.01, figures
    assert curves["reference"][-1] < 0.5 * curves["reference"][0]  # it learned: the drift is measured in training


def _stock_load(state: dict, path: str):
    """Stock paddle's door, ``paddle.distributed.load_state_dict`` (our engine behind it): it returns nothing, so
    the report is rebuilt from what it filled in."""
    import paddle.distributed as dist
    from paddle.distributed.fsdp.checkpoint import LoadReport

    dist.load_state_dict(state, path)
    return LoadReport(loaded_keys=sorted(state))


def test_low_level_doors_save_and_read_quantized_moments(tmp_path):
    """CheckpointManager.save(quantize_moments=) and every engine load of the moments (load_latest,
    load_state_dict) read them dequantized, as load_full_state_dict does, with the warning; other keys exact."""
    import paddle.distributed.fsdp.checkpoint as ck
    from paddle.distributed.fsdp.checkpoint.lossy import LossyCheckpointWarning

    _model, fsdp, opt = _train_and_save(tmp_path / "unused", None)
    state = {**fsdp.sharded_state_dict(), **fsdp.optimizer_sharded_state_dict(opt)}
    saved = {k: getattr(v, "local_tensor", v).numpy().copy() for k, v in state.items()}
    manager = ck.CheckpointManager(str(tmp_path / "root"))
    manager.save(3, state, quantize_moments="int8")
    with pytest.raises(ValueError, match="quantize_moments"):
        manager.save(4, state, quantize_moments="int16")
    whole = ck.load_full_state_dict(str(tmp_path / "root" / "step_00000003"))
    for load in (
        lambda s: manager.load_latest(s),
        lambda s: ck.load_state_dict(s, str(tmp_path / "root" / "step_00000003")),
        lambda s: _stock_load(s, str(tmp_path / "root" / "step_00000003")),
    ):
        fresh, fresh_opt = _fresh()
        fresh.init_optimizer_state(fresh_opt)
        target = {**fresh.sharded_state_dict(), **fresh.optimizer_sharded_state_dict(fresh_opt)}
        with pytest.warns(LossyCheckpointWarning):
            report = load(target)
        assert not report.missing_keys and not report.unexpected_keys
        assert set(report.loaded_keys) == set(saved)
        for k, v in target.items():
            got = getattr(v, "local_tensor", v).numpy()
            if k.endswith((".moment1", ".moment2")):
                assert np.array_equal(got.reshape(-1), whole[k].numpy().reshape(-1)), k
                assert np.abs(got - saved[k]).max() <= np.abs(saved[k]).max() / 250 + 1e-12, k
            else:
                assert np.array_equal(got, saved[k]), k


def test_stock_door_with_aoa_config_names_quantized_moments(int8_ckpt):
    """``dist.load_state_dict(..., aoa_config=)`` reads our checkpoints through the stock-format reader, which
    has no dequantizer: a quantized moment named by a statement (or asked for as a target) is an error saying so
    (it was stock's "w1.moment1 should be assigned before!"); a weight of the same checkpoint still renames."""
    import paddle
    import paddle.distributed as dist
    from paddle.distributed.fsdp.checkpoint import load_full_state_dict
    from paddle.distributed.fsdp.checkpoint.errors import InvalidStateDictError

    whole = load_full_state_dict(str(int8_ckpt))
    key = next(k for k in sorted(whole) if k.endswith(".moment1"))
    weight = key[: -len(".moment1")]
    for statement, target in ((f"{key} -> m", "m"), (f"{weight} -> renamed", key)):  # (a source; a target)
        got = {target: paddle.zeros(list(whole[key].shape), dtype="float32")}
        with pytest.raises(InvalidStateDictError, match=r"stored quantized.*without aoa_config"):
            dist.load_state_dict(got, str(int8_ckpt), aoa_config={"aoa_statements": [statement]})
    got = {"renamed": paddle.zeros(list(whole[weight].shape), dtype=whole[weight].dtype)}
    dist.load_state_dict(got, str(int8_ckpt), aoa_config={"aoa_statements": [f"{weight} -> renamed"]})
    assert np.array_equal(got["renamed"].numpy(), whole[weight].numpy())


def test_inspect_and_to_hf_read_a_lossy_checkpoint(int8_ckpt, tmp_path):
    """``inspect`` and ``to-hf`` (weights only, and ``--include-optimizer``) of a checkpoint with quantized
    moments: they used to stop on an internal KeyError of the codes' key; the exported moments are the
    dequantized ones every reader sees, and the codes and scales are listed as the moment's optimizer state."""
    import safetensors.numpy as stnp
    from paddle.distributed.fsdp.checkpoint import load_full_state_dict
    from paddle.distributed.fsdp.tools.cli import main as cli_main
    from paddle.distributed.fsdp.tools.inspect_cmd import inspect_checkpoint

    info = inspect_checkpoint(str(int8_ckpt))
    codes = [k for k in info["tensors"] if k.endswith("@qcodes")]
    assert codes and all(info["tensors"][k]["role"] == "optimizer" for k in codes)
    assert cli_main(["inspect", str(int8_ckpt)]) == 0
    whole = load_full_state_dict(str(int8_ckpt))
    for args, moments in (([], False), (["--include-optimizer"], True)):
        out = tmp_path / f"hf{len(args)}"
        assert cli_main(["to-hf", str(int8_ckpt), str(out), *args]) == 0
        got = {}
        for f in sorted(out.glob("*.safetensors")):
            got.update(stnp.load_file(str(f)))
        exported = [k for k in got if k.endswith((".moment1", ".moment2"))]
        assert bool(exported) == moments and not any("@q" in k for k in got)
        for k in exported:
            assert np.array_equal(got[k].reshape(-1), whole[k].numpy().reshape(-1)), k


def test_async_save_stores_the_moments_of_the_call(tmp_path):
    """async_save with int8: the codes are taken at the call (the next optimizer step does not leak in): the
    async checkpoint reads back exactly as a synchronous int8 save of the same state."""
    import paddle
    from models import global_batches
    from paddle.distributed.fsdp.checkpoint import load_full_state_dict

    model, fsdp, opt = _train_and_save(tmp_path / "sync", "int8")
    handle = fsdp.save_checkpoint(str(tmp_path / "async"), optimizer=opt, quantize_moments="int8", async_save=True)
    for x, y in global_batches(1, 4, seed=9):  # moves every moment while the save may still be writing
        model(paddle.to_tensor(x), paddle.to_tensor(y)).backward()
        opt.step()
        opt.clear_grad()
    handle.wait()
    sync, lazy = load_full_state_dict(str(tmp_path / "sync")), load_full_state_dict(str(tmp_path / "async"))
    assert sorted(sync) == sorted(lazy)
    assert all(np.array_equal(sync[k].numpy(), lazy[k].numpy()) for k in sync if not isinstance(sync[k], (dict, list)))
