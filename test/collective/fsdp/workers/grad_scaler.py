"""Loss scaling under FSDP: a found_inf on one rank only skips the step on every rank, the loss scale stays the
same everywhere and equal to one process, and a GradScaler resumes bit-exactly through a checkpoint.

Usage: grad_scaler.py WORKDIR. Each rank reports {case: "ok" | traceback}.

Why a CPU-enabled GradScaler: paddle disables GradScaler off GPU/XPU (it warns and does nothing). The place check
is its constructor's only device dependence, so :func:`cpu_grad_scaler` passes it and every other line, the real
``check_finite_and_unscale`` and ``_update`` included, runs as on a GPU.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

import _paths  # noqa: F401  (puts launch_util on sys.path)
import numpy as np
import paddle
import paddle.amp.grad_scaler as grad_scaler_module
import paddle.distributed as dist
from launch_util import report, run_cases
from models import decay_fun_for, global_batches, local_part, make_model
from paddle.distributed.fsdp import FullyShardFusion
from paddle.distributed.fsdp.checkpoint.errors import GradScalerMismatchError, MissingKeyError

BATCH = 12
INF_KEY, INF_INDEX = "blocks.1.up.weight", 37  # the gradient element made inf (owned by one rank only)


class _GpuLikePlace:
    def is_gpu_place(self) -> bool:
        return True


class _GpuLikeTracer:
    _expected_place = _GpuLikePlace()


@contextmanager
def _place_check_passes():
    real = grad_scaler_module._dygraph_tracer
    grad_scaler_module._dygraph_tracer = _GpuLikeTracer
    try:
        yield
    finally:
        grad_scaler_module._dygraph_tracer = real


def cpu_grad_scaler(**kwargs) -> paddle.amp.GradScaler:
    with _place_check_passes():
        scaler = paddle.amp.GradScaler(**kwargs)
    assert scaler.is_enable()
    return scaler


def make_scaler(init: float = 2.0**8, every: int = 2) -> paddle.amp.GradScaler:
    return cpu_grad_scaler(init_loss_scaling=init, incr_every_n_steps=every, decr_every_n_nan_or_inf=1)


def _owner_piece(fsdp, key):
    """(param, start, length) of this rank's piece of ``key`` in the flat parameter, or None when it owns none."""
    for k, param, buffer, index in fsdp.managed_parameters():
        if k == key:
            piece = buffer.pieces.get(index)
            return None if piece is None else (param, piece.param_start, piece.length)
    raise KeyError(key)


def holds_inf_element(fsdp) -> bool:
    found = _owner_piece(fsdp, INF_KEY)
    return found is not None and found[1] <= INF_INDEX < found[1] + found[2]


def inject_inf(model, fsdp) -> None:
    """Make gradient element INF_INDEX of INF_KEY inf in place, on the rank that holds it (every rank when
    ``fsdp`` is None: the one-process reference holds whole gradients)."""
    if fsdp is None:
        param = dict(model.named_parameters())[INF_KEY]
        start, length = 0, int(np.prod(param.shape))
    elif not holds_inf_element(fsdp):
        return
    else:
        param, start, length = _owner_piece(fsdp, INF_KEY)
    grad = param.grad
    mask = np.zeros(length, np.float32)
    mask[INF_INDEX - start] = np.inf
    with paddle.no_grad():  # in place: a bound FSDP gradient is a view of the fp32 gradient shard
        paddle.assign(grad + paddle.to_tensor(mask.reshape(grad.shape)), output=grad)


def scaled_train(model, fsdp, opt, scaler, batches, rank, world, inf_steps, first_step=0) -> list[float]:
    """The GradScaler loop; returns the loss scale after each step."""
    scales = []
    for k, (ids, labels) in enumerate(batches, start=first_step):
        x = paddle.to_tensor(local_part(ids, rank, world))
        y = paddle.to_tensor(local_part(labels, rank, world))
        # fp16 AMP's loss-scaling state (GradScaler disables itself otherwise), compute left in fp32 (CPU)
        with paddle.amp.auto_cast(enable=False, dtype="float16"):
            loss = scaler.scale(model(x, y))
        loss.backward()
        if k in inf_steps:
            inject_inf(model, fsdp)
        scaler.step(opt)
        scaler.update()
        opt.clear_grad()
        scales.append(float(scaler._scale))
    return scales


def momentum(model):
    clip = paddle.nn.ClipGradByGlobalNorm(0.05)
    return paddle.optimizer.Momentum(0.05, momentum=0.9, grad_clip=clip, parameters=model.parameters())


def _compare(ref, fsdp, tolerance: float) -> None:
    full = fsdp.full_parameters()
    for key, param in ref.named_parameters():
        got, want = full[key].numpy(), param.numpy()
        error = np.abs(got - want).max() / max(np.abs(want).max(), 1e-12)
        assert error <= tolerance, f"{key} differs from the one-process run by {error:.2e}"


def case_found_inf_one_rank(rank, world, workdir) -> None:
    """opt's auxiliary found_inf set on the last rank only (fp64 AdamW + global-norm clip, where a rank that
    stepped alone would still decay moments and weights): every rank skips, as one process does."""
    skip = {1, 3}
    batches = global_batches(5, BATCH)

    def run(model, fsdp_side: bool) -> list:
        clip = paddle.nn.ClipGradByGlobalNorm(0.05)
        fun = decay_fun_for(model)  # stock AdamW knows no `no_weight_decay`: the same exemptions by name
        opt = paddle.optimizer.AdamW(
            0.01, weight_decay=0.3, grad_clip=clip, apply_decay_param_fun=fun, parameters=model.parameters()
        )
        decided = []
        r, w = (rank, world) if fsdp_side else (0, 1)
        for k, (ids, labels) in enumerate(batches):
            model(paddle.to_tensor(local_part(ids, r, w)), paddle.to_tensor(local_part(labels, r, w))).backward()
            mine = k in skip and (not fsdp_side or rank == world - 1)
            opt._set_auxiliary_var("found_inf", paddle.to_tensor([mine]))
            opt.step()
            opt.clear_grad()
            decided.append(bool(opt._get_auxiliary_var("found_inf")))
        return decided

    ref = make_model(7, dtype="float64")
    want = run(ref, False)
    model = make_model(7, dtype="float64")
    fsdp = FullyShardFusion(model, fsdp_unit_layers=["Block"])
    got = run(model, True)
    assert got == want == [k in skip for k in range(5)], (got, want)
    _compare(ref, fsdp, 1e-10)


def case_scaler_inf_one_rank(rank, world, workdir) -> None:
    """A real (CPU-enabled) GradScaler with dynamic scaling, inf in one element of one rank's shard."""
    inf_steps = {1, 4}
    batches = global_batches(6, BATCH)
    ref = make_model(7)
    want = scaled_train(ref, None, momentum(ref), make_scaler(), batches, 0, 1, inf_steps)
    model = make_model(7)
    fsdp = FullyShardFusion(model, fsdp_unit_layers=["Block"])
    holders = fsdp.comm.all_gather_object(holds_inf_element(fsdp))
    got = scaled_train(model, fsdp, momentum(model), make_scaler(), batches, rank, world, inf_steps)
    assert sum(holders) == 1, f"the inf element of {INF_KEY} is held by ranks {holders}: not rank-local"
    steps = np.diff([256.0, *want])
    assert (steps > 0).any() and (steps < 0).any(), f"the reference scale did not move both ways: {want}"
    every = fsdp.comm.all_gather_object(got)
    assert all(s == want for s in every), f"loss scales per rank {every} vs one process {want}"
    _compare(ref, fsdp, 1e-5)


def _build(seed: int, init: float, every: int):
    model = make_model(seed)
    fsdp = FullyShardFusion(model, fsdp_unit_layers=["Block"])
    return model, fsdp, momentum(model), make_scaler(init, every)


def case_resume_bit_exact(rank, world, workdir) -> None:
    """6 uninterrupted steps against 3 steps, checkpoint (with the scaler), fresh objects with other settings and
    seed, load, 3 steps: parameters bit-equal and the scaler's state equal (saved with incr_count == 1)."""
    inf_steps = {1, 4}
    batches = global_batches(6, BATCH)
    ref, ref_fsdp, ref_opt, ref_scaler = _build(7, 2.0**8, 2)
    scaled_train(ref, ref_fsdp, ref_opt, ref_scaler, batches, rank, world, inf_steps)
    model, fsdp, opt, scaler = _build(7, 2.0**8, 2)
    scaled_train(model, fsdp, opt, scaler, batches[:3], rank, world, inf_steps)
    assert scaler.state_dict()["incr_count"] == 1, scaler.state_dict()
    path = os.path.join(workdir, f"scaler_{world}")
    fsdp.save_checkpoint(path, optimizer=opt, grad_scaler=scaler)
    model, fsdp, opt, scaler = _build(99, 2.0**3, 5)
    fsdp.load_checkpoint(path, optimizer=opt, grad_scaler=scaler)
    scaled_train(model, fsdp, opt, scaler, batches[3:], rank, world, inf_steps, first_step=3)
    want_params, got_params = ref_fsdp.full_parameters(), fsdp.full_parameters()
    assert sorted(want_params) == sorted(got_params)
    for key, value in want_params.items():
        assert np.array_equal(got_params[key].numpy(), value.numpy()), f"{key} differs from the uninterrupted run"
    want, got = ref_scaler.state_dict(), scaler.state_dict()
    assert sorted(want) == sorted(got) and all(np.array_equal(want[k], got[k]) for k in want), (want, got)


def case_refusals(rank, world, workdir) -> None:
    """Missing state (strict and not), a disabled scaler's state into an enabled one, a wrong type."""
    model, fsdp, opt, scaler = _build(7, 2.0**8, 2)
    plain = os.path.join(workdir, f"plain_{world}")
    fsdp.save_checkpoint(plain, optimizer=opt)
    before = scaler.state_dict()
    try:
        fsdp.load_checkpoint(plain, optimizer=opt, grad_scaler=scaler)
        raise AssertionError("a checkpoint without scaler state loaded into a scaler under strict=True")
    except MissingKeyError as e:
        assert "GradScaler" in str(e), e
    fsdp.load_checkpoint(plain, optimizer=opt, grad_scaler=scaler, strict=False)
    assert scaler.state_dict() == before
    disabled = paddle.amp.GradScaler()  # on a CPU: disabled by paddle itself
    assert not disabled.is_enable()
    off = os.path.join(workdir, f"disabled_{world}")
    fsdp.save_checkpoint(off, grad_scaler=disabled)
    fsdp.load_checkpoint(off, grad_scaler=disabled)
    try:
        fsdp.load_checkpoint(off, grad_scaler=scaler)
        raise AssertionError("a disabled scaler's state loaded into an enabled one")
    except GradScalerMismatchError:
        pass
    for call in (fsdp.save_checkpoint, fsdp.load_checkpoint):
        try:
            call(plain, grad_scaler={"scale": 1.0})
            raise AssertionError(f"{call.__name__} took a dict as grad_scaler")
        except TypeError as e:
            assert "GradScaler" in str(e), e


CASES = {
    "found_inf_one_rank": case_found_inf_one_rank,
    "scaler_inf_one_rank": case_scaler_inf_one_rank,
    "resume_bit_exact": case_resume_bit_exact,
    "refusals": case_refusals,
}


def main() -> None:
    workdir = sys.argv[1]
    if dist.get_world_size() > 1:
        dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    run_cases(CASES, rank, world, workdir, results=results)
    report(results)


if __name__ == "__main__":
    main()
