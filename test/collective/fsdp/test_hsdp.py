"""Hybrid sharding (HSDP) and the group layouts FullyShardFusion refuses, on 4 gloo ranks (one launch)."""

from __future__ import annotations

import os

import pytest
from _results import assert_case_ok
from launch_util import run_launch

CASES = [
    "refuse_fleet_dp_x_sharding",
    "refuse_partial_group",
    "accept_whole_world",
]


@pytest.fixture(scope="module")
def hsdp_run(tmp_path_factory):
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "hsdp.py")
    return run_launch(worker, 4, log_dir=tmp_path_factory.mktemp("hsdp4"))


@pytest.mark.parametrize("case", CASES)
def test_group_layouts(hsdp_run, case):
    """Layouts where data-parallel ranks would not average gradients raise UnsupportedGroupLayoutError (named,
    before the model is touched); sharding over the whole world stays accepted."""
    assert_case_ok(hsdp_run, case, 4)


class _TopologyDegrees:
    """fleet's hybrid group as FSDP reads it: the degree getters, answered from a real CommunicateTopology.
    (Building a second real HybridCommunicateGroup in one gloo process timed out creating its check group.)"""

    def __init__(self, **dims: int) -> None:
        from paddle.distributed.fleet.base.topology import CommunicateTopology

        names = ["data", "pipe", "sharding", "sep", "model"]
        self.topo = CommunicateTopology(names, [dims.get(n, 1) for n in names])

    def get_data_parallel_world_size(self):
        return self.topo.get_dim("data")

    def get_pipe_parallel_world_size(self):
        return self.topo.get_dim("pipe")

    def get_sharding_parallel_world_size(self):
        return self.topo.get_dim("sharding")

    def get_sep_parallel_world_size(self):
        return self.topo.get_dim("sep")

    def get_model_parallel_world_size(self):
        return self.topo.get_dim("model")


@pytest.mark.parametrize(
    "dims, named",
    [({"model": 2, "sharding": 2}, "'mp_degree': 2"), ({"pipe": 2, "data": 2}, "'pp_degree': 2"), ({"sep": 2}, "sep")],
)
def test_tensor_pipeline_sequence_parallel_refused(dims, named, monkeypatch):
    """mp/pp/sep degrees > 1 are refused by name before the model is touched (FSDP shards whole parameters)."""
    import paddle
    from paddle.distributed import fleet
    from paddle.distributed.fsdp import FullyShardFusion, UnsupportedGroupLayoutError

    monkeypatch.setattr(fleet.fleet, "_hcg", _TopologyDegrees(**dims), raising=False)
    model = paddle.nn.Linear(4, 4)
    with pytest.raises(UnsupportedGroupLayoutError, match=named):
        FullyShardFusion(model)
    assert getattr(model, "_fsdp", None) is None
