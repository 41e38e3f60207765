"""fp32 master weights stepped for real (MasterAdamW) on bf16 parameters: save, resume, reshard.

Usage: master_weights.py save WORKDIR          train 3 steps, save A_<world>, train 3 more, save REF_<world>
       master_weights.py resume WORKDIR SRC     load A_<world>, train 3, save RES_<world> (compared with REF);
                                                load A_<SRC> (another world size), save B_<SRC>_<world> at once
Each rank reports {case: "ok" | traceback}; the pytest side compares the checkpoints bit for bit.
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
from master_adamw import MasterAdamW
from models import Bf16MLP, global_batches
from paddle.distributed.fsdp import FullyShardFusion
from training import train

STEPS, BATCH = 6, 12


def build(seed: int):
    paddle.seed(seed)
    model = Bf16MLP()
    fsdp = FullyShardFusion(model)
    opt = MasterAdamW(0.01, parameters=model.parameters(), weight_decay=0.1, multi_precision=True)
    return model, fsdp, opt


def masters_by_key(fsdp, opt) -> dict:
    """Local master weights by parameter key (for the checks on the cast relation)."""
    out = {}
    for key, param, _buffer, _index in fsdp.managed_parameters():
        if param.name in opt._master_weights:
            out[key] = (param, opt._master_weights[param.name])
    return out


def save_phase(workdir, rank, world):
    batches = global_batches(STEPS, BATCH)
    model, fsdp, opt = build(seed=7)
    fsdp.init_optimizer_state(opt)
    initial = {k: m.numpy().copy() for k, (_p, m) in masters_by_key(fsdp, opt).items()}
    train(model, opt, batches[:3], rank, world)
    moved = False
    for key, (param, master) in masters_by_key(fsdp, opt).items():
        # the parameter is the cast of its master weight, and the master moved (it is not a constant)
        cast = master.astype(param.dtype).astype("float32").numpy()
        assert np.array_equal(cast, param.astype("float32").numpy()), f"{key}: param != cast(master)"
        moved = moved or not np.array_equal(initial[key], master.numpy())
    assert moved or not initial, "no master weight changed in 3 steps"
    fsdp.save_checkpoint(os.path.join(workdir, f"A_{world}"), optimizer=opt)
    train(model, opt, batches[3:], rank, world)
    fsdp.save_checkpoint(os.path.join(workdir, f"REF_{world}"), optimizer=opt)


def resume_phase(workdir, source_world, rank, world):
    batches = global_batches(STEPS, BATCH)
    model, fsdp, opt = build(seed=99)  # another seed: every value must come from the load
    fsdp.load_checkpoint(os.path.join(workdir, f"A_{world}"), optimizer=opt)
    train(model, opt, batches[3:], rank, world)
    fsdp.save_checkpoint(os.path.join(workdir, f"RES_{world}"), optimizer=opt)
    model, fsdp, opt = build(seed=123)
    fsdp.load_checkpoint(os.path.join(workdir, f"A_{source_world}"), optimizer=opt)
    fsdp.save_checkpoint(os.path.join(workdir, f"B_{source_world}_{world}"), optimizer=opt)


def main() -> None:
    phase, workdir = sys.argv[1:3]
    world = dist.get_world_size()
    if world > 1:
        dist.init_parallel_env()
    rank = dist.get_rank()
    try:
        if phase == "save":
            save_phase(workdir, rank, world)
        else:
            resume_phase(workdir, int(sys.argv[3]), rank, world)
        report({phase: "ok"})
    except Exception:
        report({phase: traceback.format_exc()})


if __name__ == "__main__":
    main()
