"""2-rank saves onto recorded block devices (test_power_loss_block.py, #54): a CheckpointManager(keep_last=1) saves
steps 1 and 2 of a FullyShardFusion model and its AdamW into each root of JOBS.json (one recorded file system
each; ``async`` jobs save with ``async_save=True``).

Usage (under paddle.distributed.launch, 2 ranks): power_loss_ranks.py JOBS.json
    JOBS.json: [{"root", "log", "refs", "async"}]. After each save has returned on every rank, rank 0 notes the
    recording log's size (every block of the save is in it by then) and writes the checkpoint as loaded by one
    process (``load_full_state_dict``, after checking its parameters against the model's) to ``refs``/step<N>.pkl:
    the crash states' loads are compared with it bit for bit. Rank 0 reports {root: {"saved1": pos, "saved2": pos}}.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import threading

import _paths  # noqa: F401  (puts launch_util on sys.path)
import numpy as np
import paddle.distributed as dist
import paddle.distributed.fsdp.checkpoint as ck
from launch_util import report
from models import trained_fsdp


def _join_background_deletes() -> None:
    for th in threading.enumerate():
        if th.name in ("ckpt-rm-old", "ckpt-prune"):
            th.join()


def _save_steps(job: dict) -> dict:
    rank = dist.get_rank()
    manager = ck.CheckpointManager(job["root"], keep_last=1)
    marks = {}
    for step in (1, 2):
        fsdp, opt = trained_fsdp(seed=5, steps=step)
        state = fsdp.sharded_state_dict()
        state.update(fsdp.optimizer_sharded_state_dict(opt))
        full = {k: np.array(v.numpy()) for k, v in fsdp.full_parameters().items()}  # collective
        handle = manager.save(step, state, async_save=job["async"])
        if handle is not None:
            handle.wait()
        _join_background_deletes()
        dist.barrier()
        if rank == 0:
            marks[f"saved{step}"] = os.path.getsize(job["log"])
            loaded = {k: np.array(v.numpy()) for k, v in ck.load_full_state_dict(manager.path_for(step)).items()}
            for k, v in full.items():
                assert loaded[k].reshape(v.shape).tobytes() == v.tobytes(), f"step {step}: {k} loads otherwise"
            with open(os.path.join(job["refs"], f"step{step}.pkl"), "wb") as f:
                pickle.dump(loaded, f)
        dist.barrier()
    return marks


def main(jobs_file: str) -> None:
    dist.init_parallel_env()
    with open(jobs_file) as f:
        jobs = json.load(f)
    out = {job["root"]: _save_steps(job) for job in jobs}
    report(out)


if __name__ == "__main__":
    main(sys.argv[1])
