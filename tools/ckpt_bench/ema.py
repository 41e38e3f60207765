#!/usr/bin/env python3
"""EMA phase of the checkpoint benchmark: what ``ShardedEMA.update()`` (state/ema.py) costs a training step.

    python tools/ckpt_bench/ema.py --size-gib 1 --world 2 --json ema.json

The benchmark model (``Linear(dim, dim)`` blocks, AdamW, fp32, sized as tools/bench_ckpt.py: parameters + AdamW
moments = ``--size-gib``) at ONE rank's share of ``--world`` ranks, in one process: the EMA update is local to a
rank (no communication), while a step at ``--world`` ranks also communicates, so the share of the step measured
here is an upper bound of the share at that world. The batch is sized as in train_loop.py (a step at least
``--step-vs-memcpy`` times a memcpy of the rank's state). Steps with and without ``ema.update()`` alternate in
one run (``--pairs`` pairs; machines vary 2-3x run to run: only the ratios of one run mean something); the update
is also timed alone, for ``every`` = 1 and each of ``--every`` (the update averaging every N-th call).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_loop import host_bytes, memcpy_seconds, model_shape  # noqa: E402  (the benchmark's sizes, memcpy)

LOG = logging.getLogger("bench_ema")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="the world whose rank share is measured (default 2)")
    p.add_argument("--size-gib", type=float, default=1.0, help="params + AdamW state in all (GiB, default 1)")
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--pairs", type=int, default=8, help="step pairs (with / without the update), default 8")
    p.add_argument("--every", default="4,16", help="also time update() averaging every N-th call (default 4,16)")
    p.add_argument("--step-vs-memcpy", type=float, default=1.5, help="step time at least this x memcpy")
    p.add_argument("--batch", type=int, default=0, help="this batch instead (rows per step; 0: the rule above)")
    p.add_argument("--seed", type=int, default=2024)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def run(args) -> dict:
    import paddle
    from paddle.distributed.fsdp import FullyShardFusion

    dim, blocks = model_shape(argparse.Namespace(dim=args.dim, size_gib=args.size_gib / args.world))
    paddle.seed(args.seed)
    model = paddle.nn.Sequential(*[paddle.nn.Linear(dim, dim) for _ in range(blocks)])
    fsdp = FullyShardFusion(model, fsdp_unit_layers=["Linear"])
    opt = paddle.optimizer.AdamW(learning_rate=1e-6, parameters=model.parameters(), weight_decay=0.01)
    fsdp.init_optimizer_state(opt)
    state = {**fsdp.sharded_state_dict(), **fsdp.optimizer_sharded_state_dict(opt)}
    memcpy = memcpy_seconds([host_bytes(getattr(v, "local_tensor", v)) for v in state.values()])
    del state
    x = {"batch": None}
    opt_steps: list[float] = []

    def step() -> float:
        t0 = time.perf_counter()
        model(x["batch"]).square().mean().backward()
        t1 = time.perf_counter()
        opt.step()
        opt_steps.append(time.perf_counter() - t1)
        opt.clear_grad()
        return time.perf_counter() - t0

    batch = args.batch or 4
    while True:
        x["batch"] = paddle.rand([batch, dim]) * 0.01
        step()
        if args.batch or step() >= args.step_vs_memcpy * memcpy or batch >= 4096:
            break
        batch *= 2
    ema = fsdp.ema(0.999)

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    plain, with_ema, alone = [], [], []
    for _ in range(args.pairs):
        plain.append(step())
        with_ema.append(step() + timed(ema.update))
        alone.append(timed(ema.update))
    every = {}
    for n in [int(v) for v in args.every.split(",") if v.strip()]:
        sparse = fsdp.ema(0.999, every=n)
        calls = [timed(sparse.update) for _ in range(n * 4)]
        every[n] = statistics.mean(calls)  # the cost a step pays on average
    step_s = statistics.median(plain)
    out = {
        "world": args.world,
        "rank_params": sum(int(e.shape[0]) for _b, e in ema.shards),
        "ema_bytes": ema.nbytes(),
        "batch": batch,
        "memcpy_s": memcpy,
        "step_s": step_s,
        "step_with_update_s": statistics.median(with_ema),
        "update_s": statistics.median(alone),
        "update_vs_step": statistics.median(alone) / step_s,
        "optimizer_step_s": statistics.median(opt_steps[-2 * args.pairs :]),  # AdamW's update alone
        "update_vs_optimizer_step": statistics.median(alone) / statistics.median(opt_steps[-2 * args.pairs :]),
        "every": {n: {"update_s": s, "update_vs_step": s / step_s} for n, s in every.items()},
    }
    return out


def table(r: dict) -> str:
    lines = [
        "| EMA update (per step) | rank params | EMA MiB | step (s) | AdamW update (s) | EMA update (s) | "
        "EMA / step | EMA / AdamW update |",
        "|---|---|---|---|---|---|---|---|",
        f"| every step, batch {r['batch']} | {r['rank_params']:,} | {r['ema_bytes'] / 2**20:.0f} | {r['step_s']:.3f} | "
        f"{r['optimizer_step_s']:.4f} | {r['update_s']:.4f} | {100 * r['update_vs_step']:.1f}% | "
        f"{r['update_vs_optimizer_step']:.2f}x |",
    ]
    for n, e in r["every"].items():
        lines.append(
            f"| every {n} steps (mean) | | | | | {e['update_s']:.4f} | {100 * e['update_vs_step']:.1f}% | "
            f"{e['update_s'] / r['optimizer_step_s']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    args = parse_args(argv)
    r = run(args)
    print(table(r))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=2)


if __name__ == "__main__":
    main()
