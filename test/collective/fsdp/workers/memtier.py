"""Memory tier worker: train with MemoryTier saves, optionally kill -9 itself, or restore and finish training.

Usage: memtier.py WORKDIR TOTAL_STEPS [--crash-at N] [--keep-at N]
  Every rank restores (``tier.restore()``; a fresh start when nothing is stored), trains to TOTAL_STEPS with a
  memory save after every step (persisted to WORKDIR/durable every PERSIST_EVERY), then dumps its records to
  WORKDIR/final.rank<R>.npz and closes the tier (a clean end removes the memory copies).
  --crash-at N: after the save of step N is complete everywhere, every rank kills itself with SIGKILL.
  --keep-at N: after the save of step N, copy this rank's slot files to WORKDIR/kept/ (for the agreement test).
The memory root comes from PADDLE_FSDP_MEMTIER_ROOT (one per simulated node). Each rank reports
{"step", "sources", "persisted", "start", "files_left", "extra"}.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal

import _paths  # noqa: F401  (puts launch_util on sys.path)
import numpy as np
import paddle
import paddle.distributed as dist
from launch_util import report
from models import global_batches, make_model
from paddle.distributed.fsdp import FullyShardFusion
from paddle.distributed.fsdp.checkpoint.tier import MemoryTier
from training import records, train

BATCH, PERSIST_EVERY = 8, 4


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("workdir")
    ap.add_argument("total", type=int)
    ap.add_argument("--crash-at", type=int)
    ap.add_argument("--keep-at", type=int)
    args = ap.parse_args()
    dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model(11 + 100 * rank, dropout=0.1)  # a different init per rank: every value must be restored
    paddle.seed(5 + rank)
    fsdp = FullyShardFusion(model, fsdp_unit_layers=["Block"])
    opt = paddle.optimizer.AdamW(
        paddle.optimizer.lr.StepDecay(0.02, step_size=2, gamma=0.5), weight_decay=0.1, parameters=model.parameters()
    )
    batches = global_batches(args.total, BATCH)
    tier = MemoryTier(fsdp, opt, durable_root=os.path.join(args.workdir, "durable"), persist_every=PERSIST_EVERY)
    restored = tier.restore()
    start = restored.step if restored is not None else 0
    for step in range(start, args.total):
        train(model, opt, batches[step : step + 1], rank, world)
        tier.save(step + 1, extra_state={"data_position": (step + 1) * BATCH})
        if args.keep_at == step + 1:
            tier.wait()
            kept = os.path.join(args.workdir, "kept")
            os.makedirs(kept, exist_ok=True)
            for path in (tier.copies.own_path(), tier.copies.peer_path()):
                shutil.copy(path, os.path.join(kept, os.path.basename(path)))
        if args.crash_at == step + 1:
            tier.wait()
            from paddle.distributed.fsdp.checkpoint.save import wait_pending

            wait_pending(raise_error=True)
            dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)
    state = {k: np.array(getattr(v, "local_tensor", v).numpy()) for k, v in records(fsdp, opt).items()}
    np.savez(os.path.join(args.workdir, f"final.rank{rank}.npz"), **state)
    rng_draw = float(paddle.rand([1]).numpy()[0])  # the RNG state must be restored too
    tier.close()
    report(
        {
            "step": start,
            "sources": restored.sources if restored is not None else None,
            "persisted": bool(restored is not None and restored.persisted),
            "extra": dict(restored) if restored is not None else None,
            "files_left": sorted(os.listdir(tier.copies.dir)) if os.path.isdir(tier.copies.dir) else [],
            "rng": rng_draw,
            "lr": float(opt.get_lr()),
        }
    )


if __name__ == "__main__":
    main()
