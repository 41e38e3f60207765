"""Turns per-rank worker reports ({case: "ok" | traceback}) into one pytest assertion per case."""

from __future__ import annotations

from launch_util import LaunchResult


def assert_case_ok(result: LaunchResult, case: str, nproc: int) -> None:
    failures = []
    for rank in range(nproc):
        outcome = result.result(rank).get(case)
        if outcome is None:
            failures.append(f"rank {rank}: case {case!r} did not run")
        elif outcome != "ok":
            failures.append(f"rank {rank}:\n{outcome}")
    assert not failures, "\n".join(failures)
