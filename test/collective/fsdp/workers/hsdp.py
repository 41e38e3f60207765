"""Hybrid sharding (HSDP) and refused group layouts; each rank reports {case: "ok" | traceback, "figures": ...}.

``hsdp.py WORKDIR`` on 4 ranks: fleet ``dp_degree=2 x sharding_degree=2`` (2 replicas x 2 shards). Refusals,
training (HSDP == one process == plain FSDP over the world), a save (each byte written once, replicas balanced,
``verify`` clean), loads (bytes read per rank: each byte once per replica group), reshards 2x2 -> 1x4 and
4 -> 2x2 (and 3 -> 2x2 when WORKDIR holds the 3-rank run's checkpoint), each with a bit-exact state (re-saved
and compared) and a continuation equal to the uninterrupted run.
``hsdp.py WORKDIR --three`` on 3 ranks: 2x2 -> 1x3 and a plain 3-rank checkpoint for the way back.

Every group is created with a barrier after it (paddle's gloo ``new_group`` otherwise fails "Connection
refused" with 4 processes): fleet.init runs inside ``topology.barrier_after_new_group``.
"""

from __future__ import annotations

import os
import sys
import traceback

import _paths  # noqa: F401  (puts launch_util on sys.path)
import numpy as np
import paddle
import paddle.distributed as dist
from launch_util import report
from models import decay_fun_for, global_batches, make_model
from paddle.distributed import fleet
from paddle.distributed.fsdp import FullyShardFusion, UnsupportedGroupLayoutError
from paddle.distributed.fsdp.checkpoint import load_full_state_dict, read_metadata
from paddle.distributed.fsdp.checkpoint.verify import verify_checkpoint
from paddle.distributed.fsdp.comm.topology import barrier_after_new_group, hybrid_groups
from training import train

BATCHES = global_batches(3, 24)  # 2 steps, a checkpoint, 1 more; 24 rows split over 1, 3 and 4 ranks
SEED = 11


def world_group():
    from paddle.distributed.collective import _get_global_group

    return _get_global_group()


def build(layout: str, groups: dict | None = None):
    """(fsdp, model, optimizer) for ``layout``: "hsdp" (fleet's dp x sharding, or ``groups``), "plain" (every
    rank), "one" (this process alone)."""
    model = make_model(SEED, dtype="float64")
    fsdp = None
    if layout == "hsdp":
        fsdp = FullyShardFusion(model, ["Block"], **(groups or {}))
    elif layout == "plain":
        fsdp = FullyShardFusion(model, ["Block"], group=world_group())
    fun = decay_fun_for(model) if fsdp is None else None  # FSDP honours param.no_weight_decay by itself
    opt = paddle.optimizer.AdamW(
        0.01,
        weight_decay=0.1,
        grad_clip=paddle.nn.ClipGradByGlobalNorm(0.05),
        apply_decay_param_fun=fun,
        parameters=model.parameters(),
    )
    return fsdp, model, opt


def run(layout: str, steps: slice, state=None, micro_batches: int = 1):
    fsdp, model, opt = state or build(layout)
    world = dist.get_world_size() if layout != "one" else 1
    train(model, opt, BATCHES[steps], dist.get_rank() if layout != "one" else 0, world, micro_batches)
    return fsdp, model, opt


def params(fsdp, model) -> dict:
    full = fsdp.full_parameters() if fsdp is not None else dict(model.named_parameters())
    return {k: v.numpy() for k, v in full.items()}


def assert_close(got: dict, want: dict, tol: float, what: str) -> float:
    """Max error relative to each tensor's largest value; returns the largest seen."""
    worst = 0.0
    assert set(got) == set(want), f"{what}: keys differ"
    for key, value in want.items():
        err = float(np.abs(got[key] - value).max() / max(np.abs(value).max(), 1e-30))
        assert err <= tol, f"{what}: {key} differs by {err:.3g} (relative), tolerance {tol}"
        worst = max(worst, err)
    return worst


def assert_same_checkpoint(a: str, b: str) -> None:
    """Every tensor and plain value of checkpoint ``a`` equals ``b``'s bit for bit (rank 0 reads both)."""
    problem = None
    if dist.get_rank() == 0:
        fa, fb = load_full_state_dict(a), load_full_state_dict(b)
        if set(fa) != set(fb):
            problem = f"keys differ: {sorted(set(fa) ^ set(fb))}"
        else:
            bad = [k for k in fa if np.asarray(fa[k]).tobytes() != np.asarray(fb[k]).tobytes()]
            problem = f"{len(bad)} of {len(fa)} keys differ, e.g. {bad[:4]}" if bad else None
    problem = gather(problem)[0]  # every rank fails alike (no rank left waiting in the next collective)
    assert problem is None, f"{a} vs {b}: {problem}"


def bytes_written_by_rank(path: str) -> dict[int, int]:
    md = read_metadata(path)
    out: dict[int, int] = {}
    for tm in md.tensors.values():
        for piece in tm.pieces:
            rank = md.files[piece.file].rank
            out[rank] = out.get(rank, 0) + piece.nbytes
    return out


def state_bytes(path: str) -> int:
    md = read_metadata(path)
    return sum(int(np.prod(tm.shape)) * np.dtype(tm.dtype).itemsize for tm in md.tensors.values())


def gather(value):
    from paddle.distributed.fsdp.comm.communication import all_gather_object

    return all_gather_object(value, world_group())


def rng_probe() -> list[float]:
    return paddle.rand([3], dtype="float64").numpy().tolist()


# ----------------------------------------------------------------------------------------------- refusals


def expect_refused(match: str, **groups) -> None:
    """FullyShardFusion refuses the layout by name, and leaves the model unwrapped."""
    model = make_model(5)
    try:
        FullyShardFusion(model, ["Block"], **groups)
    except UnsupportedGroupLayoutError as e:
        assert match in str(e), f"{match!r} not in: {e}"
    else:
        raise AssertionError(f"layout accepted; expected a refusal mentioning {match!r}")
    assert getattr(model, "_fsdp", None) is None, "a refused model was wrapped"


def case_refusals(ctx):
    hcg = fleet.get_hybrid_communicate_group()
    sharding = hcg.get_sharding_parallel_group()
    # a sharding group of 2 of the 4 ranks without replicas: the halves would never average gradients
    expect_refused("2 of the 4 ranks", group=sharding)
    # a "replicate group" whose members hold different shard positions
    expect_refused("shard positions", shard_group=sharding, replicate_group=sharding)
    # groups that do not tile the world (4 x 2 ranks for a world of 4)
    expect_refused(
        "= 8 ranks, but the world has 4", shard_group=world_group(), replicate_group=hcg.get_data_parallel_group()
    )
    fsdp = FullyShardFusion(
        make_model(5), ["Block"], shard_group=sharding, replicate_group=hcg.get_data_parallel_group()
    )
    assert fsdp.group_layout.replicate_degree == 2 and fsdp.world_size == 2


# ----------------------------------------------------------------------------------------------- training


def case_training(ctx):
    """3 steps of HSDP == one process (fp64 AdamW with global-norm clipping) == plain FSDP over the 4 ranks;
    each rank holds 1/2 of the parameters (twice plain FSDP's 1/4); the replicas' shards are identical."""
    ref = params(None, run("one", slice(0, 3))[1])
    hsdp = run("hsdp", slice(0, 2))
    ckpt = os.path.join(ctx["dir"], "hsdp_2x2")
    hsdp[0].save_checkpoint(ckpt, optimizer=hsdp[2])
    ctx["rng_after_save"] = rng_probe()
    run("hsdp", slice(2, 3), hsdp)
    plain = run("plain", slice(0, 3))
    got, want_plain = params(*hsdp[:2]), params(*plain[:2])
    ctx["figures"]["hsdp_vs_one_process"] = assert_close(got, ref, 1e-10, "HSDP vs one process")
    ctx["figures"]["hsdp_vs_plain_fsdp"] = assert_close(got, want_plain, 1e-10, "HSDP vs plain FSDP")
    fsdp = hsdp[0]
    assert fsdp.group_layout.replicate_degree == 2 and fsdp.world_size == 2, "fleet dp x sharding is not HSDP"
    assert fsdp.resident_parameter_bytes() >= 2 * plain[0].resident_parameter_bytes() - 64
    shards = gather([b.shard.numpy().tobytes() for b in fsdp.buffers])
    me = dist.get_rank()
    assert shards[me] == shards[(me + 2) % 4], "the replicas' shards differ"
    full = fsdp.full_state_dict()  # rank0_only: global rank 0 alone, not shard rank 0 of each replica
    assert (len(full) > 0) == (me == 0), f"rank {me}: full_state_dict returned {len(full)} entries"
    if me == 0:
        assert_close({k: v.numpy() for k, v in full.items() if k in got}, got, 0.0, "full_state_dict")
    ctx["uninterrupted"] = got
    ctx["hsdp_ckpt"] = ckpt


def case_explicit_groups(ctx):
    """FullyShardFusion(shard_group=, replicate_group=) with topology.hybrid_groups(2) (fleet's layout: consecutive
    ranks shard, replicas at stride 2) trains bit for bit as fleet's dp x sharding HSDP does; with gradient
    accumulation (2 micro-batches per step) HSDP equals one process."""
    replicate, shard = ctx["own_groups"]
    hcg = fleet.get_hybrid_communicate_group()
    assert shard.ranks == hcg.get_sharding_parallel_group().ranks, (shard.ranks, "vs fleet's sharding group")
    assert replicate.ranks == hcg.get_data_parallel_group().ranks, (replicate.ranks, "vs fleet's dp group")
    fsdp, model, opt = build("hsdp", {"shard_group": shard, "replicate_group": replicate})
    assert fsdp.group_layout.replicate_group is replicate
    run("hsdp", slice(0, 3), (fsdp, model, opt))
    assert_close(params(fsdp, model), ctx["uninterrupted"], 0.0, "explicit groups vs fleet HSDP")
    # gradient accumulation: two backward passes per step, each averaged over both groups, == one process
    ref = params(None, run("one", slice(0, 3), micro_batches=2)[1])
    acc = run("hsdp", slice(0, 3), micro_batches=2)
    ctx["figures"]["hsdp_accumulation_vs_one_process"] = assert_close(params(*acc[:2]), ref, 1e-10, "accumulation")


def case_save_once_balanced(ctx):
    """The 2x2 save (and an async save of the same state, in load_reads_once): each byte once (the same bytes as plain FSDP's save of the same state), the replicas write
    about half each, every rank writes, and verify finds nothing."""
    ckpt = ctx["hsdp_ckpt"]
    by_rank = bytes_written_by_rank(ckpt)
    total = state_bytes(ckpt)
    assert sum(by_rank.values()) == total, (by_rank, total)
    replica = [by_rank.get(0, 0) + by_rank.get(1, 0), by_rank.get(2, 0) + by_rank.get(3, 0)]
    assert min(replica) >= 0.4 * total, f"replicas wrote {replica} of {total} bytes"
    assert all(by_rank.get(r, 0) > 0 for r in range(4)), by_rank
    assert verify_checkpoint(ckpt) == []
    ctx["figures"]["hsdp_written_by_rank"] = [by_rank.get(r, 0) for r in range(4)]


def case_load_reads_once(ctx):
    """2x2 -> 2x2: reads total the state's size (each replica reads about half), the state is bit-exact (re-saved
    and compared), the RNG resumes, and the continuation equals the uninterrupted run bit for bit."""
    fsdp, model, opt = build("hsdp")
    paddle.seed(999)  # a different RNG state: the load must restore the saved one
    # a small host budget: the replicas' parts travel in 8 KiB broadcasts, tensors split across them
    result = fsdp.load_checkpoint(ctx["hsdp_ckpt"], optimizer=opt, max_host_bytes=16384)
    assert rng_probe() == ctx["rng_after_save"], "the RNG state was not restored for this global rank"
    reads = gather(result.report.bytes_read)
    total = state_bytes(ctx["hsdp_ckpt"])
    assert sum(reads) <= 1.05 * total + 4 * 8192, f"HSDP load read {reads} for {total} bytes of state"
    assert reads[0] + reads[1] >= 0.3 * total and reads[2] + reads[3] >= 0.3 * total, reads
    again = os.path.join(ctx["dir"], "hsdp_2x2_again")
    fsdp.save_checkpoint(again, optimizer=opt)
    assert_same_checkpoint(ctx["hsdp_ckpt"], again)
    handle = fsdp.save_checkpoint(os.path.join(ctx["dir"], "hsdp_2x2_async"), optimizer=opt, async_save=True)
    run("hsdp", slice(2, 3), (fsdp, model, opt))  # the async copy overlaps the step (snapshot_guard waits)
    handle.wait()
    assert_same_checkpoint(ctx["hsdp_ckpt"], os.path.join(ctx["dir"], "hsdp_2x2_async"))
    assert_close(params(fsdp, model), ctx["uninterrupted"], 0.0, "resumed HSDP vs uninterrupted")
    ctx["figures"]["hsdp_read_by_rank"] = reads


def case_reshard_2x2_to_1x4(ctx):
    """Plain FSDP over the 4 ranks loads the 2x2 checkpoint: bit-exact state, continuation == uninterrupted."""
    fsdp, model, opt = build("plain")
    ctx["figures"]["plain_read_by_rank"] = gather(
        fsdp.load_checkpoint(ctx["hsdp_ckpt"], optimizer=opt).report.bytes_read
    )
    again = os.path.join(ctx["dir"], "plain_from_2x2")
    fsdp.save_checkpoint(again, optimizer=opt)
    assert_same_checkpoint(ctx["hsdp_ckpt"], again)
    run("plain", slice(2, 3), (fsdp, model, opt))
    ctx["figures"]["1x4_continuation_vs_2x2"] = assert_close(params(fsdp, model), ctx["uninterrupted"], 1e-10, "1x4")


def reshard_into_hsdp(ctx, ckpt: str, uninterrupted: dict, name: str) -> None:
    fsdp, model, opt = build("hsdp")
    fsdp.load_checkpoint(ckpt, optimizer=opt)
    again = os.path.join(ctx["dir"], f"hsdp_from_{name}")
    fsdp.save_checkpoint(again, optimizer=opt)
    assert_same_checkpoint(ckpt, again)
    run("hsdp", slice(2, 3), (fsdp, model, opt))
    ctx["figures"][f"2x2_continuation_vs_{name}"] = assert_close(params(fsdp, model), uninterrupted, 1e-10, name)


def case_reshard_4_to_2x2(ctx):
    """A plain 4-rank checkpoint loads into 2x2: bit-exact state, continuation == the uninterrupted plain run."""
    plain = run("plain", slice(0, 2))
    ckpt = os.path.join(ctx["dir"], "plain_4")
    plain[0].save_checkpoint(ckpt, optimizer=plain[2])
    run("plain", slice(2, 3), plain)
    reshard_into_hsdp(ctx, ckpt, params(*plain[:2]), "4")


def case_reshard_3_to_2x2(ctx):
    """The 3-rank run's checkpoint (``--three``) loads into 2x2 (skipped when that run did not happen first)."""
    ckpt = os.path.join(ctx["dir"], "plain_3")
    if not os.path.isdir(ckpt):
        raise AssertionError(f"{ckpt} missing: run the 3-rank launch first")
    want = dict(np.load(os.path.join(ctx["dir"], "plain_3_uninterrupted.npz")))
    reshard_into_hsdp(ctx, ckpt, want, "3")


CASES = {
    "refusals": case_refusals,
    "training": case_training,
    "explicit_groups": case_explicit_groups,
    "save_once_balanced": case_save_once_balanced,
    "load_reads_once": case_load_reads_once,
    "reshard_2x2_to_1x4": case_reshard_2x2_to_1x4,
    "reshard_4_to_2x2": case_reshard_4_to_2x2,
    "reshard_3_to_2x2": case_reshard_3_to_2x2,
}


# ----------------------------------------------------------------------------------------------- 3 ranks


def three_rank_cases(ctx) -> None:
    """1x3: save a plain 3-rank checkpoint after 2 steps (and the uninterrupted 3rd step) for 3 -> 2x2."""
    plain = run("plain", slice(0, 2))
    plain[0].save_checkpoint(os.path.join(ctx["dir"], "plain_3"), optimizer=plain[2])
    run("plain", slice(2, 3), plain)
    full = params(*plain[:2])
    if dist.get_rank() == 0:
        np.savez(os.path.join(ctx["dir"], "plain_3_uninterrupted.npz"), **full)
    dist.barrier()


def three_rank_load(ctx) -> None:
    """2x2 -> 1x3: plain FSDP on 3 ranks loads the 2x2 checkpoint; bit-exact, continuation == uninterrupted."""
    fsdp, model, opt = build("plain")
    fsdp.load_checkpoint(os.path.join(ctx["dir"], "hsdp_2x2"), optimizer=opt)
    again = os.path.join(ctx["dir"], "plain3_from_2x2")
    fsdp.save_checkpoint(again, optimizer=opt)
    assert_same_checkpoint(os.path.join(ctx["dir"], "hsdp_2x2"), again)
    run("plain", slice(2, 3), (fsdp, model, opt))
    want = dict(np.load(os.path.join(ctx["dir"], "hsdp_uninterrupted.npz")))
    ctx["figures"]["1x3_continuation_vs_2x2"] = assert_close(params(fsdp, model), want, 1e-10, "1x3")


def main() -> None:
    workdir = sys.argv[1]
    three = "--three" in sys.argv
    if three:
        dist.init_parallel_env()
        # first launch: the 1x3 checkpoint for 3 -> 2x2; after the 4-rank launch: 2x2 -> 1x3
        if os.path.isdir(os.path.join(workdir, "hsdp_2x2")):
            cases = {"reshard_2x2_to_1x3": three_rank_load}
        else:
            cases = {"save_3": three_rank_cases}
    else:
        dist.init_parallel_env()
        own_groups = hybrid_groups(2)  # the project's group creation (before fleet's: gloo fails after it here)
        strategy = fleet.DistributedStrategy()
        strategy.hybrid_configs = {"dp_degree": 2, "mp_degree": 1, "pp_degree": 1, "sharding_degree": 2}
        with barrier_after_new_group():
            fleet.init(is_collective=True, strategy=strategy)
        cases = dict(CASES)
        if not os.path.isdir(os.path.join(workdir, "plain_3")):
            cases.pop("reshard_3_to_2x2")
    ctx = {"dir": workdir, "figures": {}}
    if not three:
        ctx["own_groups"] = own_groups
    results = {}
    for name, case in cases.items():
        try:
            case(ctx)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
            print(f"case {name} failed:\n{results[name]}", file=sys.stderr, flush=True)
    if not three and "uninterrupted" in ctx and dist.get_rank() == 0:
        np.savez(os.path.join(workdir, "hsdp_uninterrupted.npz"), **ctx["uninterrupted"])
    dist.barrier()
    results["figures"] = ctx["figures"]
    report(results)


if __name__ == "__main__":
    main()
