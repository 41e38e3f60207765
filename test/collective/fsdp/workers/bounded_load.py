"""Memory-bounded loads on 2 ranks: a corrupted byte on one rank, the named error on every rank, the fallback.

Usage: bounded_load.py WORKDIR (on 2 ranks). Saves step 1 and step 2 of a TinyLM + AdamW into a root, flips one
byte of rank 1's data file of step 2, then checks:
  partial    every rank raises PartiallyLoadedError naming rank 1 for a load of step 2 itself
  atomic     atomic=True: every rank raises CorruptCheckpointError and every tensor is bit-identical to before
  fallback   load_checkpoint(root) falls back to step 1 (result.path, result.fallback_from) with step 1's state
  bounded    an intact load holds at most its budget of extra host memory (the engine's own account)
Each rank reports {case: "ok" | traceback}.
"""

from __future__ import annotations

import os
import sys
import traceback

import _paths  # noqa: F401  (puts launch_util on sys.path)
import numpy as np
import paddle
import paddle.distributed as dist
from launch_util import report
from models import global_batches, make_model
from paddle.distributed.fsdp import FullyShardFusion
from paddle.distributed.fsdp.checkpoint import CorruptCheckpointError, PartiallyLoadedError, load_state_dict
from training import records, train


def build(seed: int):
    model = make_model(seed)
    fsdp = FullyShardFusion(model, fsdp_unit_layers=["Block"])
    opt = paddle.optimizer.AdamW(0.01, parameters=model.parameters())
    return model, fsdp, opt


def state_bits(fsdp, opt) -> dict:
    out = {}
    for key, value in records(fsdp, opt).items():
        t = getattr(value, "local_tensor", value)
        out[key] = np.ascontiguousarray(t.numpy()).view(np.uint8).ravel().copy()
    return out


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def main() -> None:
    workdir = sys.argv[1]
    dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    root = os.path.join(workdir, "root")
    batches = global_batches(3, 8)
    model, fsdp, opt = build(7)
    train(model, opt, batches[:1], rank, world)
    fsdp.save_checkpoint(root, optimizer=opt, step=1, extra_state={"step": 1})
    ref1 = state_bits(fsdp, opt)
    train(model, opt, batches[1:2], rank, world)
    fsdp.save_checkpoint(root, optimizer=opt, step=2, extra_state={"step": 2})
    ref2 = state_bits(fsdp, opt)
    step2 = os.path.join(root, "step_00000002")
    if rank == 0:
        victim = os.path.join(step2, "1_0.safetensors")
        raw = bytearray(open(victim, "rb").read())
        raw[len(raw) * 2 // 3] ^= 0x10  # one byte in the data of rank 1
        open(victim, "wb").write(bytes(raw))
    dist.barrier()

    results = {}

    def case(name, fn):
        try:
            fn()
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()

    # every case starts from a state that differs from both checkpoints
    def scrambled():
        m, f, o = build(100 + rank)
        f.init_optimizer_state(o)
        for value in records(f, o).values():
            t = getattr(value, "local_tensor", value)
            t.set_value(paddle.full(t.shape, 0.5, dtype=t.dtype))
        return m, f, o

    def partial():
        _m, f, o = scrambled()
        state = records(f, o)
        try:
            load_state_dict(state, step2)
        except PartiallyLoadedError as e:
            assert "rank 1" in str(e) and "checksum mismatch" in str(e) and "mix" in str(e), str(e)
        else:
            raise AssertionError("a corrupt byte on rank 1 went unnoticed")
        if rank == 0:  # its own data was intact: it holds step 2's values now, rank 1 a mix
            assert same(state_bits(f, o), ref2)

    def atomic():
        _m, f, o = scrambled()
        before = state_bits(f, o)
        try:
            load_state_dict(records(f, o), step2, atomic=True)
        except PartiallyLoadedError:
            raise AssertionError("atomic=True must not leave partly written targets") from None
        except CorruptCheckpointError as e:
            assert "rank 1" in str(e) or "checksum mismatch" in str(e), str(e)
        else:
            raise AssertionError("a corrupt byte on rank 1 went unnoticed")
        assert same(state_bits(f, o), before), "atomic load changed the state although it failed"

    def fallback():
        _m, f, o = scrambled()
        result = f.load_checkpoint(root, optimizer=o)
        assert result.path.endswith("step_00000001") and result.step == 1 and result["step"] == 1, result.path
        assert [p for p, _e in result.fallback_from] == [step2], result.fallback_from
        assert "checksum mismatch" in result.fallback_from[0][1]
        assert same(state_bits(f, o), ref1), "the fallback did not restore step 1 on every tensor"
        try:  # a checkpoint directory (not a root) has nothing to fall back to
            f.load_checkpoint(step2, optimizer=o)
        except PartiallyLoadedError:
            pass
        else:
            raise AssertionError("loading the corrupt checkpoint itself did not fail")

    def bounded():
        _m, f, o = scrambled()
        state = records(f, o)
        state_bytes = sum(getattr(v, "local_tensor", v).numel().item() * 4 for v in state.values())
        report_ = load_state_dict(state, os.path.join(root, "step_00000001"), max_host_bytes=256 << 10)
        assert report_.host_budget == 256 << 10 and report_.peak_host_bytes <= 256 << 10, report_
        assert same(state_bits(f, o), ref1)
        atomic_report = load_state_dict(records(f, o), os.path.join(root, "step_00000001"), atomic=True)
        assert atomic_report.peak_host_bytes >= state_bytes, (atomic_report.peak_host_bytes, state_bytes)

    case("partial", partial)
    case("atomic", atomic)
    case("fallback", fallback)
    case("bounded", bounded)
    report(results)


if __name__ == "__main__":
    main()
