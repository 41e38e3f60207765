"""Gradients reach the optimizer as in one process: AMP master grads, exact fp32 accumulation, and ranks
that leave different parameters unused (collectives in the same order on every rank, no hang)."""

from __future__ import annotations

import os

import pytest
from _results import assert_case_ok
from launch_util import run_launch

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "grad_paths.py")
CASES = ["amp_master", "amp_plain", "accumulate_plain", "accumulate_master", "uneven_usage"]
# a collective-order regression must fail fast instead of waiting for gloo's default 30 minutes
FAST_FAIL_ENV = {"PADDLE_PG_TIMEOUT": "60000"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {
        (n, False): run_launch(WORKER, n, timeout=400, env=FAST_FAIL_ENV, log_dir=tmp_path_factory.mktemp(f"grad{n}"))
        for n in (1, 2, 3)
    }
    # fake-device mode: the GPU branches (reduce_scatter emulated on gloo, device memory rules) on 2 ranks
    fake_env = dict(FAST_FAIL_ENV, PADDLE_FSDP_FAKE_DEVICE="1")
    out[(2, True)] = run_launch(WORKER, 2, timeout=400, env=fake_env, log_dir=tmp_path_factory.mktemp("grad2fake"))
    return out


@pytest.mark.parametrize("nproc,fake", [(1, False), (2, False), (3, False), (2, True)], ids=["1", "2", "3", "2-fake"])
@pytest.mark.parametrize("case", CASES)
def test_gradient_path(runs, nproc, fake, case):
    assert_case_ok(runs[(nproc, fake)], case, nproc)
