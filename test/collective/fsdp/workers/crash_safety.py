"""Crash safety of FSDP checkpoints on 2 ranks: a real kill -9 during a save, then checks from fresh processes.

Usage (under paddle.distributed.launch, 2 ranks):
    crash_safety.py save ROOT
        train, save step 1 (``step=1, keep_last=1``), train, dump references, save step 2. The test arms
        PADDLE_FSDP_CKPT_FAULT=<stage>:<rank>:2 (fault_storage.py), so one rank SIGKILLs itself at that stage of
        the SECOND save.
        The survivor reports how its save ended. It ignores the launcher's SIGTERM (sent when the launcher
        sees the dead rank) so that the engine's own commit timeout, not the launcher, ends its wait: that is
        what shows it cannot hang. References: ROOT.refs/ref<step>.rank<r>.npz, every record at save time.
    crash_safety.py verify SPEC.json
        fresh processes, models built from another seed: every fault cell (the checkpoint ``latest`` names loads
        bit-exactly, the partial one is reported incomplete by load and by verify_checkpoint and leaves the
        model untouched), damaged checkpoints, bad input, and two saves in flight.
Each rank reports {case: "ok" | traceback}; comparisons are bit-exact (raw values of every record).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import sys
import time
import traceback
from typing import Callable

import _paths  # noqa: F401  (puts launch_util on sys.path)
import fault_storage
import numpy as np
import paddle
import paddle.distributed as dist
import paddle.distributed.fsdp.checkpoint as ck
from crafted import metadata_json
from launch_util import report
from models import DIM, global_batches, local_part, make_model
from paddle.distributed.fsdp import FullyShardFusion
from paddle.distributed.fsdp.checkpoint.manager import read_latest

logger = logging.getLogger("crash_safety")
BATCH = 8
STEP2 = "step_00000002"


# ------------------------------------------------------------------------------------------------ helpers


def make_optimizer(kind: str, model):
    O = paddle.optimizer
    if kind == "adamw":
        return O.AdamW(O.lr.StepDecay(0.02, step_size=1, gamma=0.5), weight_decay=0.1, parameters=model.parameters())
    if kind == "momentum":
        return O.Momentum(0.02, momentum=0.9, parameters=model.parameters())
    raise ValueError(kind)


def build(seed: int, optimizer: str | None = "adamw", edit: Callable | None = None, **model_kw):
    """Model (optionally edited before wrapping: another model), FSDP wrapper, optimizer."""
    model = make_model(seed, **model_kw)
    if edit is not None:
        edit(model)
    fsdp = FullyShardFusion(model, fsdp_unit_layers=["Block"])
    opt = make_optimizer(optimizer, model) if optimizer else None
    return model, fsdp, opt


def train(model, opt, batches, rank: int, world: int) -> None:
    for ids, labels in batches:
        loss = model(paddle.to_tensor(local_part(ids, rank, world)), paddle.to_tensor(local_part(labels, rank, world)))
        loss.backward()
        opt.step()
        opt.clear_grad()
        if isinstance(opt._learning_rate, paddle.optimizer.lr.LRScheduler):
            opt._learning_rate.step()


def trained(seed: int, steps: int, rank: int, world: int, **kw):
    """A model+optimizer whose every value differs from the checkpoints' (another seed, own training)."""
    model, fsdp, opt = build(seed, **kw)
    if opt is not None and steps:
        train(model, opt, global_batches(steps, BATCH, seed=seed), rank, world)
    return model, fsdp, opt


def snapshot(fsdp, opt) -> dict[str, np.ndarray]:
    """Every record of this rank (params and optimizer state) plus the LR scheduler state, copied."""
    state = fsdp.sharded_state_dict()
    if opt is not None:
        state.update(fsdp.optimizer_sharded_state_dict(opt))
    out = {k: np.array(getattr(v, "local_tensor", v).numpy()) for k, v in state.items()}
    if opt is not None and isinstance(opt._learning_rate, paddle.optimizer.lr.LRScheduler):
        lr = opt._learning_rate
        out["__lr__"] = np.array([lr.last_epoch, lr.last_lr], dtype=np.float64)
    return out


def assert_same(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: keys differ: {sorted(set(got) ^ set(want))[:6]}"
    for k in want:
        a, b = got[k], want[k]
        if a.dtype != b.dtype or a.shape != b.shape or not np.array_equal(a.view(np.uint8), b.view(np.uint8)):
            raise AssertionError(f"{what}: {k} differs (bit-exact comparison)")


def full_params(fsdp) -> dict[str, np.ndarray]:
    return {k: np.array(v.numpy()) for k, v in fsdp.full_parameters().items()}


def ranges(fsdp) -> dict[str, tuple[int, int]]:
    """This rank's flattened range of every parameter record."""
    return {k: (v.flattened_range.start, v.flattened_range.stop) for k, v in fsdp.sharded_state_dict().items()}


def check_params_from(fsdp, full: dict, keys) -> None:
    """This rank's slice of each param in ``keys`` equals the reference full param, bit for bit."""
    mine = fsdp.sharded_state_dict()
    for k in keys:
        if k not in mine:
            continue
        rec = mine[k]
        a, b = rec.flattened_range.start, rec.flattened_range.stop
        got = np.array(rec.local_tensor.numpy())
        want = full[k].reshape(-1)[a:b]
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), f"{k}: not loaded bit-exactly"


def expect_error(fn: Callable, err: type, *fragments: str) -> BaseException:
    try:
        fn()
    except err as e:
        for f in fragments:
            assert f in str(e), f"{type(e).__name__} does not mention {f!r}: {e}"
        return e
    raise AssertionError(f"expected {err.__name__}, nothing was raised")


def refs_of(root: str, step: int, rank: int) -> dict[str, np.ndarray]:
    with np.load(os.path.join(root + ".refs", f"ref{step}.rank{rank}.npz")) as z:
        return {k: z[k] for k in z.files}


# ------------------------------------------------------------------------------------------------ save (faulted)


def save_main(root: str, rank: int, world: int) -> None:
    signal.signal(signal.SIGTERM, lambda *_: logger.warning("rank %d: SIGTERM from the launcher ignored", rank))
    refs = root + ".refs"
    os.makedirs(refs, exist_ok=True)
    model, fsdp, opt = build(7)
    batches = global_batches(3, BATCH)
    train(model, opt, batches[:2], rank, world)
    fsdp.save_checkpoint(root, optimizer=opt, extra_state={"step": 1}, step=1, keep_last=1)
    np.savez(os.path.join(refs, f"ref1.rank{rank}.npz"), **snapshot(fsdp, opt))
    out: dict = {"save1": "ok"}
    report(out)
    train(model, opt, batches[2:], rank, world)
    np.savez(os.path.join(refs, f"ref2.rank{rank}.npz"), **snapshot(fsdp, opt))
    t0 = time.monotonic()
    try:
        fsdp.save_checkpoint(root, optimizer=opt, extra_state={"step": 2}, step=2, keep_last=1)
        out["save2"] = "ok"
    except ck.SaveFailedError as e:
        out["save2"] = f"SaveFailedError: {e}"
    out["save2_seconds"] = time.monotonic() - t0
    logger.warning("rank %d: second save ended: %s", rank, out["save2"])
    report(out)


# ------------------------------------------------------------------------------------------------ verify


def case_cell(cell: dict, rank: int, world: int) -> None:
    """After a kill: ``latest`` names the expected checkpoint and it loads bit-exactly; step 2 loads bit-exactly
    if it was committed, else loading it raises IncompleteCheckpointError and changes nothing."""
    root = cell["root"]
    mgr = ck.CheckpointManager(root)
    pointer = read_latest(root)  # the pointer itself, not latest()'s fallback
    assert pointer == f"step_{cell['latest']:08d}", (pointer, cell)
    assert mgr.latest_step() == cell["latest"], (mgr.latest_step(), cell)
    assert mgr.steps() == cell["steps"], (mgr.steps(), cell)
    model, fsdp, opt = trained(99, 1, rank, world)
    res = fsdp.load_checkpoint(root, optimizer=opt)
    assert res.step == cell["latest"] and res == {"step": cell["latest"]}, (res.step, dict(res))
    assert_same(snapshot(fsdp, opt), refs_of(root, cell["latest"], rank), f"{root} latest")
    step2 = os.path.join(root, STEP2)
    model, fsdp, opt = trained(99, 1, rank, world)
    if cell["committed"]:
        assert ck.verify_checkpoint(step2) == []
        res = fsdp.load_checkpoint(step2, optimizer=opt)
        assert res == {"step": 2}
        assert_same(snapshot(fsdp, opt), refs_of(root, 2, rank), f"{step2}")
        return
    before = snapshot(fsdp, opt)
    expect_error(
        lambda: fsdp.load_checkpoint(step2, optimizer=opt),
        ck.IncompleteCheckpointError,
        "incomplete",
        "never committed",
    )
    assert_same(snapshot(fsdp, opt), before, "model after the refused load of the partial checkpoint")
    problems = ck.verify_checkpoint(step2)
    assert len(problems) == 1 and problems[0].startswith("IncompleteCheckpointError"), problems


def _damage(kind: str, path: str) -> None:
    md = metadata_json(path)
    if kind in ("flipped_byte", "checksums_off"):
        # the largest param piece in rank 1's file: only rank 1 reads it, so rank 0's own reads all succeed
        pieces = [
            (p["nbytes"], p["offset"])
            for key, tm in md["tensors"].items()
            if not key.endswith((".moment1", ".moment2", "_pow_acc"))
            for p in tm["pieces"]
            if p["file"] == "1_0.safetensors"
        ]
        _, off = max(pieces)
        with open(os.path.join(path, "1_0.safetensors"), "r+b") as f:
            f.seek(off + 1)
            b = f.read(1)
            f.seek(off + 1)
            f.write(bytes([b[0] ^ 0x40]))
    elif kind == "truncated_file":
        f = os.path.join(path, "0_0.safetensors")
        os.truncate(f, os.path.getsize(f) - 7)
    elif kind == "missing_shard":
        os.unlink(os.path.join(path, "1_0.safetensors"))
    elif kind == "damaged_metadata":
        raw = bytearray(open(os.path.join(path, "metadata.json"), "rb").read())
        raw[len(raw) // 2] ^= 0x01
        open(os.path.join(path, "metadata.json"), "wb").write(bytes(raw))
    elif kind == "damaged_commit":
        raw = open(os.path.join(path, "COMMIT"), "rb").read()
        open(os.path.join(path, "COMMIT"), "wb").write(raw[: len(raw) // 2])
    elif kind == "missing_commit":
        os.unlink(os.path.join(path, "COMMIT"))
    else:
        raise AssertionError(kind)


DAMAGE = {  # kind -> (error, fragments of its message)
    "flipped_byte": (ck.CorruptCheckpointError, ("checksum mismatch", "1_0.safetensors")),
    "truncated_file": (ck.CorruptCheckpointError, ("0_0.safetensors", "bytes")),
    "missing_shard": (ck.CorruptCheckpointError, ("1_0.safetensors", "missing")),
    "damaged_metadata": (ck.MetadataError, ("metadata.json",)),
    "damaged_commit": (ck.MetadataError, ("COMMIT", "damaged")),
    "missing_commit": (ck.IncompleteCheckpointError, ("COMMIT",)),
}


def case_damaged(kind: str, workdir: str, pristine: str, rank: int, world: int, fsdp_any) -> None:
    """A damaged checkpoint raises a named error on every rank; no model or optimizer value changes."""
    path = os.path.join(workdir, "damaged", kind)
    if rank == 0:
        shutil.copytree(pristine, path)
        _damage(kind, path)
    fsdp_any.comm.barrier()
    model, fsdp, opt = trained(99, 1, rank, world)
    before = snapshot(fsdp, opt)
    if kind == "checksums_off":  # the check can be turned off: the flipped byte then reaches rank 1's tensor
        fsdp.load_checkpoint(path, optimizer=opt, verify_checksums=False)
        ref = refs_of(pristine, 2, rank)
        got = snapshot(fsdp, opt)
        diff = sum(int((got[k].view(np.uint8) != ref[k].view(np.uint8)).sum()) for k in ref)
        assert diff == (1 if rank == 1 else 0), f"rank {rank}: {diff} bytes differ from the saved values"
        return
    err, fragments = DAMAGE[kind]
    if kind == "flipped_byte":
        # damaged data is found while reading: atomic=True restores every tensor; the default (memory-bounded)
        # load says on every rank that the tensors were written in part (PartiallyLoadedError)
        expect_error(lambda: fsdp.load_checkpoint(path, optimizer=opt, atomic=True), err, *fragments)
        assert_same(snapshot(fsdp, opt), before, f"model and optimizer after the failed atomic load ({kind})")
        expect_error(lambda: fsdp.load_checkpoint(path, optimizer=opt), ck.PartiallyLoadedError, *fragments)
        assert ck.verify_checkpoint(path), f"verify_checkpoint found nothing wrong with {kind}"
        return
    expect_error(lambda: fsdp.load_checkpoint(path, optimizer=opt), err, *fragments)
    assert_same(snapshot(fsdp, opt), before, f"model and optimizer after the failed load ({kind})")
    assert ck.verify_checkpoint(path), f"verify_checkpoint found nothing wrong with {kind}"


def _wider_norm(model) -> None:
    model.norm = paddle.nn.LayerNorm(DIM * 2)


def _f64_norm(model) -> None:
    model.norm.to(dtype="float64")


def case_bad_input(name: str, workdir: str, pristine: str, model_only: str, full: dict, rank: int, world: int) -> None:
    if name == "not_a_checkpoint":
        model, fsdp, opt = trained(99, 1, rank, world)
        before = snapshot(fsdp, opt)
        junk = os.path.join(workdir, "junk")
        if rank == 0:
            os.makedirs(junk, exist_ok=True)
            open(os.path.join(junk, "notes.txt"), "w").write("not a checkpoint")
            os.makedirs(os.path.join(workdir, "empty"), exist_ok=True)
        fsdp.comm.barrier()
        expect_error(
            lambda: fsdp.load_checkpoint(os.path.join(workdir, "nowhere"), optimizer=opt),
            ck.NotACheckpointError,
            "nowhere",
            "no such directory",
        )
        expect_error(lambda: fsdp.load_checkpoint(junk, optimizer=opt), ck.NotACheckpointError, "notes.txt")
        expect_error(lambda: fsdp.load_checkpoint(os.path.join(workdir, "empty")), ck.NotACheckpointError, "empty")
        assert_same(snapshot(fsdp, opt), before, "after loading a non-checkpoint")
    elif name == "other_optimizer":
        model, fsdp, _ = trained(99, 0, rank, world, optimizer=None)
        opt = make_optimizer("momentum", model)
        before = snapshot(fsdp, None)
        expect_error(
            lambda: fsdp.load_checkpoint(pristine, optimizer=opt), ck.OptimizerMismatchError, "AdamW", "Momentum"
        )
        assert_same(snapshot(fsdp, None), before, "model after the refused load")
        assert not opt._accumulators, "the refused load created optimizer state"
        # the class check is a ValueError too, as before
        expect_error(lambda: fsdp.load_checkpoint(pristine, optimizer=opt), ValueError, "Momentum")
    elif name == "optimizer_but_none_saved":
        model, fsdp, opt = trained(99, 1, rank, world)
        before = snapshot(fsdp, opt)
        expect_error(
            lambda: fsdp.load_checkpoint(model_only, optimizer=opt), ck.OptimizerMismatchError, "no optimizer state"
        )
        assert_same(snapshot(fsdp, opt), before, "after the refused load")
    elif name == "model_only_load_of_full_checkpoint":
        model, fsdp, _ = trained(99, 0, rank, world, optimizer=None)
        res = fsdp.load_checkpoint(pristine)  # strict: optimizer records are not "keys of another model"
        assert res == {"step": 2}
        check_params_from(fsdp, full, full)
    elif name in ("missing_keys", "extra_keys", "shape_mismatch", "dtype_mismatch"):
        kw: dict = {
            "missing_keys": {"n_blocks": 4},
            "extra_keys": {"n_blocks": 2},
            "shape_mismatch": {"edit": _wider_norm, "optimizer": None},
            "dtype_mismatch": {"edit": _f64_norm, "optimizer": None},
        }[name]
        if kw.get("optimizer", "adamw"):
            model, fsdp, opt = trained(99, 1, rank, world, **kw)
        else:
            model, fsdp, opt = build(99, **kw)
        before = snapshot(fsdp, opt)
        err, frag, odd = {
            "missing_keys": (ck.MissingKeyError, "'blocks.3.", lambda k: k.startswith("blocks.3.")),
            "extra_keys": (ck.UnexpectedKeyError, "'blocks.2.", lambda k: k.startswith("blocks.2.")),
            "shape_mismatch": (ck.ShapeMismatchError, "'norm.", lambda k: k.startswith("norm.")),
            "dtype_mismatch": (ck.DtypeMismatchError, "'norm.", lambda k: k.startswith("norm.")),
        }[name]
        expect_error(lambda: fsdp.load_checkpoint(pristine, optimizer=opt), err, frag)
        assert_same(snapshot(fsdp, opt), before, f"{name}: strict load failed but changed values")
        # strict=False: the matching subset is loaded, the rest reported and left as it was
        res = fsdp.load_checkpoint(pristine, optimizer=opt, strict=False)
        assert res == {"step": 2}, dict(res)
        rep = res.report
        mine = set(before) - {"__lr__"}
        if name == "missing_keys":
            assert set(rep.missing_keys) == {k for k in mine if odd(k)}, rep.missing_keys
        elif name == "extra_keys":
            assert rep.unexpected_keys and all(odd(k) for k in rep.unexpected_keys), rep.unexpected_keys
        else:
            assert set(rep.mismatched_keys) == {k for k in mine if odd(k)}, rep.mismatched_keys
            kind = "shape" if name == "shape_mismatch" else "dtype"
            assert all(kind in v for v in rep.mismatched_keys.values()), rep.mismatched_keys
        check_params_from(fsdp, full, [k for k in full if not odd(k)])
        after = snapshot(fsdp, opt)
        for k in mine:
            if odd(k):
                assert np.array_equal(after[k].view(np.uint8), before[k].view(np.uint8)), f"{k} was changed"
    else:
        raise AssertionError(name)


def case_two_saves_in_flight(workdir: str, rank: int, world: int) -> None:
    """An async save in flight, then another save: the second waits for the first; both commit in order,
    ``latest`` names the second on every rank when it returns. Saving the same step again replaces it."""
    root = os.path.join(workdir, "inflight")
    model, fsdp, opt = build(7)
    batches = global_batches(3, BATCH)
    train(model, opt, batches[:1], rank, world)
    ref1 = snapshot(fsdp, opt)
    h = fsdp.save_checkpoint(root, optimizer=opt, extra_state={"step": 1}, step=1, async_save=True)
    train(model, opt, batches[1:2], rank, world)  # changes params while the first save may still run
    ref2 = snapshot(fsdp, opt)
    fsdp.save_checkpoint(root, optimizer=opt, extra_state={"step": 2}, step=2, keep_last=1)
    assert h.done(), "the second save returned before the first one finished"
    h.wait()
    mgr = ck.CheckpointManager(root)
    assert mgr.latest_step() == 2, mgr.latest_step()
    # keep_last pruning runs on the coordinator after `latest` moved; the other ranks return once `latest`
    # names the new checkpoint (manager.py), so only the coordinator is sure to see it pruned already
    if rank == 0:
        assert mgr.steps() == [2], mgr.steps()
    m2, f2, o2 = trained(99, 1, rank, world)
    f2.load_checkpoint(root, optimizer=o2)
    assert_same(snapshot(f2, o2), ref2, "second of two saves in flight")
    assert any(not np.array_equal(ref1[k], ref2[k]) for k in ref1), "training did not change anything"
    # the same step again: replaced atomically, `latest` unchanged
    train(model, opt, batches[2:], rank, world)
    ref3 = snapshot(fsdp, opt)
    fsdp.save_checkpoint(root, optimizer=opt, extra_state={"step": 3}, step=2, keep_last=1)
    assert mgr.latest_step() == 2 and mgr.steps() == [2]
    m3, f3, o3 = trained(99, 1, rank, world)
    assert f3.load_checkpoint(root, optimizer=o3) == {"step": 3}
    assert_same(snapshot(f3, o3), ref3, "re-saved step")


def verify_main(spec_path: str, rank: int, world: int) -> None:
    spec = json.load(open(spec_path))
    workdir = spec["workdir"]
    results: dict = {}

    def run(name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
            logger.error("rank %d: case %s FAILED:\n%s", rank, name, results[name])

    for cell in spec["cells"]:
        run(f"cell:{cell['name']}", lambda cell=cell: case_cell(cell, rank, world))

    # a pristine checkpoint (and a model-only one) for the damaged and bad-input cases
    pristine = os.path.join(workdir, "pristine")
    model, fsdp, opt = build(7)
    train(model, opt, global_batches(2, BATCH), rank, world)
    fsdp.save_checkpoint(pristine, optimizer=opt, extra_state={"step": 2})
    os.makedirs(pristine + ".refs", exist_ok=True)
    np.savez(os.path.join(pristine + ".refs", f"ref2.rank{rank}.npz"), **snapshot(fsdp, opt))
    model_only = os.path.join(workdir, "model_only")
    fsdp.save_checkpoint(model_only)
    full = full_params(fsdp)
    for kind in list(DAMAGE) + ["checksums_off"]:
        run(f"damaged:{kind}", lambda kind=kind: case_damaged(kind, workdir, pristine, rank, world, fsdp))
    for name in (
        "not_a_checkpoint",
        "other_optimizer",
        "optimizer_but_none_saved",
        "model_only_load_of_full_checkpoint",
        "missing_keys",
        "extra_keys",
        "shape_mismatch",
        "dtype_mismatch",
    ):
        run(f"bad:{name}", lambda name=name: case_bad_input(name, workdir, pristine, model_only, full, rank, world))
    run("two_saves_in_flight", lambda: case_two_saves_in_flight(workdir, rank, world))
    report(results)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    if sys.argv[1] == "save":
        save_main(sys.argv[2], rank, world)
    else:
        verify_main(sys.argv[2], rank, world)


if __name__ == "__main__":
    fault_storage.install()  # the kill the test arms (PADDLE_FSDP_CKPT_FAULT)
    main()
