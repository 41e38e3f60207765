"""Elastic resume: save on N ranks, load on M (2->1, 2->3, 3->2, 1->2, 2->4, and another grouping)."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
from _results import assert_case_ok
from launch_util import run_launch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers"))
from models import make_model  # noqa: E402
from reshard import reference  # noqa: E402

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "reshard.py")
CONFIGS = ["adamw_fp64", "asgd_fp64", "sgd_bf16_master"]
# loading world size -> checkpoints it loads ("2:layer" = saved by 2 ranks, loaded with per-layer buffers)
LOADS = {1: ["2"], 3: ["2"], 2: ["3", "1", "2:layer"], 4: ["2"]}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("reshard")
    saves = {
        n: run_launch(WORKER, n, ["save", str(workdir)], log_dir=tmp_path_factory.mktemp(f"save{n}")) for n in (1, 2, 3)
    }
    loads = {
        m: run_launch(WORKER, m, ["load", str(workdir), *sources], log_dir=tmp_path_factory.mktemp(f"load{m}"))
        for m, sources in LOADS.items()
    }
    return workdir, saves, loads


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize(
    "load_world,source",
    [(m, s) for m, sources in LOADS.items() for s in sources],
    ids=lambda v: str(v),
)
def test_load_into_other_world_size(runs, config, load_world, source):
    """Every loaded record equals the saved values bit for bit (scalar accumulators, ASGD's stacked `y`
    and master weights included); 3 more steps on M ranks match 3 more steps on N ranks."""
    _, saves, loads = runs
    assert_case_ok(saves[int(source.split(":")[0])], config, int(source.split(":")[0]))
    assert_case_ok(loads[load_world], f"{config}-{source}", load_world)


@pytest.mark.parametrize("load_world", sorted(LOADS))
def test_mismatched_model_fails_before_writing(runs, load_world):
    _, _, loads = runs
    assert_case_ok(loads[load_world], "refusal", load_world)


def test_load_full_state_dict_into_plain_model(runs):
    """One process, no collectives: full tensors by key, usable with set_state_dict of an unsharded model."""
    import paddle
    from paddle.distributed.fsdp.checkpoint import load_full_state_dict

    workdir, _, _ = runs
    path = os.path.join(workdir, "adamw_fp64-n2")
    saved = reference(path, saved_world=2)  # assembled from the saving ranks' own dumps, not the engine
    model = make_model(123, dtype="float64")
    names = [k for k, _ in model.named_parameters()]  # the tied head.weight is embed.weight
    full = load_full_state_dict(path, keys=names)
    assert sorted(full) == sorted(names)
    model.set_state_dict(full)
    for key, param in model.named_parameters():
        np.testing.assert_array_equal(param.numpy(), saved[key], err_msg=key)
    subset = load_full_state_dict(path, keys=["embed.weight.moment1"])
    assert list(subset) == ["embed.weight.moment1"]
    assert isinstance(subset["embed.weight.moment1"], paddle.Tensor)
    np.testing.assert_array_equal(subset["embed.weight.moment1"].numpy(), saved["embed.weight.moment1"])
