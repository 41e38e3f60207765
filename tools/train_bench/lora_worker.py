"""The LoRA case of train_bench (issue #51), one contender on this rank: a frozen attention base with adapters.

Model: ``L`` pre-norm blocks, causal multi-head self-attention (``q``/``k``/``v``/``o`` projections) and a 4d MLP,
fp32, loss ``mean(out ** 2)``; every attention projection carries a LoRA adapter (``A [in, r]``, ``B [r, out]``,
scale ``alpha / r``, B zero at the start); everything else is frozen (``stop_gradient``). The optimizer gets
``model.parameters()``, as PaddleFormers' Trainer gives it. Contenders: ``fsdp`` (FullyShardFusion, one unit per
block, the base built under ``paddle.LazyGuard`` (docs/training.md: a model larger than a rank);
``fsdp.save_checkpoint``), ``dp`` (paddle.DataParallel; rank 0 ``paddle.save``s model and optimizer state dicts,
as the stock Trainer does), ``stage1`` (fleet sharding stage 1; rank 0 saves the model, every rank its optimizer
shard). After the timed steps each saves one checkpoint. Writes ``<out>.rank<r>.json``: step times, losses, peak
RSS of the process and of the training steps, the trainable and optimizer bytes, and the checkpoint's bytes.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import time

from probe import peak_rss_mib, rss_now_mib, threads_pinned, write_result

threads_pinned()

import paddle  # noqa: E402
import paddle.distributed as dist  # noqa: E402
from bench_model import batch  # noqa: E402
from paddle import nn  # noqa: E402
from paddle_worker import fleet_stage1, optimizer_state_bytes  # noqa: E402

LOG = logging.getLogger("train_bench.lora")
PROJECTIONS = ("q", "k", "v", "o")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contender", required=True, choices=["dp", "stage1", "fsdp"])
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--rank-r", type=int, default=8, help="LoRA rank r (default 8; alpha = 2r)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--ckpt", required=True, help="checkpoint directory this contender writes (new)")
    p.add_argument("--out", required=True, help="result path prefix (<out>.rank<r>.json)")
    return p.parse_args(argv)


class LoRALinear(nn.Layer):
    """A frozen ``Linear`` plus ``scale * x @ A @ B``."""

    def __init__(self, d_in: int, d_out: int, r: int) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.lora_A = self.create_parameter([d_in, r], default_initializer=nn.initializer.KaimingUniform())
        self.lora_B = self.create_parameter([r, d_out], default_initializer=nn.initializer.Constant(0.0))
        self.scale = 2.0  # alpha = 2r

    def forward(self, x):
        return self.base(x) + (x @ self.lora_A @ self.lora_B) * self.scale


class Block(nn.Layer):
    def __init__(self, d: int, heads: int, r: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        for name in PROJECTIONS:
            setattr(self, name, LoRALinear(d, d, r))
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, s, d = x.shape
        h = self.norm1(x)
        q, k, v = (
            getattr(self, n)(h).reshape([b, s, self.heads, d // self.heads]).transpose([0, 2, 1, 3]) for n in "qkv"
        )
        scores = (q @ k.transpose([0, 1, 3, 2])) / math.sqrt(d // self.heads)
        mask = paddle.triu(paddle.full([s, s], float("-inf")), diagonal=1)
        att = nn.functional.softmax(scores + mask, axis=-1) @ v
        x = x + self.o(att.transpose([0, 2, 1, 3]).reshape([b, s, d]))
        return x + self.down(nn.functional.gelu(self.up(self.norm2(x))))


class Stack(nn.Layer):
    def __init__(self, d: int, layers: int, heads: int, r: int) -> None:
        super().__init__()
        self.blocks = nn.LayerList([Block(d, heads, r) for _ in range(layers)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return (x * x).mean()


def build(args):
    """The model, its adapters trainable and the rest frozen (seeded: every contender starts from the same values)."""
    paddle.seed(0)
    model = Stack(args.dim, args.layers, args.heads, args.rank_r)
    for name, param in model.named_parameters():
        param.stop_gradient = ".lora_" not in f".{name}"
    return model


def parameter_count(args) -> int:
    """Every parameter of the model (base and adapters), counted from its shape, whatever a rank holds."""
    d, r = args.dim, args.rank_r
    per_block = 4 * d + 4 * (d * d + d + 2 * d * r) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    return args.layers * per_block


def directory_bytes(path: str) -> tuple[int, int]:
    """(every file's bytes, tensor data files' bytes) under ``path``."""
    total = data = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            size = os.path.getsize(os.path.join(root, name))
            total += size
            data += size if name.endswith((".safetensors", ".pdparams", ".pdopt", ".distcp")) else 0
    return total, data


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    world = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    if world > 1 and args.contender != "stage1":
        dist.init_parallel_env()
    rank = dist.get_rank() if world > 1 else 0
    fsdp = None
    if args.contender == "fsdp":
        from paddle.distributed.fsdp import FullyShardFusion

        with paddle.LazyGuard():
            model = build(args)
        fsdp = FullyShardFusion(model, fsdp_unit_layers=["Block"])
    else:
        model = build(args)
    params = list(model.parameters())
    trainable = sum(int(p.numel()) * p.element_size() for p in params if not p.stop_gradient)
    frozen = sum(int(p.numel()) * p.element_size() for p in params if p.stop_gradient)
    opt = paddle.optimizer.AdamW(learning_rate=1e-3, parameters=model.parameters(), weight_decay=0.01)
    if args.contender == "dp":
        model = paddle.DataParallel(model)
    elif args.contender == "stage1":
        model, opt = fleet_stage1(model, opt, world)
    wrapped_rss = rss_now_mib()
    times, losses, step_rss, forward_rss = [], [], [], []
    for step in range(args.warmup + args.steps):
        x = paddle.to_tensor(batch(step, rank, args.batch, args.seq, args.dim))
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        loss = model(x)
        forward_rss.append(rss_now_mib())
        loss.backward()
        step_rss.append(rss_now_mib())
        opt.step()
        opt.clear_grad()
        value = float(loss)
        step_rss.append(rss_now_mib())
        losses.append(value)
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
        LOG.info("rank %d step %d: loss %.9g, rss %.0f MiB", rank, step, value, step_rss[-1])
    train_peak = peak_rss_mib()
    opt_bytes = optimizer_state_bytes(opt)
    start = time.perf_counter()
    save(args, fsdp, model, opt, rank)
    save_s = time.perf_counter() - start
    if world > 1:
        dist.barrier()
    total, data = directory_bytes(args.ckpt) if rank == 0 else (0, 0)
    write_result(args.out, rank, {
        "contender": args.contender, "world": world, "rank": rank, "times": times, "losses": losses,
        "peak_rss_mib": peak_rss_mib(), "train_peak_rss_mib": train_peak, "wrapped_rss_mib": wrapped_rss,
        "step_rss_mib": max(step_rss), "forward_rss_mib": max(forward_rss), "trainable_bytes": trainable, "frozen_bytes_here": frozen,
        "optimizer_state": opt_bytes, "parameters": parameter_count(args), "ckpt_bytes": total, "ckpt_data_bytes": data,
        "save_s": save_s,
    })  # fmt: skip
    return 0


def save(args, fsdp, model, opt, rank: int) -> None:
    """One checkpoint, as each contender's user writes it."""
    if fsdp is not None:
        fsdp.save_checkpoint(args.ckpt, optimizer=opt)
        return
    os.makedirs(args.ckpt, exist_ok=True)
    if rank == 0:
        paddle.save(model.state_dict(), os.path.join(args.ckpt, "model.pdparams"))
    if args.contender == "stage1" or rank == 0:  # stage 1: each rank its optimizer shard
        paddle.save(opt.state_dict(), os.path.join(args.ckpt, f"optimizer.rank{rank}.pdopt"))


if __name__ == "__main__":
    sys.exit(main())
