#!/usr/bin/env python3
"""Fleet's expert-parallel start-up on 4 gloo ranks, launched N times: how many launches come up (issue 50 item 10).

Each launch runs ``fleet.init`` with ``ep_degree=2, moe_sharding_degree=2, sharding_degree=4`` (the example of
docs/expert-parallel.md), then an all-reduce over the sharding, EP and moe_sharding groups. Modes, interleaved so
that they see the same load:

- ``barrier``: the former workaround, every ``new_group`` followed by a global barrier, groups of identical
  members reused (what ``barrier_after_new_group(reuse_identical=True)`` did before group_startup.py);
- ``retry``: ``barrier_after_new_group(reuse_identical=True)`` as it is now (bounded attempts agreed by every rank);
- ``retry_noreuse``: the same without reusing groups of identical members (fleet then creates the sharding and
  context-sharding groups of the whole world too: more handshakes);
- ``stock``: plain ``fleet.init``.

``--load K`` keeps K two-rank jobs (all-reduces of 256x256 matmul products) running during the measurement, as
other jobs on the machine would. Launches get no PORT_RANGE unless ``--port-range`` is given (paddle's launcher then
takes 35100-64000, as a user's launch does). Prints one line per launch and a summary; ``--json`` writes them.

Usage::

    python tools/ep_startup_bench.py --launches 20 --modes barrier,retry --load 2 --json ep-startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ORDER = ["pp", "moe_sharding", "ep", "dp", "sharding", "sep", "cp", "mp"]
OK_MARK = "EP_STARTUP_OK"
_ERROR_LINE = re.compile(r"^(\w*(Error|Exception)\b.*)$", re.M)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--launches", type=int, default=20, help="launches per mode (default 20)")
    p.add_argument("--modes", default="barrier,retry", help="comma-separated: barrier, retry, retry_noreuse, stock")
    p.add_argument("--load", type=int, default=0, help="two-rank load jobs kept running meanwhile (default 0)")
    p.add_argument("--timeout", type=float, default=300, help="seconds a launch may take (default 300)")
    p.add_argument("--port-range", default=None, help="PORT_RANGE for the measured launches (default: paddle's)")
    p.add_argument("--dir", default=None, help="log directory (default: a temp dir)")
    p.add_argument("--json", default=None, help="write every launch's outcome and the summary here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # rank side of a measured launch
    p.add_argument("--load-worker", type=float, default=None, help=argparse.SUPPRESS)  # rank side of a load job
    return p.parse_args(argv)


def _former_barrier_after_new_group():
    """The former wrapper (a global barrier after each new_group, identical groups reused), kept here to measure
    against."""
    import contextlib

    import paddle.distributed as dist
    from paddle.distributed.collective import _get_group_map

    @contextlib.contextmanager
    def ctx():
        original, made = dist.new_group, {}
        for _gid, g in sorted(_get_group_map().items(), key=lambda item: item[0]):
            if getattr(g, "ranks", None):
                made.setdefault(tuple(sorted(g.ranks)), g)

        def wrapped(ranks=None, *args, **kwargs):
            key = tuple(sorted(ranks)) if ranks is not None else None
            if key is not None and key in made:
                return made[key]
            group = original(ranks, *args, **kwargs)
            dist.barrier()
            if key is not None:
                made[key] = group
            return group

        dist.new_group = wrapped
        try:
            yield
        finally:
            dist.new_group = original

    return ctx()


def worker(mode: str) -> None:
    import contextlib
    import logging

    import paddle
    import paddle.distributed as dist
    from paddle.distributed import fleet

    logging.basicConfig(level=logging.WARNING)
    start = time.monotonic()
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
    if mode in ("retry", "retry_noreuse"):
        from paddle.distributed.fsdp import barrier_after_new_group

        ctx = barrier_after_new_group(reuse_identical=mode == "retry")
    elif mode == "barrier":
        ctx = _former_barrier_after_new_group()
    else:
        ctx = contextlib.nullcontext()
    with ctx:
        fleet.init(is_collective=True, strategy=strategy)
    hcg = fleet.get_hybrid_communicate_group()
    for g in (
        hcg.get_sharding_parallel_group(),
        hcg.get_expert_parallel_group(),
        hcg.get_moe_sharding_parallel_group(),
    ):
        x = paddle.to_tensor([1.0])
        dist.all_reduce(x, group=g)
        assert float(x) == g.nranks, (float(x), g.ranks)
    dist.barrier()
    print(f"{OK_MARK} {time.monotonic() - start:.1f}", flush=True)


def load_worker(seconds: float) -> None:
    import paddle
    import paddle.distributed as dist

    dist.init_parallel_env()
    end, x = time.monotonic() + seconds, paddle.randn([256, 256])
    while time.monotonic() < end:
        dist.all_reduce(x @ x)


def _launch(nproc: int, args: list[str], log_dir: Path, env: dict[str, str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nproc_per_node", str(nproc), "--log_dir"]
    cmd += [str(log_dir), "--max_restart", "0", __file__, *args]
    out = open(log_dir.with_suffix(".out"), "wb")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def _stop(proc: subprocess.Popen) -> None:
    """The launcher and its workers (their own session, started by us)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except OSError:
            return
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _outcome(log_dir: Path, rc: int | None) -> dict:
    logs = {int(p.name.rsplit(".", 1)[1]): p.read_text(errors="replace") for p in log_dir.glob("workerlog.*")}
    ok = sorted(r for r, text in logs.items() if OK_MARK in text)
    errors = sorted({m.group(1)[:200] for text in logs.values() for m in _ERROR_LINE.finditer(text)})
    retries = sum(text.count("attempt") for text in logs.values() if "failed (" in text)
    return {"rc": rc, "ok": rc == 0 and len(ok) == 4, "ok_ranks": ok, "errors": errors, "retry_lines": retries}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args.worker)
        return 0
    if args.load_worker is not None:
        load_worker(args.load_worker)
        return 0
    root = Path(args.dir or tempfile.mkdtemp(prefix="ep_startup_"))
    root.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PADDLE_") or k.startswith("PADDLE_FSDP_")}
    env.pop("PORT_RANGE", None)
    env.setdefault("OMP_NUM_THREADS", "1")
    measured_env = dict(env, **({"PORT_RANGE": args.port_range} if args.port_range else {}))
    modes = [m for m in args.modes.split(",") if m]
    loads: list[subprocess.Popen | None] = [None] * args.load
    runs, load_count = [], 0
    try:
        for i in range(args.launches):
            for mode in modes:
                for k, proc in enumerate(loads):  # keep the load jobs running
                    if proc is None or proc.poll() is not None:
                        load_count += 1
                        loads[k] = _launch(2, ["--load-worker", "120"], root / f"load{load_count}", env)
                log_dir = root / f"{mode}{i + 1}"
                t0 = time.monotonic()
                proc = _launch(4, ["--worker", mode], log_dir, measured_env)
                try:
                    rc = proc.wait(timeout=args.timeout)
                except subprocess.TimeoutExpired:
                    rc = None
                    _stop(proc)
                run = {"mode": mode, "launch": i + 1, "seconds": round(time.monotonic() - t0, 1)}
                run.update(_outcome(log_dir, rc), load=os.getloadavg()[0])
                runs.append(run)
                print(json.dumps(run), flush=True)
    finally:
        for proc in loads:
            if proc is not None:
                _stop(proc)
    summary = {m: f"{sum(r['ok'] for r in runs if r['mode'] == m)}/{sum(r['mode'] == m for r in runs)}" for m in modes}
    print("summary (launches up / launched):", json.dumps(summary), f"logs in {root}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
