"""Every failure named, prompt and harmless, on 2 ranks (issue 13).

Usage (under paddle.distributed.launch, 2 ranks): ``robust.py WORKDIR [TMPFS_DIR]``

* atomic loads of non-tensor state: one field changed on ONE rank only (that rank's RNG entry, that rank's LR
  scheduler class) or for all (scheduler field types, a float LR against a scheduler, extra_state): every rank
  raises the same named error and every tensor, the LR scheduler and the RNG are bit-identical to before;
* prompt named save failure: an injected I/O error (errno) on each rank at several stages: every rank raises
  SaveFailedError naming the failing rank and the cause, long before the commit timeout; the previous checkpoint
  loads bit-exactly; the failed save left no staging directory; the next save succeeds;
* a real full tmpfs (TMPFS_DIR, mounted by the test with size=2m), when given.
Each rank reports {case: "ok" | traceback} and {case + ":seconds": elapsed} for the save failures.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
import traceback

import _paths  # noqa: F401  (puts launch_util on sys.path)
import fault_storage
import numpy as np
import paddle
import paddle.distributed as dist
import paddle.distributed.fsdp.checkpoint as ck
from crafted import edit_metadata
from launch_util import report
from models import global_batches, local_part, make_model
from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight
from paddle.distributed.fsdp import FullyShardFusion
from paddle.distributed.fsdp.checkpoint.format.reserved import EXTRA_KEY, OPTIMIZER_KEY, RNG_KEY

BATCH = 8
O = paddle.optimizer


def build(seed: int, lr: str = "cosine"):
    model = make_model(seed)
    fsdp = FullyShardFusion(model, fsdp_unit_layers=["Block"])
    sched = {
        "cosine": lambda: O.lr.CosineAnnealingDecay(0.02, T_max=10),
        "step": lambda: O.lr.StepDecay(0.02, step_size=1, gamma=0.5),
        "float": lambda: 0.02,
    }[lr]()
    return model, fsdp, O.AdamW(sched, weight_decay=0.1, parameters=model.parameters())


def train(model, opt, steps: int, seed: int, rank: int, world: int) -> None:
    for ids, labels in global_batches(steps, BATCH, seed=seed):
        loss = model(paddle.to_tensor(local_part(ids, rank, world)), paddle.to_tensor(local_part(labels, rank, world)))
        loss.backward()
        opt.step()
        opt.clear_grad()
        if isinstance(opt._learning_rate, O.lr.LRScheduler):
            opt._learning_rate.step()


def everything(fsdp, opt) -> dict:
    """Every tensor this rank holds (params, optimizer state), the LR scheduler state and the RNG state."""
    state = fsdp.sharded_state_dict()
    state.update(fsdp.optimizer_sharded_state_dict(opt))
    out = {k: np.array(getattr(v, "local_tensor", v).numpy()).view(np.uint8).tobytes() for k, v in state.items()}
    lr = opt._learning_rate
    out["__lr__"] = json.dumps(lr.state_dict() if isinstance(lr, O.lr.LRScheduler) else lr, sort_keys=True)
    out["__rng__"] = json.dumps([list(s.__getstate__()) for s in paddle.get_rng_state()])
    return out


def assert_same(got: dict, want: dict, what: str) -> None:
    assert sorted(got) == sorted(want), f"{what}: keys differ"
    bad = [k for k in want if got[k] != want[k]]
    assert not bad, f"{what}: changed by a refused load: {bad[:5]}"


class CaseFailed(Exception):
    """Some rank failed a step of a case; raised on every rank at the same step (carries every rank's traceback)."""


_failure: list = []  # this rank's traceback of the current step, until it is exchanged


def agree() -> None:
    """End of a step: exchange every rank's outcome before any further collective (also a barrier).

    Why: a check that fails on one rank only must not make that rank skip collectives the others still run (the
    ranks would pair different collectives and gloo aborts the whole job); so each step's outcome is exchanged
    and every rank leaves the case at the same point, reporting every rank's traceback."""
    mine = _failure.pop() if _failure else None
    outcomes: list = []
    dist.all_gather_object(outcomes, mine)
    bad = {r: tb for r, tb in enumerate(outcomes) if tb is not None}
    if bad:
        raise CaseFailed("\n".join(f"[rank {r}] {tb}" for r, tb in sorted(bad.items())))


class step:
    """``with step(): ...`` runs one step of a case: its exception (if any) is kept for ``agree`` at the end."""

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        if kind is not None and issubclass(kind, CaseFailed):
            return False  # an inner step: every rank raised it at the same exchange already
        if kind is not None and issubclass(kind, Exception):
            _failure[:] = ["".join(traceback.format_exception(kind, value, tb))]
        agree()
        return kind is not None and issubclass(kind, Exception)


def on_rank0(rank: int, fn) -> None:
    """Run ``fn`` on rank 0 (file edits), then every rank continues after it."""
    with step():
        if rank == 0:
            fn()


def fresh_copy(src: str, dst: str) -> None:
    if os.path.exists(dst):
        shutil.rmtree(dst)
    shutil.copytree(src, dst)


def expect_load_refused(fsdp, model, opt, path: str, err: type, *fragments: str) -> None:
    before = everything(fsdp, opt)
    try:
        fsdp.load_checkpoint(path, optimizer=opt)
    except err as e:
        for f in fragments:
            assert f in str(e), f"{type(e).__name__} does not mention {f!r}: {e}"
    else:
        raise AssertionError(f"expected {err.__name__}, the load succeeded")
    assert_same(everything(fsdp, opt), before, path)


def main() -> None:
    dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    workdir = sys.argv[1]
    tmpfs = sys.argv[2] if len(sys.argv) > 2 else None
    out: dict = {}

    def run(case: str, fn) -> None:
        """One case: every step of it ends in an exchange (``step``), and so does the case itself."""
        t0 = time.monotonic()
        try:
            with step():
                fn()
            out[case] = "ok"
        except CaseFailed as e:  # noqa: BLE001 - reported to the test, by every rank alike
            out[case] = str(e)
        out[case + ":seconds"] = time.monotonic() - t0

    base = os.path.join(workdir, "base")
    model, fsdp, opt = build(1)
    train(model, opt, 2, 1, rank, world)
    fsdp.save_checkpoint(base, optimizer=opt, extra_state={"epoch": 1})
    saved = everything(fsdp, opt)

    # ---- atomic loads of non-tensor state: one rank (or every rank) cannot restore one field
    def other(lr: str = "cosine"):
        m, f, o = build(7, lr)
        train(m, o, 1, 7, rank, world)
        return m, f, o

    def scheduler_class_on_one_rank():
        m, f, o = other("step" if rank == 1 else "cosine")
        expect_load_refused(f, m, o, base, ck.OptimizerMismatchError, "CosineAnnealingDecay", "StepDecay")

    def float_lr_against_scheduler():
        m, f, o = other("float")
        expect_load_refused(f, m, o, base, ck.OptimizerMismatchError, "CosineAnnealingDecay")

    def edited(name: str, fn, err: type, *fragments: str):
        def case():
            path = os.path.join(workdir, name)
            on_rank0(rank, lambda: (fresh_copy(base, path), edit_metadata(__import__("pathlib").Path(path), fn)))
            m, f, o = other()
            expect_load_refused(f, m, o, path, err, *fragments)

        return case

    def rng_of_rank1_truncated(md):
        md["values"][RNG_KEY][1]["cpu"][3] = md["values"][RNG_KEY][1]["cpu"][3][:-7]

    def rng_of_rank1_two_generators(md):  # saved where a GPU generator existed, loaded on CPU only
        md["values"][RNG_KEY][1]["device"] = {"type": "gpu", "state": md["values"][RNG_KEY][1]["cpu"]}

    def scheduler_field_as_string(md):
        st = md["values"][OPTIMIZER_KEY]["global_state"]["learning_rate"]["state"]
        st["last_epoch"] = str(st["last_epoch"])

    def scheduler_field_missing(md):
        del md["values"][OPTIMIZER_KEY]["global_state"]["learning_rate"]["state"]["last_lr"]

    def extra_state_list(md):
        md["values"][EXTRA_KEY] = [1, 2]

    run("scheduler_class_on_one_rank", scheduler_class_on_one_rank)
    run("float_lr_against_scheduler", float_lr_against_scheduler)
    run("rng_of_rank1_truncated", edited("rng1", rng_of_rank1_truncated, ck.MetadataError, "rng"))
    run("rng_of_rank1_two_generators", edited("rng2", rng_of_rank1_two_generators, ck.StateDictMismatchError, "rng"))
    run("scheduler_field_as_string", edited("sched1", scheduler_field_as_string, ck.MetadataError, "last_epoch"))
    run("scheduler_field_missing", edited("sched2", scheduler_field_missing, ck.MetadataError, "last_lr"))
    run("extra_state_list", edited("extra", extra_state_list, ck.MetadataError, "extra_state"))

    def sound_load_still_works():
        m, f, o = other()
        f.load_checkpoint(base, optimizer=o)
        got = everything(f, o)
        got.pop("__rng__")
        want = dict(saved)
        want.pop("__rng__")
        assert_same(got, want, "load of the sound checkpoint")

    run("sound_load_still_works", sound_load_still_works)

    # ---- prompt, named save failure on every rank: an injected I/O error on one rank; with ``markers`` the failing
    # rank pauses between the detail of its failure marker and the marker named by its cause (fault_storage.py): every
    # rank must still report the full cause, whenever it looks
    # ``after_data``: the failing rank's data is complete and handed over (done marker); the coordinator decides: it
    # aborts when it sees the failure before its commit record (every rank raises), else the checkpoint is complete
    # and every rank returns; ``handed_over`` delays the failure until after that decision
    cases = [
        ("mid_data", 0, "ENOSPC", None, "fail"),
        ("mid_data", 1, "ENOSPC", None, "fail"),
        ("before_data", 1, "EACCES", None, "fail"),
        ("after_data", 1, "EIO", None, "same on every rank"),
        ("before_metadata", 0, "EROFS", None, "fail"),
        ("before_commit", 0, "EIO", None, "fail"),
        ("mid_data", 1, "ENOSPC", ("markers", 1), "fail"),
        ("before_commit", 0, "EIO", ("markers", 0), "fail"),
        ("after_data", 1, "EIO", ("handed_over", 1), "commit"),
        ("after_data", 1, "EIO", ("before_data", 0), "fail"),  # the coordinator learns it while still writing
    ]
    import errno as errno_mod

    for stage, bad_rank, code, slow, expect in cases:

        def fail_once(stage=stage, bad_rank=bad_rank, code=code, slow=slow, expect=expect):
            with step():
                os.environ[fault_storage.ENV] = f"{stage}:{bad_rank}:1:{code}"
                if slow:
                    os.environ[fault_storage.DELAY_ENV] = f"{slow[0]}:{slow[1]}:2"
                fault_storage.reset()
                try:
                    fsdp.save_checkpoint(base, optimizer=opt, extra_state={"epoch": 2})
                    outcome = "commit"
                except ck.SaveFailedError as e:
                    outcome = "fail"
                    msg = str(e)
                    assert f"rank {bad_rank} " in msg and os.strerror(getattr(errno_mod, code)) in msg, msg
                    assert f"[injected by {fault_storage.ENV} at stage {stage}]" in msg, f"not the full cause: {msg}"
                finally:
                    os.environ.pop(fault_storage.ENV, None)
                    os.environ.pop(fault_storage.DELAY_ENV, None)
                assert expect in (outcome, "same on every rank"), f"expected the save to {expect}, it did {outcome}"
            with step():
                outcomes: list = []
                dist.all_gather_object(outcomes, outcome)
                assert len(set(outcomes)) == 1, f"the ranks disagree on the save: {outcomes}"
                if outcome == "fail":  # every rank has returned: the failed save left nothing behind (issue 29)
                    left = [n for n in os.listdir(workdir) if n.startswith("base.tmp-")]
                    assert not left, f"the failed save left its staging directory behind: {left}"
                assert ck.verify_checkpoint(base) == [], "the checkpoint at the path does not verify"
            with step():
                m, f, o = other()
                f.load_checkpoint(base, optimizer=o)  # the previous checkpoint is intact and loads
                got, want = everything(f, o), dict(saved)
                got.pop("__rng__"), want.pop("__rng__")
                assert_same(got, want, "previous checkpoint after a failed save")
            with step():
                fsdp.save_checkpoint(base, optimizer=opt, extra_state={"epoch": 1})  # a later save succeeds
                for th in __import__("threading").enumerate():
                    if th.name == "ckpt-rm-old":
                        th.join()
            left = [n for n in os.listdir(workdir) if n.startswith("base.tmp-")]
            assert not left, f"failed staging directories left: {left}"

        run(f"save_fault:{stage}:{bad_rank}:{code}" + (f":slow_{slow[0]}_{slow[1]}" if slow else ""), fail_once)

    # ---- a real full file system
    if tmpfs:

        def full_tmpfs():
            n = 300_000  # 1.2 MB: one checkpoint fits into 2 MB, two do not
            a, b = rank * n // world, (rank + 1) * n // world
            paddle.seed(3)
            full = paddle.rand([n])
            first = {
                "x": ShardedWeight(
                    "x", full[a:b].clone(), [n], [n], [0], is_flattened=True, flattened_range=slice(a, b)
                )
            }
            path = os.path.join(tmpfs, "ckpt")
            with step():
                ck.save_state_dict(first, path, write_stock_metadata=False)
            paddle.seed(4)
            second = {
                "x": ShardedWeight(
                    "x", paddle.rand([b - a]), [n], [n], [0], is_flattened=True, flattened_range=slice(a, b)
                )
            }
            with step():
                try:
                    ck.save_state_dict(second, path, write_stock_metadata=False)
                except ck.SaveFailedError as e:
                    assert "No space left" in str(e) and "failed" in str(e), str(e)
                else:
                    raise AssertionError("a save that cannot fit succeeded")
            with step():  # every rank has returned: nothing of the failed save is left on the full disk
                assert sorted(os.listdir(tmpfs)) == ["ckpt"], os.listdir(tmpfs)
            t = {
                "x": ShardedWeight(
                    "x", paddle.zeros([b - a]), [n], [n], [0], is_flattened=True, flattened_range=slice(a, b)
                )
            }
            with step():
                ck.load_state_dict(t, path)
                assert np.array_equal(t["x"].local_tensor.numpy(), full[a:b].numpy())
            small = {"y": paddle.ones([50_000])}
            with step():
                ck.save_state_dict(small, os.path.join(tmpfs, "small"), write_stock_metadata=False)  # fits
            with step():
                ck.save_state_dict(small, path, write_stock_metadata=False)  # and replaces; failed staging removed
                for th in __import__("threading").enumerate():
                    if th.name == "ckpt-rm-old":
                        th.join()
            assert sorted(os.listdir(tmpfs)) == ["ckpt", "small"], os.listdir(tmpfs)

        run("full_tmpfs", full_tmpfs)

    report(out)


if __name__ == "__main__":
    fault_storage.install()  # the faults the cases arm (PADDLE_FSDP_CKPT_FAULT)
    main()
