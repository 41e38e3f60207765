"""FullyShardFusion trains like one process: parity on 1, 2 and 3 ranks, edge cases, bad input."""

from __future__ import annotations

import pytest
from _results import assert_case_ok
from launch_util import run_launch

PARITY_CASES = [
    "sgd-float32",
    "momentum-float32",
    "sgd-float64",
    "momentum-float64",
    "adam_l2-float64",
    "adamw_attr-float64",
    "adamw_clip-float64",
    "adamw_accum-float64",
    "adamw_groups-float64",
]
EDGE_CASES = [
    "object_exchange",
    "more_ranks_than_elements",
    "step_before_backward",
    "unused_parameters",
    "two_instances",
    "sharding_group",
]


@pytest.fixture(scope="module")
def parity_runs(tmp_path_factory):
    """One launch per world size runs every configuration (launches are the slow part); the 3-rank one then runs
    the gloo edge cases as well."""
    return {
        n: run_launch(
            _worker("train_parity.py"),
            n,
            ["--edge-cases"] if n == 3 else [],
            log_dir=tmp_path_factory.mktemp(f"parity{n}"),
        )
        for n in (1, 2, 3)
    }


@pytest.fixture(scope="module")
def edge_runs(parity_runs, tmp_path_factory):
    return {
        "gloo-3": (3, parity_runs[3]),  # in the 3-rank parity launch, after its cases
        "fleet-2": (2, run_launch(_worker("edge_cases.py"), 2, ["--fleet"], log_dir=tmp_path_factory.mktemp("edgef"))),
    }


def _worker(name: str) -> str:
    import os

    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", name)


@pytest.mark.parametrize("nproc", [1, 2, 3])
@pytest.mark.parametrize("case", PARITY_CASES)
def test_fsdp_matches_one_process(parity_runs, nproc, case):
    """Parameters after 3 steps equal the one-process run (max error relative to the tensor's largest
    value: 1e-5 in fp32, 1e-10 in fp64), and each rank's resident parameter storage is its 1/N shard."""
    assert_case_ok(parity_runs[nproc], case, nproc)


@pytest.mark.parametrize("run", ["gloo-3", "fleet-2"])
@pytest.mark.parametrize("case", EDGE_CASES)
def test_edge_cases(edge_runs, run, case):
    nproc, result = edge_runs[run]
    assert_case_ok(result, case, nproc)


def test_model_without_parameters_is_refused():
    import paddle
    from paddle.distributed.fsdp import FullyShardFusion

    with pytest.raises(ValueError, match="has no parameters"):
        FullyShardFusion(paddle.nn.Sequential(paddle.nn.ReLU()))


def test_unknown_unit_class_is_refused():
    import paddle
    from paddle.distributed.fsdp import FullyShardFusion

    with pytest.raises(ValueError, match="NoSuchBlock"):
        FullyShardFusion(paddle.nn.Linear(2, 2), fsdp_unit_layers=["NoSuchBlock"])


def test_wrapping_twice_is_refused():
    import paddle
    from paddle.distributed.fsdp import FullyShardFusion

    model = paddle.nn.Linear(2, 2)
    FullyShardFusion(model)
    with pytest.raises(ValueError, match="already wrapped"):
        FullyShardFusion(model)


def test_unlaunched_single_process_is_bit_exact():
    """No launcher, no process group: FSDP over one rank issues no collective and equals plain training."""
    import sys

    import numpy as np
    import paddle
    from paddle.distributed.fsdp import FullyShardFusion

    sys.path.insert(0, _worker(""))
    from models import decay_fun_for, global_batches, make_model
    from training import train

    ref, model = make_model(3), make_model(3)
    fsdp = FullyShardFusion(model, ["Block"])
    assert fsdp.world_size == 1
    # FSDP honours param.no_weight_decay itself; stock AdamW needs it spelled as apply_decay_param_fun
    for m, decay_fun in ((ref, decay_fun_for(ref)), (model, None)):
        opt = paddle.optimizer.AdamW(
            0.01,
            weight_decay=0.1,
            parameters=m.parameters(),
            apply_decay_param_fun=decay_fun,
            grad_clip=paddle.nn.ClipGradByGlobalNorm(0.1),
        )
        train(m, opt, global_batches(3, 4), 0, 1)
    full = fsdp.full_parameters()
    for key, param in ref.named_parameters():
        np.testing.assert_array_equal(full[key].numpy(), param.numpy(), err_msg=key)
    via_model, via_fsdp = model.sharded_state_dict(), fsdp.sharded_state_dict()
    assert sorted(via_model) == sorted(via_fsdp) == sorted(k for k, _ in ref.named_parameters())
    for key, record in via_model.items():
        assert record.is_flattened and record.flattened_range == slice(0, record.local_tensor.shape[0])
        np.testing.assert_array_equal(record.local_tensor.numpy().reshape(record.global_shape), full[key].numpy())
