"""Gradient paths compared with one process: AMP master grads, fp32 accumulation, rank-dependent usage.

Usage: grad_paths.py CASE...   Each rank reports {case: "ok" | traceback}.

Cases:
  amp_master / amp_plain: a constant true gradient of 1.0 on bf16 parameters, 4 steps, with
      ``paddle.amp.decorate(..., master_grad=True)`` (AMP's real backward-final hook runs
      ``set_master_grads``) and without: the optimizer sees 1.0 every step, in the dtype one process sees.
  accumulate_plain / accumulate_master: 16 micro-batches of random gradients on bf16 parameters; the
      fp32 main_grad and what the optimizer sees are compared with an fp64 reference.
  uneven_usage: a skip-idle-experts MoE unit and a branch on the rank, used sets differing per rank and
      per step, AdamW + ClipGradByGlobalNorm; parameters compared with one process after every step.
"""

from __future__ import annotations

import os
import sys
import traceback

import _paths  # noqa: F401  (puts launch_util on sys.path)
import numpy as np
import paddle
import paddle.distributed as dist
from launch_util import report
from paddle.amp.auto_cast import amp_global_state
from paddle.distributed.fsdp import FullyShardFusion

N = 24  # elements per bf16 parameter (not a multiple of 2 or 3 ranks' padding on purpose)


def bf16_round(values: np.ndarray) -> np.ndarray:
    """Round fp32 values to the nearest bf16 (ties to even), returned as float64."""
    bits = np.asarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32).astype(np.float64)


def bf16_ulp(values: np.ndarray) -> np.ndarray:
    exponent = np.floor(np.log2(np.maximum(np.abs(values), 1e-30)))
    return 2.0 ** (exponent - 7)


class GradRecorder(paddle.optimizer.SGD):
    """An SGD whose per-parameter op records the gradient it is handed (dtype and values) and steps nothing."""

    def __init__(self, params) -> None:
        super().__init__(0.0, parameters=params)
        self.seen: list[dict] = []

    def step(self):
        self.seen.append({})
        super().step()

    def _append_optimize_op(self, block, param_and_grad):
        param, grad = param_and_grad
        self.seen[-1][param.name] = (str(grad.dtype), grad.astype("float32").numpy().copy())


class ConstUnit(paddle.nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        init = paddle.nn.initializer.Constant(0.5)
        self.a = self.create_parameter([N], dtype="bfloat16", default_initializer=init)
        self.b = self.create_parameter([3, N], dtype="bfloat16", default_initializer=init)

    def forward(self, x):
        # CPU has no bf16 kernels for matmul: compute in fp32 from casts, as the Bf16 models of the suite do
        return (self.a.astype("float32") * x).sum() + (self.b.astype("float32") * x).sum()


class ConstModel(paddle.nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.unit = ConstUnit()

    def forward(self, x):
        return self.unit(x)


def _amp_reset() -> None:
    state = amp_global_state()
    state.use_master_grad = False
    state.model_parameters = []
    state.already_register_final_backward_hook = False


def _run_const(master: bool, wrap: bool, micro_batches: int, inputs) -> list[dict]:
    """Train ConstModel; returns what the optimizer saw per step, keyed by parameter position."""
    _amp_reset()
    model = ConstModel()
    opt = GradRecorder(model.parameters())
    if master:
        model, opt = paddle.amp.decorate(model, opt, level="O2", dtype="bfloat16", master_grad=True)
        # on CPU decorate returns before its master-grad lines (it supports GPU/XPU/custom places only);
        # these are those lines, so auto_cast registers AMP's real master_grad_hook (set_master_grads)
        state = amp_global_state()
        if not state.use_master_grad:
            state.use_master_grad = True
            state.model_parameters.extend(model.parameters())
    order = {p.name: k for k, p in enumerate(model.parameters())}
    fsdp = FullyShardFusion(model, fsdp_unit_layers=["ConstUnit"]) if wrap else None
    for step_inputs in inputs:
        for x in step_inputs:
            with paddle.amp.auto_cast(level="O2", dtype="bfloat16"):
                loss = model(paddle.to_tensor(x))
            (loss / micro_batches).backward()
        opt.step()
        opt.clear_grad()
    _amp_reset()
    seen = [{order[name]: value for name, value in step.items()} for step in opt.seen]
    return seen, fsdp


def _local_piece_of(fsdp, position: int, full: np.ndarray) -> np.ndarray:
    """This rank's piece of parameter ``position`` (flattened), or an empty array."""
    params = [p for _k, p, _b, _i in fsdp.managed_parameters()]
    buffer = params[position]._fsdp_buffer
    index = next(k for k, p in enumerate(buffer.params) if p is params[position])
    piece = buffer.pieces.get(index)
    flat = full.reshape(-1)
    return flat[piece.param_start : piece.param_stop] if piece is not None else flat[:0]


def case_amp(master: bool, rank: int, world: int) -> None:
    # every rank's x is 1: the true gradient of every element is 1.0 (mean over ranks), every step
    inputs = [[np.ones([N], dtype="float32")] for _ in range(4)]
    reference, _ = _run_const(master, wrap=False, micro_batches=1, inputs=inputs)
    seen, fsdp = _run_const(master, wrap=True, micro_batches=1, inputs=inputs)
    want_dtype = "paddle.float32" if master else "paddle.bfloat16"
    assert len(seen) == 4
    for step, (mine, ref) in enumerate(zip(seen, reference)):
        for position, (dtype, values) in mine.items():
            ref_dtype, ref_values = ref[position]
            assert dtype == ref_dtype == want_dtype, (step, position, dtype, ref_dtype)
            assert np.all(values == 1.0), f"step {step}: the optimizer saw {sorted(set(values.tolist()))}, not 1.0"
            np.testing.assert_array_equal(values, _local_piece_of(fsdp, position, ref_values))


def case_accumulate(master: bool, rank: int, world: int) -> None:
    micro = 16
    rng = np.random.default_rng(5)
    # per step, per rank, per micro-batch inputs; values chosen so partial sums are far from bf16-representable
    data = rng.normal(size=(3, world, micro, N)).astype("float32") * np.float32(1.37)
    inputs = [[data[s, rank, k] for k in range(micro)] for s in range(3)]
    seen, fsdp = _run_const(master, wrap=True, micro_batches=micro, inputs=inputs)
    for step in range(3):
        # each micro-batch gradient is bf16(x / micro) (the cast's backward rounds it), summed exactly, mean of ranks
        per_rank = bf16_round((data[step] / np.float32(micro)).astype("float32")).sum(axis=1)  # [world, N]
        exact = per_rank.mean(axis=0)  # float64
        for position, (dtype, values) in seen[step].items():
            want = _local_piece_of(fsdp, position, np.broadcast_to(exact, (3, N)) if position == 1 else exact)
            if master:
                assert dtype == "paddle.float32", dtype
                np.testing.assert_allclose(values, want, rtol=2e-6, atol=1e-7)
            else:
                assert dtype == "paddle.bfloat16", dtype
                err = np.abs(values.astype(np.float64) - want)
                bound = 0.5 * bf16_ulp(want) * 1.001 + 1e-7
                assert np.all(err <= bound), (
                    f"step {step}: bf16 gradient {err.max() / bf16_ulp(want)[err.argmax()]:.2f} ulp from the exact sum"
                )


class Expert(paddle.nn.Layer):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.up = paddle.nn.Linear(dim, dim)

    def forward(self, x):
        return paddle.tanh(self.up(x))


class MoEBlock(paddle.nn.Layer):
    """Runs only the experts that have tokens (idle experts skipped, as many MoE codes do), plus an extra
    Linear used on some ranks only."""

    def __init__(self, dim: int, experts: int) -> None:
        super().__init__()
        self.experts = paddle.nn.LayerList([Expert(dim) for _ in range(experts)])
        self.extra = paddle.nn.Linear(dim, dim)

    def forward(self, x, active, use_extra):
        out = x
        for e in active:
            out = out + self.experts[e](x)
        if use_extra:
            out = out + self.extra(out)
        return out


class MoEModel(paddle.nn.Layer):
    def __init__(self, dim: int = 8, experts: int = 4) -> None:
        super().__init__()
        self.embed = paddle.nn.Linear(dim, dim)
        self.blocks = paddle.nn.LayerList([MoEBlock(dim, experts) for _ in range(2)])
        self.head = paddle.nn.Linear(dim, 1)

    def forward(self, x, plan):
        h = self.embed(x)
        for block, (active, use_extra) in zip(self.blocks, plan):
            h = block(h, active, use_extra)
        return self.head(h).square().mean()


def usage_plan(step: int, rank: int) -> list:
    """Which experts each block runs and whether it uses ``extra``: differs per rank and per step; expert 3
    of block 0 is idle on every rank at step 0 (never stepped then, as in one process)."""
    plans = []
    for b in range(2):
        active = [e for e in range(4) if (e + step + rank + b) % 3 != 0 and not (step == 0 and b == 0 and e == 3)]
        plans.append((active, (rank + step + b) % 2 == 1))
    return plans


def case_uneven_usage(rank: int, world: int) -> None:
    steps = 5
    rng = np.random.default_rng(11)
    xs = rng.normal(size=(steps, world, 6, 8)).astype("float32")

    def make():
        paddle.seed(3)
        model = MoEModel()
        opt = paddle.optimizer.AdamW(
            0.01, parameters=model.parameters(), weight_decay=0.1, grad_clip=paddle.nn.ClipGradByGlobalNorm(0.05)
        )
        return model, opt

    ref, ref_opt = make()
    model, opt = make()
    fsdp = FullyShardFusion(model, fsdp_unit_layers=["MoEBlock"])
    if world > 1 and os.environ.get("PADDLE_FSDP_FAKE_DEVICE") == "1":  # the GPU reduce_scatter branch runs
        assert fsdp.comm.reduce_scatter_mode == "emulated", fsdp.comm.reduce_scatter_mode
    squares = []
    real_square = paddle.square

    def counting_square(x, *args, **kwargs):
        squares.append(x.shape)
        return real_square(x, *args, **kwargs)

    for step in range(steps):
        loss = sum(ref(paddle.to_tensor(xs[step, r]), usage_plan(step, r)) for r in range(world)) / world
        loss.backward()
        ref_opt.step()
        ref_opt.clear_grad()
        model(paddle.to_tensor(xs[step, rank]), usage_plan(step, rank)).backward()
        squares.clear()
        paddle.square = counting_square
        try:
            opt.step()
        finally:
            paddle.square = real_square
        if world > 1:
            # the global norm comes from one sum of squares per fused buffer holding gradients, not per parameter
            assert 0 < len(squares) <= len(fsdp.buffers), (len(squares), len(fsdp.buffers))
        else:  # one rank: stock clipping itself (bit-equal to a plain model's), not the fused sums
            assert not squares, squares
        opt.clear_grad()
        mine = fsdp.full_parameters()
        for name, value in ref.state_dict().items():
            np.testing.assert_allclose(
                mine[name].numpy(), value.numpy(), rtol=2e-5, atol=2e-6, err_msg=f"step {step}: {name}"
            )


CASES = {
    "amp_master": lambda r, w: case_amp(True, r, w),
    "amp_plain": lambda r, w: case_amp(False, r, w),
    "accumulate_plain": lambda r, w: case_accumulate(False, r, w),
    "accumulate_master": lambda r, w: case_accumulate(True, r, w),
    "uneven_usage": case_uneven_usage,
}


def main() -> None:
    world = dist.get_world_size()
    if world > 1:
        dist.init_parallel_env()
    rank = dist.get_rank()
    results = {}
    for name in sys.argv[1:] or list(CASES):
        try:
            CASES[name](rank, world)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
    report(results)
    for name, outcome in results.items():
        print(f"{name}: {outcome}", file=sys.stderr)


if __name__ == "__main__":
    main()
