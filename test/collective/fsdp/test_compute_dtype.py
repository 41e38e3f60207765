"""FullyShardFusion(compute_dtype=...): parameters gathered in the compute dtype, so autograd saves the unit's
low-precision parameters (freed with the unit) instead of one cast per op kept through the whole forward (AMP O1's
memory problem, reproduced one precision up on CPU: fp64 parameters, fp32 compute). 1 and 2 gloo ranks."""

from __future__ import annotations

import os

import pytest
from _results import assert_case_ok
from launch_util import run_launch

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "compute_dtype.py")
CASES = ["retained_after_forward", "same_training", "refusals"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return {n: run_launch(WORKER, n, log_dir=tmp_path_factory.mktemp(f"compute{n}")) for n in (1, 2)}


@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("case", CASES)
def test_compute_dtype(runs, nproc, case):
    """retained_after_forward: host bytes still allocated after forward: without compute_dtype at least every
    weight's cast (8 units, the bug reproduced), with it at most one unit's gathered buffer plus the activations.
    same_training: 3 Momentum steps bit-equal with and without compute_dtype, equal to one process (1e-5, fp32
    compute).
    refusals: a non-floating compute_dtype is refused by name."""
    assert_case_ok(runs[nproc], case, nproc)
