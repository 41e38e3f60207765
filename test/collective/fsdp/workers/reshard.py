"""Elastic resume: a checkpoint saved by N ranks loads on M ranks (and with another unit grouping).

Usage:
  reshard.py save WORKDIR           on N ranks: per config, train 3 steps, save to WORKDIR/<config>-n<N>,
                                    dump this rank's records (numpy, for an engine-independent reference),
                                    train 3 more steps and dump the final full parameters.
  reshard.py load WORKDIR SRC_N...  on M ranks: per config and source N, build the model from another seed,
                                    load, compare every record with the reference assembled from the N
                                    dumps (bit for bit), then train 3 more steps and compare with the N-rank
                                    continuation. `SRC_N:layer` loads with per-layer grouping instead of
                                    fsdp_unit_layers=["Block"].
Each rank reports {case: "ok" | traceback}.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import _paths  # noqa: F401  (puts launch_util on sys.path)
import numpy as np
import paddle
import paddle.distributed as dist
from launch_util import report
from models import Bf16MLP, global_batches, make_model
from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight
from paddle.distributed.fsdp import FullyShardFusion
from paddle.distributed.fsdp.checkpoint.errors import ShapeMismatchError
from training import records, train

BATCH = 12
CONFIGS = ["adamw_fp64", "asgd_fp64", "sgd_bf16_master"]


def build(config: str, seed: int, units):
    if config == "sgd_bf16_master":
        paddle.seed(seed)
        model = Bf16MLP()
        fsdp = FullyShardFusion(model)
        return model, fsdp, paddle.optimizer.SGD(0.05, parameters=model.parameters(), multi_precision=True)
    model = make_model(seed, dtype="float64")
    fsdp = FullyShardFusion(model, fsdp_unit_layers=units)
    if config == "adamw_fp64":
        lr = paddle.optimizer.lr.StepDecay(0.01, step_size=2, gamma=0.5)
        return model, fsdp, paddle.optimizer.AdamW(lr, weight_decay=0.1, parameters=model.parameters())
    return model, fsdp, paddle.optimizer.ASGD(0.01, batch_num=2, parameters=model.parameters())


def describe(value):
    """(numpy data, placement) of a record; placement locates it inside the full tensor."""
    if isinstance(value, ShardedWeight):
        data = np.array(value.local_tensor.numpy())
        if value.is_flattened:
            r = value.flattened_range
            return data, {"kind": "flat", "shape": list(value.global_shape), "start": r.start, "stop": r.stop}
        return data, {"kind": "box", "shape": list(value.global_shape), "offset": list(value.global_offset)}
    return np.array(value.numpy()), {"kind": "replicated", "shape": list(value.shape)}


def place(full: dict, key: str, data: np.ndarray, where: dict) -> None:
    if key not in full:
        full[key] = np.zeros(where["shape"], dtype=data.dtype)
    target = full[key]
    if where["kind"] == "flat":
        target.reshape(-1)[where["start"] : where["stop"]] = data.reshape(-1)
    elif where["kind"] == "box":
        index = tuple(slice(o, o + s) for o, s in zip(where["offset"], data.shape))
        target[index] = data
    else:
        target[...] = data


def save(workdir: str, rank: int, world: int) -> dict:
    results = {}
    batches = global_batches(6, BATCH)
    for config in CONFIGS:
        try:
            model, fsdp, opt = build(config, 7, ["Block"])
            train(model, opt, batches[:3], rank, world)
            path = os.path.join(workdir, f"{config}-n{world}")
            fsdp.save_checkpoint(path, optimizer=opt)
            dump = {key: describe(value) for key, value in records(fsdp, opt).items()}
            np.savez(f"{path}.records{rank}.npz", **{k: d for k, (d, _) in dump.items()})
            with open(f"{path}.records{rank}.json", "w") as f:
                json.dump({k: w for k, (_, w) in dump.items()}, f)
            train(model, opt, batches[3:], rank, world)
            final = {k: v.numpy() for k, v in fsdp.full_parameters().items()}
            if rank == 0:
                np.savez(f"{path}.final.npz", **final)
            results[config] = "ok"
        except Exception:
            results[config] = traceback.format_exc()
    return results


def reference(path: str, saved_world: int) -> dict:
    full: dict = {}
    for r in range(saved_world):
        data = np.load(f"{path}.records{r}.npz")
        with open(f"{path}.records{r}.json") as f:
            where = json.load(f)
        for key in data.files:
            place(full, key, data[key], where[key])
    return full


def load_case(config: str, source: str, workdir: str, rank: int, world: int) -> None:
    saved_world, _, grouping = source.partition(":")
    units = None if grouping == "layer" else ["Block"]
    path = os.path.join(workdir, f"{config}-n{saved_world}")
    model, fsdp, opt = build(config, 99, units)
    fsdp.load_checkpoint(path, optimizer=opt)
    expected = reference(path, int(saved_world))
    mine = records(fsdp, opt)
    assert sorted(mine) == sorted(k for k in expected if k in mine), "keys outside the checkpoint"
    local_bytes = 0
    for key, value in mine.items():
        data, where = describe(value)
        local_bytes += data.nbytes
        got_full = expected[key]
        if where["kind"] == "flat":
            ref = got_full.reshape(-1)[where["start"] : where["stop"]]
        elif where["kind"] == "box":
            ref = got_full[tuple(slice(o, o + s) for o, s in zip(where["offset"], data.shape))]
        else:
            ref = got_full
        assert ref.dtype == data.dtype and np.array_equal(ref.reshape(data.shape), data), (
            f"{config} from {source}: {key} differs from the saved values"
        )
    train(model, opt, global_batches(6, BATCH)[3:], rank, world)
    final = np.load(f"{path}.final.npz")
    # fp64: reduction order differs between N and M ranks, rounding stays ~1e-16. bf16 params: another
    # reduction order may round a value to the neighbouring bf16 number, so allow one bf16 step (2^-7).
    tolerance = 2.0**-7 if config == "sgd_bf16_master" else 1e-10
    for key, value in fsdp.full_parameters().items():
        got, want = as_float(value.numpy()), as_float(final[key])
        error = np.abs(got - want).max() / max(np.abs(want).max(), 1e-12)
        assert error <= tolerance, f"{config} from {source}: {key} after 3 more steps differs by {error:.2e}"


def as_float(array: np.ndarray) -> np.ndarray:
    """bf16 arrives from paddle as uint16 bit patterns: widen them to float32."""
    if array.dtype == np.uint16:
        return (array.astype(np.uint32) << 16).view(np.float32)
    return array


def refusal_case(workdir: str, rank: int, world: int) -> None:
    """A checkpoint of another model (another shape) fails before any tensor is written, naming the key."""
    path = os.path.join(workdir, "adamw_fp64-n2")
    paddle.seed(1)

    class Wider(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.embed = paddle.nn.Embedding(37, 17)

    model = Wider()
    model.to(dtype="float64")
    fsdp = FullyShardFusion(model)
    before = {k: v.numpy().copy() for k, v in fsdp.full_parameters().items()}
    try:
        dist.load_state_dict(fsdp.sharded_state_dict(), path)
        raise AssertionError("a shape mismatch loaded")
    except ShapeMismatchError as e:
        assert "embed.weight" in str(e), str(e)
    for key, value in fsdp.full_parameters().items():
        assert np.array_equal(value.numpy(), before[key]), f"{key} changed by a failed load"


def main() -> None:
    phase, workdir = sys.argv[1:3]
    world = dist.get_world_size()
    if world > 1:
        dist.init_parallel_env()
    rank = dist.get_rank()
    if phase == "save":
        report(save(workdir, rank, world))
        return
    results = {}
    for source in sys.argv[3:]:
        for config in CONFIGS:
            try:
                load_case(config, source, workdir, rank, world)
                results[f"{config}-{source}"] = "ok"
            except Exception:
                results[f"{config}-{source}"] = traceback.format_exc()
    try:
        refusal_case(workdir, rank, world)
        results["refusal"] = "ok"
    except Exception:
        results["refusal"] = traceback.format_exc()
    report(results)


if __name__ == "__main__":
    main()
