"""Zero-stall async save: values at the call are saved although training writes the tensors right after it.

The background copy of the deferred tensors (parameters, optimizer state) is held back by a gate in these tests,
so every writer really runs before the copy would have happened; each writer must wait for the copy (the guard
is seen reached before the gate opens), and the checkpoint must hold the values at the call.
"""

from __future__ import annotations

import threading

import numpy as np
import paddle
import paddle.distributed.fsdp.checkpoint as ck
import pytest
from paddle.distributed.fsdp.checkpoint import snapshot, snapshot_guard
from paddle.distributed.fsdp.step import optimizer_integration


def bits(t) -> np.ndarray:
    return np.ascontiguousarray(t.numpy()).view(np.uint8).ravel().copy()


@pytest.fixture()
def gated(monkeypatch):
    """Holds every deferred copy until ``gate`` is set; ``reached`` is set when a writer waits for a copy."""
    gate, reached = threading.Event(), threading.Event()
    copy = snapshot.Snapshot.copy_deferred

    def held(self):
        gate.wait(60)
        copy(self)

    real_wait = snapshot_guard.wait_for_snapshot

    def spy(tensor=None):
        if snapshot_guard.snapshot_in_flight():
            reached.set()
        real_wait(tensor)

    monkeypatch.setattr(snapshot.Snapshot, "copy_deferred", held)
    monkeypatch.setattr(snapshot_guard, "wait_for_snapshot", spy)
    # FSDP's optimizer integration (installed once any model was wrapped in this process) waits first, through
    # the name it imported: spy on it too, or a step would wait unseen until the gate times out
    monkeypatch.setattr(optimizer_integration, "wait_for_snapshot", spy)
    yield gate, reached
    gate.set()


def _write_while_gated(gate, reached, write) -> None:
    """Run ``write`` on a thread; it must reach the guard (and wait there) before the copy is let go."""
    done = threading.Event()
    error: list = []

    def run():
        try:
            write()
        except BaseException as e:  # noqa: BLE001 - reported below
            error.append(e)
        finally:
            done.set()

    th = threading.Thread(target=run)
    th.start()
    while not (reached.is_set() or done.is_set()):
        reached.wait(0.05)
    waited = reached.is_set() and not done.is_set()
    gate.set()
    th.join(60)
    assert not error, error
    assert waited, "the write was not held back until the snapshot was copied"


def _linear_and_adamw(seed=3):
    paddle.seed(seed)
    lin = paddle.nn.Linear(8, 6)
    opt = paddle.optimizer.AdamW(parameters=lin.parameters(), learning_rate=0.1)
    lin(paddle.rand([4, 8])).sum().backward()
    opt.step()
    opt.clear_grad()
    return lin, opt


def _engine_state(lin, opt) -> dict:
    state = {"weight": lin.weight, "bias": lin.bias}
    for name, per_param in opt._accumulators.items():
        for pname, t in per_param.items():
            state[f"{pname}.{name}"] = t
    return state


WRITES = {
    "optimizer_step": lambda lin, opt: (lin(paddle.rand([4, 8])).sum().backward(), opt.step()),
    "add_": lambda lin, opt: lin.weight.add_(paddle.ones_like(lin.weight)),
    "set_value": lambda lin, opt: lin.weight.set_value(paddle.full(lin.weight.shape, 5.0)),
    "setitem": lambda lin, opt: lin.weight.__setitem__(0, 7.0),
    "assign_output": lambda lin, opt: paddle.assign(paddle.full(lin.weight.shape, 2.0), output=lin.weight),
    "copy_": lambda lin, opt: lin.weight.copy_(paddle.full(lin.weight.shape, 3.0), False),
    "wait_for_snapshot": lambda lin, opt: snapshot_guard.wait_for_snapshot(),
}


@pytest.mark.parametrize("writer", sorted(WRITES))
def test_write_right_after_async_save_waits_and_save_holds_values_at_the_call(tmp_path, gated, writer):
    gate, reached = gated
    lin, opt = _linear_and_adamw()
    state = _engine_state(lin, opt)
    at_call = {k: bits(v) for k, v in state.items()}
    h = ck.save_state_dict(state, str(tmp_path / "c"), async_save=True)
    assert ck.snapshot_in_flight()

    def write():
        if writer == "optimizer_step":
            WRITES[writer](lin, opt)
        else:
            with paddle.no_grad():
                WRITES[writer](lin, opt)

    _write_while_gated(gate, reached, write)
    h.wait()
    assert not ck.snapshot_in_flight()
    changed = {k for k, v in state.items() if not np.array_equal(bits(v), at_call[k])}
    if writer == "optimizer_step":
        assert {"weight", "bias"} <= changed and any(".moment1" in k for k in changed)  # the step ran
    elif writer != "wait_for_snapshot":
        assert "weight" in changed
    targets = {k: paddle.zeros_like(v) for k, v in state.items()}
    ck.load_state_dict(targets, str(tmp_path / "c"))
    for k, v in targets.items():
        assert np.array_equal(bits(v), at_call[k]), f"{k} saved with a value after the call"


def test_volatile_tensors_are_copied_before_the_call_returns(tmp_path, gated):
    """A tensor that is not a trainable parameter (e.g. BatchNorm statistics, written by forward kernels the
    guard cannot see) is copied at the call: a raw write right after it does not reach the checkpoint."""
    gate, _reached = gated
    bn = paddle.nn.BatchNorm1D(5)
    bn.train()
    bn(paddle.rand([16, 5]) * 3)
    state = {"mean": bn._mean, "var": bn._variance, "w": bn.weight}
    at_call = {k: bits(v) for k, v in state.items()}
    h = ck.save_state_dict(state, str(tmp_path / "c"), async_save=True)
    bn(paddle.rand([16, 5]) * 7)  # forward updates the running statistics in place, no guard involved
    assert not np.array_equal(bits(bn._mean), at_call["mean"])
    gate.set()
    h.wait()
    targets = {k: paddle.zeros_like(v) for k, v in state.items()}
    ck.load_state_dict(targets, str(tmp_path / "c"))
    for k, v in targets.items():
        assert np.array_equal(bits(v), at_call[k]), k


def test_writes_to_unrelated_tensors_do_not_wait(tmp_path, gated):
    gate, reached = gated
    lin, opt = _linear_and_adamw()
    h = ck.save_state_dict({"weight": lin.weight}, str(tmp_path / "c"), async_save=True)
    other = paddle.rand([64])
    other.add_(paddle.ones([64]))  # would hang here if it waited for the gated copy
    other[3] = 1.0
    assert ck.snapshot_in_flight()
    gate.set()
    h.wait()


def test_fsdp_async_checkpoint_then_training_step_saves_the_state_at_the_call(tmp_path, gated):
    """One-rank FullyShardFusion + AdamW: save_checkpoint(async_save=True), then forward, backward and
    ``opt.step()`` at once (the user calls nothing in between): the checkpoint holds the state at the call."""
    from paddle.distributed.fsdp import FullyShardFusion

    gate, reached = gated
    paddle.seed(11)
    model = paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.ReLU(), paddle.nn.Linear(16, 4))
    fsdp = FullyShardFusion(model)
    opt = paddle.optimizer.AdamW(parameters=model.parameters(), learning_rate=0.05)

    def step():
        model(paddle.rand([4, 8])).square().mean().backward()
        opt.step()
        opt.clear_grad()

    step()
    at_call_state = fsdp.sharded_state_dict()
    at_call_state.update(fsdp.optimizer_sharded_state_dict(opt))
    at_call = {k: bits(v.local_tensor if hasattr(v, "local_tensor") else v) for k, v in at_call_state.items()}
    h = fsdp.save_checkpoint(str(tmp_path / "c"), optimizer=opt, extra_state={"step": 1}, async_save=True)
    _write_while_gated(gate, reached, step)
    h.wait()
    after = {k: bits(v.local_tensor if hasattr(v, "local_tensor") else v) for k, v in at_call_state.items()}
    assert any(not np.array_equal(after[k], at_call[k]) for k in at_call)  # the step did change the state
    paddle.seed(99)
    model2 = paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.ReLU(), paddle.nn.Linear(16, 4))
    fsdp2 = FullyShardFusion(model2)
    opt2 = paddle.optimizer.AdamW(parameters=model2.parameters(), learning_rate=0.05)
    result = fsdp2.load_checkpoint(str(tmp_path / "c"), optimizer=opt2)
    assert result["step"] == 1
    loaded = fsdp2.sharded_state_dict()
    loaded.update(fsdp2.optimizer_sharded_state_dict(opt2))
    for k, v in loaded.items():
        t = v.local_tensor if hasattr(v, "local_tensor") else v
        assert np.array_equal(bits(t), at_call[k]), k


def test_summon_full_params_writeback_right_after_an_async_save_waits(tmp_path, gated):
    """The writeback of ``summon_full_params(writeback=True)`` goes through ``paddle.assign(output=shard)``: it
    waits for the snapshot, and the checkpoint holds the parameters at the call."""
    from paddle.distributed.fsdp import FullyShardFusion

    gate, reached = gated
    paddle.seed(5)
    model = paddle.nn.Sequential(paddle.nn.Linear(6, 5), paddle.nn.Linear(5, 3))
    fsdp = FullyShardFusion(model)
    records = fsdp.sharded_state_dict()
    at_call = {k: bits(v.local_tensor) for k, v in records.items()}
    h = fsdp.save_checkpoint(str(tmp_path / "c"), async_save=True)

    def rewrite():
        with fsdp.summon_full_params(writeback=True), paddle.no_grad():
            for p in model.parameters():
                p.set_value(paddle.full(p.shape, 9.0, dtype=p.dtype))

    _write_while_gated(gate, reached, rewrite)
    h.wait()
    assert all(bool((v.local_tensor.numpy() == 9.0).all()) for v in fsdp.sharded_state_dict().values())
    paddle.seed(77)
    model2 = paddle.nn.Sequential(paddle.nn.Linear(6, 5), paddle.nn.Linear(5, 3))
    fsdp2 = FullyShardFusion(model2)
    fsdp2.load_checkpoint(str(tmp_path / "c"))
    for k, v in fsdp2.sharded_state_dict().items():
        assert np.array_equal(bits(v.local_tensor), at_call[k]), k


def test_snapshot_guard_overlap_is_by_address():
    g = snapshot_guard.SnapshotInFlight([(100, 200), (300, 310), (1000, 5000)])
    assert g.overlaps(150, 160) and g.overlaps(190, 305) and g.overlaps(4999, 6000) and g.overlaps(0, 101)
    assert not g.overlaps(200, 300) and not g.overlaps(310, 1000) and not g.overlaps(5000, 9000)
    assert not g.overlaps(0, 100)
