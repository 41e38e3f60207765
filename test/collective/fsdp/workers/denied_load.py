"""One rank that cannot read the checkpoint's storage, on 2 ranks (issue 40).

Usage (under paddle.distributed.launch, 2 ranks): ``denied_load.py WORKDIR``

Rank 0 saves a checkpoint root (FullyShardFusion, AdamW). Then, per case, rank 1's reads of the checkpoint are
denied (its storage raises PermissionError, as a bucket policy or a lost mount would) for: every read
(``all``), the index objects and data only (``objects``: metadata.json and COMMIT still read), the data files
only (``data``), or one values object (``values``); and both ranks call ``load_checkpoint(root)`` and
``load_state_dict``. Each rank reports, per case and call, the class of the error it got and its message.
"""

from __future__ import annotations

import sys
import time

import _paths  # noqa: F401  (puts launch_util on sys.path)
import paddle
import paddle.distributed as dist
import paddle.distributed.fsdp.checkpoint as ck
from launch_util import report
from models import make_model
from paddle.distributed.fsdp import FullyShardFusion
from paddle.distributed.fsdp.checkpoint.io.local import LocalStorage

DENY = {
    "all": lambda name: True,
    "objects": lambda name: name not in ("metadata.json", "COMMIT", "latest"),
    "data": lambda name: name.endswith(".safetensors"),
    "values": lambda name: name.endswith(".values"),
}


def denying(root: str, case: str):
    """Patch LocalStorage so that this rank's reads of the objects of ``case`` under ``root`` raise EACCES."""
    real_get, real_open = LocalStorage.get, LocalStorage.open_read

    def denied(location: str, name: str) -> bool:
        return str(location).startswith(root) and DENY[case](name)

    def get(self, location, name, limit=None):
        if denied(location, name):
            raise PermissionError(13, "Permission denied (injected)", name)
        return real_get(self, location, name, limit)

    def open_read(self, location, name):
        if denied(location, name):
            raise PermissionError(13, "Permission denied (injected)", name)
        return real_open(self, location, name)

    LocalStorage.get, LocalStorage.open_read = get, open_read
    return lambda: (setattr(LocalStorage, "get", real_get), setattr(LocalStorage, "open_read", real_open))


def main() -> None:
    work = sys.argv[1]
    dist.init_parallel_env()
    rank = dist.get_rank()
    model = make_model(3)
    fsdp = FullyShardFusion(model, fsdp_unit_layers=["Block"])
    opt = paddle.optimizer.AdamW(0.01, parameters=model.parameters())
    fsdp.init_optimizer_state(opt)
    root = f"{work}/run"
    fsdp.save_checkpoint(root, optimizer=opt, step=1)
    path = ck.latest_checkpoint(root)
    out: dict = {}
    for case in DENY:
        for call in ("load_checkpoint", "load_state_dict"):
            undo = denying(work, case) if rank == 1 else (lambda: None)
            t0 = time.monotonic()
            try:
                if call == "load_checkpoint":
                    fsdp.load_checkpoint(root, optimizer=opt)
                else:
                    ck.load_state_dict(fsdp.sharded_state_dict(), path)
                got = ["none", ""]
            except Exception as e:  # noqa: BLE001 - reported by class
                got = [type(e).__name__, str(e)[:300], isinstance(e, ck.CheckpointError)]
            finally:
                undo()
            out[f"{case}:{call}"] = got + [round(time.monotonic() - t0, 1)]
            dist.barrier()
    out.update(flipped_row(fsdp, opt, path, f"{work}/flipped", rank))
    out.update(fallback(fsdp, opt, root, rank))
    report(out)


def flipped_row(fsdp, opt, path: str, copy: str, rank: int) -> dict:
    """A copy of the checkpoint with one flipped bit in the ``file`` of index.pieces row 0 (a resume used to
    load another rank's bytes for it): ``load_checkpoint`` names the row on both ranks."""
    import shutil

    from paddle.distributed.fsdp.checkpoint.format.index import PIECE_ROW

    if rank == 0:
        shutil.copytree(path, copy)
        raw = bytearray(open(f"{copy}/index.pieces", "rb").read())
        raw[PIECE_ROW.fields["file"][1]] ^= 0x01
        open(f"{copy}/index.pieces", "wb").write(bytes(raw))
    dist.barrier()
    try:
        fsdp.load_checkpoint(copy, optimizer=opt)
        got = ["none", "", False]
    except Exception as e:  # noqa: BLE001 - reported by class
        got = [type(e).__name__, str(e)[:300], isinstance(e, ck.CheckpointError)]
    dist.barrier()
    return {"flipped_row": got}


def fallback(fsdp, opt, root: str, rank: int) -> dict:
    """Step 2 saved with a damaged data byte in every file (found while reading: PartiallyLoadedError), so
    ``load_checkpoint(root)`` falls back to step 1 (``fallback:sound``), or, with rank 1 unable to list the root
    at that moment (``fallback:denied``), every rank raises the same named error (never one rank alone)."""
    from paddle.distributed.fsdp.state import resume

    fsdp.save_checkpoint(root, optimizer=opt, step=2)
    dist.barrier()
    step2 = ck.latest_checkpoint(root)
    if rank == 0:
        md = ck.read_metadata(step2)
        for name in md.files:
            p = f"{step2}/{name}"
            data = bytearray(open(p, "rb").read())
            data[-1] ^= 0x01  # (the last byte of the data region: a piece's data, after the header)
            open(p, "wb").write(bytes(data))
    dist.barrier()
    out = {}
    for case in ("sound", "denied"):
        real = resume.survey  # what the fallback lists the root with

        def denied(*_a, **_k):
            raise PermissionError(13, "Permission denied (injected)", root)

        if case == "denied" and rank == 1:
            resume.survey = denied
        t0 = time.monotonic()
        try:
            res = fsdp.load_checkpoint(root, optimizer=opt)
            got = ["none", f"step {res.step}", False]
        except Exception as e:  # noqa: BLE001 - reported by class
            got = [type(e).__name__, str(e)[:600], isinstance(e, ck.CheckpointError)]
        finally:
            resume.survey = real
        out[f"fallback:{case}"] = got + [round(time.monotonic() - t0, 1)]
        dist.barrier()
    return out


if __name__ == "__main__":
    main()
