#!/usr/bin/env python3
"""Training-loop phase of the checkpoint benchmark: what an async checkpoint costs a running training loop.

Run by ``tools/bench_ckpt.py`` (``run_training_loops``: the benchmark's world and 1 rank), or alone::

    python tools/ckpt_bench/train_loop.py --world 2 --size-gib 1 --json train.json    # launches itself

For each framework, on ``--world`` ranks: the benchmark model (``Linear(dim, dim)`` blocks, AdamW, fp32; the same
sizes as ``tools/bench_ckpt.py``) trains ``--steps`` steps of a batch sized so that one step takes at least
``--step-vs-memcpy`` times a host memcpy of the rank's state; once without checkpoints and once with an async
checkpoint every ``--every`` steps (the last one ``--every`` steps before the end, and the loop waits for it at the
end), alternating ``--repeats`` times. The figure is the extra wall time per checkpoint (median loop with
checkpoints - median loop without, divided by the checkpoints per loop), in seconds and as a ratio to the memcpy.

* paddle: ``FullyShardFusion`` (one unit per block), ``fsdp.save_checkpoint(..., async_save=True)``; the user
  calls nothing else (the next ``opt.step()`` waits for the snapshot copy by itself).
* torch: FSDP2 (``fully_shard`` per Linear) on gloo, ``dcp.async_save`` with ``DefaultStager`` (async staging on
  its thread, no pinned/shared memory: CPU only) and a process group of its own, ``staging_completion.result()``
  called before the next ``optimizer.step()`` (its best mode).

Compute runs on ``--threads`` threads per rank (default 1): with 2 ranks both cores compute, so the background
copy and write compete with training; with 1 rank a core is free, as on real nodes where the copy thread finds an
idle core. Results: a markdown table on stdout, ``--json`` for everything.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import json
import logging
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

LOG = logging.getLogger("bench_train_loop")
FLOAT_BYTES = 4
STATE_COPIES = 3  # fp32 parameter + AdamW moment1 + moment2


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--size-gib", type=float, default=1.0, help="params + AdamW state in all (GiB, default 1)")
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--steps", type=int, default=30, help="training steps per loop (default 30)")
    p.add_argument("--every", type=int, default=10, help="async checkpoint every N steps (default 10)")
    p.add_argument("--repeats", type=int, default=2, help="loops of each kind, alternating (default 2)")
    p.add_argument("--step-vs-memcpy", type=float, default=1.5, help="step time at least this x memcpy")
    p.add_argument("--threads", type=int, default=1, help="compute threads per rank (default 1)")
    p.add_argument("--frameworks", default="paddle,torch")
    p.add_argument("--dir", default=None)
    p.add_argument("--json", default=None)
    p.add_argument("--seed", type=int, default=2024)
    p.add_argument("--mode", default="main", choices=["main", "paddle", "torch"], help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def model_shape(args) -> tuple[int, int]:
    """(dim, blocks) so that params + AdamW moments come to ``--size-gib`` (as tools/bench_ckpt.py)."""
    dim = args.dim
    per_block = (dim * dim + dim) * FLOAT_BYTES * STATE_COPIES
    return dim, max(1, round(args.size_gib * (1 << 30) / per_block))


def setup_logging(rank: int, tag: str) -> None:
    LOG.handlers.clear()
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter(f"%(asctime)s train-{tag}[r{rank}] %(message)s", datefmt="%H:%M:%S"))
    LOG.addHandler(h)
    LOG.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    LOG.propagate = False


def memcpy_seconds(arrays: list[np.ndarray]) -> float:
    """Median of 3 host memcpys of ``arrays`` into one preallocated, touched buffer."""
    total = sum(len(a) for a in arrays)
    buf = np.empty(total, np.uint8)
    buf[:] = 1
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        pos = 0
        for a in arrays:
            np.copyto(buf[pos : pos + len(a)], a)
            pos += len(a)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def host_bytes(t) -> np.ndarray:
    n = int(np.prod(t.shape)) * t.element_size()
    if n == 0:
        return np.zeros(0, np.uint8)
    return np.frombuffer((ctypes.c_ubyte * n).from_address(t.data_ptr()), dtype=np.uint8)


def remove_checkpoints(work: str, prefix: str, rank: int) -> None:
    """Rank 0 deletes the loop's checkpoints (between loops, outside every timed region: deleting a 1 GiB
    checkpoint took ~0.2 s here, which is neither framework's cost)."""
    if rank != 0:
        return
    for name in os.listdir(work):
        if name.startswith(prefix):
            shutil.rmtree(os.path.join(work, name), ignore_errors=True)


class LoopTimer:
    """Runs the two loops alternately and keeps their wall times and per-step times."""

    def __init__(self, args, step, checkpoint, finish, barrier, gather, cleanup=None):
        self.args, self.step, self.checkpoint, self.finish = args, step, checkpoint, finish
        self.barrier, self.gather, self.cleanup = barrier, gather, cleanup

    def loop(self, with_ckpt: bool, tag: str) -> dict:
        K, M = self.args.steps, self.args.every
        steps, blocked = [], []
        self.barrier()
        t0 = time.perf_counter()
        for i in range(1, K + 1):
            ts = time.perf_counter()
            self.step()
            steps.append(time.perf_counter() - ts)
            if with_ckpt and i % M == 0 and i + M <= K:
                tb = time.perf_counter()
                self.checkpoint(f"{tag}_{i}")
                blocked.append(time.perf_counter() - tb)
        tw = time.perf_counter()
        self.finish()
        end = time.perf_counter()
        per = self.gather((end - t0, end - tw))
        if self.cleanup is not None:  # the loop's checkpoints are deleted outside the timed region
            self.barrier()
            self.cleanup()
        return {
            "wall_s": max(p[0] for p in per),
            "final_wait_s": max(p[1] for p in per),
            "step_s": steps,
            "blocked_s": blocked,
        }

    def run(self) -> dict:
        out = {"plain": [], "ckpt": []}
        for r in range(self.args.repeats):
            out["plain"].append(self.loop(False, f"p{r}"))
            LOG.info("loop without checkpoints: %.3f s", out["plain"][-1]["wall_s"])
            out["ckpt"].append(self.loop(True, f"c{r}"))
            LOG.info(
                "loop with checkpoints: %.3f s (blocked %s s, final wait %.3f s)",
                out["ckpt"][-1]["wall_s"],
                ", ".join(f"{b:.3f}" for b in out["ckpt"][-1]["blocked_s"]),
                out["ckpt"][-1]["final_wait_s"],
            )
        return out


# ============================================================================================ paddle


def run_paddle(args) -> None:
    import paddle
    import paddle.distributed as dist
    from paddle.distributed.fsdp import FullyShardFusion

    world = dist.get_world_size()
    if world > 1:
        dist.init_parallel_env()
    rank = dist.get_rank()
    setup_logging(rank, "paddle")
    dim, n = model_shape(args)

    class Block(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.fc = paddle.nn.Linear(dim, dim)

        def forward(self, x):
            return self.fc(x)

    class Net(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.blocks = paddle.nn.LayerList([Block() for _ in range(n)])

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    paddle.seed(args.seed)
    model = Net()
    fsdp = FullyShardFusion(model, fsdp_unit_layers=["Block"])
    opt = paddle.optimizer.AdamW(learning_rate=1e-6, parameters=model.parameters(), weight_decay=0.01)
    fsdp.init_optimizer_state(opt)

    def gather(obj):
        if world == 1:
            return [obj]
        out: list = []
        dist.all_gather_object(out, obj)
        return out

    def barrier():
        if world > 1:
            dist.barrier()

    state = {**fsdp.sharded_state_dict(), **fsdp.optimizer_sharded_state_dict(opt)}
    arrays = [host_bytes(getattr(v, "local_tensor", v)) for v in state.values()]
    del state
    nbytes = sum(len(a) for a in arrays)
    memcpy = max(gather(memcpy_seconds(arrays)))
    arrays = None
    batch = {"x": None}

    def step():
        loss = model(batch["x"]).square().mean()
        loss.backward()
        opt.step()
        opt.clear_grad()

    def time_steps(b: int) -> float:
        batch["x"] = paddle.rand([b, dim]) * 0.01
        step()
        t0 = time.perf_counter()
        for _ in range(2):
            step()
        return max(gather((time.perf_counter() - t0) / 2))

    b = args.batch or 4
    step_s = time_steps(b)
    while not args.batch and step_s < args.step_vs_memcpy * memcpy and b < 4096:
        b *= 2
        step_s = time_steps(b)
    LOG.info("rank state %.1f MiB, memcpy %.3f s, batch %d, step %.3f s", nbytes / 2**20, memcpy, b, step_s)
    pending = {"h": None}
    work = args.dir

    def checkpoint(tag: str) -> None:
        if pending["h"] is not None:  # one async save at a time (done by now: M steps since)
            pending["h"].wait()
        path = os.path.join(work, f"paddle_{tag}")
        pending["h"] = fsdp.save_checkpoint(path, optimizer=opt, async_save=True)

    def finish() -> None:
        if pending["h"] is not None:
            pending["h"].wait()
            pending["h"] = None

    res = LoopTimer(
        args, step, checkpoint, finish, barrier, gather, lambda: remove_checkpoints(work, "paddle_", rank)
    ).run()
    barrier()
    if rank == 0:
        res.update(memcpy_s=memcpy, step_probe_s=step_s, batch=b, rank_bytes=nbytes, world=world)
        with open(args.result, "w") as f:
            json.dump(res, f)


# ============================================================================================ torch


def run_torch(args) -> None:
    import torch
    import torch.distributed as tdist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, world = args.rank, args.world
    setup_logging(rank, "torch")
    torch.set_num_threads(args.threads)
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=world)
    ckpt_group = tdist.new_group(backend="gloo")  # async_save's collectives off the training group
    mesh = init_device_mesh("cpu", (world,))
    dim, n = model_shape(args)
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(n)])
    for m in model:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)
    get_state_dict(model, opt)  # creates the AdamW state

    def gather(obj):
        per = [None] * world
        tdist.all_gather_object(per, obj)
        return per

    def barrier():
        tdist.barrier()

    x = torch.rand(args.batch, dim) * 0.01

    def step():
        loss = model(x).square().mean()
        loss.backward()
        if pending["resp"] is not None and not pending["staged"]:
            pending["resp"].staging_completion.result()  # DCP's rule: staging done before the step
            pending["staged"] = True
        opt.step()
        opt.zero_grad()

    pending = {"resp": None, "staged": True}
    stager = DefaultStager(StagingOptions(False, False, True, False))
    work = args.dir

    def checkpoint(tag: str) -> None:
        if pending["resp"] is not None:
            pending["resp"].upload_completion.result()
        msd, osd = get_state_dict(model, opt)
        path = os.path.join(work, f"torch_{tag}")
        pending["resp"] = dcp.async_save(
            {"model": msd, "optim": osd}, checkpoint_id=path, process_group=ckpt_group, async_stager=stager
        )
        pending["staged"] = False

    def finish() -> None:
        if pending["resp"] is not None:
            pending["resp"].staging_completion.result()
            pending["resp"].upload_completion.result()
            pending["resp"] = None
            pending["staged"] = True

    for _ in range(3):
        step()
    res = LoopTimer(
        args, step, checkpoint, finish, barrier, gather, lambda: remove_checkpoints(work, "torch_", rank)
    ).run()
    stager.close()
    barrier()
    if rank == 0:
        res.update(batch=args.batch, world=world, version=torch.__version__)
        with open(args.result, "w") as f:
            json.dump(res, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo teardown at exit sometimes aborts after all work is done


# ============================================================================================ driver


def child_env(threads: int) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k.startswith("PADDLE_FSDP_CKPT_") or not (k.startswith("PADDLE_") or k.startswith("POD_"))
    }
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONWARNINGS="ignore::UserWarning")
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # compiled bytecode, as an installed package has (common.clean_env)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def common_args(args) -> list[str]:
    return [
        "--size-gib",
        str(args.size_gib),
        "--dim",
        str(args.dim),
        "--steps",
        str(args.steps),
        "--every",
        str(args.every),
        "--repeats",
        str(args.repeats),
        "--step-vs-memcpy",
        str(args.step_vs_memcpy),
        "--threads",
        str(args.threads),
        "--seed",
        str(args.seed),
        "--dir",
        args.dir,
    ]


def launch_paddle(args) -> dict:
    out = os.path.join(args.dir, f"train_paddle_{args.world}.json")
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(args.world)]
    cmd += ["--log_dir", os.path.join(args.dir, f"log_train_paddle_{args.world}"), os.path.abspath(__file__)]
    cmd += ["--mode", "paddle", "--result", out] + common_args(args)
    if args.world == 1:  # no launcher needed (and none of its environment)
        cmd = [sys.executable, os.path.abspath(__file__), "--mode", "paddle", "--result", out] + common_args(args)
    r = subprocess.run(cmd, env=child_env(args.threads))
    if r.returncode != 0 or not os.path.exists(out):
        raise SystemExit(f"paddle training loop failed (exit {r.returncode}); logs in {args.dir}")
    with open(out) as f:
        return json.load(f)


def launch_torch(args, batch: int) -> dict:
    out = os.path.join(args.dir, f"train_torch_{args.world}.json")
    port = free_port()
    procs = []
    for r in range(args.world):
        cmd = [sys.executable, os.path.abspath(__file__), "--mode", "torch", "--rank", str(r), "--port", str(port)]
        cmd += ["--world", str(args.world), "--batch", str(batch), "--result", out] + common_args(args)
        log = open(os.path.join(args.dir, f"train_torch_{args.world}_rank{r}.log"), "w")
        procs.append((subprocess.Popen(cmd, env=child_env(args.threads), stdout=log, stderr=subprocess.STDOUT), log))
    codes = [p.wait() for p, _ in procs]
    for _, log in procs:
        log.close()
    if any(codes) or not os.path.exists(out):
        raise SystemExit(f"torch training loop failed ({codes}); logs in {args.dir}")
    with open(out) as f:
        return json.load(f)


def summarize(res: dict, memcpy: float, ckpts_per_loop: int, every: int) -> dict:
    plain = statistics.median(r["wall_s"] for r in res["plain"])
    plain_step = statistics.median(x for r in res["plain"] for x in r["step_s"])
    with_ckpt = statistics.median(r["wall_s"] for r in res["ckpt"])
    extra = (with_ckpt - plain) / ckpts_per_loop
    blocked = [b for r in res["ckpt"] for b in r["blocked_s"]]
    return {
        "loop_plain_s": plain,
        "loop_ckpt_s": with_ckpt,
        "extra_per_ckpt_s": extra,
        "extra_vs_memcpy": extra / memcpy,
        "blocked_median_s": statistics.median(blocked) if blocked else None,
        "blocked_vs_memcpy": (statistics.median(blocked) / memcpy) if blocked else None,
        "final_wait_s": statistics.median(r["final_wait_s"] for r in res["ckpt"]),
        # per-step medians are robust against the loop-to-loop drift that dominates the wall-time difference
        "step_median_plain_s": statistics.median(x for r in res["plain"] for x in r["step_s"]),
        "step_median_ckpt_s": statistics.median(x for r in res["ckpt"] for x in r["step_s"]),
        # the steps right after a checkpoint call (they run while the background copy and write do)
        "step_after_ckpt_median_s": _median_after_ckpt(res["ckpt"], every),
        # the same cost from step times: every with-checkpoint loop's steps, calls and final wait against its
        # steps at the median step time of the loops without (immune to drift between whole loops)
        "extra_per_ckpt_from_steps_s": statistics.median(
            (sum(r["step_s"]) + sum(r["blocked_s"]) + r["final_wait_s"] - len(r["step_s"]) * plain_step)
            / ckpts_per_loop
            for r in res["ckpt"]
        )
        if ckpts_per_loop
        else None,
    }


def _fmt(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def _median_after_ckpt(loops: list[dict], every: int) -> float | None:
    """Median time of the first step after each checkpoint call (a checkpoint follows step i, 1-based, when
    i % every == 0 and i + every <= steps: the step after it is index i)."""
    after = [
        steps[i]
        for steps in (loop["step_s"] for loop in loops)
        for i in range(every, len(steps), every)
        if i + every <= len(steps)
    ]
    return statistics.median(after) if after else None


def run_main(args) -> dict:
    if args.dir is None:
        args.dir = tempfile.mkdtemp(prefix="bench_train_", dir="/tmp")
    os.makedirs(args.dir, exist_ok=True)
    setup_logging(0, "main")
    fw = [f.strip() for f in args.frameworks.split(",") if f.strip()]
    ckpts_per_loop = len([i for i in range(1, args.steps + 1) if i % args.every == 0 and i + args.every <= args.steps])
    out: dict = {"world": args.world, "threads": args.threads, "steps": args.steps, "every": args.every}
    out["ckpts_per_loop"] = ckpts_per_loop
    LOG.info("training loop, %d rank(s): paddle", args.world)
    pres = launch_paddle(args)
    out["paddle"] = pres
    memcpy = pres["memcpy_s"]
    out["memcpy_s"] = memcpy
    out["paddle_summary"] = summarize(pres, memcpy, ckpts_per_loop, args.every)
    LOG.info("paddle: %s", out["paddle_summary"])
    if "torch" in fw:
        if importlib.util.find_spec("torch") is not None:
            LOG.info("training loop, %d rank(s): torch DCP async_save", args.world)
            tres = launch_torch(args, pres["batch"])
            out["torch"] = tres
            out["torch_summary"] = summarize(tres, memcpy, ckpts_per_loop, args.every)
            LOG.info("torch: %s", out["torch_summary"])
    return out


def run_training_loops(bench_args, worlds: list[int], work: str) -> list[dict]:
    """The phase for ``tools/bench_ckpt.py``: one ``run_main`` per world (same sizes and seed as the benchmark)."""
    out = []
    for world in dict.fromkeys(worlds):
        args = parse_args(
            [
                "--world",
                str(world),
                "--size-gib",
                str(bench_args.train_size_gib or bench_args.size_gib),
                "--dim",
                str(bench_args.dim),
                "--steps",
                str(bench_args.train_steps),
                "--every",
                str(bench_args.train_every),
                "--repeats",
                str(bench_args.train_repeats),
                "--seed",
                str(bench_args.seed),
                "--dir",
                os.path.join(work, f"train_{world}"),
            ]
            + (
                []
                if importlib.util.find_spec("torch") is not None and not bench_args.no_torch
                else ["--frameworks", "paddle"]
            )
        )
        out.append(run_main(args))
    return out


def table(results: list[dict]) -> str:
    lines = [
        "| training loop | ranks | step (s) | memcpy (s) | loop w/o ckpt (s) | extra per ckpt (s) | x memcpy | "
        "blocked per ckpt (s) | step median w/o / with ckpt (s) | step after ckpt (s) | extra per ckpt from "
        "step times (s) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for name, fw in (("paddle FSDP async_save", "paddle"), ("torch FSDP2 DCP async_save", "torch")):
            s = r.get(f"{fw}_summary")
            if s is None:
                continue
            after = s.get("step_after_ckpt_median_s")
            lines.append(
                f"| {name} | {r['world']} | {s['step_median_plain_s']:.3f} | {r['memcpy_s']:.3f} | "
                f"{s['loop_plain_s']:.2f} | {s['extra_per_ckpt_s']:.3f} | {s['extra_vs_memcpy']:.2f}x | "
                f"{s['blocked_median_s']:.3f} | {s['step_median_plain_s']:.3f} / {s['step_median_ckpt_s']:.3f} | "
                f"{'-' if after is None else f'{after:.3f}'} | {_fmt(s.get('extra_per_ckpt_from_steps_s'))} |"
            )
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.mode == "paddle":
        run_paddle(args)
        return
    if args.mode == "torch":
        run_torch(args)
        return
    res = run_main(args)
    print(table([res]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
