"""Communication/computation overlap: step times, the recorded schedule, equality, reduce dtype, order check.

Usage: overlap.py CASE...   Each rank reports {case: "ok" | traceback, "<case>.figures": {...}}.

Timing and trace cases need the emulated GPU stream (PADDLE_FSDP_EMULATE_GPU_COLLECTIVES=1, see
comm_emulation.py); the case sets the per-collective delay itself. Units compute by sleeping (GIL released)
for a known time in forward and in backward, and note what they computed in the schedule's trace.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import _paths  # noqa: F401  (puts launch_util on sys.path)
import numpy as np
import paddle
import paddle.distributed as dist
from launch_util import report
from models import decay_fun_for, global_batches, make_model
from paddle.autograd import PyLayer
from paddle.distributed.fsdp import FullyShardFusion
from paddle.distributed.fsdp.comm.comm_emulation import DELAY_ENV
from training import train

DIM = 8
TRACE: list = []  # the running schedule's trace (shared with the units' compute events)


class _Compute(PyLayer):
    """Identity that takes ``fwd`` seconds in forward and ``bwd`` in backward, noting both in TRACE."""

    @staticmethod
    def forward(ctx, x, unit: int, fwd: float, bwd: float):
        ctx.unit, ctx.bwd = unit, bwd
        time.sleep(fwd)
        TRACE.append(("F", unit, "compute"))
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.bwd)
        TRACE.append(("B", ctx.unit, "compute"))
        return grad


class SleepUnit(paddle.nn.Layer):
    def __init__(self, unit: int, fwd: float, bwd: float) -> None:
        super().__init__()
        self.unit, self.fwd, self.bwd = unit, fwd, bwd
        self.linear = paddle.nn.Linear(DIM, DIM)

    def forward(self, x):
        return _Compute.apply(self.linear(x), self.unit, self.fwd, self.bwd)


class SleepNet(paddle.nn.Layer):
    def __init__(self, n: int, fwd: float = 0.0, bwd: float = 0.0) -> None:
        super().__init__()
        self.units = paddle.nn.LayerList([SleepUnit(i, fwd, bwd) for i in range(n)])

    def forward(self, x):
        for unit in self.units:
            x = unit(x)
        return x.pow(2).mean()


def _wrap(n: int, depth: int, fwd: float = 0.0, bwd: float = 0.0, delay_ms: float = 0.0, **options):
    os.environ[DELAY_ENV] = str(delay_ms)
    paddle.seed(11)
    model = SleepNet(n, fwd, bwd)
    fsdp = FullyShardFusion(model, ["SleepUnit"], prefetch_depth=depth, **options)
    fsdp.schedule.trace = TRACE
    return model, fsdp, paddle.optimizer.SGD(0.1, parameters=model.parameters())


def _step(model, opt, rank: int, step: int) -> None:
    x = paddle.to_tensor(np.random.default_rng(100 * step + rank).standard_normal([4, DIM]).astype("float32"))
    model(x).backward()
    opt.step()
    opt.clear_grad()


# ---- timing ------------------------------------------------------------------------------------------
def measure(n: int, depth: int, fwd: float, bwd: float, delay_ms: float, rank: int, steps: int = 2) -> dict:
    """Step times (after one step that records the order) and the communication the trace shows per step."""
    model, fsdp, opt = _wrap(n, depth, fwd, bwd, delay_ms)
    _step(model, opt, rank, 0)
    times, collectives = [], []
    for step in range(1, steps + 1):
        dist.barrier()
        TRACE.clear()
        start = time.perf_counter()
        _step(model, opt, rank, step)
        times.append(time.perf_counter() - start)
        collectives.append(sum(1 for op, _, what in TRACE if op in ("AG", "RS") and what == "issue"))
    assert len(set(collectives)) == 1, collectives
    comm = collectives[0] * delay_ms / 1000
    compute = n * (fwd + bwd)
    return {"step_s": min(times), "all_s": times, "comm_s": comm, "compute_s": compute, "collectives": collectives[0]}


def case_timing(rank: int, world: int) -> dict:
    """Compute-bound and communication-bound configurations, without and with prefetching."""
    figures = {}
    # (units, forward s, backward s, delay ms): communication a third of computation, then 4x it
    configs = {"compute_bound": (8, 0.08, 0.16, 25.0), "comm_bound": (4, 0.01, 0.02, 40.0)}
    for name, (n, fwd, bwd, delay) in configs.items():
        for depth in (0, 1):
            got = measure(n, depth, fwd, bwd, delay, rank)
            bound = max(got["comm_s"], got["compute_s"])
            got["ratio_to_max"] = got["step_s"] / bound
            got["ratio_to_sum"] = got["step_s"] / (got["comm_s"] + got["compute_s"])
            figures[f"{name}/depth{depth}"] = got
    return figures


# ---- the recorded schedule ---------------------------------------------------------------------------
def expected_trace(n: int, depth: int, queue_depth: int) -> list:
    """The schedule of overlap.py's docstring for a chain of n one-buffer units, written out independently:
    gathers prefetched ``depth`` units ahead, at most ``queue_depth`` reduce-scatters in flight (0: none)."""
    out, flight, queue = [], set(), []

    def gather(i):
        if i not in flight:
            out.append(("AG", i, "issue"))
            flight.add(i)

    def reduce(i):
        if queue_depth == 0:
            out.extend([("RS", i, "issue"), ("RS", i, "wait")])
            return
        while len(queue) >= queue_depth:
            out.append(("RS", queue.pop(0), "wait"))
        out.append(("RS", i, "issue"))
        queue.append(i)

    for i in range(n):
        gather(i)
        for j in range(i + 1, min(i + depth, n - 1) + 1):
            gather(j)
        out.append(("AG", i, "wait"))
        flight.discard(i)
        out.append(("F", i, "compute"))
    for i in reversed(range(n)):
        if i < n - 1:
            reduce(i + 1)
        gather(i)
        for j in range(i - 1, max(i - depth, 0) - 1, -1):
            gather(j)
        out.append(("AG", i, "wait"))
        flight.discard(i)
        out.append(("B", i, "compute"))
    reduce(0)
    out.extend(("RS", i, "wait") for i in queue)
    return out


def case_trace(rank: int, world: int) -> None:
    """The first step runs unprefetched (recording the order); later steps follow the documented schedule."""
    n = 4
    for depth in (0, 1, 2):
        model, fsdp, opt = _wrap(n, depth)
        for step in range(3):
            TRACE.clear()
            _step(model, opt, rank, step)
            # the first step has no recorded order yet: nothing is prefetched, reduce-scatters are queued;
            # plain gloo completes them inside the call: waited for at once, never queued (overlap.py)
            queue = depth if fsdp.comm.emulation is not None else 0
            want = expected_trace(n, depth if step else 0, queue)
            assert TRACE == want, f"depth {depth}, step {step}:\n got  {TRACE}\n want {want}"
        assert not any(b.gather_in_flight or b.reduce_in_flight for b in fsdp.buffers)


# ---- equality -----------------------------------------------------------------------------------------
def _train_lm(depth: int, dtype: str, rank: int, world: int, reduce_dtype=None):
    model = make_model(5, dtype=dtype)
    fsdp = FullyShardFusion(model, ["Block"], prefetch_depth=depth, reduce_dtype=reduce_dtype) if world else None
    # FSDP honours param.no_weight_decay; stock AdamW (the one-process reference) needs it as a function
    opt = paddle.optimizer.AdamW(
        0.01,
        weight_decay=0.1,
        parameters=model.parameters(),
        grad_clip=paddle.nn.ClipGradByGlobalNorm(0.05),
        apply_decay_param_fun=None if fsdp else decay_fun_for(model),
    )
    train(model, opt, global_batches(3, 12), rank, max(world, 1), micro_batches=2)
    if fsdp is None:
        return {k: p.numpy() for k, p in model.named_parameters()}
    full = {k: v.numpy() for k, v in fsdp.full_parameters().items()}
    assert not any(b.gather_in_flight or b.reduce_in_flight or b.is_gathered for b in fsdp.buffers)
    return full


def case_equality(rank: int, world: int) -> None:
    """Prefetching (depths 1, 2) trains bit-identically to depth 0, which matches one process."""
    for dtype in ("float32", "float64"):
        base = _train_lm(0, dtype, rank, world)
        assert all(np.isfinite(v).all() for v in base.values()), "NaN in parameters: an output read before its wait"
        for depth in (1, 2):
            got = _train_lm(depth, dtype, rank, world)
            for key, value in base.items():
                np.testing.assert_array_equal(got[key], value, err_msg=f"{dtype} depth {depth}: {key}")
        if dtype == "float64":
            ref = _train_lm(0, dtype, 0, 0)
            for key, want in ref.items():
                error = np.abs(base[key] - want).max() / max(np.abs(want).max(), 1e-12)
                assert error <= 1e-10, f"{key} differs from one process by {error:.2e}"


# ---- reduce dtype --------------------------------------------------------------------------------------
def case_reduce_bf16(rank: int, world: int) -> dict:
    """bf16 reduce-scatter: on 2 ranks .grad equals the bf16 sum of the ranks' bf16-rounded halves exactly."""
    paddle.seed(11)
    ref = SleepNet(3)
    grads = []
    for r in range(world):
        x = paddle.to_tensor(np.random.default_rng(r).standard_normal([4, DIM]).astype("float32"))
        ref(x).backward()
        grads.append({k: p.grad.numpy().copy() for k, p in ref.named_parameters()})
        ref.clear_gradients()
    seen = {}
    for reduce_dtype in ("bfloat16", "float32"):
        paddle.seed(11)
        model = SleepNet(3)
        fsdp = FullyShardFusion(model, ["SleepUnit"], reduce_dtype=reduce_dtype)
        x = paddle.to_tensor(np.random.default_rng(rank).standard_normal([4, DIM]).astype("float32"))
        model(x).backward()
        seen[reduce_dtype] = {
            key: param.grad.numpy().copy() for key, param, b, i in fsdp.managed_parameters() if i in b.pieces
        }
    differs = 0
    for key, _param, buffer, index in fsdp.managed_parameters():
        piece = buffer.pieces.get(index)
        if piece is None:
            continue
        parts = [paddle.to_tensor(g[key].reshape(-1)[piece.param_start : piece.param_stop]) for g in grads]
        halves = [(p * (1.0 / world)).astype("bfloat16").astype("float32") for p in parts]
        exact32 = sum(p * (1.0 / world) for p in parts).numpy()
        got = seen["bfloat16"][key]
        differs += int((got != seen["float32"][key]).sum())
        if world == 2:
            want = (halves[0] + halves[1]).astype("bfloat16").astype("float32").numpy()
            np.testing.assert_array_equal(got, want, err_msg=key)
        # each rounding to bf16 errs by <= 2^-9 of the largest value involved
        np.testing.assert_allclose(got, exact32, rtol=0, atol=world * 2**-8 * np.abs(exact32).max(), err_msg=key)
    assert differs > 0, "bf16 and fp32 reductions gave identical gradients: bf16 was not used"
    return {"elements_differing_from_fp32": differs}


# ---- take_back_grads: no host sync, same semantics -------------------------------------------------------
class Bf16Unit(paddle.nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.w = self.create_parameter([3, DIM], dtype="bfloat16")

    def forward(self, x):  # CPU has no bf16 matmul: compute in fp32 from a cast
        return (self.w.astype("float32") * x).sum()


class _NoHostSync:
    """Inside: any host read of a tensor (numpy, bool, item, tolist) raises."""

    NAMES = ("numpy", "__bool__", "item", "tolist")

    def __enter__(self):
        self.saved = {name: getattr(paddle.Tensor, name) for name in self.NAMES}

        def refuse(*args, **kwargs):
            raise AssertionError("host sync inside take_back_grads")

        for name in self.NAMES:
            setattr(paddle.Tensor, name, refuse)

    def __exit__(self, *exc):
        for name, method in self.saved.items():
            setattr(paddle.Tensor, name, method)


def case_take_back(rank: int, world: int) -> None:
    """bf16 parameters without master grads: an untouched bf16 .grad keeps main_grad's exact fp32 sum, one
    scaled in place is taken as the new value; take_back_grads reads nothing on the host (every rank has the
    same data, so main_grad is exactly the fp32 sum of the bf16 gradients)."""
    model = Bf16Unit()
    fsdp = FullyShardFusion(model)  # the root gathers
    [buffer] = fsdp.buffers
    original = buffer.take_back_grads

    def guarded():
        with _NoHostSync():
            original()

    buffer.take_back_grads = guarded
    rng = np.random.default_rng(3)
    xs = [paddle.to_tensor(rng.standard_normal([3, DIM]) * 2.0 ** rng.integers(-8, 8, [3, DIM])) for _ in range(4)]
    xs = [x.astype("bfloat16").astype("float32") for x in xs]  # the bf16 gradients are these values
    want = np.zeros([3 * DIM], np.float32)
    for step, x in enumerate(xs):
        model(x).backward()
        want = want + x.numpy().reshape(-1)  # fp32 accumulation, as main_grad's
        if step == 2:  # the user scales the bf16 .grad: main_grad becomes that copy, doubled
            with paddle.no_grad():
                model.w.grad.scale_(2.0)
            rounded = paddle.to_tensor(want).astype("bfloat16").astype("float32").numpy()
            want = rounded * 2
    model(xs[0]).backward()  # takes the scaled copy back, adds one more gradient
    want = want + xs[0].numpy().reshape(-1)
    piece = buffer.pieces.get(0)
    if piece is not None:
        got = buffer.main_grad.numpy()[piece.shard_start : piece.shard_start + piece.length]
        np.testing.assert_array_equal(got, want[piece.param_start : piece.param_stop])
        assert not np.array_equal(want, paddle.to_tensor(want).astype("bfloat16").astype("float32").numpy())


# ---- the order check -----------------------------------------------------------------------------------
def _count_checks(fsdp) -> list[int]:
    """Wrap ``fsdp.comm.agree``: each call made while the check is on adds one to the list's last entry."""
    checked: list[int] = []
    original = fsdp.comm.agree

    def counting(*args, **kwargs):
        checked[-1] += int(fsdp.comm.check_order)
        return original(*args, **kwargs)

    fsdp.comm.agree = counting
    return checked


def case_check_interval(rank: int, world: int) -> dict:
    """check_collective_order=2 checks during backward passes 0, 2, 4; 0 never; the env default is off."""
    counts = {}
    for interval in (2, 0, None):
        model, fsdp, opt = _wrap(3, 1, check_collective_order=interval)
        checked = _count_checks(fsdp)
        for step in range(5):
            checked.append(0)
            _step(model, opt, rank, step)
        counts[str(interval)] = checked
    per_pass = counts["2"][0]
    assert per_pass >= 3 * 3 + 1, counts  # a gather and reduce per unit, a gather per unit in forward, the exchange
    assert counts["2"] == [per_pass, 0, per_pass, 0, per_pass], counts
    assert counts["0"] == counts["None"] == [0] * 5, counts
    return counts


CASES = {
    "trace": case_trace,
    "equality": case_equality,
    "reduce_bf16": case_reduce_bf16,
    "check_interval": case_check_interval,
    "take_back": case_take_back,
    "timing": case_timing,
}


def main() -> None:
    world = dist.get_world_size()
    if world > 1:
        dist.init_parallel_env()
    rank = dist.get_rank()
    results = {}
    for name in sys.argv[1:] or list(CASES):
        try:
            figures = CASES[name](rank, world)
            results[name] = "ok"
            if figures:
                results[f"{name}.figures"] = figures
        except Exception:
            results[name] = traceback.format_exc()
        print(f"{name}: {results[name]}", file=sys.stderr)
    report(results)


if __name__ == "__main__":
    main()
