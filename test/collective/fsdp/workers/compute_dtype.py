"""AMP O1's memory problem and FullyShardFusion(compute_dtype=...), measured with paddle's host allocator stats.

Under O1 the parameters are fp32 and AMP casts each one to bf16 for every white-listed op (matmul), which saves
the cast for backward: a new tensor per weight, alive until backward, i.e. the whole model's weights resident
through forward. CPU paddle has no bf16 matmul, so the same mechanism runs one precision up: fp64 parameters,
cast to fp32 exactly where AMP would cast (an input whose dtype differs from the compute dtype), matmul in fp32.

Cases (each rank reports {case: "ok" | traceback, "figures": {...}}):
  retained_after_forward: bytes still allocated after forward, before backward: without compute_dtype >= every
      weight's cast (the bug), with compute_dtype="float32" <= one unit's gathered buffer plus the activations.
  same_training: 3 Momentum steps with and without compute_dtype are bit-equal (the same fp32 values reach every op,
      gradients accumulate in fp64 either way) and equal one process (1e-5: fp32 compute).
"""

from __future__ import annotations

import _paths  # noqa: F401  (puts launch_util on sys.path)
import numpy as np
import paddle
from launch_util import worker_main
from models import local_part
from paddle.base import core
from paddle.distributed.fsdp import FullyShardFusion

WIDE, BLOCKS, ROWS = 128, 8, 4
COMPUTE = "float32"


def amp_cast(tensor):
    """What AMP does to an input of a white-listed op: cast it to the compute dtype when it differs."""
    return tensor if tensor.dtype == paddle.float32 else tensor.astype(COMPUTE)


class CastBlock(paddle.nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.up = self.create_parameter([WIDE, 2 * WIDE], dtype="float64")
        self.down = self.create_parameter([2 * WIDE, WIDE], dtype="float64")

    def forward(self, x):
        h = paddle.nn.functional.relu(paddle.matmul(x, amp_cast(self.up)))
        return x + paddle.matmul(h, amp_cast(self.down))


class CastModel(paddle.nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = paddle.nn.LayerList([CastBlock() for _ in range(BLOCKS)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def build(seed: int, compute_dtype=None):
    paddle.seed(seed)
    model = CastModel()
    fsdp = FullyShardFusion(model, fsdp_unit_layers=["CastBlock"], compute_dtype=compute_dtype)
    return model, fsdp


def _live() -> int:
    return core.host_memory_stat_current_value("Allocated", 0)


def retained_after_forward(compute_dtype) -> int:
    model, _fsdp = build(3, compute_dtype)
    x = paddle.to_tensor(np.random.default_rng(0).standard_normal((ROWS, WIDE)).astype("float32"))
    before = _live()
    loss = model(x)
    retained = _live() - before
    loss.backward()
    return retained


def case_retained_after_forward(rank, world, figures) -> None:
    weights = BLOCKS * 2 * (2 * WIDE * WIDE)  # elements
    casts = weights * 4  # every weight cast to fp32
    unit = 2 * (2 * WIDE * WIDE) * 4  # one unit gathered in fp32
    activations = BLOCKS * 6 * ROWS * 2 * WIDE * 4  # generous: a few [ROWS, 2*WIDE] fp32 tensors per block
    without = retained_after_forward(None)
    with_fix = retained_after_forward(COMPUTE)
    figures.update(retained_without=without, retained_with=with_fix, casts=casts, unit=unit, activations=activations)
    assert without >= casts, f"the measurement does not see the casts: {without} < {casts}"
    assert with_fix <= unit + activations, f"compute_dtype still retains {with_fix} > unit {unit} + {activations}"


def train(model, world, rank, steps=3):
    opt = paddle.optimizer.Momentum(0.05, momentum=0.9, parameters=model.parameters())
    rng = np.random.default_rng(1)
    for _ in range(steps):
        x = rng.standard_normal((ROWS * 3, WIDE)).astype("float32")
        model(paddle.to_tensor(local_part(x, rank, world))).backward()
        opt.step()
        opt.clear_grad()


def case_same_training(rank, world, figures) -> None:
    paddle.seed(3)
    ref = CastModel()
    train(ref, 1, 0)
    runs = {}
    for compute_dtype in (None, COMPUTE):
        model, fsdp = build(3, compute_dtype)
        train(model, world, rank)
        runs[compute_dtype] = {k: v.numpy() for k, v in fsdp.full_parameters().items()}
        for key, value in runs[compute_dtype].items():
            assert value.dtype == np.float64, f"{key} came back as {value.dtype}"
    for key, param in ref.named_parameters():
        got, plain, want = runs[COMPUTE][key], runs[None][key], param.numpy()
        assert np.array_equal(got, plain), f"{key}: compute_dtype changed the training"
        error = np.abs(got - want).max() / max(np.abs(want).max(), 1e-12)
        # compute is fp32: N ranks and one process reduce the fp32 gradients in another order
        assert error <= 1e-5, f"{key} differs from the one-process run by {error:.2e}"


def case_refusals(rank, world, figures) -> None:
    try:
        build(3, "int8")
        raise AssertionError("compute_dtype='int8' accepted")
    except ValueError as e:
        assert "compute_dtype" in str(e), e


CASES = {
    "retained_after_forward": case_retained_after_forward,
    "same_training": case_same_training,
    "refusals": case_refusals,
}


if __name__ == "__main__":
    worker_main(CASES)
