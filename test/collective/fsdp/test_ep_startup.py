"""Fleet's EP start-up on gloo survives a failed group handshake (issue 50 item 10): every new_group inside
``barrier_after_new_group`` is retried with a new group id until every rank's attempt came up, and a group that
never comes up is a GroupCreationError on every rank naming its ranks and each rank's error.

Faults are injected by the worker (workers/ep_startup.py) into paddle's own gloo group creation: a "Connection
refused" on both members of the EP group, and a member that comes out of the handshake past its peer's probe
deadline. The 20-launch measurement under load is tools/ep_startup_bench.py (docs/reports/ep-startup-2026-12-07.md).
"""

from __future__ import annotations

import os

import pytest
from launch_util import run_launch

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "ep_startup.py")
# 4 ranks, ep_degree=2 x moe_sharding_degree=2; each rank all-reduces rank + 1 over each group
RANKS = {"sharding": [0, 1, 2, 3], "ep": {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]}, "moe": {0: [0, 2], 2: [0, 2]}}


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    out = {}
    for scenario, nproc in (("plain", 4), ("faults", 4), ("exhaust", 2)):
        res = run_launch(WORKER, nproc, [scenario], log_dir=tmp_path_factory.mktemp(scenario), timeout=600)
        out[scenario] = {rank: res.result(rank) for rank in range(nproc)}
    return out


def _expected(rank: int) -> dict:
    ep = [0, 1] if rank < 2 else [2, 3]
    moe = [0, 2] if rank % 2 == 0 else [1, 3]
    return {
        "ranks": {"sharding": [0, 1, 2, 3], "ep": ep, "moe_sharding": moe},
        "sums": {"sharding": 10.0, "ep": float(sum(r + 1 for r in ep)), "moe_sharding": float(sum(r + 1 for r in moe))},
    }


@pytest.mark.parametrize("scenario", ["plain", "faults"])
def test_ep_startup_on_four_ranks_gives_working_groups(launches, scenario):
    """Plain, and with both faults: fleet's sharding, EP and moe_sharding groups are the right ranks and an
    all-reduce over each sums the right members on every rank."""
    for rank, got in launches[scenario].items():
        assert got["error"] is None, (rank, got)
        want = _expected(rank)
        assert got["ranks"] == want["ranks"], (rank, got)
        assert got["sums"] == want["sums"], (rank, got)


def test_a_refused_handshake_is_retried_on_every_rank(launches):
    """Both members of [0, 1] raised paddle's "Connection refused" at attempt 1: every rank (the two that are not
    members too) says so, names both ranks and their error, and the group came up at attempt 2."""
    for rank, got in launches["faults"].items():
        failed = [w for w in got["warnings"] if w.startswith("new_group([0, 1]): attempt 1 of 4 failed")]
        assert len(failed) == 1, (rank, got["warnings"])
        assert "rank 0: RuntimeError: " in failed[0] and "rank 1: RuntimeError: " in failed[0], failed
        assert "Connection refused" in failed[0], failed
        assert "new_group([0, 1]) came up at attempt 2 of 4" in got["warnings"], (rank, got["warnings"])


def test_a_member_past_the_probe_deadline_is_retried(launches):
    """Rank 2 came out of [0, 2]'s handshake 12 s late: rank 0's first barrier of the group missed its 4 s
    deadline, so every rank dropped the group and made it again."""
    for rank, got in launches["faults"].items():
        failed = [w for w in got["warnings"] if w.startswith("new_group([0, 2]): attempt 1 of 4 failed")]
        assert len(failed) == 1, (rank, got["warnings"])
        assert "rank 0: its first barrier did not complete within 4 s" in failed[0], failed
        assert any(w.startswith("new_group([0, 2]) came up at attempt ") for w in got["warnings"]), got["warnings"]
        # a later reuse_identical block returns the group that came up, never the dropped attempt's
        assert got["reused_moe_group"] is True, (rank, got)


def test_a_group_that_never_comes_up_is_a_named_error_on_every_rank(launches):
    """Every attempt of [0, 1] refused, 2 allowed: both ranks raise GroupCreationError naming the group, the
    attempts, each rank and its error, within seconds (no wait for gloo's own timeout)."""
    for rank, got in launches["exhaust"].items():
        error = got["error"] or ""
        assert error.startswith("GroupCreationError: new_group([0, 1]) failed 2 attempts"), (rank, error)
        assert "rank 0: RuntimeError: " in error and "rank 1: RuntimeError: " in error, error
        assert "Connection refused" in error, error
        assert got["seconds"] < 120, got["seconds"]  # generous: the machine is shared
