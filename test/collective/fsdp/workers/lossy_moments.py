"""Lossy moments saved at 2 ranks (test_lossy_moments.py): ``lossy_moments.py WORKDIR``.

TinyLM (fused buffers cut between the ranks inside parameters), AdamW, 3 steps; saves WORKDIR/exact, WORKDIR/int8
and WORKDIR/int4; then each rank loads int8 and int4 into a fresh model and writes the moments it got, with the
global flat offset of its piece, to WORKDIR/<mode>_rank<r>.npz for the test to compare with one-process reads.
Each rank reports {"save_and_reload": "ok" | traceback}.
"""

from __future__ import annotations

import sys
import warnings

import _paths  # noqa: F401  (puts launch_util on sys.path)
import numpy as np
import paddle
import paddle.distributed as dist
from launch_util import report, run_cases
from models import global_batches, local_part, make_model
from paddle.distributed.fsdp import FullyShardFusion


def build(seed: int):
    model = make_model(seed)
    fsdp = FullyShardFusion(model)
    return model, fsdp, paddle.optimizer.AdamW(1e-2, parameters=model.parameters())


def save_and_reload(workdir: str, rank: int, world: int) -> None:
    model, fsdp, opt = build(1)
    for x, y in global_batches(3, 4):
        model(paddle.to_tensor(local_part(x, rank, world)), paddle.to_tensor(local_part(y, rank, world))).backward()
        opt.step()
        opt.clear_grad()
    fsdp.save_checkpoint(f"{workdir}/exact", optimizer=opt)
    for mode in ("int8", "int4"):
        fsdp.save_checkpoint(f"{workdir}/{mode}", optimizer=opt, quantize_moments=mode)
    for mode in ("int8", "int4"):
        _, fresh, fresh_opt = build(2)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fresh.load_checkpoint(f"{workdir}/{mode}", optimizer=fresh_opt)
        assert any("not bit-exact" in str(w.message) for w in caught), [str(w.message) for w in caught]
        out = {}
        for key, sw in fresh.optimizer_sharded_state_dict(fresh_opt).items():
            if key.endswith((".moment1", ".moment2")) and sw.flattened_range is not None:
                out[key] = np.asarray(sw.local_tensor.numpy()).reshape(-1)
                out[key + ":lo"] = np.asarray(sw.flattened_range.start)
        np.savez(f"{workdir}/{mode}_rank{rank}.npz", **out)


if __name__ == "__main__":
    dist.init_parallel_env()
    workdir = sys.argv[1]
    report(run_cases({"save_and_reload": save_and_reload}, workdir, dist.get_rank(), dist.get_world_size()))
