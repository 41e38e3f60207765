"""Any unit ending works: a zoo of unit forwards against the same model in one process (values, gradients)."""

from __future__ import annotations

import os

import pytest
from _results import assert_case_ok
from launch_util import run_launch

WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers")
CASES = [
    "tanh",
    "sigmoid",
    "softmax",
    "exp",
    "tuple",
    "list",
    "namedtuple",
    "dict",
    "dataclass",
    "input_passthrough",
    "input_view",
    "used_twice",
    "stop_gradient_output",
    "called_twice",
    "recurrence",
    "nested",
    "no_grad_eval",
    "recompute_tanh",
    "recompute_tuple",
    "recompute_nonreentrant",
    "unsupported",
]


@pytest.fixture(scope="module")
def zoo_runs(tmp_path_factory):
    return {
        n: run_launch(os.path.join(WORKERS, "unit_zoo.py"), n, log_dir=tmp_path_factory.mktemp(f"zoo{n}"))
        for n in (1, 2)
    }


@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("case", CASES)
def test_unit_forward_matches_one_process(zoo_runs, nproc, case):
    """Loss, every gradient piece (rtol 1e-10, fp64) and the parameters after two SGD steps equal the unwrapped
    model's; "unsupported" checks that an opaque unit output is refused at the first forward, naming the layer."""
    assert_case_ok(zoo_runs[nproc], case, nproc)


def test_zoo_lists_every_case():
    import sys

    sys.path.insert(0, WORKERS)
    try:
        import unit_zoo
    finally:
        sys.path.remove(WORKERS)
    assert sorted(unit_zoo.CASES + ["unsupported"]) == sorted(CASES)
