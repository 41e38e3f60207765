#!/usr/bin/env python3
"""Training speed and memory per rank: FullyShardFusion against paddle's other options and torch FSDP2.

One command runs every contender side by side, each as fresh processes, interleaved over several rounds (the
order reversed every other round), with one compute thread per rank (OMP_NUM_THREADS=1)::

    python tools/train_bench/run.py                       # d=512, 2 ranks, 3 rounds, curve 1/2/4 ranks
    python tools/train_bench/run.py --d 128 --rounds 1    # a quick small run
    python tools/train_bench/run.py --write-docs docs/performance.md --json results.json
    python tools/train_bench/lora.py --write-docs docs/performance.md  # the LoRA case (frozen base; lora.py)

Contenders (same model, data and optimizer; see bench_model.py): paddle one process, paddle DataParallel, stock
GroupShardedStage3 (forced onto CPU: see paddle_worker.stock_stage3), fleet sharding stage 1, FullyShardFusion
(one unit per block, its default prefetch_depth: 0 on gloo; ``fsdp_d1``: prefetch_depth 1; not in the default
set: ``fsdp_d0``, ``fsdp_heap`` (its per-step blocks from paddle's allocator instead of mappings) and
``fsdp_notrim`` (no malloc_trim at the start of forward and backward)), and, if torch is importable, torch one process and torch FSDP2. Reported per rank: step
time median, peak RSS (getrusage), the allocator's own peak (paddle's host memory statistics) and, for
FullyShardFusion, the account of what its buffers hold at the sampled peak against the model bound
(state / N + activations + (prefetch_depth + 1) gathered units); the compute-floor ratio (step / one-process
step of the same framework); and the curve of FullyShardFusion's memory at 1, 2 and 4 ranks.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from ckpt_bench.common import clean_env  # noqa: E402
from report import render, update_docs  # noqa: E402

LOG = logging.getLogger("train_bench")
PADDLE = ("single", "dp", "stage3", "stage1", "fsdp", "fsdp_d1")
TORCH = ("torch_single", "torch_fsdp2")
ONE_PROCESS = ("single", "torch_single")
OPTIONAL = ("fsdp_d0", "fsdp_heap", "fsdp_notrim")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--d", type=int, default=512, help="model width (default 512: 16.8M parameters)")
    p.add_argument("--layers", type=int, default=8, help="blocks (default 8)")
    p.add_argument("--batch", type=int, default=16, help="sequences per rank (default 16)")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--world", type=int, default=2, help="ranks of the distributed contenders (default 2)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per run (default 1)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per run (default 3)")
    p.add_argument(
        "--prefetch-depth",
        type=int,
        default=None,
        help="FullyShardFusion's prefetch_depth (default: its own, 0 on gloo)",
    )
    p.add_argument(
        "--contenders", default=",".join(PADDLE + TORCH), help=f"comma-separated subset (also: {', '.join(OPTIONAL)})"
    )
    p.add_argument("--curve", default="1,2,4", help="FullyShardFusion's ranks for the memory curve ('' none)")
    p.add_argument("--dir", default=None, help="work directory (results, logs; default a temporary one)")
    p.add_argument("--json", default=None, help="write every result here")
    p.add_argument("--from-json", default=None, help="render tables from a saved --json instead of running")
    p.add_argument("--markdown", default=None, help="write the tables here")
    p.add_argument("--write-docs", default=None, help="replace the generated table in this guide (performance.md)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run before it is killed (default 1800)")
    return p.parse_args(argv)


def child_env() -> dict:
    env = clean_env()
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return env


def model_args(args) -> list[str]:
    return [
        "--dim", str(args.d), "--layers", str(args.layers), "--batch", str(args.batch), "--seq", str(args.seq),
        "--warmup", str(args.warmup), "--steps", str(args.steps),
    ]  # fmt: skip


def command(contender: str, world: int, args, out: str, log_dir: str) -> tuple[list[str], dict]:
    """The command (and environment) that runs ``contender`` on ``world`` fresh processes."""
    env = child_env()
    script = os.path.join(HERE, "torch_worker.py" if contender in TORCH else "paddle_worker.py")
    name = "fsdp" if contender.startswith("fsdp") else contender  # fsdp_d0, fsdp_heap: fsdp with options
    worker = [script, "--contender", name, "--out", out, *model_args(args)]
    depth = {"fsdp_d0": 0, "fsdp_d1": 1}.get(contender, args.prefetch_depth)
    if contender.startswith("fsdp") and depth is not None:
        worker += ["--prefetch-depth", str(depth)]
    if contender == "fsdp_heap":
        worker.append("--heap-blocks")
    if contender == "fsdp_notrim":
        worker.append("--no-heap-trim")
    if world == 1:
        return [sys.executable, *worker], env
    if contender in TORCH:
        launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world)]
        env["OMP_NUM_THREADS"] = "1"
        return [sys.executable, *launcher, *worker], env
    launcher = ["-m", "paddle.distributed.launch", "--nproc_per_node", str(world), "--log_dir", log_dir]
    return [sys.executable, *launcher, *worker], env


def run_one(contender: str, world: int, args, work: str, tag: str) -> dict:
    """Run one contender once; its per-rank results, or the reason it failed."""
    out = os.path.join(work, tag)
    log_dir = os.path.join(work, f"{tag}.logs")
    cmd, env = command(contender, world, args, out, log_dir)
    with open(f"{out}.log", "w") as log:
        try:
            code = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=args.timeout).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
    ranks = []
    for rank in range(world):
        path = f"{out}.rank{rank}.json"
        if os.path.exists(path):
            with open(path) as f:
                ranks.append(json.load(f))
    if code != 0 or len(ranks) != world:
        return {"contender": contender, "world": world, "error": f"exit {code}; log {out}.log"}
    return {"contender": contender, "world": world, "ranks": ranks}


def load_average() -> float:
    return os.getloadavg()[0]


def plan(args) -> list[tuple[int, str, int]]:
    """(round, contender, world) in run order: contenders interleaved, reversed every other round; the curve's
    extra worlds of FullyShardFusion once, after the first round."""
    contenders = [c for c in args.contenders.split(",") if c]
    if importlib.util.find_spec("torch") is None:
        dropped = [c for c in contenders if c in TORCH]
        if dropped:
            LOG.info("torch is not importable: %s left out", ", ".join(dropped))
        contenders = [c for c in contenders if c not in TORCH]
    jobs = []
    for r in range(args.rounds):
        order = contenders if r % 2 == 0 else contenders[::-1]
        jobs += [(r, c, 1 if c in ONE_PROCESS else args.world) for c in order]
        if r == 0:
            curve = [int(w) for w in args.curve.split(",") if w.strip()]
            jobs += [(r, "fsdp", w) for w in curve if w != args.world]
    return jobs


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    if args.from_json:
        with open(args.from_json) as f:
            results = json.load(f)
    else:
        work = args.dir or tempfile.mkdtemp(prefix="train_bench_")
        os.makedirs(work, exist_ok=True)
        jobs = plan(args)
        LOG.info("%d runs in %s (d=%d, %d ranks, %d rounds)", len(jobs), work, args.d, args.world, args.rounds)
        runs, started = [], time.monotonic()
        for done, (r, contender, world) in enumerate(jobs):
            load = load_average()
            t0 = time.monotonic()
            run = run_one(contender, world, args, work, f"{done:02d}_r{r}_{contender}_w{world}")
            run.update(round=r, load=load, wall_s=time.monotonic() - t0)
            runs.append(run)
            elapsed = time.monotonic() - started
            eta = elapsed / (done + 1) * (len(jobs) - done - 1)
            status = run.get("error") or "ok"
            LOG.info("[%d/%d] round %d %s on %d: %s in %.0f s (load %.1f); ETA %.0f min", done + 1, len(jobs),
                     r + 1, contender, world, status, run["wall_s"], load, eta / 60)  # fmt: skip
        results = {"args": vars(args), "runs": runs, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    text = render(results)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    if args.write_docs:
        update_docs(args.write_docs, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
