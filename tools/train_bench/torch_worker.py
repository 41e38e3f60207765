"""One torch contender on this rank (run by ``run.py`` as fresh processes, torchrun-style env, gloo).

Contenders: ``torch_single`` (one process) and ``torch_fsdp2`` (``fully_shard`` per block, then the root, on a
1-D CPU mesh). torch has no CPU allocator statistics: only RSS and step times are reported.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import sys
import time

from probe import peak_rss_mib, rss_now_mib, threads_pinned, write_result

threads_pinned()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from bench_model import batch, torch_model  # noqa: E402

LOG = logging.getLogger("train_bench.torch")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contender", required=True, choices=["torch_single", "torch_fsdp2"])
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    baseline_rss = rss_now_mib()
    model = torch_model(args.dim, args.layers)
    if args.contender == "torch_fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    wrapped_rss = rss_now_mib()
    times, losses = [], []
    for step in range(args.warmup + args.steps):
        x = torch.from_numpy(batch(step, rank, args.batch, args.seq, args.dim))
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        loss = model(x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        value = float(loss)
        elapsed = time.perf_counter() - start
        losses.append(value)
        if step >= args.warmup:
            times.append(elapsed)
        LOG.info("rank %d step %d: %.2f s, loss %.9g, rss %.0f MiB", rank, step, elapsed, value, rss_now_mib())
    write_result(
        args.out,
        rank,
        {
            "contender": args.contender,
            "world": world,
            "rank": rank,
            "times": times,
            "losses": losses,
            "peak_rss_mib": peak_rss_mib(),
            "baseline_rss_mib": baseline_rss,
            "wrapped_rss_mib": wrapped_rss,
        },
    )
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
