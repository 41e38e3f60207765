"""GradScaler under FSDP (2 and 3 gloo ranks): found_inf agreed over the sharding group, so every rank skips the
same steps and keeps the same loss scale as one process; the scaler's state through save/load_checkpoint."""

from __future__ import annotations

import os

import pytest
from _results import assert_case_ok
from launch_util import run_launch

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "grad_scaler.py")
CASES = ["found_inf_one_rank", "scaler_inf_one_rank", "resume_bit_exact", "refusals"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for n in (2, 3):
        work = tmp_path_factory.mktemp(f"scaler{n}")
        out[n] = run_launch(WORKER, n, [str(work)], timeout=300, log_dir=work / "logs")
    return out


@pytest.mark.parametrize("nproc", [2, 3])
@pytest.mark.parametrize("case", CASES)
def test_grad_scaler(runs, nproc, case):
    """found_inf_one_rank: the optimizer's found_inf set on one rank only skips the step on every rank (fp64
    AdamW with global-norm clip equals one process, 1e-10). scaler_inf_one_rank: a GradScaler with dynamic
    scaling and an inf in one element of one rank's gradient shard: the loss scale after every step is the same
    on every rank and equal to one process, parameters equal one process (1e-5, fp32). resume_bit_exact: a
    resume through a checkpoint (saved with incr_count 1, restored into a scaler built with other settings) is
    bit-equal to the uninterrupted run, scaler state included. refusals: missing state (strict / not), a disabled
    scaler's state into an enabled one, a wrong type."""
    assert_case_ok(runs[nproc], case, nproc)
