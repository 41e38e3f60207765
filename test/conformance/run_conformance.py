"""Paddle's own tests of ``paddle.distributed.save_state_dict`` / ``load_state_dict`` as a conformance suite.

Runs every case of ``../shared/conformance/paddle-flex-checkpoint`` (relative to the repository root; override
with ``--suite DIR``) twice, with the fork's overlay disabled (``PADDLE_FSDP_FORK_DISABLE=1``, stock paddle) and
enabled, and requires the same outcome (exit status 0 or not) in both modes. Cases whose scripts name their
checkpoint directory with ``tempfile.TemporaryDirectory()`` run both with one directory shared by all ranks
(``PEER_SHARED_TEMPDIR``) and with a directory per rank (node-local storage). Multi-rank scripts run under
``python -m paddle.distributed.launch`` through the suite's ``cpu_shim.py``, as its README says.

Exit status: 0 when every case agrees (or the suite is absent: skipped, and said so), 1 otherwise. Each launch is
bounded by ``--timeout`` seconds; ``--jobs`` launches run at once.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_SUITE = os.path.join(os.path.dirname(REPO), "shared", "conformance", "paddle-flex-checkpoint")


@dataclass
class Step:
    script: str  # relative to the suite
    nproc: int
    env: dict = field(default_factory=dict)
    unittest: str | None = None  # run "python -m unittest <name>" in the script's directory instead


@dataclass
class Case:
    name: str
    steps: list[Step]
    shared_tmp: bool | None = None  # None: the case does not use TemporaryDirectory


def cases() -> list[Case]:
    hs = "auto_parallel/hybrid_strategy"
    out = [
        Case(f"semi_auto_save_state_dict[{n}]", [Step(f"{hs}/semi_auto_save_state_dict.py", n, {"device_num": str(n)})])
        for n in (1, 4)
    ]
    for saved in (1, 4):
        for loaded in (1, 2, 4, 8):
            out.append(
                Case(
                    f"semi_auto_load_state_dict[save {saved} -> load {loaded}]",
                    [
                        Step(f"{hs}/semi_auto_save_only.py", saved, {"device_num": str(saved)}),
                        Step(f"{hs}/semi_auto_load_state_dict.py", loaded, {"device_num": str(loaded)}),
                    ],
                )
            )
    for shared in (True, False):
        out.append(
            Case(
                f"load_state_dict_transpose_logic[{'shared' if shared else 'per-rank'} dir]",
                [
                    Step(
                        "flex_checkpoint/load_state_dict_transpose_logic.py",
                        2,
                        {"aoa_statements": "linear.weight^T -> linear.weight"},
                    )
                ],
                shared_tmp=shared,
            )
        )
    out.append(
        Case(
            "merge_sharded_state_dict[tp=2]",
            [
                Step(
                    "flex_checkpoint/merge_sharded_state_dict.py",
                    2,
                    {
                        "tp": "2",
                        "dp": "1",
                        "world_size": "2",
                        "test_type": "layer",
                        "layer_type": "ColumnParallelLinear",
                    },
                )
            ],
        )
    )
    out.append(
        Case(
            "test_nested_state_dict_load.test_loads_into_flat_state_dict",
            [
                Step(
                    "flex_checkpoint/test_nested_state_dict_load.py",
                    1,
                    unittest="test_nested_state_dict_load.TestNestedStateDictLoad.test_loads_into_flat_state_dict",
                )
            ],
        )
    )
    return out


def run_case(suite: str, case: Case, fork: bool, timeout: float, python: str) -> tuple[bool, str, float]:
    """(passed, last lines of output of the failing step, seconds) of one case in one mode."""
    t0 = time.monotonic()
    work = tempfile.mkdtemp(prefix="fsdp-conformance-")
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_TRAINER", "PADDLE_CURRENT"))}
        env.pop("PADDLE_FSDP_FORK_DISABLE", None)
        if not fork:
            env["PADDLE_FSDP_FORK_DISABLE"] = "1"
        env["ckpt_path"] = os.path.join(work, "ckpt")
        env["PYTHONPATH"] = os.pathsep.join([suite, os.path.join(suite, "flex_checkpoint")])
        env["TMPDIR"] = work
        if case.shared_tmp:
            env["PEER_SHARED_TEMPDIR"] = os.path.join(work, "shared")
        else:
            env.pop("PEER_SHARED_TEMPDIR", None)
        shim = os.path.join(suite, "cpu_shim.py")
        for i, step in enumerate(case.steps):
            step_env = dict(env, **step.env)
            script = os.path.join(suite, step.script)
            if step.unittest:
                cmd = [python, "-m", "unittest", "-q", step.unittest]
                cwd = os.path.dirname(script)
            elif step.nproc == 1:
                cmd, cwd = [python, shim, script], work
            else:
                log_dir = os.path.join(work, f"log{i}")
                cmd = [
                    python,
                    "-m",
                    "paddle.distributed.launch",
                    "--nproc_per_node",
                    str(step.nproc),
                    "--log_dir",
                    log_dir,
                    shim,
                    script,
                ]
                cwd = work
            try:
                proc = subprocess.run(
                    cmd, cwd=cwd, env=step_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout
                )
                ok, text = proc.returncode == 0, proc.stdout.decode(errors="replace")
            except subprocess.TimeoutExpired as e:
                ok, text = False, f"timed out after {timeout:g} s\n" + (e.stdout or b"").decode(errors="replace")
            if not ok:
                logs = os.path.join(work, f"log{i}")
                if os.path.isdir(logs):
                    for name in sorted(os.listdir(logs)):
                        with open(os.path.join(logs, name), errors="replace") as f:
                            text += f"\n--- {name}\n" + "".join(f.readlines()[-15:])
                tail = "\n".join(text.strip().splitlines()[-25:])
                return (
                    False,
                    f"step {i + 1} ({os.path.basename(step.script)}, {step.nproc} proc): {tail}",
                    time.monotonic() - t0,
                )
        return True, "", time.monotonic() - t0
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", default=os.environ.get("FSDP_CONFORMANCE_SUITE", DEFAULT_SUITE))
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds per launch")
    ap.add_argument("--jobs", type=int, default=2, help="launches at once")
    ap.add_argument("-k", default="", help="only cases whose name contains this")
    ap.add_argument("--python", default=sys.executable)
    args = ap.parse_args(argv)
    if not os.path.isdir(args.suite):
        print(f"conformance: SKIPPED, suite directory {args.suite} is absent (it sits in ../shared beside the clone)")
        return 0
    selected = [c for c in cases() if args.k in c.name]
    t0 = time.monotonic()
    jobs = [(c, fork) for c in selected for fork in (False, True)]
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(lambda j: run_case(args.suite, j[0], j[1], args.timeout, args.python), jobs))
    by_case: dict[str, dict[bool, tuple]] = {}
    for (c, fork), r in zip(jobs, results):
        by_case.setdefault(c.name, {})[fork] = r
    bad = 0
    for c in selected:
        stock, fork = by_case[c.name][False], by_case[c.name][True]
        same = stock[0] == fork[0]
        bad += not same
        verdict = "same" if same else "DIFFERENT"
        print(
            f"conformance: {verdict:9s} stock={'pass' if stock[0] else 'FAIL'} ({stock[2]:.0f}s) "
            f"fork={'pass' if fork[0] else 'FAIL'} ({fork[2]:.0f}s)  {c.name}"
        )
        for label, r in (("stock", stock), ("fork", fork)):
            if not same and not r[0]:
                print(f"  [{label}] {r[1]}")
    print(f"conformance: {len(selected) - bad}/{len(selected)} cases agree, {time.monotonic() - t0:.0f} s wall")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
