"""Run a script on N CPU ranks with ``python -m paddle.distributed.launch`` and collect its results.

Why a helper: tests must start real processes (gloo), never hang, and on failure show what every
rank printed. Used from tests (``run_launch``) and from worker scripts (``report``).

Worker convention: a script started by :func:`run_launch` calls ``report(obj)`` (JSON-serialisable)
once per rank; the launcher side returns them as ``LaunchResult.results[rank]``. The directory is
passed to workers in the ``FSDP_TEST_RESULT_DIR`` environment variable, so scripts keep their own
command-line arguments free. Worker scripts living next to this file can ``from launch_util import
report`` (the script's directory is ``sys.path[0]``). This module imports no paddle.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["LaunchResult", "run_launch", "report", "RESULT_DIR_ENV"]

_logger = logging.getLogger(__name__)

RESULT_DIR_ENV = "FSDP_TEST_RESULT_DIR"
#: Launcher/worker variables inherited from an enclosing launch would reconfigure ours.
_KEEP_PADDLE_ENV_PREFIX = "PADDLE_FSDP_"
#: Lines of each worker log shown in a failure message.
_TAIL_LINES = 60
#: Ports below Linux's ephemeral range (32768+), where no outgoing connection can steal them.
_PORT_BLOCK = 200
_PORT_LOW, _PORT_HIGH = 15000, 32000


@dataclass
class LaunchResult:
    """Outcome of one launch: exit code, per-rank logs and per-rank reported results."""

    returncode: int
    log_dir: Path
    elapsed: float
    launcher_output: str
    worker_logs: dict[int, str] = field(default_factory=dict)
    results: dict[int, Any] = field(default_factory=dict)

    def result(self, rank: int = 0) -> Any:
        """Object reported by ``rank``; a clear error if it reported nothing."""
        if rank not in self.results:
            raise AssertionError(
                f"rank {rank} reported no result (reported: {sorted(self.results)}); logs in {self.log_dir}"
            )
        return self.results[rank]


def report(obj: Any, rank: int | None = None) -> Path | None:
    """Worker side: store ``obj`` as this rank's JSON result (atomically). No-op outside run_launch."""
    result_dir = os.environ.get(RESULT_DIR_ENV)
    if not result_dir:
        return None
    if rank is None:
        rank = int(os.environ.get("PADDLE_TRAINER_ID", os.environ.get("PADDLE_GLOBAL_RANK", "0")))
    path = Path(result_dir) / f"rank{rank}.json"
    tmp = path.with_suffix(f".json.tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj), encoding="utf-8")
    os.replace(tmp, path)
    return path


def run_cases(cases: dict, *args, results: dict | None = None) -> dict:
    """Worker side: run every ``case(*args)`` of ``cases`` in order; ``results[name]`` is "ok" or the traceback (a
    failing case does not stop the others: each is reported by name)."""
    results = {} if results is None else results
    for name, case in cases.items():
        try:
            case(*args)
            results[name] = "ok"
        except Exception:  # noqa: BLE001 - reported per case
            results[name] = traceback.format_exc()
    return results


def worker_main(cases: dict) -> None:
    """Worker side: join the launch's process group, run every ``case(rank, world, figures)`` and report the
    outcomes with the figures the cases filled in."""
    import paddle.distributed as dist

    if dist.get_world_size() > 1:
        dist.init_parallel_env()
    results: dict = {"figures": {}}
    run_cases(cases, dist.get_rank(), dist.get_world_size(), results["figures"], results=results)
    report(results)


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def _pick_port_range(rng: random.Random) -> str:
    """A random block of ports for the launcher's own free-port scan (master, store, endpoints).

    The launcher otherwise draws from 35100-64000, which overlaps the ephemeral range: a port it
    found free can be taken by any outgoing connection before rank 0 binds it. Random blocks also
    keep concurrent launches (pytest-xdist, parallel CI jobs) apart.
    """
    for _ in range(50):
        start = rng.randrange(_PORT_LOW, _PORT_HIGH - _PORT_BLOCK)
        if all(_port_is_free(start + i) for i in range(8)):
            return f"{start}:{start + _PORT_BLOCK - 1}"
    return f"{_PORT_LOW}:{_PORT_HIGH}"


def _descendants(root: int) -> list[int]:
    """PIDs of all live descendants of ``root`` (Linux /proc), children before grandchildren."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out: list[int] = []
    todo = list(children.get(root, []))
    while todo:
        pid = todo.pop(0)
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """Stop the launcher and all its workers (which run in their own sessions, via os.setsid)."""
    pids = _descendants(proc.pid)
    groups = {proc.pid}
    for pid in pids:
        try:
            groups.add(os.getpgid(pid))
        except OSError:
            pass
    groups.discard(os.getpgrp())  # never signal the test runner's own group
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pgid in groups:
            try:
                os.killpg(pgid, sig)
            except OSError:
                pass
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        if sig == signal.SIGTERM:  # grace period: the launcher stops its workers on TERM
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
    proc.wait()


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def _tail(text: str, lines: int = _TAIL_LINES) -> str:
    return "\n".join(text.splitlines()[-lines:])


def _clean_env(extra: Mapping[str, str] | None, result_dir: Path, port_range: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PADDLE_") or k.startswith(_KEEP_PADDLE_ENV_PREFIX)}
    env.pop("PORT_RANGE", None)
    env["PORT_RANGE"] = port_range
    env[RESULT_DIR_ENV] = str(result_dir)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("PYTHONFAULTHANDLER", "1")  # a worker that crashes in native code logs its Python stack
    if extra:
        env.update({k: str(v) for k, v in extra.items()})
    return env


def run_launch(
    script: str | os.PathLike[str],
    nproc: int,
    args: Sequence[str] = (),
    timeout: float = 600,
    env: Mapping[str, str] | None = None,
    *,
    log_dir: str | os.PathLike[str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
    check: bool = True,
) -> LaunchResult:
    """Run ``script args...`` on ``nproc`` CPU ranks via ``python -m paddle.distributed.launch``.

    Kills the launcher and every worker on timeout. With ``check`` (default), a non-zero exit or a
    timeout raises AssertionError carrying the tail of every ``workerlog.*``. ``log_dir`` defaults to
    a fresh temp dir (kept, so the logs stay inspectable); pass pytest's ``tmp_path`` to scope it.
    """
    if nproc < 1:
        raise ValueError(f"nproc must be >= 1, got {nproc}")
    script = Path(script).resolve()
    if not script.is_file():
        raise FileNotFoundError(f"launch script not found: {script}")
    logs = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="fsdp_launch_"))
    logs.mkdir(parents=True, exist_ok=True)
    result_dir = logs / "results"
    result_dir.mkdir(exist_ok=True)
    port_range = _pick_port_range(random.Random())
    cmd = [
        sys.executable,
        "-m",
        "paddle.distributed.launch",
        "--nproc_per_node",
        str(nproc),
        "--log_dir",
        str(logs),
        "--max_restart",
        "0",
        str(script),
        *map(str, args),
    ]
    launcher_log = logs / "launcher.log"
    _logger.info("launching (%d ranks, ports %s): %s", nproc, port_range, " ".join(cmd))
    start = time.monotonic()
    timed_out = False
    with open(launcher_log, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_clean_env(env, result_dir, port_range),
            cwd=str(cwd) if cwd is not None else None,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            if proc.poll() is None:  # timeout, or KeyboardInterrupt in the test process
                _kill_tree(proc)
    elapsed = time.monotonic() - start

    worker_logs: dict[int, str] = {}
    for path in sorted(logs.glob("workerlog.*")):
        suffix = path.name.rsplit(".", 1)[-1]
        if suffix.isdigit():
            worker_logs[int(suffix)] = _read(path)
    results: dict[int, Any] = {}
    for path in sorted(result_dir.glob("rank*.json")):
        try:
            results[int(path.stem[4:])] = json.loads(_read(path))
        except ValueError as exc:
            _logger.warning("unreadable result %s: %s", path, exc)
    result = LaunchResult(
        returncode=proc.returncode,
        log_dir=logs,
        elapsed=elapsed,
        launcher_output=_read(launcher_log),
        worker_logs=worker_logs,
        results=results,
    )
    if check and (timed_out or proc.returncode != 0):
        what = f"timed out after {timeout:.0f}s" if timed_out else f"exited with code {proc.returncode}"
        parts = [f"launch of {script.name} on {nproc} rank(s) {what}; logs in {logs}"]
        for rank, text in sorted(worker_logs.items()):
            parts.append(f"----- workerlog.{rank} (tail) -----\n{_tail(text)}")
        parts.append(f"----- launcher (tail) -----\n{_tail(result.launcher_output, 30)}")
        raise AssertionError("\n".join(parts))
    return result


def beside_one_rank(one_rank: Callable[[], Any], other: Callable[[], Any]) -> tuple[Any, Any]:
    """Run two independent launches at the same time, the first of one rank; returns their results in that order.

    Why: a launch waits much of its wall time (the launcher's paddle import, its 1 s poll, the workers' start-up),
    and a one-rank worker sets up no process group, so it adds no second gloo start-up beside the other's (paddle's
    gloo ``new_group`` race under load, docs/reports/2026-12-07-ci-time.md). The caller keeps their directories apart.
    """
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(one_rank)
        second = other()
        return first.result(), second
