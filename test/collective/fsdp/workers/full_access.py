"""Full-parameter access and persistable buffers on a wrapped model, against the same model unwrapped.

Usage: full_access.py WORKDIR [OTHER_WORKDIR]: OTHER_WORKDIR holds a checkpoint saved by another world size
(buffers_elastic); with --only-elastic only that case runs. Each rank reports {case: "ok" | traceback}.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback

import _paths  # noqa: F401  (puts launch_util on sys.path)
import numpy as np
import paddle
import paddle.distributed as dist
import paddle.nn.functional as F
from launch_util import report
from paddle.distributed.fsdp import FullyShardFusion
from paddle.distributed.fsdp.checkpoint import load_full_state_dict
from paddle.distributed.fsdp.step.layer_integration import ShardedStateDictError

DIM = 8


class Block(paddle.nn.Layer):
    """Keeps training state in buffers: a step counter and an EMA of its output (persistable), a scratch
    buffer (not persistable)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = paddle.nn.Linear(DIM, DIM)
        self.register_buffer("steps", paddle.zeros([1], dtype="int64"))
        self.register_buffer("ema", paddle.zeros([DIM]))
        self.register_buffer("scratch", paddle.zeros([3]), persistable=False)

    def forward(self, x):
        y = paddle.tanh(self.fc(x))
        if self.training:
            with paddle.no_grad():
                self.steps.add_(paddle.ones([1], dtype="int64"))
                self.ema.scale_(0.9).add_(0.1 * y.mean(axis=[0, 1]))
        return y


class Net(paddle.nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.embed = paddle.nn.Embedding(11, DIM)
        self.blocks = paddle.nn.LayerList([Block() for _ in range(3)])
        self.head = paddle.nn.Linear(DIM, 11)

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def make(seed: int = 3) -> Net:
    paddle.seed(seed)
    return Net()


def ids(seed: int) -> paddle.Tensor:
    return paddle.to_tensor(np.random.default_rng(seed).integers(0, 11, (4, 5)))


def train(model, opt, steps: int, seed: int = 0) -> None:
    for k in range(steps):
        x = ids(seed + k)
        loss = F.cross_entropy(model(x).reshape([-1, 11]), x.reshape([-1, 1])).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()


def numpy_state(state) -> dict:
    return {k: np.array(v.numpy()) for k, v in state.items()}


def case_print_and_state_dict(rank, world, workdir):
    reference = make()
    model = make()
    fsdp = FullyShardFusion(model, fsdp_unit_layers=["Block"])
    assert repr(model) == repr(reference), repr(model)
    assert repr(model.blocks[1]) == repr(reference.blocks[1])
    assert len(model.blocks[0].fc.weight.shape) == 1  # at rest: this rank's 1-D piece
    for call in (lambda: model.state_dict(), lambda: model.set_state_dict(reference.state_dict())):
        try:
            call()
        except ShardedStateDictError as e:
            assert "summon_full_params" in str(e) and "full_state_dict" in str(e)
        else:
            raise AssertionError("state_dict/set_state_dict accepted sharded pieces")
    for alias in ("set_dict", "load_dict"):
        try:
            getattr(model, alias)(reference.state_dict())
        except ShardedStateDictError:
            pass
        else:
            raise AssertionError(f"{alias} accepted sharded pieces")
    want = numpy_state(reference.state_dict())
    with fsdp.summon_full_params():
        got = numpy_state(model.state_dict())
        assert repr(model) == repr(reference)
        with paddle.no_grad():  # evaluation inside the context
            np.testing.assert_array_equal(model(ids(5)).numpy(), reference(ids(5)).numpy())
    assert list(got) == list(want), (list(got), list(want))
    for key in want:
        np.testing.assert_array_equal(got[key], want[key], err_msg=key)
    assert "blocks.0.scratch" not in got


def case_summon_writeback(rank, world, workdir):
    model = make()
    fsdp = FullyShardFusion(model, fsdp_unit_layers=["Block"])
    before = numpy_state(fsdp.full_parameters())
    with fsdp.summon_full_params():
        model.blocks[0].fc.weight.set_value(paddle.full([DIM, DIM], 5.0))
        with paddle.no_grad():
            model.head.bias.scale_(0.0)
    after = numpy_state(fsdp.full_parameters())
    for key in before:
        np.testing.assert_array_equal(after[key], before[key], err_msg=f"{key} changed without writeback")
    new = make(seed=99)
    with fsdp.summon_full_params(writeback=True):
        model.set_state_dict(new.state_dict())  # custom initialisation / loading a full state dict
        with paddle.no_grad():
            model.head.bias.add_(paddle.ones([11]))
    after = numpy_state(fsdp.full_parameters())
    want = numpy_state(dict(new.named_parameters()))
    want["head.bias"] = want["head.bias"] + 1
    for key in want:
        np.testing.assert_array_equal(after[key], want[key], err_msg=key)
    # training still works after the context, and matches the unwrapped model loaded the same way
    reference = make(seed=99)
    with paddle.no_grad():
        reference.head.bias.add_(paddle.ones([11]))
    opt = paddle.optimizer.AdamW(parameters=model.parameters())
    ref_opt = paddle.optimizer.AdamW(parameters=reference.parameters())
    train(model, opt, 2)
    train(reference, ref_opt, 2)  # every rank trains on the same batch: the gradient mean is the same gradient
    full = numpy_state(fsdp.full_parameters())
    for key, value in reference.named_parameters():
        np.testing.assert_allclose(full[key], value.numpy(), rtol=1e-5, atol=1e-6, err_msg=key)


def case_summon_rank0_only_and_errors(rank, world, workdir):
    model = make()
    fsdp = FullyShardFusion(model, fsdp_unit_layers=["Block"])
    with fsdp.summon_full_params(rank0_only=True):
        shape = list(model.blocks[0].fc.weight.shape)
        assert shape == [DIM, DIM] if rank == 0 else len(shape) == 1, shape
    assert len(model.blocks[0].fc.weight.shape) == 1
    try:
        with fsdp.summon_full_params(rank0_only=True, writeback=True):
            pass
    except ValueError:
        pass
    else:
        raise AssertionError("rank0_only + writeback accepted")
    with fsdp.summon_full_params():
        out = model(ids(1))  # grad enabled: forward fine, backward refused
        try:
            out.sum().backward()
        except Exception as e:  # noqa: BLE001 - paddle re-raises hook errors as its own type
            assert "summon_full_params" in str(e), str(e)
        else:
            raise AssertionError("backward inside summon_full_params accepted")


def case_full_state_dict(rank, world, workdir):
    reference = make()
    model = make()
    fsdp = FullyShardFusion(model, fsdp_unit_layers=["Block"])
    opt = paddle.optimizer.AdamW(parameters=model.parameters())
    ref_opt = paddle.optimizer.AdamW(parameters=reference.parameters())
    train(model, opt, 2)
    train(reference, ref_opt, 2)
    peak = {"now": 0, "max": 0}
    for buffer in fsdp.buffers:
        original = buffer.gather

        def gather(original=original, buffer=buffer, **kwargs):
            if not buffer.is_gathered:
                peak["now"] = sum(b.is_gathered for b in fsdp.buffers) + 1
                peak["max"] = max(peak["max"], peak["now"])
            original(**kwargs)

        buffer.gather = gather
    full = fsdp.full_state_dict(rank0_only=True)
    for buffer in fsdp.buffers:
        del buffer.gather
    assert peak["max"] == 1, f"full_state_dict held {peak['max']} buffers gathered at once"
    every = fsdp.full_state_dict(rank0_only=False)
    assert list(every) == list(reference.state_dict())
    if rank != 0:
        assert full == {}, list(full)
        return
    want = reference.state_dict()
    assert list(full) == list(want), (list(full), list(want))
    for key, value in want.items():
        np.testing.assert_allclose(full[key].numpy(), value.numpy(), rtol=1e-5, atol=1e-6, err_msg=key)
    fresh = make(seed=7)
    fresh.set_state_dict(full)  # an unwrapped model takes it as is
    np.testing.assert_allclose(fresh(ids(3)).numpy(), reference(ids(3)).numpy(), rtol=1e-5, atol=1e-6)


def case_buffers_checkpointed(rank, world, workdir):
    """Buffers round-trip through the low-level and the one-call API; a buffer that differs across ranks
    is saved from rank 0 with a warning, and every rank gets rank 0's value back."""
    model = make()
    fsdp = FullyShardFusion(model, fsdp_unit_layers=["Block"])
    opt = paddle.optimizer.AdamW(parameters=model.parameters())
    train(model, opt, 2)
    state = fsdp.sharded_state_dict()
    assert "blocks.0.steps" in state and "blocks.0.ema" in state and "blocks.0.scratch" not in state
    assert int(model.blocks[0].steps) == 2
    path = os.path.join(workdir, "buffers_low")
    dist.save_state_dict(state, path)
    saved = {k: np.array(v.numpy()) for k, v in model.named_buffers() if "scratch" not in k}
    with paddle.no_grad():
        for block in model.blocks:
            block.steps.zero_()
            block.ema.zero_()
    dist.load_state_dict(fsdp.sharded_state_dict(), path)
    for key, value in model.named_buffers():
        if "scratch" not in key:
            np.testing.assert_array_equal(value.numpy(), saved[key], err_msg=key)
    # one-call API, with a buffer that differs across ranks
    with paddle.no_grad():
        model.blocks[1].ema.add_(paddle.full([DIM], float(rank)))
    rank0_ema = fsdp.comm.all_gather_object(model.blocks[1].ema.numpy().tolist())[0]
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("paddle.distributed.fsdp.state.buffers").addHandler(handler)
    path = os.path.join(workdir, "buffers_one_call")
    fsdp.save_checkpoint(path, optimizer=opt)
    messages = [r.getMessage() for r in records]
    if world > 1:
        assert any("blocks.1.ema" in m and "rank 0" in m for m in messages), messages
        assert not any("blocks.0.ema" in m for m in messages), messages
    else:
        assert not messages, messages
    with paddle.no_grad():
        for block in model.blocks:
            block.ema.scale_(3.0)
            block.steps.zero_()
    fsdp.load_checkpoint(path, optimizer=opt)
    np.testing.assert_array_equal(model.blocks[1].ema.numpy(), np.array(rank0_ema, dtype=np.float32))
    assert int(model.blocks[2].steps) == 2
    if rank == 0:
        full = load_full_state_dict(path)
        np.testing.assert_array_equal(full["blocks.1.ema"].numpy(), np.array(rank0_ema, dtype=np.float32))
        assert int(full["blocks.0.steps"]) == 2 and "blocks.0.scratch" not in full


def case_buffers_elastic(rank, world, workdir):
    """A checkpoint saved by another world size (argv[2]) restores every buffer on every rank, and the
    parameters with them."""
    if len(sys.argv) < 3:
        return
    path = os.path.join(sys.argv[2], "buffers_one_call")
    model = make(seed=5)
    fsdp = FullyShardFusion(model, fsdp_unit_layers=["Block"])
    opt = paddle.optimizer.AdamW(parameters=model.parameters())
    fsdp.load_checkpoint(path, optimizer=opt)
    saved = load_full_state_dict(path)
    for key, value in model.named_buffers():
        if "scratch" in key:
            continue
        np.testing.assert_array_equal(value.numpy(), saved[key].numpy(), err_msg=key)
    full = fsdp.full_state_dict(rank0_only=False)
    for key, value in full.items():
        np.testing.assert_array_equal(value.numpy(), saved[key].numpy(), err_msg=key)


CASES = {
    "print_and_state_dict": case_print_and_state_dict,
    "summon_writeback": case_summon_writeback,
    "summon_rank0_only_and_errors": case_summon_rank0_only_and_errors,
    "full_state_dict": case_full_state_dict,
    "buffers_checkpointed": case_buffers_checkpointed,
    "buffers_elastic": case_buffers_elastic,
}


def main() -> None:
    workdir = sys.argv[1]
    if dist.get_world_size() > 1:
        dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    only = "--only-elastic" in sys.argv
    sys.argv = [a for a in sys.argv if a != "--only-elastic"]
    for name, case in CASES.items():
        if only and name != "buffers_elastic":
            continue
        try:
            case(rank, world, workdir)
            out[name] = "ok"
        except Exception:  # noqa: BLE001 - reported per case
            out[name] = traceback.format_exc()
        report(out)
        if world > 1:
            dist.barrier()
    report(out)


if __name__ == "__main__":
    main()
