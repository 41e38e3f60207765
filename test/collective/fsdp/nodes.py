"""Simulated nodes on one machine: two ``paddle.distributed.launch --nnodes 2 --rank i`` launchers, each with its
own memory-tier root (PADDLE_FSDP_MEMTIER_ROOT), for the memory tier's node-loss tests."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

from launch_util import _clean_env, _descendants, _kill_tree, _pick_port_range, _port_is_free, _tail

WORKERS = Path(__file__).resolve().parent / "workers"


def _free_port() -> int:
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(15000, 32000)
        if _port_is_free(port):
            return port
    raise RuntimeError("no free port")


def launch_nodes(
    log_dir: Path,
    script: str,
    args: list[str],
    roots: list[Path],
    per_node: int = 1,
    timeout: float = 180,
    extra_env: list[dict] | None = None,
) -> tuple[list[int], dict[int, dict]]:
    """Run ``script`` on len(roots) nodes of ``per_node`` ranks; returns (launcher exit codes, results by rank)."""
    procs = start_nodes(log_dir, script, args, roots, per_node, extra_env)
    results = log_dir / "results"
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            for q in procs:
                _kill_tree(q)
            raise AssertionError(f"launch of {script} timed out; logs in {log_dir}\n{tails(log_dir)}") from None
    found = {int(p.stem[4:]): json.loads(p.read_text()) for p in results.glob("rank*.json")}
    for p in results.glob("rank*.json"):
        p.unlink()
    return codes, found


def start_nodes(
    log_dir: Path,
    script: str,
    args: list[str],
    roots: list[Path],
    per_node: int = 1,
    extra_env: list[dict] | None = None,
) -> list[subprocess.Popen]:
    """Start the launchers of ``launch_nodes`` and return them at once (a test that kills them at its moment)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    results = log_dir / "results"
    results.mkdir(exist_ok=True)
    port, port_range = _free_port(), _pick_port_range(random.Random())
    procs = []
    for i, root in enumerate(roots):
        node_env = {"PADDLE_FSDP_MEMTIER_ROOT": str(root), **(extra_env[i] if extra_env else {})}
        env = _clean_env(node_env, results, port_range)
        cmd = [sys.executable, "-m", "paddle.distributed.launch", "--nnodes", str(len(roots)), "--rank", str(i)]
        cmd += ["--master", f"127.0.0.1:{port}", "--nproc_per_node", str(per_node), "--max_restart", "0"]
        cmd += ["--log_dir", str(log_dir / f"node{i}"), str(WORKERS / script), *args]
        out = open(log_dir / f"launcher{i}.log", "wb")
        procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True))
    return procs


def kill9_all(procs: list[subprocess.Popen]) -> None:
    """SIGKILL every worker of the launchers ``procs`` at once (no rank outlives another by more than the loop),
    then the launchers."""
    workers = [pid for p in procs for pid in _descendants(p.pid)]
    for pid in workers:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    for p in procs:
        _kill_tree(p)
        p.wait()


def tails(log_dir: Path) -> str:
    parts = []
    for path in sorted(log_dir.glob("node*/workerlog.*")):
        parts.append(f"----- {path.relative_to(log_dir)} -----\n{_tail(path.read_text(errors='replace'))}")
    return "\n".join(parts)
