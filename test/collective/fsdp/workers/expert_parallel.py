"""Expert parallelism (EP) on gloo ranks; each rank reports {case: "ok" | traceback, "figures": ...}.

``expert_parallel.py WORKDIR`` on 2 ranks: fleet ``ep_degree=2`` (``sharding_degree=2``, ``moe_sharding_degree=1``).
On 4 ranks: fleet ``ep_degree=2 x moe_sharding_degree=2`` (``sharding_degree=4``), plus EP=4 through explicit
groups. The 2-rank launch saves the checkpoints the 4-rank launch reshards (EP 2 -> 2x2, 1 -> 2x2, 2 -> 4, 2 -> 1
with FSDP 2 -> 4), each bit-exact (re-saved and compared: same keys and full shapes at every EP degree) and
continuing within 1e-5 of the uninterrupted run.

The model (moe_models.py): 8 experts, top-2 routing, a shared expert, a tied embedding; fp64, AdamW with weight
decay and global-norm clipping. One process trains the same global batches for reference.
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
from models import decay_fun_for, local_part
from moe_models import EXPERTS, make_moe, moe_batches
from paddle.distributed import fleet
from paddle.distributed.fsdp import FullyShardFusion, UnsupportedGroupLayoutError
from paddle.distributed.fsdp.checkpoint import load_full_state_dict, read_metadata
from paddle.distributed.fsdp.comm.topology import barrier_after_new_group

BATCHES = moe_batches(3, 8)  # 2 steps, a checkpoint, 1 more
SEED = 5
UNITS = ["MoeDecoderBlock"]
EXPERT_CLASSES = ["MoeExpert"]
#: fleet ignores ep_degree / moe_sharding_degree unless "order" names them
ORDER = ["pp", "moe_sharding", "ep", "dp", "sharding", "sep", "cp", "mp"]


def world_group():
    from paddle.distributed.collective import _get_global_group

    return _get_global_group()


def gather(value):
    from paddle.distributed.fsdp.comm.communication import all_gather_object

    return all_gather_object(value, world_group())


def optimizer(model, fsdp):
    fun = decay_fun_for(model) if fsdp is None else None  # FSDP honours param.no_weight_decay by itself
    return paddle.optimizer.AdamW(
        0.01,
        weight_decay=0.1,
        grad_clip=paddle.nn.ClipGradByGlobalNorm(0.05),
        apply_decay_param_fun=fun,
        parameters=model.parameters(),
    )


def build(layout: str, dtype: str = "float64", **options):
    """(fsdp, model, optimizer): "fleet" (EP from fleet's hybrid config), "ep_world" (EP over every rank, explicit
    groups), "dense" (no EP: every rank holds every expert, FSDP over the world), "one" (this process alone)."""
    if layout == "fleet":
        model = make_moe(SEED, fleet.get_hybrid_communicate_group().get_expert_parallel_group(), dtype=dtype)
        fsdp = FullyShardFusion(model, UNITS, moe_layers_name=EXPERT_CLASSES, **options)
    elif layout == "ep_world":
        model = make_moe(SEED, world_group())
        fsdp = FullyShardFusion(
            model, UNITS, group=world_group(), moe_layers_name=EXPERT_CLASSES, expert_parallel_group=world_group()
        )
    elif layout == "dense":
        model = make_moe(SEED)
        fsdp = FullyShardFusion(model, UNITS, group=world_group(), expert_parallel_group=None)
    else:
        model, fsdp = make_moe(SEED, dtype=dtype), None
    return fsdp, model, optimizer(model, fsdp)


def run(layout: str, steps: slice, state=None):
    fsdp, model, opt = state or build(layout)
    rank, world = (dist.get_rank(), dist.get_world_size()) if layout != "one" else (0, 1)  # "own": every rank
    for ids, labels in BATCHES[steps]:
        model(
            paddle.to_tensor(local_part(ids, rank, world)), paddle.to_tensor(local_part(labels, rank, world))
        ).backward()
        opt.step()
        opt.clear_grad()
    return fsdp, model, opt


def params(fsdp, model) -> dict:
    full = fsdp.full_parameters() if fsdp is not None else dict(model.named_parameters())
    return {k: v.numpy() for k, v in full.items()}


def assert_close(got: dict, want: dict, tol: float, what: str) -> float:
    """Max error relative to each tensor's largest value; returns the largest seen."""
    assert set(got) == set(want), f"{what}: keys differ: {sorted(set(got) ^ set(want))[:6]}"
    worst = 0.0
    for key, value in want.items():
        err = float(np.abs(got[key] - value).max() / max(np.abs(value).max(), 1e-30))
        assert err <= tol, f"{what}: {key} differs by {err:.3g} (relative), tolerance {tol}"
        worst = max(worst, err)
    return worst


def assert_same_checkpoint(a: str, b: str) -> None:
    """Checkpoint ``a`` and ``b`` hold the same keys with the same values, bit for bit (rank 0 reads both)."""
    problem = None
    if dist.get_rank() == 0:
        fa, fb = load_full_state_dict(a), load_full_state_dict(b)
        if set(fa) != set(fb):
            problem = f"keys differ: {sorted(set(fa) ^ set(fb))[:6]}"
        else:
            bad = [k for k in fa if np.asarray(fa[k]).tobytes() != np.asarray(fb[k]).tobytes()]
            problem = f"{len(bad)} of {len(fa)} keys differ, e.g. {bad[:4]}" if bad else None
    problem = gather(problem)[0]
    assert problem is None, f"{a} vs {b}: {problem}"


def state_bytes(path: str) -> int:
    md = read_metadata(path)
    return sum(int(np.prod(tm.shape)) * np.dtype(tm.dtype).itemsize for tm in md.tensors.values())


def share_bytes(fsdp, opt) -> int:
    """The bytes of this rank's records (its pieces of the model and optimizer state, the replicated values it
    holds): what a load must read for it."""
    records = fsdp.sharded_state_dict()
    records.update(fsdp.optimizer_sharded_state_dict(opt))
    total = 0
    for record in records.values():
        tensor = getattr(record, "local_tensor", record)
        total += int(np.prod(tensor.shape)) * tensor.element_size()
    return total


def bytes_written(path: str) -> int:
    return sum(p.nbytes for tm in read_metadata(path).tensors.values() for p in tm.pieces)


# ------------------------------------------------------------------------------------------------ 2 ranks


def case_groups(ctx):
    """What fleet's hybrid config gives: EP group = the world, no expert sharding; experts in buffers of their own."""
    fsdp, model, _ = build("fleet")
    assert fsdp.expert_layout.ep_degree == 2 and fsdp.expert_layout.shard_degree == 1
    assert fsdp.world_size == 2 and fsdp.expert_comm.world_size == 1
    expert_buffers = [b for b in fsdp.buffers if b.layout.attrs.get("expert")]
    # per decoder block: the experts' weights and their biases (exempt from decay: a buffer of their own)
    assert len(expert_buffers) == 4, [b.layout.name for b in fsdp.buffers]
    mine = {s.key.split(".experts.")[1].split(".")[0] for b in expert_buffers for s in b.layout.slots}
    want = {str(e) for e in range(dist.get_rank() * EXPERTS // 2, (dist.get_rank() + 1) * EXPERTS // 2)}
    assert mine == want, (mine, want)
    dense_keys = {s.key for b in fsdp.buffers if not b.layout.attrs.get("expert") for s in b.layout.slots}
    assert any("shared_expert" in k for k in dense_keys) and not any(".experts." in k for k in dense_keys)


def expect_refused(match: str, make, **kwargs) -> None:
    model = make()
    try:
        FullyShardFusion(model, UNITS, **kwargs)
    except UnsupportedGroupLayoutError as e:
        assert match in str(e), f"{match!r} not in: {e}"
    else:
        raise AssertionError(f"accepted; expected a refusal mentioning {match!r}")
    assert getattr(model, "_fsdp", None) is None, "a refused model was wrapped"


def case_refusals(ctx):
    """Refused by name, on every rank, before the model changes."""
    ep = fleet.get_hybrid_communicate_group().get_expert_parallel_group()
    # EP on, but no expert found (the expert class not named)
    expect_refused("no parameter is an expert", lambda: make_moe(SEED, ep), moe_layers_name=["Nothing"])
    # experts held by one EP rank each, but FSDP told nothing about EP: dense keys differ between ranks
    expect_refused(
        "different non-expert parameters", lambda: make_moe(SEED, ep), group=world_group(), expert_parallel_group=None
    )

    # experts named by local index (experts.0 on both EP ranks): keys would collide across EP degrees
    def local_names():
        model = make_moe(SEED, ep)
        for block in model.blocks:
            kept = [e for e in block.mlp.experts if e is not None]
            block.mlp.experts = paddle.nn.LayerList(kept)
        return model

    expect_refused("exists on EP ranks 0 and 1", local_names, moe_layers_name=EXPERT_CLASSES)

    # experts marked expert=True without any EP group
    def marked():
        model = make_moe(SEED)
        for p in model.blocks[0].mlp.experts[0].parameters():
            p.expert = True
        return model

    expect_refused("no expert-parallel group", marked, group=world_group(), expert_parallel_group=None)


def case_training_ep2(ctx):
    """3 AdamW steps with clipping at ep2 == one process (fp64, 1e-5 relative; ~1e-15 in practice)."""
    ref = params(None, run("one", slice(0, 3))[1])
    state = run("fleet", slice(0, 2))
    state[0].save_checkpoint(os.path.join(ctx["dir"], "ep2"), optimizer=state[2])
    run("fleet", slice(2, 3), state)
    got = params(*state[:2])
    ctx["figures"]["ep2_vs_one_process"] = assert_close(got, ref, 1e-5, "ep2 vs one process")
    full = state[0].full_state_dict()  # rank 0 gets every expert, in the unwrapped model's order
    if dist.get_rank() == 0:
        one = make_moe(SEED).state_dict()
        assert list(full) == list(one), f"full_state_dict keys/order: {list(full)[:12]} vs {list(one)[:12]}"
        assert_close({k: v.numpy() for k, v in full.items() if k in got}, got, 0.0, "full_state_dict")
        np.savez(os.path.join(ctx["dir"], "ep2_uninterrupted.npz"), **got)
    dense = run("dense", slice(0, 2))  # EP=1 over the same 2 ranks: the checkpoint EP=1 -> EP=2 starts from
    dense[0].save_checkpoint(os.path.join(ctx["dir"], "ep1"), optimizer=dense[2])
    run("dense", slice(2, 3), dense)
    got_dense = params(*dense[:2])  # collective: every rank
    ctx["figures"]["ep1_vs_one_process"] = assert_close(got_dense, ref, 1e-5, "ep1 vs one process")
    if dist.get_rank() == 0:
        np.savez(os.path.join(ctx["dir"], "ep1_uninterrupted.npz"), **got_dense)


def case_save_once(ctx):
    """An EP save writes the state once: the same keys and full shapes as EP=1's, every byte written once."""
    ep2, ep1 = os.path.join(ctx["dir"], "ep2"), os.path.join(ctx["dir"], "ep1")
    a, b = read_metadata(ep2), read_metadata(ep1)
    shapes = {k: tuple(t.shape) for k, t in a.tensors.items()}
    assert shapes == {k: tuple(t.shape) for k, t in b.tensors.items()}, "EP=2 and EP=1 checkpoints differ in keys"
    assert bytes_written(ep2) == state_bytes(ep2), (bytes_written(ep2), state_bytes(ep2))
    ctx["figures"]["ep2_state_bytes"] = state_bytes(ep2)


def case_summon(ctx):
    """summon_full_params: local experts whole inside, a writeback lands in the shards."""
    fsdp, model, _ = build("fleet")
    mine = model.blocks[0].mlp.experts[dist.get_rank() * EXPERTS // 2]
    with fsdp.summon_full_params(writeback=True):
        assert list(mine.up.weight.shape) == [32, 64], mine.up.weight.shape
        mine.up.weight.set_value(paddle.full_like(mine.up.weight, float(dist.get_rank() + 1)))
    key = f"blocks.0.mlp.experts.{dist.get_rank() * EXPERTS // 2}.up.weight"
    full = fsdp.full_parameters()
    assert float(full[key].numpy().min()) == float(full[key].numpy().max()) == dist.get_rank() + 1


def case_scaler_inf_in_one_experts_gradient(ctx):
    """A real (CPU-enabled) GradScaler; one element of one expert's gradient is inf on EP rank 1 only (rank 0 never
    holds that expert): both ranks skip the step, and the loss scale halves on both."""
    from grad_scaler import cpu_grad_scaler

    fsdp, model, opt = build("fleet", dtype="float32")  # GradScaler checks fp16/bf16/fp32 gradients only
    scaler = cpu_grad_scaler(init_loss_scaling=2.0**8, incr_every_n_steps=2, decr_every_n_nan_or_inf=1)
    before = params(fsdp, model)
    rank, world = dist.get_rank(), dist.get_world_size()
    ids, labels = BATCHES[0]
    with paddle.amp.auto_cast(enable=False, dtype="float16"):  # the scaler's AMP state; compute stays fp32 on CPU
        loss = scaler.scale(
            model(paddle.to_tensor(local_part(ids, rank, world)), paddle.to_tensor(local_part(labels, rank, world)))
        )
    loss.backward()
    if rank == 1:
        grad = model.blocks[0].mlp.experts[EXPERTS - 1].up.weight.grad
        with paddle.no_grad():  # in place: the bound gradient is a view of the expert buffer's gradient shard
            paddle.assign(grad + paddle.full_like(grad, float("inf")), output=grad)
    scaler.step(opt)
    scaler.update()
    opt.clear_grad()
    assert_close(params(fsdp, model), before, 0.0, "a step with an inf expert gradient on one rank")
    scales = gather(float(scaler._scale))
    assert scales == [2.0**7] * world, scales


def case_clip_by_norm(ctx):
    """ClipGradByNorm (per-parameter norms: expert pieces summed over their own shard group) == one process."""

    def clipped(layout):
        fsdp, model, _ = build(layout, dtype="float32")  # CPU's clip_by_norm kernel is fp32 only
        clip = paddle.nn.ClipGradByNorm(0.01)
        opt = paddle.optimizer.SGD(0.5, grad_clip=clip, parameters=model.parameters())
        return run(layout, slice(0, 2), (fsdp, model, opt))

    ref = params(None, clipped("one")[1])
    ctx["figures"]["clip_by_norm_vs_one_process"] = assert_close(params(*clipped("fleet")[:2]), ref, 1e-5, "clip")


def build_bf16(layout: str):
    """bf16 parameters computed in fp32 (``compute_dtype``: CPU has no bf16 matmul) with fp32 master weights (a test
    optimizer doing the GPU kernel's arithmetic: CPU paddle's own never updates them), at EP=2 or EP=1."""
    from master_adamw import MasterAdamW

    if layout == "fleet":
        model = make_moe(SEED, fleet.get_hybrid_communicate_group().get_expert_parallel_group(), dtype="bfloat16")
        fsdp = FullyShardFusion(model, UNITS, compute_dtype="float32", moe_layers_name=EXPERT_CLASSES)
    else:
        model = make_moe(SEED, dtype="bfloat16")
        fsdp = FullyShardFusion(model, UNITS, compute_dtype="float32", group=world_group())
    clip = paddle.nn.ClipGradByGlobalNorm(0.05)
    opt = MasterAdamW(0.01, weight_decay=0.1, multi_precision=True, grad_clip=clip, parameters=model.parameters())
    return fsdp, model, opt


def case_master_weights(ctx):
    """bf16 + fp32 master weights at EP=2 -> EP=1 (every expert on both ranks) and back -> EP=2: model, moments and
    master weights bit-exact (re-saved and compared); the experts' master weights are in the checkpoint."""
    source = os.path.join(ctx["dir"], "ep2_bf16")
    state = run("fleet", slice(0, 2), build_bf16("fleet"))
    state[0].save_checkpoint(source, optimizer=state[2])
    keys = read_metadata(source).tensors
    masters = [k for k in keys if ".experts." in k and k.endswith(".master_weight")]
    assert len(masters) == 2 * EXPERTS * 3, f"{len(masters)} expert master weights in the checkpoint"
    derived = read_metadata(source).derived  # each rank holds its own experts: the agreement's second gather
    assert sum(".experts." in k for k in derived) == len(masters), f"{len(derived)} derived weights"
    dense = build_bf16("dense")
    dense[0].load_checkpoint(source, optimizer=dense[2])
    ep1 = os.path.join(ctx["dir"], "ep1_bf16")
    dense[0].save_checkpoint(ep1, optimizer=dense[2])
    assert_same_checkpoint(source, ep1)
    back = build_bf16("fleet")
    back[0].load_checkpoint(ep1, optimizer=back[2])
    again = os.path.join(ctx["dir"], "ep2_bf16_again")
    back[0].save_checkpoint(again, optimizer=back[2])
    assert_same_checkpoint(source, again)


def case_memory_tier(ctx):
    """The memory tier at EP=2: a tier save (memory, peer copy, durable persist) restores into a fresh EP=2 model
    bit-exactly from memory, and the persisted checkpoint loads at EP=1 with the same state."""
    from memtier_util import state_bytes as record_bytes

    fsdp, model, opt = run("fleet", slice(0, 2))
    durable = os.path.join(ctx["dir"], "tier_durable")
    memory = os.path.join(ctx["dir"], "tier_memory")  # a directory of this run, not /dev/shm: nothing left behind
    tier = fsdp.memory_tier(opt, durable_root=durable, memory_root=memory, persist_every=1, keep_last=None)
    tier.save(2)
    tier.wait_persisted()
    want = record_bytes(fsdp, opt)
    tier.close()
    again = build("fleet")
    tier = again[0].memory_tier(again[2], durable_root=durable, memory_root=memory, persist_every=1, keep_last=None)
    assert tier.start_step == 2, tier.start_step
    got = record_bytes(again[0], again[2])
    assert got == want, sorted(k for k in want if got.get(k) != want[k])[:5]
    tier.close()
    dense = build("dense")
    persisted = dense[0].load_checkpoint(durable, optimizer=dense[2]).path  # the root's latest: the persisted step 2
    resaved = os.path.join(ctx["dir"], "tier_as_ep1")
    dense[0].save_checkpoint(resaved, optimizer=dense[2])
    assert_same_checkpoint(persisted, resaved)


def case_s3(ctx):
    """``expert_parallel.py WORKDIR --s3 URL`` (2 ranks, S3 credentials in the environment): an EP=2 save to S3
    equals the same save to a local directory, and loads from S3 at EP=1 into the same state."""
    url = ctx["s3"]
    fsdp, model, opt = run("fleet", slice(0, 2))
    local = os.path.join(ctx["dir"], "ep2_local_for_s3")
    fsdp.save_checkpoint(url, optimizer=opt)
    fsdp.save_checkpoint(local, optimizer=opt)
    dense = build("dense")
    dense[0].load_checkpoint(url, optimizer=dense[2])
    resaved = os.path.join(ctx["dir"], "ep1_from_s3")
    dense[0].save_checkpoint(resaved, optimizer=dense[2])
    assert_same_checkpoint(local, resaved)


def two_rank_cases():
    return {
        "groups": case_groups,
        "refusals": case_refusals,
        "training_ep2": case_training_ep2,
        "save_once": case_save_once,
        "summon": case_summon,
        "scaler_inf_in_one_experts_gradient": case_scaler_inf_in_one_experts_gradient,
        "clip_by_norm": case_clip_by_norm,
        "master_weights": case_master_weights,
        "memory_tier": case_memory_tier,
    }


# ------------------------------------------------------------------------------------------------ 4 ranks


def case_training_ep2x2(ctx):
    """ep2 x moe_sharding2 on 4 ranks == one process; experts sharded over 2 ranks, the dense part over 4."""
    ref = params(None, run("one", slice(0, 3))[1])
    fsdp, model, opt = run("fleet", slice(0, 3))
    assert fsdp.expert_layout.ep_degree == 2 and fsdp.expert_layout.shard_degree == 2 and fsdp.world_size == 4
    got = params(fsdp, model)
    ctx["figures"]["ep2x2_vs_one_process"] = assert_close(got, ref, 1e-5, "ep2x2 vs one process")
    # every collective synchronous, and 2 units ahead with the collective-order check on: bit for bit the same
    for options in ({"prefetch_depth": 0}, {"prefetch_depth": 2, "check_collective_order": 1}):
        other = run("fleet", slice(0, 3), build("fleet", **options))
        assert_close(params(*other[:2]), got, 0.0, f"ep2x2 with {options}")
    run_ep4 = run("ep_world", slice(0, 3))
    ctx["figures"]["ep4_vs_one_process"] = assert_close(params(*run_ep4[:2]), ref, 1e-5, "ep4 vs one process")


def reshard(ctx, source: str, layout: str, name: str) -> None:
    """Load ``source`` into ``layout``: re-saved it is the same checkpoint bit for bit; each rank reads <= 1.1x its
    share; one more step equals the source run's uninterrupted third step within 1e-5."""
    ckpt = os.path.join(ctx["dir"], source)
    fsdp, model, opt = build(layout)
    # checksums widen every read to whole 256 KiB checksum chunks (each piece of this tiny model is smaller): the
    # bytes a load needs are measured without them (docs/reports/expert-parallel-2026-12-05.md has both)
    result = fsdp.load_checkpoint(ckpt, optimizer=opt, verify_checksums=False)
    again = os.path.join(ctx["dir"], f"{name}_again")
    fsdp.save_checkpoint(again, optimizer=opt)
    assert_same_checkpoint(ckpt, again)
    # its share: its records, and its values (the RNG state, ~15 KB per rank here, read by every load)
    mine, read = share_bytes(fsdp, opt), result.report.bytes_read
    assert read <= 1.1 * mine, f"{name}: rank {dist.get_rank()} read {read} bytes for its share of {mine}"
    ctx["figures"][f"{name}_read_vs_share"] = [read, mine]
    run(layout, slice(2, 3), (fsdp, model, opt))
    want = dict(np.load(os.path.join(ctx["dir"], f"{source}_uninterrupted.npz")))
    ctx["figures"][f"{name}_continuation"] = assert_close(params(fsdp, model), want, 1e-5, name)


def case_explicit_groups(ctx):
    """ep2 x expert-shard 2 from groups made with topology.new_group (before fleet.init) trains bit for bit as
    fleet's; the same groups swapped (EP over strided ranks, against the model's dispatch over consecutive ones)
    are refused by name: two ranks of one EP position would hold different experts."""
    ep, shard = ctx["own_groups"]
    hcg = fleet.get_hybrid_communicate_group()
    assert (
        ep.ranks == hcg.get_expert_parallel_group().ranks and shard.ranks == hcg.get_moe_sharding_parallel_group().ranks
    )

    def own(expert_parallel_group, expert_shard_group):
        model = make_moe(SEED, ep)  # the model's dispatch runs over the consecutive EP group
        groups = dict(expert_parallel_group=expert_parallel_group, expert_shard_group=expert_shard_group)
        fsdp = FullyShardFusion(model, UNITS, moe_layers_name=EXPERT_CLASSES, **groups)  # dense: the default group
        return fsdp, model, optimizer(model, fsdp)

    mine = run("own", slice(0, 3), own(ep, shard))
    theirs = run("fleet", slice(0, 3))
    assert_close(params(*mine[:2]), params(*theirs[:2]), 0.0, "explicit groups vs fleet's")
    try:
        own(shard, ep)
    except UnsupportedGroupLayoutError as e:
        assert "hold EP position 0 but different experts" in str(e), str(e)
    else:
        raise AssertionError("swapped expert groups accepted")


def four_rank_cases():
    return {
        "training_ep2x2": case_training_ep2x2,
        "explicit_groups": case_explicit_groups,
        "reshard_ep2_to_ep2x2": lambda ctx: reshard(ctx, "ep2", "fleet", "ep2_to_ep2x2"),
        "reshard_ep1_to_ep2x2": lambda ctx: reshard(ctx, "ep1", "fleet", "ep1_to_ep2x2"),
        "reshard_ep2_to_ep4": lambda ctx: reshard(ctx, "ep2", "ep_world", "ep2_to_ep4"),
        "reshard_ep2_to_ep1": lambda ctx: reshard(ctx, "ep2", "dense", "ep2_to_ep1"),
    }


def _own_groups():
    """(EP group, expert shard group) of this rank in fleet's layout for ep2 x 2: EP over consecutive ranks."""
    from paddle.distributed.fsdp.comm.topology import new_group

    me, mine = dist.get_rank(), {}
    for name, lists in (("ep", ([0, 1], [2, 3])), ("shard", ([0, 2], [1, 3]))):
        for ranks in lists:
            group = new_group(ranks)
            if me in ranks:
                mine[name] = group
    return mine["ep"], mine["shard"]


def main() -> None:
    workdir = sys.argv[1]
    dist.init_parallel_env()
    world = dist.get_world_size()
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {
        "dp_degree": 1,
        "mp_degree": 1,
        "pp_degree": 1,
        "sharding_degree": world,
        "ep_degree": 2,
        "moe_sharding_degree": world // 2,
        "order": ORDER,
    }
    own_groups = _own_groups() if world == 4 else None  # before fleet.init: gloo's new_group failed after it
    with barrier_after_new_group(reuse_identical=True):  # gloo: see topology.barrier_after_new_group
        fleet.init(is_collective=True, strategy=strategy)
    cases = two_rank_cases() if world == 2 else four_rank_cases()
    ctx = {"dir": workdir, "figures": {}, "own_groups": own_groups}
    if "--s3" in sys.argv:
        ctx["s3"], cases = sys.argv[sys.argv.index("--s3") + 1], {"s3": case_s3}
    results = {}
    for name, case in cases.items():
        try:
            case(ctx)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
            print(f"case {name} failed:\n{results[name]}", file=sys.stderr, flush=True)
    dist.barrier()
    results["figures"] = ctx["figures"]
    report(results)


if __name__ == "__main__":
    main()
