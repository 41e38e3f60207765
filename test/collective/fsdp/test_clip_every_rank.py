"""Global-norm clipping joins its all-reduce on every rank, also on a rank that owns no piece of the optimizer's
parameters (a second optimizer over one tiny parameter): no hang (run under a timeout), equal to one process."""

from __future__ import annotations

import os

import pytest
from _results import assert_case_ok
from launch_util import run_launch

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "tiny_clip.py")


@pytest.mark.parametrize("nproc", [2, 3])
def test_tiny_optimizer_with_global_norm_clip_does_not_hang(tmp_path, nproc):
    # a hang (a rank skipping the collective) is killed after the timeout and fails the launch
    result = run_launch(WORKER, nproc, timeout=120, log_dir=tmp_path / "logs")
    assert_case_ok(result, "tiny_clip", nproc)
