"""Memory tier worker (one rank of a simulated node; the memory root is PADDLE_FSDP_MEMTIER_ROOT).

Usage:
  memtier.py run WORKDIR TOTAL [--crash-at N] [--keep-at N]
      restore (a fresh start when nothing is stored), train to TOTAL with a MemoryTier save after every step
      (persisted to WORKDIR/durable every PERSIST_EVERY), dump the final records to WORKDIR/final.rank<R>.npz and
      close the tier (a clean end removes the copies). --crash-at N: once the save of step N is complete on every
      rank, every rank kills itself with SIGKILL. --keep-at N: after the save of step N copy this rank's slot
      files to WORKDIR/kept/ (older copies for the agreement scenario).
  memtier.py restore WORKDIR TOTAL SCENARIO[,SCENARIO...]
      per scenario, in this process: put back the crashed run's memory roots and storage from WORKDIR/bak
      (saved by the test), damage them as the scenario says, build the model from ANOTHER seed, restore, train to
      TOTAL and compare every record, the RNG and the LR with the uninterrupted run's (WORKDIR/ref).
      Scenarios: memory (all copies intact), node1 (node 1's root wiped), both (every root wiped),
      agree (rank 1 has only older copies), corrupt (rank 1's own copy has a flipped data byte).
Each rank reports its results as JSON.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import traceback

import _paths  # noqa: F401  (puts launch_util on sys.path)
import numpy as np
import paddle
import paddle.distributed as dist
from launch_util import report
from models import global_batches, make_model
from paddle.distributed.fsdp import FullyShardFusion
from paddle.distributed.fsdp.checkpoint.save import wait_pending
from paddle.distributed.fsdp.checkpoint.tier import MemoryTier
from paddle.distributed.fsdp.checkpoint.tier.slot import Slot
from training import records, train

BATCH, PERSIST_EVERY = 8, 4


def build(workdir: str, seed: int, rank: int, restore_now: bool = False):
    model = make_model(seed + 100 * rank, dropout=0.1)
    paddle.seed(seed + rank)
    fsdp = FullyShardFusion(model, fsdp_unit_layers=["Block"])
    opt = paddle.optimizer.AdamW(
        paddle.optimizer.lr.StepDecay(0.02, step_size=2, gamma=0.5), weight_decay=0.1, parameters=model.parameters()
    )
    durable = os.path.join(workdir, "durable")
    if restore_now:  # the README's form: built and restored in one call
        tier = fsdp.memory_tier(opt, durable_root=durable, persist_every=PERSIST_EVERY)
    else:
        tier = MemoryTier(fsdp, opt, durable_root=durable, persist_every=PERSIST_EVERY)
    return model, fsdp, opt, tier


def train_to_end(model, fsdp, opt, tier, start, total, rank, world, crash_at=None, keep_at=None, workdir=""):
    batches = global_batches(total, BATCH)
    for step in range(start, total):
        train(model, opt, batches[step : step + 1], rank, world)
        tier.save(step + 1, extra_state={"data_position": (step + 1) * BATCH})
        if keep_at == step + 1:
            tier.wait()
            kept = os.path.join(workdir, "kept")
            os.makedirs(kept, exist_ok=True)
            for path in (tier.copies.own_path(), tier.copies.peer_path()):
                shutil.copy(path, os.path.join(kept, os.path.basename(path)))
        if crash_at == step + 1:
            tier.wait()
            wait_pending(raise_error=True)
            dist.barrier()
            os.kill(os.getpid(), signal.SIGKILL)
    final = {k: np.array(getattr(v, "local_tensor", v).numpy()) for k, v in records(fsdp, opt).items()}
    rng_draw = float(paddle.rand([1]).numpy()[0])  # the RNG state must have been restored too
    return final, rng_draw, float(opt.get_lr())


def run(args, rank, world) -> dict:
    model, fsdp, opt, tier = build(args.workdir, 11, rank, restore_now=True)
    start = tier.start_step
    final, rng_draw, lr = train_to_end(
        model, fsdp, opt, tier, start, args.total, rank, world, args.crash_at, args.keep_at, args.workdir
    )
    np.savez(os.path.join(args.workdir, f"final.rank{rank}.npz"), **final)
    tier.close()
    left = sorted(os.listdir(tier.copies.dir)) if os.path.isdir(tier.copies.dir) else []
    disabled = type(tier.disabled_reason).__name__ if tier.disabled_reason is not None else None
    return {"rng": rng_draw, "lr": lr, "files_left": left, "disabled": disabled, "durable": tier.durable_saves}


def _prepare(workdir: str, scenario: str, rank: int, node: int, local_rank: int, job_dir: str) -> None:
    """Put the crashed run's state back (storage by rank 0, each node's root by its local rank 0), then damage."""
    bak = os.path.join(workdir, "bak")
    root = os.environ["PADDLE_FSDP_MEMTIER_ROOT"]
    if rank == 0:
        shutil.rmtree(os.path.join(workdir, "durable"), ignore_errors=True)
        shutil.copytree(os.path.join(bak, "durable"), os.path.join(workdir, "durable"))
    if local_rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        wiped = scenario == "both" or (scenario == "node1" and node == 1)
        if not wiped:
            shutil.copytree(os.path.join(bak, f"node{node}"), root)
    dist.barrier()
    own = os.path.join(job_dir, f"rank{rank:05d}.own")
    if scenario == "agree":  # rank 1 has only step-5 copies: its own, and the one rank 0 holds for it
        kept = os.path.join(workdir, "kept")
        names = {0: ["rank00000.peer"], 1: ["rank00001.own", "rank00001.peer"]}.get(rank, [])
        for name in names:
            shutil.copy(os.path.join(kept, name), os.path.join(job_dir, name))
    if scenario == "corrupt" and rank == 1:  # one flipped bit in the middle of its largest record
        slot = Slot.open(own)
        header, data_off, _len = slot.header()
        slot.close()
        _key, _dtype, _shape, off, nbytes, _sums = max(header["records"], key=lambda rec: rec[4])
        with open(own, "r+b") as f:
            f.seek(data_off + off + nbytes // 2)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x01]))
    dist.barrier()


def restore(args, rank, world) -> dict:
    per_node = int(os.environ.get("PADDLE_LOCAL_SIZE", world))
    node, local_rank = rank // per_node, rank % per_node
    out = {}
    for scenario in args.scenarios.split(","):
        try:
            model, fsdp, opt, tier = build(args.workdir, 77, rank)  # another seed: every value must come back
            _prepare(args.workdir, scenario, rank, node, local_rank, tier.copies.dir)
            restored = tier.restore()
            final, rng_draw, lr = train_to_end(model, fsdp, opt, tier, restored.step, args.total, rank, world)
            tier.close()
            ref = np.load(os.path.join(args.workdir, "ref", f"final.rank{rank}.npz"))
            assert sorted(ref.files) == sorted(final), sorted(set(ref.files) ^ set(final))
            differ = [k for k in ref.files if not np.array_equal(ref[k], final[k])]
            left = sorted(os.listdir(tier.copies.dir)) if os.path.isdir(tier.copies.dir) else []
            out[scenario] = {
                "step": restored.step,
                "sources": restored.sources,
                "persisted": restored.persisted,
                "extra": dict(restored),
                "differ": differ,
                "rng": rng_draw,
                "lr": lr,
                "files_left": left,
            }
        except Exception:
            out[scenario] = {"error": traceback.format_exc()}
        dist.barrier()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["run", "restore"])
    ap.add_argument("workdir")
    ap.add_argument("total", type=int)
    ap.add_argument("scenarios", nargs="?", default="")
    ap.add_argument("--crash-at", type=int)
    ap.add_argument("--keep-at", type=int)
    args = ap.parse_args()
    dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    report((run if args.mode == "run" else restore)(args, rank, world))


if __name__ == "__main__":
    main()
