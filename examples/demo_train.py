"""Demo: train a tiny language model with FullyShardFusion on CPU ranks, checkpoint it, resume it.

    python -m paddle.distributed.launch --nproc_per_node 2 examples/demo_train.py

Prints the loss per step (rank 0), saves a sharded checkpoint after step 5, reloads it into a fresh
model and optimizer, and checks that the reloaded parameters equal the trained ones.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F
from paddle.distributed.fsdp import FullyShardFusion

VOCAB, DIM, SEQ = 64, 32, 8


class Block(paddle.nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.norm = paddle.nn.LayerNorm(DIM)
        self.up = paddle.nn.Linear(DIM, 4 * DIM)
        self.down = paddle.nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class TinyLM(paddle.nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.embed = paddle.nn.Embedding(VOCAB, DIM)
        self.blocks = paddle.nn.LayerList([Block() for _ in range(4)])
        self.norm = paddle.nn.LayerNorm(DIM)
        self.head = paddle.nn.Linear(DIM, VOCAB)
        for name, param in self.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.no_weight_decay = True

    def forward(self, ids, labels):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        logits = self.head(self.norm(h))
        return F.cross_entropy(logits.reshape([-1, VOCAB]), labels.reshape([-1, 1])).mean()


def batch(step: int, rank: int, world: int, per_rank: int = 4):
    """A learnable toy task (predict the next token of a counting sequence); each rank its own rows."""
    rng = np.random.default_rng(step)
    start = rng.integers(0, VOCAB, (per_rank * world, 1))
    ids = (start + np.arange(SEQ)) % VOCAB
    rows = slice(rank * per_rank, (rank + 1) * per_rank)
    return paddle.to_tensor(ids[rows]), paddle.to_tensor((ids[rows] + 1) % VOCAB)


def build():
    paddle.seed(2024)
    model = TinyLM()
    fsdp = FullyShardFusion(model, fsdp_unit_layers=["Block"])
    opt = paddle.optimizer.AdamW(
        learning_rate=3e-3,
        parameters=model.parameters(),
        weight_decay=0.01,
        grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0),
    )
    return model, fsdp, opt


def checkpoint_dir(given: str | None, world: int) -> tuple[str, str | None]:
    """The user's directory, or one in a new temporary directory (made by rank 0, its name sent to every rank)
    that the demo removes at the end: ``(path, directory to remove or None)``."""
    if given:
        return given, None
    names = [tempfile.mkdtemp(prefix="fsdp_demo_") if dist.get_rank() == 0 else None]
    if world > 1:
        dist.broadcast_object_list(names, src=0)
    return os.path.join(names[0], "checkpoint"), names[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--checkpoint", default=None, help="checkpoint directory, kept (default: a new temp dir, removed at the end)"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if dist.get_world_size() > 1:
        dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    model, fsdp, opt = build()
    if rank == 0:
        print(
            f"{world} rank(s); rank 0 holds {fsdp.resident_parameter_bytes()} of "
            f"{fsdp.total_parameter_bytes()} parameter bytes"
        )
    path, scratch = checkpoint_dir(args.checkpoint, world)
    for step in range(args.steps):
        loss = model(*batch(step, rank, world))
        loss.backward()
        opt.step()
        opt.clear_grad()
        mean_loss = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean_loss)
        if rank == 0:
            print(f"step {step:3d}  loss {float(mean_loss) / world:.4f}")
        if step == args.steps // 2:
            fsdp.save_checkpoint(path, optimizer=opt, extra_state={"step": step})
            if rank == 0:
                print(f"saved checkpoint to {path}")
    trained = {k: v.local_tensor.numpy() for k, v in fsdp.sharded_state_dict().items()}
    fsdp.save_checkpoint(path, optimizer=opt, extra_state={"step": args.steps})
    model2, fsdp2, opt2 = build()
    extra = fsdp2.load_checkpoint(path, optimizer=opt2)
    reloaded = fsdp2.sharded_state_dict()
    same = all(np.array_equal(reloaded[k].local_tensor.numpy(), v) for k, v in trained.items())
    if rank == 0:
        print(f"reloaded checkpoint at step {extra['step']}: parameters identical = {same}")
    if scratch:  # every rank is done with it before rank 0 removes it
        if world > 1:
            dist.barrier()
        if rank == 0:
            shutil.rmtree(scratch, ignore_errors=True)
    if not same:
        raise SystemExit("reloaded parameters differ from the trained ones")


if __name__ == "__main__":
    main()
