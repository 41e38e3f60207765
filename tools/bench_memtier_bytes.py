#!/usr/bin/env python3
"""Bytes per parameter of what the memory tier writes to storage (issue 52): a persist and a flush of a bf16 +
fp32-master model, against a direct ``save_checkpoint`` of the same step, for each codec / quantize choice.

One process (world 1): a decoder-like set of bf16 parameters (~3.4M), MasterAdamW (fp32 masters that move), a few
steps, then per mode: the tier's persist of the step, a flush of the next step (the tier left as after a crash),
and a direct save. Bytes: every file of the checkpoint directory (data, index, sidecars, chunk tables) / params.

Usage::

    python tools/bench_memtier_bytes.py --json memtier-bytes.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import shutil
import sys
import tempfile

import numpy as np
import paddle

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "test", "collective", "fsdp", "workers"))
from master_adamw import MasterAdamW  # noqa: E402


class Decoder(paddle.nn.Layer):
    """bf16 parameters shaped like a small decoder (embedding, attention and MLP weights, a norm per block)."""

    def __init__(self, vocab: int, dim: int, blocks: int) -> None:
        super().__init__()
        self.embed = self.create_parameter([vocab, dim], dtype="bfloat16")
        self.mats = paddle.nn.ParameterList()
        for _ in range(blocks):
            for shape in ([dim, 3 * dim], [dim, dim], [dim, 4 * dim], [4 * dim, dim]):
                self.mats.append(self.create_parameter(shape, dtype="bfloat16"))
            self.mats.append(self.create_parameter([dim], dtype="bfloat16", is_bias=True))

    def forward(self, seed: int):
        rng = np.random.default_rng(seed)
        loss = 0.0
        for p in [self.embed, *self.mats]:
            target = paddle.to_tensor(rng.standard_normal(p.shape).astype("float32") * 0.02)
            loss = loss + (p.astype("float32") - target).square().mean()
        return loss


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def run_mode(work: str, name: str, tier_kw: dict, direct_kw: dict, args) -> dict:
    from paddle.distributed.fsdp import FullyShardFusion
    from paddle.distributed.fsdp.memtier import MemoryTier
    from paddle.distributed.fsdp.memtier.flush import flush_memory

    paddle.seed(args.seed)
    model = Decoder(args.vocab, args.dim, args.blocks)
    n = sum(int(np.prod(p.shape)) for p in model.parameters())
    fsdp = FullyShardFusion(model)
    opt = MasterAdamW(1e-3, parameters=model.parameters(), weight_decay=0.1, multi_precision=True)
    fsdp.init_optimizer_state(opt)
    base = os.path.join(work, name)
    durable, mem = os.path.join(base, "durable"), os.path.join(base, "mem")
    supported = inspect.signature(MemoryTier.__init__).parameters
    kw = {k: v for k, v in tier_kw.items() if k in supported}
    tier = MemoryTier(fsdp, opt, durable_root=durable, memory_root=mem, persist_every=args.steps, job_id="b", **kw)
    for step in range(1, args.steps + 2):
        model(step).backward()
        opt.step()
        opt.clear_grad()
        tier.save(step)
        tier.wait_persisted()
    direct = os.path.join(base, "direct")
    fsdp.save_checkpoint(direct, optimizer=opt, **direct_kw)
    tier.close(remove=False)  # the "crash": step steps+1 is in memory only
    flushed = flush_memory([mem], durable)
    persisted = os.path.join(durable, f"step_{args.steps:08d}")
    out = {"params": n, "tier_kw": {k: str(v) for k, v in kw.items()}}
    for what, path in (("persist", persisted), ("flush", flushed.path), ("direct", direct)):
        md = json.load(open(os.path.join(path, "metadata.json")))
        out[what] = {
            "bytes_per_param": round(_dir_bytes(path) / n, 3),
            "version": md["version"],
            "derived": len(md.get("derived", {})),
            "codecs": sorted(set(md.get("codecs", {}).values())),
            "quantized": len(md.get("quant", {}).get("keys", {})),
        }
    shutil.rmtree(base)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="steps before the persisted one (default 3)")
    p.add_argument("--seed", type=int, default=2024)
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    from paddle.distributed.fsdp.checkpoint import CheckpointOptions

    modes = {
        "default (auto codec: raw on a local disk)": ({}, {}),
        "byteplane-zstd": (
            {"options": CheckpointOptions(codec="byteplane-zstd")},
            {"options": CheckpointOptions(codec="byteplane-zstd")},
        ),
        "quantize_moments=int8": ({"quantize_moments": "int8"}, {"quantize_moments": "int8"}),
    }
    results = {}
    with tempfile.TemporaryDirectory(prefix="memtier-bytes-") as work:
        for name, (tier_kw, direct_kw) in modes.items():
            results[name] = run_mode(work, name.split(" ")[0].replace("=", "-"), tier_kw, direct_kw, args)
            r = results[name]
            print(f"{name}: params {r['params']}, B/param persist {r['persist']['bytes_per_param']}, "
                  f"flush {r['flush']['bytes_per_param']}, direct {r['direct']['bytes_per_param']}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
