"""fp32 master weights stepped for real (MasterAdamW) on bf16 parameters: save, resume, reshard.

Usage: master_weights.py save WORKDIR          train 3 steps, save A_<world>, train 3 more, save REF_<world>
       master_weights.py resume WORKDIR SRC     load A_<world>, train 3, save RES_<world> (compared with REF);
                                                load A_<SRC> (another world size), save B_<SRC>_<world> at once
       master_weights.py writeback WORKDIR      train 2 steps, write new values back through summon_full_params,
                                                step once more: the written values survive it (masters followed)
       master_weights.py save,writeback WORKDIR both phases in one launch, in that order (one start-up, not two)
Each rank reports {case: "ok" | traceback}; the pytest side compares the checkpoints bit for bit.
"""

from __future__ import annotations

import os
import sys

import _paths  # noqa: F401  (puts launch_util on sys.path)
import numpy as np
import paddle
import paddle.distributed as dist
from launch_util import report, run_cases
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


WRITTEN = 3.0  # the value written back into w1 (far from the trained weights, |w| < 1)


def _bump_first(param) -> None:
    """Add 1 to the first element only (through fp32: CPU has no bf16 add)."""
    values = param.astype("float32").numpy()
    values.reshape(-1)[0] += 1.0
    param.set_value(paddle.to_tensor(values).astype(param.dtype))


def writeback_phase(rank, world):
    """summon_full_params(writeback=True) refreshes exactly the master weights it changed: w1 (whole), b1 (one
    element); every other master keeps its full fp32 precision, and the next step starts from what was written.
    Also equals one process doing the same by hand (set the param, re-cast its master)."""
    batches = global_batches(3, BATCH)
    model, fsdp, opt = build(seed=7)
    train(model, opt, batches[:2], rank, world)
    before = {k: m.numpy().copy() for k, (_p, m) in masters_by_key(fsdp, opt).items()}
    with fsdp.summon_full_params(writeback=True):
        model.w1.set_value(paddle.full(model.w1.shape, WRITTEN, dtype=model.w1.dtype))
        _bump_first(model.b1)
    masters = masters_by_key(fsdp, opt)
    for key, (param, master) in masters.items():
        cast = master.astype(param.dtype).astype("float32").numpy()
        assert np.array_equal(cast, param.astype("float32").numpy()), f"{key}: param != cast(master) after writeback"
        if key in ("w2", "embed.weight"):
            assert np.array_equal(master.numpy(), before[key]), f"{key}: an unchanged master weight was re-cast"
    if "b1" in masters and masters["b1"][0].shape[0] > 1:  # elements other than the one written keep precision
        assert np.array_equal(masters["b1"][1].numpy()[1:], before["b1"][1:]), "b1: unwritten elements re-cast"
    train(model, opt, batches[2:], rank, world)
    full = fsdp.full_parameters()
    w1 = full["w1"].astype("float32").numpy()
    assert np.abs(w1 - WRITTEN).max() <= 0.05, f"w1 after the next step is not near the written {WRITTEN}: {w1}"
    paddle.seed(7)
    ref = Bf16MLP()
    ref_opt = MasterAdamW(0.01, parameters=ref.parameters(), weight_decay=0.1, multi_precision=True)
    train(ref, ref_opt, batches[:2], 0, 1)
    with paddle.no_grad():
        ref.w1.set_value(paddle.full(ref.w1.shape, WRITTEN, dtype=ref.w1.dtype))
        _bump_first(ref.b1)
    for param in (ref.w1, ref.b1):
        master = ref_opt._master_weights[param.name]
        changed = master.astype(param.dtype) != param
        paddle.assign(paddle.where(changed, param.astype("float32"), master), output=master)
    train(ref, ref_opt, batches[2:], 0, 1)
    for key, param in ref.named_parameters():
        got, want = full[key].astype("float32").numpy(), param.astype("float32").numpy()
        # Adam moves an element whose gradient is ~0 by +-lr whatever its size, so a different reduction order
        # (N ranks vs one) can differ by up to 2 lr per step there: 3 steps of lr 0.01 bound it by 0.06
        bad = ~np.isclose(got, want, rtol=2**-7, atol=0.06)
        assert not bad.any(), f"{key} differs from one process doing the same: {got[bad][:5]} vs {want[bad][:5]}"


def main() -> None:
    phases, workdir = sys.argv[1].split(","), sys.argv[2]
    world = dist.get_world_size()
    if world > 1:
        dist.init_parallel_env()
    rank = dist.get_rank()
    every = {
        "save": lambda: save_phase(workdir, rank, world),
        "writeback": lambda: writeback_phase(rank, world),
        "resume": lambda: resume_phase(workdir, int(sys.argv[3]), rank, world),
    }
    report(run_cases({phase: every[phase] for phase in phases}))


if __name__ == "__main__":
    main()
