"""Saves on 2 ranks while one process is frozen with SIGSTOP at a chosen stage (test_frozen_save.py).

Usage (under paddle.distributed.launch, 2 ranks):
    frozen_save.py SPEC.json
        SPEC: {"root", "coordinator", "cells": [{"stage", "frozen"}, ...]}. Rank ``coordinator`` commits. A
        CheckpointManager save of step 1 (keep_last=1), then one save per cell (step 2, 3, ...), each armed with
        PADDLE_FSDP_CKPT_FAULT=<stage>:<by>:1:FREEZE[<frozen>] (fault_storage.py): the process of rank
        ``frozen`` is stopped with SIGSTOP when rank ``by`` reaches ``stage`` (``by`` is the frozen rank itself
        at the stages every rank passes, else the coordinator, the only rank that passes them). The live rank
        records how its save ended and how long it took, then resumes the frozen process with SIGCONT (a pause
        that ends, as a frozen container's), which finishes its own save however it can; both go on with the next
        cell. At the end every rank checks that every committed step (and the one ``latest`` names) verifies
        complete: a resumed coordinator never commits without a rank's data.
Each rank reports {"store_host": bool, "cells": [{"stage", "frozen", "outcome", "seconds"}], "final": ...}.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import os
import signal
import sys
import time
import traceback

import _paths  # noqa: F401  (puts launch_util on sys.path)
import fault_storage
import paddle.distributed as dist
import paddle.distributed.fsdp.checkpoint as ck
from launch_util import report
from models import trained_fsdp
from paddle.distributed.fsdp.checkpoint.save.channel import store_endpoint

logger = logging.getLogger("frozen_save")
EVERY_RANK = ("before_data", "mid_data", "after_data")  # the stages every rank passes (the others: coordinator)
HANG_DUMP = 25.0  # seconds after which a cell's stacks go to the log (gloo's barrier gives up at about 30)
FROZEN_WAIT = 30.0  # seconds the live rank waits for the freeze to be recorded (it may come after its save)


def serves_store() -> bool:
    """True when this process holds the listening socket of the job's TCP store (the save channel's endpoint)."""
    port = store_endpoint()[1]
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if int(f[1].rsplit(":", 1)[1], 16) == port and f[3] == "0A":  # LISTEN
                inodes.add(f[9])
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}") in {f"socket:[{i}]" for i in inodes}:
                return True
        except OSError:
            pass
    return False


def resume_frozen(rank: int) -> int | None:
    """The live rank: SIGCONT the process the cell froze (waiting for the freeze to be recorded)."""
    end = time.monotonic() + FROZEN_WAIT
    while (pid := fault_storage.frozen_pid()) is None and time.monotonic() < end:
        time.sleep(0.05)
    if pid is None or pid == os.getpid():
        return pid
    os.kill(pid, signal.SIGCONT)
    fault_storage.clear_frozen()
    logger.warning("rank %d: resumed pid %d", rank, pid)
    return pid


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    dist.init_parallel_env()
    rank = dist.get_rank()
    spec = json.load(open(sys.argv[1]))
    coordinator = spec["coordinator"]
    fault_storage.note_pid(rank)
    out: dict = {"store_host": serves_store(), "cells": []}
    fsdp, opt = trained_fsdp(seed=3, steps=1)
    state = fsdp.sharded_state_dict()
    state.update(fsdp.optimizer_sharded_state_dict(opt))
    mgr = ck.CheckpointManager(spec["root"], keep_last=1, coordinator_rank=coordinator)
    mgr.save(1, state)
    for i, cell in enumerate(spec["cells"]):
        stage, frozen = cell["stage"], cell["frozen"]
        by = frozen if stage in EVERY_RANK or frozen == coordinator else coordinator
        os.environ[fault_storage.ENV] = f"{stage}:{by}:1:FREEZE{'' if by == frozen else frozen}"
        fault_storage.reset()
        t0 = time.monotonic()
        faulthandler.dump_traceback_later(HANG_DUMP)  # a save or its resume that hangs shows where, in the log
        try:
            mgr.save(i + 2, state)
            outcome = "ok"
        except ck.SaveFailedError as e:
            outcome = f"SaveFailedError: {e}"
        except Exception:  # noqa: BLE001 - reported: the test says which cell and how
            outcome = traceback.format_exc()
        seconds = time.monotonic() - t0
        os.environ.pop(fault_storage.ENV)
        resumed = resume_frozen(rank) if rank != frozen else None
        logger.warning("rank %d: cell %s/rank %d: %s (%.1f s)", rank, stage, frozen, outcome[:300], seconds)
        dist.barrier()  # the resumed rank's save is over too: what it left must be sound
        faulthandler.cancel_dump_traceback_later()
        committed = i + 2 in ck.CheckpointManager(spec["root"]).steps()
        problems = ck.verify_checkpoint(mgr.path_for(i + 2)) if committed else None
        out["cells"].append(
            {
                "stage": stage,
                "frozen": frozen,
                "outcome": outcome,
                "seconds": seconds,
                "resumed": resumed,
                "committed": committed,
                "problems": problems,
            }
        )
        report(out)
    try:
        problems = {}
        for step in mgr.steps():
            found = ck.verify_checkpoint(mgr.path_for(step))
            if found:
                problems[step] = found
        out["final"] = {"steps": mgr.steps(), "latest": mgr.latest_step(), "problems": problems}
    except Exception:  # noqa: BLE001
        out["final"] = traceback.format_exc()
    report(out)


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1)  # a hang's stacks into the worker log: kill -USR1 <pid>
    fault_storage.install()
    main()
