"""Saves without a shared file system, and a rank killed mid-save, on 2 ranks (test_node_local_saves.py).

Usage (under paddle.distributed.launch, 2 ranks):
    node_local.py perrank WORK
        every rank saves an FSDP state (params + AdamW state) to WORK/node<rank>/ckpt, a directory only it uses
        (node-local disks). The save commits; each rank's own directory alone is refused with a named error on
        every rank (no metadata where it lacks); the files gathered into one directory load bit-exactly at world
        size 2 (collective) and 1 (load_full_state_dict, one process), against the values at save time.
    node_local.py kill ROOT
        a CheckpointManager save of step 1, then step 2 with PADDLE_FSDP_CKPT_FAULT=mid_data:1:2 (rank 1 is
        killed with SIGKILL half way through writing its file). Rank 0 reports how its save ended and the
        seconds from rank 1's start of that save to rank 0's error (an upper bound of the detection time); it
        ignores the launcher's SIGTERM so that the engine, not the launcher, ends its wait.
Each rank reports {case: "ok" | text}.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
import traceback

import _paths  # noqa: F401  (puts launch_util on sys.path)
import fault_storage
import numpy as np
import paddle.distributed as dist
import paddle.distributed.fsdp.checkpoint as ck
from launch_util import report
from models import trained_fsdp
from state_compare import assert_bit_equal, host_values


def state_of(fsdp, opt) -> dict:
    state = fsdp.sharded_state_dict()
    state.update(fsdp.optimizer_sharded_state_dict(opt))
    return state


def perrank(work: str) -> None:
    rank = dist.get_rank()
    fsdp, opt = trained_fsdp(seed=3, steps=2)
    saved = host_values(state_of(fsdp, opt))
    full = {k: np.array(v.numpy()) for k, v in fsdp.full_parameters().items()}
    mine = os.path.join(work, f"node{rank}", "ckpt")
    ck.save_state_dict(state_of(fsdp, opt), mine)
    names = sorted(os.listdir(mine))
    if rank == 0:
        assert {"COMMIT", "metadata.json", "0_0.safetensors"} <= set(names), names
        assert "1_0.safetensors" not in names and "1_0.safetensors.sums" not in names, names
    else:  # this rank's file and its checksums (format 2: written by this rank), published at its own path
        assert names == ["1_0.safetensors", "1_0.safetensors.sums"], names
    assert not [n for n in os.listdir(os.path.dirname(mine)) if ".tmp-" in n], "staging left behind"
    # each rank's own directory alone: the metadata is only on rank 0's, so the load is refused everywhere
    other, _ = trained_fsdp(seed=9, steps=1)
    try:
        ck.load_state_dict(other.sharded_state_dict(), mine)
    except ck.CheckpointError as e:
        assert "rank 1" in str(e) or rank == 1, e
        assert isinstance(e, (ck.NotACheckpointError, ck.IncompleteCheckpointError)), type(e)
    else:
        raise AssertionError("a load from rank 1's directory alone was not refused")
    dist.barrier()
    gathered = os.path.join(work, "gathered")
    if rank == 0:  # the files made visible again (copied onto one file system)
        shutil.copytree(os.path.join(work, "node0", "ckpt"), gathered)
        for name in ("1_0.safetensors", "1_0.safetensors.sums"):
            shutil.copy2(os.path.join(work, "node1", "ckpt", name), gathered)
    dist.barrier()
    fsdp2, opt2 = trained_fsdp(seed=11, steps=1)
    target = state_of(fsdp2, opt2)
    ck.load_state_dict(target, gathered)
    assert_bit_equal(host_values(target), saved, "world size 2")
    if rank == 0:  # world size 1: one process reads the whole checkpoint
        got = ck.load_full_state_dict(gathered, list(full))
        assert_bit_equal({k: np.array(v.numpy()).reshape(full[k].shape) for k, v in got.items()}, full, "world size 1")
    assert ck.verify_checkpoint(gathered) == []
    dist.barrier()


def kill(root: str) -> None:
    rank = dist.get_rank()
    fsdp, opt = trained_fsdp(seed=5, steps=1)
    manager = ck.CheckpointManager(root, keep_last=2)
    manager.save(1, state_of(fsdp, opt))
    full = {k: np.array(v.numpy()) for k, v in fsdp.full_parameters().items()}  # collective: before the kill
    stamp = os.path.join(root, "..", "rank1_started")
    dist.barrier()
    if rank == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the engine must end the wait, not the launcher
    else:
        with open(stamp, "w") as f:
            f.write(repr(time.time()))
    out = {}
    try:
        manager.save(2, state_of(fsdp, opt))  # rank 1 dies half way through writing its file
        out["save2"] = "ok"
    except ck.SaveFailedError as e:
        t_err = time.time()
        out["save2"] = f"SaveFailedError: {e}"
        with open(stamp) as f:
            out["detect_seconds"] = t_err - float(f.read())
    # nothing committed, the previous checkpoint still loads (in this process alone: its peer is dead)
    out["latest"] = os.path.basename(manager.latest() or "")
    out["step2_exists"] = os.path.exists(manager.path_for(2))
    got = ck.load_full_state_dict(manager.path_for(1), list(full))
    assert_bit_equal(
        {k: np.array(v.numpy()).reshape(full[k].shape) for k, v in got.items()}, full, "step 1 after the kill"
    )
    out["step1_verify"] = ck.verify_checkpoint(manager.path_for(1))
    report(out)
    sys.stdout.flush()
    os._exit(0)  # the peer is dead: no collective clean-up


if __name__ == "__main__":
    fault_storage.install()  # the kill a test arms (PADDLE_FSDP_CKPT_FAULT)
    case, work = sys.argv[1], sys.argv[2]
    dist.init_parallel_env()
    try:
        {"perrank": perrank, "kill": kill}[case](work)
        report({case: "ok"})
    except BaseException:  # noqa: BLE001 - the test shows the traceback
        report({case: traceback.format_exc()})
        sys.stdout.flush()
        os._exit(1)
