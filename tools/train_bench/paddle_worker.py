"""One paddle contender on this rank (run by ``run.py``, under ``paddle.distributed.launch`` for 2+ ranks).

Contenders: ``single`` (one process, no distribution), ``dp`` (paddle.DataParallel), ``stage3`` (stock
GroupShardedStage3, see :func:`stock_stage3`), ``stage1`` (fleet sharding_degree=N: optimizer state sharded),
``fsdp`` (FullyShardFusion, one unit per block). Writes ``<out>.rank<r>.json``: step times, peak RSS, the
allocator's own peak, live memory sampled before every block's backward, and (fsdp) the account of its buffers.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time

from probe import heap_now_mib, peak_rss_mib, rss_now_mib, threads_pinned, write_result

threads_pinned()

import paddle  # noqa: E402
import paddle.distributed as dist  # noqa: E402
from bench_model import batch, paddle_model, parameter_count  # noqa: E402
from paddle.base import core  # noqa: E402

LOG = logging.getLogger("train_bench.paddle")
MIB = 1 << 20


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contender", required=True, choices=["single", "dp", "stage3", "stage1", "fsdp"])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prefetch-depth", type=int, default=None, help="fsdp: prefetch_depth (default: FSDP's own)")
    p.add_argument(
        "--heap-blocks",
        action="store_true",
        help="fsdp: take gathered units and gradient buffers from paddle's allocator (malloc) instead of mappings "
        "of their own: the A/B of what buffer_memory.py's mappings save and cost",
    )
    p.add_argument(
        "--no-heap-trim",
        action="store_true",
        help="fsdp: no malloc_trim at the start of forward and backward (heap_trim.py): the A/B of what it saves and costs",
    )
    p.add_argument("--out", required=True, help="result path prefix (<out>.rank<r>.json)")
    return p.parse_args(argv)


def barrier_after_new_group() -> None:
    """paddle 3.3.1's gloo ``new_group`` with 4 processes: a member may connect before its peer listens
    ("Connection refused"); a barrier after each group creation keeps them in step."""
    import paddle.distributed.collective as collective

    original = collective.new_group

    def new_group(*args, **kwargs):
        group = original(*args, **kwargs)
        dist.barrier()
        return group

    collective.new_group = dist.new_group = new_group


def stock_stage3(model, opt):
    """Stock ``GroupShardedStage3(model, opt, device="cpu", segment_size=0)``, built directly.

    ``group_sharded_parallel(level="p_g_os")`` refuses CPU (an assert on the build: gpu, xpu or custom device),
    and so does the stage-3 constructor: ``core.is_compiled_with_cuda`` is patched to True during the
    constructor only (not a path a user can reach). ``segment_size=0``: stage 3 shards only parameters with more
    elements than ``segment_size``; the default 2**20 would shard none of this model's (the largest is exactly
    2**20 at d=512)."""
    from paddle.distributed.fleet.meta_parallel.sharding import group_sharded_stage3 as stage3

    original = stage3.core.is_compiled_with_cuda
    stage3.core.is_compiled_with_cuda = lambda: True
    try:
        return stage3.GroupShardedStage3(model, opt, device="cpu", segment_size=0)
    finally:
        stage3.core.is_compiled_with_cuda = original


def fleet_stage1(model, opt, world: int):
    from paddle.distributed import fleet

    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": 1, "pp_degree": 1, "sharding_degree": world}
    fleet.init(is_collective=True, strategy=strategy)
    return fleet.distributed_model(model), fleet.distributed_optimizer(opt)


def optimizer_state_bytes(opt) -> int:
    """AdamW's moments (and any master weights) this rank holds, wherever fleet or stage 3 wrapped the optimizer."""
    seen, total = set(), 0
    while opt is not None and id(opt) not in seen:
        seen.add(id(opt))
        for per_param in getattr(opt, "_accumulators", {}).values():
            total += sum(t._numel() * t.element_size() for t in per_param.values() if t._is_initialized())
        total += sum(t._numel() * t.element_size() for t in getattr(opt, "_master_weights", {}).values())
        opt = getattr(opt, "_inner_opt", None) or getattr(opt, "_optim", None)
    return total


class Sampler:
    """Live memory before every block's backward (and after forward, backward and step): paddle's allocator's
    current bytes plus, for fsdp, what FSDP mapped itself (outside the allocator). Keeps the largest sample."""

    def __init__(self, fsdp=None) -> None:
        self.fsdp = fsdp
        self.peak: dict | None = None
        self.trace: list[dict] = []
        self.where = ""

    def sample(self, where: str) -> None:
        allocator = core.host_memory_stat_current_value("Allocated", 0)
        account = self.fsdp.memory_account() if self.fsdp is not None else {}
        live = allocator + account.get("mapped_outside_allocator", 0)
        entry = {
            "where": where,
            "live": live,
            "allocator": allocator,
            "rss_mib": rss_now_mib(),
            "heap_mib": heap_now_mib(),
            "account": account,
        }
        if self.peak is None or live > self.peak["live"]:
            self.peak = entry
        self.trace.append({k: v for k, v in entry.items() if k != "account"})

    def watch(self, blocks) -> None:
        """Sample right before each block's backward: a hook on its output (after FSDP's own, which gathers)."""
        for index, block in enumerate(blocks):

            def post(layer, inputs, output, index=index):
                if paddle.is_grad_enabled() and not output.stop_gradient:
                    output.register_hook(lambda grad: self.sample(f"backward {index}"))

            block.register_forward_post_hook(post)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    world = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    if world > 1:
        if world > 2:
            barrier_after_new_group()
        if args.contender != "stage1":
            dist.init_parallel_env()
    rank = dist.get_rank() if world > 1 else 0
    baseline_rss = rss_now_mib()
    model = paddle_model(args.dim, args.layers)
    fsdp = None
    if args.contender == "fsdp":
        from paddle.distributed.fsdp import FullyShardFusion
        from paddle.distributed.fsdp.buffers import fused_buffer

        if args.heap_blocks:
            fused_buffer.maps_blocks = lambda like: False

        fsdp = FullyShardFusion(model, fsdp_unit_layers=["Block"], prefetch_depth=args.prefetch_depth)
        if args.no_heap_trim:
            fsdp.heap_trim.enabled = False
    opt = paddle.optimizer.AdamW(learning_rate=1e-3, parameters=model.parameters(), weight_decay=0.01)
    blocks = model.blocks
    if args.contender == "dp":
        model = paddle.DataParallel(model)
    elif args.contender == "stage3":
        model = stock_stage3(model, opt)
    elif args.contender == "stage1":
        model, opt = fleet_stage1(model, opt, world)
    sampler = Sampler(fsdp)
    sampler.watch(blocks)
    core.host_memory_stat_reset_peak_value("Allocated", 0)
    wrapped_rss = rss_now_mib()
    times, losses, after_forward = [], [], []
    for step in range(args.warmup + args.steps):
        x = paddle.to_tensor(batch(step, rank, args.batch, args.seq, args.dim))
        if world > 1:
            dist.barrier()
        sampler.sample(f"step {step} start")
        before_forward = sampler.trace[-1]["live"]
        start = time.perf_counter()
        loss = model(x)
        sampler.sample(f"step {step} after forward")
        after_forward.append(sampler.trace[-1]["live"] - before_forward)
        loss.backward()
        sampler.sample(f"step {step} after backward")
        opt.step()
        opt.clear_grad()
        value = float(loss)
        elapsed = time.perf_counter() - start
        sampler.sample(f"step {step} after step")
        losses.append(value)
        if step >= args.warmup:
            times.append(elapsed)
        LOG.info("rank %d step %d: %.2f s, loss %.9g, rss %.0f MiB", rank, step, elapsed, value, rss_now_mib())
    result = {
        "contender": args.contender,
        "world": world,
        "rank": rank,
        "times": times,
        "losses": losses,
        "peak_rss_mib": peak_rss_mib(),
        "baseline_rss_mib": baseline_rss,
        "wrapped_rss_mib": wrapped_rss,
        "allocator_peak": core.host_memory_stat_peak_value("Allocated", 0),
        "peak_sample": sampler.peak,
        "trace": sampler.trace,
        "activations": max(after_forward),
        "optimizer_state": optimizer_state_bytes(opt),
        "parameters": parameter_count(args.dim, args.layers),
        "prefetch_depth": fsdp.schedule.depth if fsdp is not None else None,
    }
    if fsdp is not None:
        result["unit_bytes"] = max(b.layout.padded_numel * b.shard.element_size() for b in fsdp.buffers)
        result["block_peaks"] = dict(fsdp.blocks.peak)
        result["heap_trim"] = {"calls": fsdp.heap_trim.calls, "seconds": fsdp.heap_trim.seconds}
    write_result(args.out, rank, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
