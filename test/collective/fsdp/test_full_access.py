"""A wrapped model is still a paddle model: printing, state_dict, full parameters and persistable buffers."""

from __future__ import annotations

import os

import pytest
from _results import assert_case_ok
from launch_util import run_launch

WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers")
CASES = [
    "print_and_state_dict",
    "summon_writeback",
    "summon_rank0_only_and_errors",
    "full_state_dict",
    "buffers_checkpointed",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for n in (1, 2):
        work = tmp_path_factory.mktemp(f"full{n}")
        out[n] = run_launch(os.path.join(WORKERS, "full_access.py"), n, [str(work)], log_dir=work / "logs")
    return out


@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("case", CASES)
def test_full_access(runs, nproc, case):
    """print(model) equals the unwrapped repr; state_dict()/set_state_dict() (and aliases) refuse sharded
    pieces naming the alternatives; summon_full_params gives the unwrapped state_dict, discards changes without
    writeback and scatters them with it; full_state_dict gathers one buffer at a time and loads into an
    unwrapped model; persistable buffers round-trip (low level and one call), rank 0's value wins when ranks
    differ (with a warning), non-persistable buffers stay out."""
    assert_case_ok(runs[nproc], case, nproc)
