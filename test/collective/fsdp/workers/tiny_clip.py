"""A second optimizer over one tiny parameter, with ClipGradByGlobalNorm, next to the main one.

With 2 or 3 ranks only one rank owns the single element of ``gate``: the others hand the second optimizer no
(param, grad) pair at all, and must still join the global-norm all-reduce (the bug: they returned before it,
leaving the owner waiting there). Trains 3 steps on N ranks and in one process (reference) and reports
{"tiny_clip": "ok" | traceback}; the pytest side runs this under a timeout, so a hang fails the test.
"""

from __future__ import annotations

import traceback

import _paths  # noqa: F401  (puts launch_util on sys.path)
import numpy as np
import paddle
import paddle.distributed as dist
from launch_util import report
from models import local_part
from paddle.distributed.fsdp import FullyShardFusion

DIM, STEPS, BATCH = 8, 3, 12


class GatedLinear(paddle.nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.body = paddle.nn.Linear(DIM, DIM)
        self.gate = self.create_parameter([1], dtype="float64")

    def forward(self, x):
        return (self.body(x) * self.gate).square().mean()


def build(seed: int):
    paddle.seed(seed)
    paddle.set_default_dtype("float64")
    model = GatedLinear()
    paddle.set_default_dtype("float32")
    return model


def optimizers(model):
    main = paddle.optimizer.SGD(0.1, parameters=model.body.parameters(), grad_clip=paddle.nn.ClipGradByGlobalNorm(0.5))
    tiny = paddle.optimizer.AdamW(0.05, parameters=[model.gate], grad_clip=paddle.nn.ClipGradByGlobalNorm(1e-3))
    return main, tiny


def train(model, opts, rank: int, world: int) -> None:
    rng = np.random.default_rng(5)
    for _ in range(STEPS):
        x = paddle.to_tensor(local_part(rng.standard_normal((BATCH, DIM)), rank, world))
        model(x).backward()
        for opt in opts:
            opt.step()
            opt.clear_grad()


def check(rank: int, world: int) -> None:
    ref = build(3)
    train(ref, optimizers(ref), 0, 1)
    model = build(3)
    fsdp = FullyShardFusion(model)
    owners = [fsdp.buffers[0].pieces.get(fsdp.buffers[0].param_position(model.gate)) is not None]
    train(model, optimizers(model), rank, world)
    full = fsdp.full_parameters()
    for key, param in ref.named_parameters():
        got, want = full[key].numpy(), param.numpy()
        error = np.abs(got - want).max() / max(np.abs(want).max(), 1e-12)
        assert error <= 1e-10, f"{key} differs from the one-process run by {error:.2e}"
    owning = fsdp.comm.all_gather_object(owners[0])
    assert world == 1 or not all(owning), f"every rank owns a piece of gate: the case is not exercised {owning}"


def main() -> None:
    if dist.get_world_size() > 1:
        dist.init_parallel_env()
    try:
        check(dist.get_rank(), dist.get_world_size())
        report({"tiny_clip": "ok"})
    except Exception:
        report({"tiny_clip": traceback.format_exc()})


if __name__ == "__main__":
    main()
