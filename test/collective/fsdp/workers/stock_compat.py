"""Multi-rank stock use cases with the fork installed. Usage: stock_compat.py CASE WORKDIR [CASE WORKDIR ...]: the
cases in order, in one process (one launch for several cases: CI time); reports {case: "ok" or its traceback}.

Cases:
  dist_save        semi-auto DistTensors (Shard(0) on all ranks) saved with stock's default arguments
  dist_load        load WORKDIR/dist (saved by any world) into Shard(1) DistTensors, replicated DistTensors and
                   FSDP-style flattened ShardedWeights; compare with the known full values
  node_local       stock-format save and load where every rank is given its own directory
  fsdp_from_stock  a plain model's state_dict saved by stock's own writer (data parallel)
                   loads into a FullyShardFusion model of this world size through dist.load_state_dict
  different_dirs   the engine (safetensors=True) with a different directory per rank: a named error on every
                   rank, not the commit timeout
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import _paths  # noqa: F401
import numpy as np
import paddle
import paddle.distributed as dist
from launch_util import report
from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight


def full_w():
    return np.arange(13 * 8, dtype=np.float32).reshape(13, 8)


def full_b():
    return np.arange(6, dtype=np.float32) * 0.5


def mesh():
    return dist.ProcessMesh(list(range(dist.get_world_size())))


def dist_save(work):
    w = dist.shard_tensor(paddle.to_tensor(full_w()), mesh(), [dist.Shard(0)])
    b = dist.shard_tensor(paddle.to_tensor(full_b()), mesh(), [dist.Replicate()])
    dist.save_state_dict({"w": w, "b": b}, os.path.join(work, "dist"))
    if dist.get_world_size() > 1:
        dist.barrier()
    names = sorted(os.listdir(os.path.join(work, "dist")))
    assert "0.metadata" in names and f"{dist.get_rank()}_0.distcp" in names, names


def dist_load(work):
    n, r = dist.get_world_size(), dist.get_rank()
    w = dist.shard_tensor(paddle.zeros([13, 8]), mesh(), [dist.Shard(1)])
    b = dist.shard_tensor(paddle.zeros([6]), mesh(), [dist.Replicate()])
    dist.load_state_dict({"w": w, "b": b}, os.path.join(work, "dist"))
    cols = np.array_split(np.arange(8), n)[r] if 8 % n == 0 else None
    if cols is not None:
        np.testing.assert_array_equal(w._local_value().numpy(), full_w()[:, cols[0] : cols[-1] + 1])
    np.testing.assert_array_equal(b._local_value().numpy(), full_b())
    # FSDP-style: each rank a contiguous flat range of the whole tensor
    total = 13 * 8
    a, z = r * total // n, (r + 1) * total // n
    flat = paddle.zeros([z - a])
    dist.load_state_dict(
        {"w": ShardedWeight("w", flat, (13, 8), (13, 8), (0, 0), True, slice(a, z))}, os.path.join(work, "dist")
    )
    np.testing.assert_array_equal(flat.numpy(), full_w().reshape(-1)[a:z])


def node_local(work):
    r, n = dist.get_rank(), dist.get_world_size()
    mine = os.path.join(work, f"node{r}")
    rows = np.array_split(np.arange(13), n)[r]
    local = paddle.to_tensor(full_w()[rows[0] : rows[-1] + 1])
    sd = {
        "w": ShardedWeight("w", local, tuple(local.shape), (13, 8), (int(rows[0]), 0)),
        "b": paddle.to_tensor(full_b()),
    }
    dist.save_state_dict(sd, mine)
    other = (r + 1) % n  # read the rows another rank saved on its own "disk"
    rows = np.array_split(np.arange(13), n)[other]
    tgt = paddle.zeros([len(rows), 8])
    got = {"w": ShardedWeight("w", tgt, tuple(tgt.shape), (13, 8), (int(rows[0]), 0)), "b": paddle.zeros([6])}
    dist.load_state_dict(got, mine)
    np.testing.assert_array_equal(tgt.numpy(), full_w()[rows[0] : rows[-1] + 1])
    np.testing.assert_array_equal(got["b"].numpy(), full_b())


def fsdp_from_stock(work):
    from models import make_model
    from paddle.distributed.flex_checkpoint.dcp.save_state_dict import save_state_dict as stock_save
    from paddle.distributed.fsdp import FullyShardFusion

    path = os.path.join(work, "plain")
    stock_save(dict(make_model(seed=5).state_dict()), path)  # stock's data-parallel save (pickles), collective
    want = {k: v.numpy() for k, v in make_model(seed=5).state_dict().items()}
    model = make_model(seed=77)
    fsdp = FullyShardFusion(model, fsdp_unit_layers=["Block"])
    dist.load_state_dict(fsdp.sharded_state_dict(), path)
    got = fsdp.full_parameters()
    assert got, "no parameters"
    for k, v in got.items():
        np.testing.assert_array_equal(v.numpy(), want[k], err_msg=k)


def different_dirs(work):
    from paddle.distributed.fsdp.checkpoint.stock import DirectoryMismatchError

    for name in ("shared", "shared", "step_2"):
        dist.save_state_dict({"w": paddle.ones([4])}, os.path.join(work, name), safetensors=True)
    # ranks given different checkpoint names are refused on every rank, at once (decided from the exchange)
    t0 = time.monotonic()
    try:
        name = "shared" if dist.get_rank() == 0 else f"rank{dist.get_rank()}"
        dist.save_state_dict({"w": paddle.ones([4])}, os.path.join(work, name), safetensors=True)
    except DirectoryMismatchError as e:
        assert "different directories" in str(e), e
    else:
        raise AssertionError("no DirectoryMismatchError")
    assert time.monotonic() - t0 < 120, time.monotonic() - t0
    # the same name in different parents is node-local storage: it commits (the coordinator's directory holds
    # the metadata, every other rank's its own data file; test_node_local_saves.py loads such a checkpoint)
    mine = os.path.join(work, f"r{dist.get_rank()}", "c")
    dist.save_state_dict({"w": paddle.ones([4])}, mine, safetensors=True)
    assert os.path.exists(os.path.join(mine, f"{dist.get_rank()}_0.safetensors"))


if __name__ == "__main__":
    pairs = list(zip(sys.argv[1::2], sys.argv[2::2]))
    dist.init_parallel_env()
    outcomes = {}
    for case, work in pairs:
        try:
            globals()[case](work)
            outcomes[case] = "ok"
        except Exception:  # noqa: BLE001 - reported per case; the next cases still run
            outcomes[case] = traceback.format_exc()
    report(outcomes)
