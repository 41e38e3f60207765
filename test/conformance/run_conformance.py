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
    setup: Step | None = None  # run once per mode for all cases with the same setup (their common save)


def cases() -> list[Case]:
    hs = "auto_parallel/hybrid_strategy"
    out = [
        Case(f"semi_auto_save_state_dict[{n}]", [Step(f"{hs}/semi_auto_save_state_dict.py", n, {"device_num": str(n)})])
        for n in (1, 4)
    ]
    for saved in (1, 4):
        save = Step(f"{hs}/semi_auto_save_only.py", saved, {"device_num": str(saved)})
        for loaded in (1, 2, 4, 8):
            out.append(
                Case(
                    f"semi_auto_load_state_dict[save {saved} -> load {loaded}]",
                    [Step(f"{hs}/semi_auto_load_state_dict.py", loaded, {"device_num": str(loaded)})],
                    setup=save,
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


def run_step(suite: str, step: Step, env: dict, work: str, tag: str, timeout: float, python: str) -> tuple[bool, str]:
    """(passed, tail of its output and worker logs) of one script run."""
    step_env = dict(env, **step.env)
    script = os.path.join(suite, step.script)
    log_dir = os.path.join(work, f"log-{tag}")
    if step.unittest:
        cmd, cwd = [python, "-m", "unittest", "-q", step.unittest], os.path.dirname(script)
    elif step.nproc == 1:
        cmd, cwd = [python, os.path.join(suite, "cpu_shim.py"), script], work
    else:
        launch = [python, "-m", "paddle.distributed.launch", "--nproc_per_node", str(step.nproc), "--log_dir", log_dir]
        cmd, cwd = [*launch, os.path.join(suite, "cpu_shim.py"), script], work
    try:
        proc = subprocess.run(
            cmd, cwd=cwd, env=step_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout
        )
        ok, text = proc.returncode == 0, proc.stdout.decode(errors="replace")
    except subprocess.TimeoutExpired as e:
        ok, text = False, f"timed out after {timeout:g} s\n" + (e.stdout or b"").decode(errors="replace")
    if ok:
        return True, ""
    if os.path.isdir(log_dir):
        for name in sorted(os.listdir(log_dir)):
            with open(os.path.join(log_dir, name), errors="replace") as f:
                text += f"\n--- {name}\n" + "".join(f.readlines()[-15:])
    tail = "\n".join(text.strip().splitlines()[-25:])
    return False, f"{os.path.basename(step.script)} on {step.nproc} proc: {tail}"


def run_group(suite: str, group: list[Case], fork: bool, timeout: float, python: str) -> list[tuple[bool, str, float]]:
    """Run the cases of one group (same setup) in one mode: (passed, failure text, seconds) per case."""
    work = tempfile.mkdtemp(prefix="fsdp-conformance-")
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_TRAINER", "PADDLE_CURRENT"))}
        env.pop("PADDLE_FSDP_FORK_DISABLE", None)
        if not fork:
            env["PADDLE_FSDP_FORK_DISABLE"] = "1"
        env["ckpt_path"] = os.path.join(work, "ckpt")
        env["PYTHONPATH"] = os.pathsep.join([suite, os.path.join(suite, "flex_checkpoint")])
        env["TMPDIR"] = work
        env.pop("PEER_SHARED_TEMPDIR", None)
        if group[0].shared_tmp:
            env["PEER_SHARED_TEMPDIR"] = os.path.join(work, "shared")
        setup_ok, setup_text, t_setup = True, "", 0.0
        if group[0].setup is not None:
            t0 = time.monotonic()
            setup_ok, setup_text = run_step(suite, group[0].setup, env, work, "setup", timeout, python)
            t_setup = time.monotonic() - t0
        out = []
        for ci, case in enumerate(group):
            t0 = time.monotonic()
            ok, text = setup_ok, f"setup {setup_text}"
            for si, step in enumerate(case.steps if setup_ok else []):
                ok, text = run_step(suite, step, env, work, f"{ci}-{si}", timeout, python)
                if not ok:
                    break
            out.append((ok, text, t_setup + time.monotonic() - t0))
        return out
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
    groups: dict[int, list[Case]] = {}
    for c in selected:  # cases sharing a setup (the same save) run in one group per mode
        groups.setdefault(id(c.setup) if c.setup is not None else id(c), []).append(c)
    jobs = [(g, fork) for g in groups.values() for fork in (False, True)]
    jobs.sort(key=lambda j: -sum(s.nproc for c in j[0] for s in c.steps))  # longest first
    with ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        results = list(pool.map(lambda j: run_group(args.suite, j[0], j[1], args.timeout, args.python), jobs))
    by_case: dict[str, dict[bool, tuple]] = {}
    for (g, fork), rs in zip(jobs, results):
        for c, r in zip(g, rs):
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
    print(
        f"conformance: {len(selected)} cases in {time.monotonic() - t0:.0f} s wall; a case passes when stock and fork agree"
    )
    print(f"conformance: {len(selected) - bad} passed, {bad} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
