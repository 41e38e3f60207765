"""Memory-tier trust worker: one rank of a simulated node (memory root: PADDLE_FSDP_MEMTIER_ROOT).

Usage: memtier_trust.py WORKDIR
  1. strangers: rank 1 starts real stranger processes (workers/memtier_stranger.py: silent, trickling, garbage,
     forged) on its own peer-link port; both ranks save steps 1-3 (peer_timeout_s 5): every save's exchange
     must succeed. Then a node loss: rank 0's own copy is removed, both restart: rank 0 restores step 3 from
     the peer copy rank 1 holds, bit for bit.
  2. unsafe root: rank 1's job directory is a symlink: both ranks raise MemoryRootError ("rank 1 failed").
  3. unreadable: the memory roots are wiped, and rank 1's storage cannot list the durable root (PermissionError
     from the storage's listing): both ranks must raise the same named error.
Each rank reports {scenario: result} as JSON.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import traceback

import _paths  # noqa: F401  (puts launch_util and memtier_util on sys.path)
import paddle
import paddle.distributed as dist
from launch_util import report
from memtier_util import small_fsdp, state_bytes, train_and_save
from paddle.distributed.fsdp.checkpoint.io.local import LocalStorage
from paddle.distributed.fsdp.memtier import MemoryTier

STRANGER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "memtier_stranger.py")


def _tier(fsdp, opt, root: str) -> MemoryTier:
    return MemoryTier(fsdp, opt, durable_root=root, persist_every=4, job_id="trust", peer_timeout_s=5.0)


def strangers(workdir: str, rank: int) -> dict:
    root = os.path.join(workdir, "durable")
    model, fsdp, opt = small_fsdp(1 + rank)
    paddle.seed(7 + rank)
    tier = _tier(fsdp, opt, root)
    tier.restore()
    procs = []
    if rank == 1:
        host, port = tier.peer_link().address
        for mode in ("idle", "trickle", "garbage", "forged"):
            p = subprocess.Popen([sys.executable, STRANGER, mode, host, str(port), __file__], stdout=subprocess.PIPE,
                                 text=True)  # fmt: skip
            assert p.stdout.readline().strip() == "CONNECTED"
            procs.append(p)
    try:
        wants = train_and_save(model, fsdp, opt, tier, (1, 2, 3))
        tier.wait()
    finally:
        for p in procs:
            p.kill()
            p.wait()
    tier.close(remove=False)
    dist.barrier()
    if rank == 0:
        os.unlink(tier.copies.own_path())  # node 0 lost its memory
    dist.barrier()
    _m, fsdp2, opt2 = small_fsdp(50 + rank)
    tier2 = _tier(fsdp2, opt2, root)
    got = tier2.restore()
    mine = state_bytes(fsdp2, opt2)
    want = wants[3][0]
    tier2.close()
    return {"step": got.step, "sources": got.sources, "differ": [k for k in want if mine[k] != want[k]]}


def unsafe_root(workdir: str, rank: int) -> dict:
    mem = os.environ["PADDLE_FSDP_MEMTIER_ROOT"]
    if rank == 1:
        os.makedirs(os.path.join(workdir, "elsewhere"), exist_ok=True)
        os.makedirs(mem, exist_ok=True)
        os.symlink(os.path.join(workdir, "elsewhere"), os.path.join(mem, "trust"))
    dist.barrier()
    _m, fsdp, opt = small_fsdp(1 + rank)
    tier = _tier(fsdp, opt, os.path.join(workdir, "durable-s"))
    try:
        tier.restore()
        return {"restored": True}
    except Exception as e:  # noqa: BLE001 - reported
        return {"error": type(e).__name__, "message": str(e)}
    finally:
        tier.close()
        if rank == 1:
            os.unlink(os.path.join(mem, "trust"))


def unreadable(workdir: str, rank: int) -> dict:
    root = os.path.join(workdir, "durable-u")
    model, fsdp, opt = small_fsdp(1 + rank)
    tier = _tier(fsdp, opt, root)
    tier.restore()
    train_and_save(model, fsdp, opt, tier, (1, 2, 3, 4))
    tier.close()  # removes the copies: /dev/shm wiped
    dist.barrier()
    if rank == 1:
        real = LocalStorage.children

        def denied(self, parent):
            if os.path.abspath(parent) == root:
                raise PermissionError(13, "Permission denied", parent)
            return real(self, parent)

        LocalStorage.children = denied
    _m, fsdp2, opt2 = small_fsdp(50 + rank)
    tier2 = _tier(fsdp2, opt2, root)
    try:
        got = tier2.restore()
        return {"restored": None if got is None else got.step}
    except Exception as e:  # noqa: BLE001 - reported
        return {"error": type(e).__name__, "message": str(e)}
    finally:
        tier2.close()


def main() -> None:
    workdir = sys.argv[1]
    dist.init_parallel_env()
    rank = dist.get_rank()
    out = {}
    for name, fn in (("strangers", strangers), ("unsafe_root", unsafe_root), ("unreadable", unreadable)):
        try:
            out[name] = fn(workdir, rank)
        except Exception:  # noqa: BLE001 - reported
            out[name] = {"crash": traceback.format_exc()}
        dist.barrier()
    shutil.rmtree(os.environ["PADDLE_FSDP_MEMTIER_ROOT"], ignore_errors=True)
    report(out, rank)


if __name__ == "__main__":
    main()
