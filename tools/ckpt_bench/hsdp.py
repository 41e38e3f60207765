"""The HSDP phase: bytes written and read per rank by hybrid sharding against plain FSDP on the same ranks.

Why: under HSDP (R replicas x world/R shards) every shard exists R times; a save must still write each byte once
(the replicas split the writing) and a load must read each byte once per replica group (each replica reads its
part, then broadcasts it). The phase builds a small model (``--hsdp-dim``: 4 blocks of Linear(dim, dim)) with
AdamW state twice, as plain FSDP over every rank and as HSDP with ``--hsdp-replicas`` replicas, saves and loads
each once, and reports per rank the bytes written (from the checkpoint's metadata), the bytes read (the load's
``LoadReport.bytes_read``: whole checksum chunks, so a rank may read more than its share) and the seconds.
"""

from __future__ import annotations

import os
import shutil

BLOCKS = 4


def _build(dim: int, groups: dict | None):
    import paddle
    from paddle.distributed.fsdp import FullyShardFusion

    class Block(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.fc = paddle.nn.Linear(dim, dim)

        def forward(self, x):
            return self.fc(x)

    paddle.seed(7)
    model = paddle.nn.Sequential(*[Block() for _ in range(BLOCKS)])
    fsdp = FullyShardFusion(model, ["Block"], **(groups or {}))
    opt = paddle.optimizer.AdamW(1e-3, parameters=model.parameters())
    model(paddle.rand([4, dim])).mean().backward()  # one step: AdamW's moments exist
    opt.step()
    opt.clear_grad()
    return fsdp, opt


def _written_by_rank(path: str, world: int) -> list[int]:
    from paddle.distributed.fsdp.checkpoint import read_metadata

    md = read_metadata(path)
    out = [0] * world
    for tm in md.tensors.values():
        for piece in tm.pieces:
            out[md.files[piece.file].rank] += piece.nbytes
    return out


def run_hsdp(comm, replicas: int, dim: int, work: str) -> dict:
    """Save and load once as plain FSDP and as HSDP: {"replicas", "world", kind: {"written", "read", "save_s",
    "load_s"}} with per-rank byte lists (collective; the world must be a multiple of ``replicas``)."""
    import paddle.distributed as dist
    from paddle.distributed.collective import _get_global_group
    from paddle.distributed.fsdp.comm.topology import hybrid_groups

    replicate, shard = hybrid_groups(replicas)
    out: dict = {"replicas": replicas, "world": comm.world, "dim": dim}
    for kind, groups in (
        ("plain", {"group": _get_global_group()}),
        ("hsdp", {"shard_group": shard, "replicate_group": replicate}),
    ):
        fsdp, opt = _build(dim, groups)
        path = os.path.join(work, f"hsdp_phase_{kind}")
        _, save_s, _ = comm.timed(fsdp.save_checkpoint, path, optimizer=opt)
        result, load_s, _ = comm.timed(fsdp.load_checkpoint, path, optimizer=opt)
        out[kind] = {
            "written": _written_by_rank(path, comm.world),
            "read": comm.gather(result.report.bytes_read),
            "save_s": save_s,
            "load_s": load_s,
        }
        comm.barrier()
        if comm.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
    return out


def summary(res: dict) -> list[str]:
    """Report lines: per-rank KiB written and read, totals, seconds, for plain FSDP and HSDP."""
    R, W = res["replicas"], res["world"]
    lines = [
        f"HSDP ({R} replicas x {W // R} shards) against plain FSDP over the same {W} ranks, "
        f"{BLOCKS} x Linear({res['dim']}, {res['dim']}) + AdamW; per rank KiB (total):"
    ]
    for kind, label in (("plain", f"plain FSDP 1x{W}"), ("hsdp", f"HSDP {R}x{W // R}")):
        r = res[kind]

        def kib(xs):
            return f"{[round(x / 1024) for x in xs]} ({sum(xs) / 1024:.0f})"

        lines.append(
            f"- {label}: written {kib(r['written'])}, read {kib(r['read'])}, save {r['save_s']:.2f} s, "
            f"load {r['load_s']:.2f} s"
        )
    return lines
