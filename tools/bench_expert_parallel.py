#!/usr/bin/env python3
"""Expert-parallel checkpoint benchmark (issue 43): an EP save writes the state once; a reshard to another EP and
FSDP degree reads each byte once.

On 4 ranks, a mixture-of-experts model (``--blocks`` blocks of a dense Linear(dim, dim) and ``--experts`` experts of
Linear(dim, 2 dim) + Linear(2 dim, dim)) with AdamW state is saved at EP=2 x expert-sharding 2 (dense part over the 4
ranks), then loaded at EP=4 (no expert sharding) and at EP=1 (every expert on every rank, plain FSDP over 4). Per
layout: bytes written against the state's bytes (each byte once), bytes read per rank against the rank's share
(with and without checksum verification: a verified read covers whole 256 KiB checksum chunks), seconds.
Groups are created explicitly (``topology.new_group``), the API for people who build their own.

Usage::

    python -m paddle.distributed.launch --nproc_per_node 4 tools/bench_expert_parallel.py --dim 256 --json ep.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=256, help="hidden size (default 256)")
    p.add_argument("--experts", type=int, default=8, help="experts per MoE layer (default 8)")
    p.add_argument("--blocks", type=int, default=2, help="MoE blocks (default 2)")
    p.add_argument("--dir", default=None, help="directory for the checkpoints (default: a temp dir in /tmp)")
    p.add_argument("--json", default=None, help="write the results to this JSON file (rank 0)")
    return p.parse_args(argv)


def build(args, ep_group, shard_group):
    """(fsdp, optimizer) at the EP degree of ``ep_group`` (None: EP=1), after one AdamW step."""
    import paddle
    from paddle.distributed.collective import _get_global_group
    from paddle.distributed.fsdp import FullyShardFusion

    dim, n = args.dim, args.experts

    class BenchExpert(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.up = paddle.nn.Linear(dim, 2 * dim)
            self.down = paddle.nn.Linear(2 * dim, dim)

        def forward(self, x):
            return self.down(paddle.nn.functional.silu(self.up(x)))

    class Block(paddle.nn.Layer):
        def __init__(self, ep, me):
            super().__init__()
            self.dense = paddle.nn.Linear(dim, dim)
            experts = [BenchExpert() for _ in range(n)]  # every expert built: values independent of the EP degree
            per = n // ep
            self.experts = paddle.nn.LayerList([e if i // per == me else None for i, e in enumerate(experts)])

        def forward(self, x):
            h = self.dense(x)
            return h + sum(e(h) for e in self.experts if e is not None)

    ep, me = (ep_group.nranks, ep_group.rank) if ep_group is not None else (1, 0)
    paddle.seed(7)
    model = paddle.nn.Sequential(*[Block(ep, me) for _ in range(args.blocks)])
    groups = {"group": _get_global_group(), "moe_layers_name": ["BenchExpert"]}
    if ep_group is not None:
        groups.update(expert_parallel_group=ep_group, expert_shard_group=shard_group)
    fsdp = FullyShardFusion(model, ["Block"], **groups)
    opt = paddle.optimizer.AdamW(1e-3, parameters=model.parameters())
    model(paddle.rand([4, dim])).mean().backward()
    opt.step()
    opt.clear_grad()
    return fsdp, opt


def share_bytes(fsdp, opt) -> int:
    records = fsdp.sharded_state_dict()
    records.update(fsdp.optimizer_sharded_state_dict(opt))
    total = 0
    for record in records.values():
        t = getattr(record, "local_tensor", record)
        total += int(t.numel()) * t.element_size()
    return total


def main(args) -> None:
    import numpy as np
    import paddle.distributed as dist
    from paddle.distributed.collective import _get_global_group
    from paddle.distributed.fsdp.checkpoint import read_metadata
    from paddle.distributed.fsdp.comm.communication import all_gather_object
    from paddle.distributed.fsdp.comm.topology import new_group

    dist.init_parallel_env()
    world, me = dist.get_world_size(), dist.get_rank()
    if world != 4:
        raise SystemExit("bench_expert_parallel.py runs on 4 ranks (--nproc_per_node 4)")
    mine = {}
    for name, lists in (("ep2", ([0, 1], [2, 3])), ("ms2", ([0, 2], [1, 3]))):
        for ranks in lists:
            group = new_group(ranks)
            if me in ranks:
                mine[name] = group
    work = args.dir or (tempfile.mkdtemp(prefix="ep-bench-") if me == 0 else None)
    work = all_gather_object(work, _get_global_group())[0]
    src = os.path.join(work, "ep2x2")
    out: dict = {"world": world, "dim": args.dim, "experts": args.experts, "blocks": args.blocks}
    fsdp, opt = build(args, mine["ep2"], mine["ms2"])
    t0 = time.perf_counter()
    fsdp.save_checkpoint(src, optimizer=opt)
    out["save_s"] = time.perf_counter() - t0
    md = read_metadata(src)
    state = sum(int(np.prod(t.shape)) * np.dtype(t.dtype).itemsize for t in md.tensors.values())
    written = sum(p.nbytes for t in md.tensors.values() for p in t.pieces)
    out["state_bytes"], out["written_bytes"] = state, written
    for name, ep_group, shard_group in (("ep4", _get_global_group(), None), ("ep1", None, None)):
        for verify in (True, False):
            fsdp, opt = build(args, ep_group, shard_group)
            t0 = time.perf_counter()
            result = fsdp.load_checkpoint(src, optimizer=opt, verify_checksums=verify)
            seconds = time.perf_counter() - t0
            reads = all_gather_object((result.report.bytes_read, share_bytes(fsdp, opt)), _get_global_group())
            out[f"load_{name}_{'verified' if verify else 'unverified'}"] = {
                "read_by_rank": [r for r, _ in reads],
                "share_by_rank": [s for _, s in reads],
                "read_over_share_max": max(r / s for r, s in reads),
                "seconds_rank0": seconds,
            }
    if me == 0:
        text = json.dumps(out, indent=2)
        print(text)
        if args.json:
            with open(args.json, "w") as f:
                f.write(text)
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    dist.barrier()


if __name__ == "__main__":
    main(parse_args())
