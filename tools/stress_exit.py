#!/usr/bin/env python
"""Clean-exit stress: launch a 2-rank MoE train+save job many times and report every rank's exit code.

    python tools/stress_exit.py --runs 30                 # FullyShardFusion + save_checkpoint (the fork)
    python tools/stress_exit.py --runs 30 --job stock     # the same model and steps, fork disabled, stock paddle
    python tools/stress_exit.py --runs 30 --json out.json

Each run is ``python -m paddle.distributed.launch --nproc_per_node N`` of this file in ``--rank-wrapper`` mode:
the wrapper runs the real rank process as its child and records its exit status (a negative status is the
signal that ended it, e.g. -6 = SIGABRT), so a crash at interpreter exit is seen exactly, per rank, even after
the job reported success. Not part of the pytest run (it takes minutes): run it by hand.

Jobs (``--job``): ``fsdp``: PaddleFormers' tiny Qwen3MoeForCausalLM under FullyShardFusion, AdamW, a few steps,
a synchronous and an asynchronous ``save_checkpoint``; ``stock``: the same model and steps with the fork disabled
(``PADDLE_FSDP_FORK_DISABLE=1``), gradients all-reduced by hand and ``paddle.save`` on rank 0 (rank 1 does not
wait for it). ``--final-barrier`` ends either job with ``dist.barrier()``, so the ranks exit together.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.abspath(__file__)
STATUS_FILE_ENV = "STRESS_EXIT_STATUS_DIR"


def _describe(code: int | None) -> str:
    if code is None:
        return "missing"
    if code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            return str(code)
    return str(code)


# ------------------------------------------------------------------------------------------------ the job


def _build_moe():
    import paddle
    from paddleformers.transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=32,
        tie_word_embeddings=False,
    )
    paddle.seed(1)
    return Qwen3MoeForCausalLM(config)


def run_job(kind: str, workdir: str, steps: int, final_barrier: bool = False) -> None:
    import logging

    import numpy as np
    import paddle
    import paddle.distributed as dist

    logging.getLogger("paddleformers").setLevel(logging.WARNING)
    dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = _build_moe()
    opt = paddle.optimizer.AdamW(1e-3, parameters=model.parameters(), grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0))
    fsdp = None
    if kind == "fsdp":
        from paddle.distributed.fsdp import FullyShardFusion

        fsdp = FullyShardFusion(model, fsdp_unit_layers=["Qwen3MoeDecoderLayer"])
    rng = np.random.default_rng(0)
    for _ in range(steps):
        ids = paddle.to_tensor(rng.integers(0, 64, (2 * world, 8))[2 * rank : 2 * rank + 2])
        loss = model(input_ids=ids, labels=ids)[0]
        loss.backward()
        if fsdp is None:
            with paddle.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        dist.all_reduce(p.grad)
                        p.grad.scale_(1.0 / world)
        opt.step()
        opt.clear_grad()
    if fsdp is not None:
        fsdp.save_checkpoint(os.path.join(workdir, "sync"), optimizer=opt, extra_state={"steps": steps})
        fsdp.save_checkpoint(os.path.join(workdir, "async"), optimizer=opt, async_save=True).wait()
    else:
        if rank == 0:
            paddle.save(model.state_dict(), os.path.join(workdir, "model.pdparams"))
            paddle.save(opt.state_dict(), os.path.join(workdir, "opt.pdopt"))
    if final_barrier:
        dist.barrier()
    import threading

    python_threads = sorted(t.name for t in threading.enumerate())
    os_threads = len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else -1
    print(f"rank {rank}: job done; Python threads {python_threads}; OS threads {os_threads}", flush=True)


def _allow_core_dumps() -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def rank_wrapper(argv: list[str], workdir: str, cores: bool) -> int:
    """Run the real rank as a child and record how it ended (the launcher only sees this wrapper)."""
    rank = os.environ.get("PADDLE_TRAINER_ID", "0")
    cwd = os.path.join(workdir, f"cwd{rank}")
    os.makedirs(cwd, exist_ok=True)  # a core file (core_pattern "core") lands here
    proc = subprocess.run(
        [sys.executable, HERE, "--rank-job", *argv], cwd=cwd, preexec_fn=_allow_core_dumps if cores else None
    )
    status_dir = os.environ.get(STATUS_FILE_ENV)
    if status_dir:
        with open(os.path.join(status_dir, f"rank{rank}"), "w") as f:
            f.write(str(proc.returncode))
    return 0 if proc.returncode == 0 else 1


# ------------------------------------------------------------------------------------------------ the driver


def one_run(args, index: int) -> dict:
    work = tempfile.mkdtemp(prefix=f"stress-exit-{index}-", dir=args.tmp)
    status = os.path.join(work, "status")
    os.makedirs(status)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PADDLE_") or k.startswith("PADDLE_FSDP_")}
    # faulthandler prints every Python thread's stack to the worker log if a rank dies of a signal
    env.update({STATUS_FILE_ENV: status, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"})
    if args.job == "stock":
        env["PADDLE_FSDP_FORK_DISABLE"] = "1"
    cmd = (
        [
            sys.executable,
            "-m",
            "paddle.distributed.launch",
            "--nproc_per_node",
            str(args.nproc),
            "--log_dir",
            os.path.join(work, "logs"),
            HERE,
            "--rank-wrapper",
            "--job",
            args.job,
            "--workdir",
            work,
            "--steps",
            str(args.steps),
        ]
        + (["--cores"] if args.cores else [])
        + (["--final-barrier"] if args.final_barrier else [])
    )
    start = time.monotonic()
    try:
        launcher = subprocess.run(
            cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=args.timeout
        ).returncode
    except subprocess.TimeoutExpired:
        launcher = "timeout"
    codes = {}
    for rank in range(args.nproc):
        path = os.path.join(status, f"rank{rank}")
        codes[rank] = int(open(path).read()) if os.path.exists(path) else None
    ok = launcher == 0 and all(code == 0 for code in codes.values())
    if ok and not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "run": index,
        "launcher": launcher,
        "ranks": codes,
        "seconds": round(time.monotonic() - start, 1),
        "logs": None if ok and not args.keep else work,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--job", choices=["fsdp", "stock"], default="fsdp")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("--tmp", default=None, help="where run directories go (default: the system temp dir)")
    parser.add_argument("--keep", action="store_true", help="keep the directories of successful runs too")
    parser.add_argument("--json", help="write every run's exit codes here")
    parser.add_argument("--cores", action="store_true", help="allow core dumps (into each run's cwd<rank>/)")
    parser.add_argument(
        "--final-barrier", action="store_true", help="end the job with dist.barrier() (ranks exit together)"
    )
    parser.add_argument("--rank-wrapper", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank-job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    job_args = ["--job", args.job, "--workdir", args.workdir, "--steps", str(args.steps)]
    if args.rank_wrapper:
        return rank_wrapper(job_args + (["--final-barrier"] if args.final_barrier else []), args.workdir, args.cores)
    if args.rank_job:
        run_job(args.job, args.workdir, args.steps, args.final_barrier)
        return 0
    runs = []
    for index in range(args.runs):
        result = one_run(args, index)
        runs.append(result)
        ranks = ", ".join(f"rank {r}: {_describe(c)}" for r, c in result["ranks"].items())
        note = f"  logs: {result['logs']}" if result["logs"] else ""
        print(f"run {index:3d}  launcher {result['launcher']}  {ranks}  ({result['seconds']} s){note}", flush=True)
    counts = collections.Counter(_describe(c) for r in runs for c in r["ranks"].values())
    failed = sum(1 for r in runs if r["launcher"] != 0 or any(c != 0 for c in r["ranks"].values()))
    print(f"\n{args.job}: {len(runs)} runs x {args.nproc} ranks; exit statuses: {dict(counts)}; failed runs: {failed}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"job": args.job, "runs": runs, "counts": dict(counts), "failed_runs": failed}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
