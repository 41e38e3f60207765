"""Real FSDP checkpoints for the checkpoint tools' tests (test_tools.py).

Usage: hf_tools.py save WORKDIR
         2 ranks: TinyLM + FullyShardFusion(["Block"]) + AdamW, 2 training steps,
         fsdp.save_checkpoint(WORKDIR/fsdp_ckpt, optimizer=opt); rank 0 also writes the gathered full
         parameters to WORKDIR/full_params.npz (the reference the converted files are compared with).
       hf_tools.py load CASES_JSON
         for every case {"name", "ckpt", "expected_npz"}: a model built from ANOTHER seed loads `ckpt`
         with fsdp.load_checkpoint (form "one") and with dist.load_state_dict(fsdp.sharded_state_dict())
         (form "low"); its gathered parameters must equal the arrays of `expected_npz` (by key), exactly.
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
from models import decay_fun_for, global_batches, local_part, make_model
from paddle.distributed.fsdp import FullyShardFusion

STEPS, BATCH = 2, 8


def save(workdir: str, rank: int, world: int) -> None:
    model = make_model(7)
    fsdp = FullyShardFusion(model, fsdp_unit_layers=["Block"])
    opt = paddle.optimizer.AdamW(
        0.01, parameters=model.parameters(), weight_decay=0.1, apply_decay_param_fun=decay_fun_for(model)
    )
    for ids, labels in global_batches(STEPS, BATCH):
        loss = model(paddle.to_tensor(local_part(ids, rank, world)), paddle.to_tensor(local_part(labels, rank, world)))
        loss.backward()
        opt.step()
        opt.clear_grad()
    fsdp.save_checkpoint(os.path.join(workdir, "fsdp_ckpt"), optimizer=opt, extra_state={"step": STEPS})
    full = {key: value.numpy() for key, value in fsdp.full_parameters().items()}
    if rank == 0:
        np.savez(os.path.join(workdir, "full_params.npz"), **full)


def load_case(case: dict, form: str) -> None:
    model = make_model(99)  # another seed: every value must come from the checkpoint
    fsdp = FullyShardFusion(model, fsdp_unit_layers=["Block"])
    if form == "one":
        extra = fsdp.load_checkpoint(case["ckpt"])
        assert extra == {}, extra
    else:
        dist.load_state_dict(fsdp.sharded_state_dict(), case["ckpt"])
    full = {key: value.numpy() for key, value in fsdp.full_parameters().items()}
    expected = np.load(case["expected_npz"])
    assert sorted(full) == sorted(expected.files), sorted(set(full) ^ set(expected.files))
    for key, value in full.items():
        want = expected[key]
        assert value.dtype == want.dtype and value.shape == want.shape, (
            key,
            value.dtype,
            value.shape,
            want.dtype,
            want.shape,
        )
        assert np.array_equal(value, want), f"{case['name']}/{form}: {key} differs after loading"


def main() -> None:
    phase = sys.argv[1]
    world = dist.get_world_size()
    if world > 1:
        dist.init_parallel_env()
    rank = dist.get_rank()
    results = {}
    if phase == "save":
        try:
            save(sys.argv[2], rank, world)
            results["save"] = "ok"
        except Exception:
            results["save"] = traceback.format_exc()
    else:
        with open(sys.argv[2], encoding="utf-8") as f:
            cases = json.load(f)
        for case in cases:
            for form in ("one", "low"):
                try:
                    load_case(case, form)
                    results[f"{case['name']}-{form}"] = "ok"
                except Exception:
                    results[f"{case['name']}-{form}"] = traceback.format_exc()
    report(results)


if __name__ == "__main__":
    main()
