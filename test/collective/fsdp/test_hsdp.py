"""Hybrid sharding (HSDP) and the group layouts FullyShardFusion refuses: 4 gloo ranks as fleet's dp_degree=2 x
sharding_degree=2, and 3 ranks for the 1x3 reshards. Three launches share one directory: 1x3 saves, 2x2 runs
everything (and loads the 1x3 checkpoint), 1x3 loads the 2x2 checkpoint."""

from __future__ import annotations

import os

import pytest
from _results import assert_case_ok
from launch_util import run_launch

FOUR = [
    "refusals",
    "training",
    "explicit_groups",
    "save_once_balanced",
    "load_reads_once",
    "reshard_2x2_to_1x4",
    "reshard_4_to_2x2",
    "reshard_3_to_2x2",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "hsdp.py")
    work = str(tmp_path_factory.mktemp("hsdp_ckpts"))
    first3 = run_launch(worker, 3, [work, "--three"], log_dir=tmp_path_factory.mktemp("hsdp3a"))
    four = run_launch(worker, 4, [work], log_dir=tmp_path_factory.mktemp("hsdp4"))
    then3 = run_launch(worker, 3, [work, "--three"], log_dir=tmp_path_factory.mktemp("hsdp3b"))
    return {"first3": first3, "four": four, "then3": then3, "dir": work}


@pytest.mark.parametrize("case", FOUR)
def test_hsdp_2x2(runs, case):
    """refusals: layouts where data-parallel ranks would not average gradients raise UnsupportedGroupLayoutError.
    training: HSDP == one process == plain FSDP over the world (fp64, 1e-10 relative), replicas identical.
    save_once_balanced / load_reads_once: bytes written and read per rank (each byte once per replica group).
    reshard_*: bit-exact state (re-saved and compared) and continuation equal to the uninterrupted run."""
    assert_case_ok(runs["four"], case, 4)


def test_hsdp_checkpoint_read_by_tools(runs):
    """The 2x2 checkpoint is the plain FSDP format: the tools' inspect and verify read it as such."""
    from paddle.distributed.fsdp.tools.inspect_cmd import inspect_checkpoint
    from paddle.distributed.fsdp.tools.verify_cmd import verify

    path = os.path.join(runs["dir"], "hsdp_2x2")
    info = inspect_checkpoint(path)
    assert info["world_size"] == 4 and info["optimizer_class"] == "AdamW", info["world_size"]
    assert sorted(f["rank"] for f in info["files"].values()) == [0, 1, 2, 3]
    assert info["model_tensors"] > 0 and info["optimizer_bytes"] > info["model_bytes"]
    problems, _ = verify(path, progress=False)
    assert problems == []


def test_hsdp_reshard_1x3(runs):
    """1x3 saves for 3 -> 2x2 (checked in the 4-rank launch); 2x2 -> 1x3 is bit-exact and continues."""
    assert_case_ok(runs["first3"], "save_3", 3)
    assert_case_ok(runs["then3"], "reshard_2x2_to_1x3", 3)


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


def test_replica_byte_stream_windows():
    """The byte stream of a replica's part, read and written in windows smaller than some tensors (tensors split
    across windows, empty tensors, mixed dtypes): the copy equals the source bit for bit. Under --fake-device
    the tensors count as device memory: the host-copy and staging paths run."""
    import numpy as np
    import paddle
    from paddle.distributed.fsdp.state.replicas import _ByteStream

    rng = np.random.default_rng(3)
    shapes = [(5,), (0,), (3, 7), (1,), (40,), (2, 2)]
    dtypes = ["float32", "float64", "int64", "float32", "float16", "float64"]
    src = [paddle.to_tensor(rng.standard_normal(s).astype(d)) for s, d in zip(shapes, dtypes)]
    for window in (1, 7, 64, 10_000):
        dst = [paddle.zeros(list(s), dtype=d) for s, d in zip(shapes, dtypes)]
        reader, writer = _ByteStream(src), _ByteStream(dst)
        assert reader.total == sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in zip(shapes, dtypes))
        for lo in range(0, reader.total, window):
            writer.write(lo, reader.read(lo, min(window, reader.total - lo)))
        for a, b in zip(src, dst):
            assert a.numpy().tobytes() == b.numpy().tobytes(), (window, a.shape)
