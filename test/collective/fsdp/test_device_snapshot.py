"""Async-save snapshot of device tensors (fake-device mode, switched on in-process as in test_device.py).

Device records are staged like host ones: their bytes reach the snapshot through ``device.to_host`` in batches
(fewer calls than tensors), deferred ones on the save's background thread (the optimizer step and direct writes
wait for them), volatile ones at the call; device memory is never read through a data pointer.
"""

from __future__ import annotations

import threading

import numpy as np
import paddle
import paddle.distributed.fsdp.checkpoint as ck
import pytest
import test_async_snapshot as base
from paddle.distributed.fsdp import device
from paddle.distributed.fsdp.checkpoint import snapshot, snapshot_guard

gated = base.gated  # the gate that holds background copies back (fixture shared with test_async_snapshot)
WRITES, bits, _write_while_gated = base.WRITES, base.bits, base._write_while_gated
_linear_and_adamw, _engine_state = base._linear_and_adamw, base._engine_state


@pytest.fixture
def fake_device():
    before = device.options()
    device.set_options(device.DeviceOptions(fake_device=True, emulate_gpu_collectives=True))
    try:
        yield
    finally:
        device.set_options(before)


@pytest.fixture
def spy(monkeypatch):
    """Records every device.to_host call (thread, tensor count, device bytes) and every raw pointer read."""
    calls: list[dict] = []
    pointer_reads: list[bool] = []
    real_to_host, real_data_ptr = device.to_host, device.data_ptr

    def to_host(tensors, staging=None, chunk_bytes=device.DEFAULT_CHUNK_BYTES):
        tensors = list(tensors)
        dev = [t for t in tensors if not device.is_host(t)]
        calls.append(
            {
                "thread": threading.current_thread() is threading.main_thread(),
                "n": len(dev),
                "bytes": sum(int(np.prod(t.shape)) * t.element_size() for t in dev),
            }
        )
        return real_to_host(tensors, staging, chunk_bytes)

    def data_ptr(t):
        pointer_reads.append(device.is_host(t))
        return real_data_ptr(t)

    monkeypatch.setattr(device, "to_host", to_host)
    monkeypatch.setattr(device, "data_ptr", data_ptr)
    return calls, pointer_reads


def _nbytes(t) -> int:
    return int(np.prod(t.shape)) * t.element_size()


def _mlp_and_adamw(layers=6, seed=4):
    paddle.seed(seed)
    model = paddle.nn.Sequential(*[paddle.nn.Linear(8, 8) for _ in range(layers)])
    opt = paddle.optimizer.AdamW(parameters=model.parameters(), learning_rate=0.1)
    model(paddle.rand([4, 8])).sum().backward()
    opt.step()
    opt.clear_grad()
    state = {f"p{i}": p for i, p in enumerate(model.parameters())}
    for name, per_param in opt._accumulators.items():
        for pname, t in per_param.items():
            state[f"{pname}.{name}"] = t
    return model, opt, state


def test_async_save_of_device_tensors_is_batched_off_the_training_thread(tmp_path, fake_device, gated, spy):
    gate, reached = gated
    calls, pointer_reads = spy
    model, opt, state = _mlp_and_adamw()
    assert not any(device.is_host(t) for t in state.values())
    at_call = {k: bits(v) for k, v in state.items()}
    h = ck.save_state_dict(state, str(tmp_path / "c"), async_save=True, deferred_keys=list(state))
    assert not calls, "deferred device tensors were copied on the training thread at the call"

    def step():
        model(paddle.rand([4, 8])).sum().backward()
        opt.step()

    _write_while_gated(gate, reached, step)
    h.wait()
    assert calls and not any(c["thread"] for c in calls), "device copies ran on the training thread"
    assert sum(c["n"] for c in calls) == len(state)  # every tensor once ...
    assert len(calls) < len(state)  # ... batched, not one call per tensor
    assert sum(c["bytes"] for c in calls) == sum(_nbytes(t) for t in state.values())
    assert all(pointer_reads), "a device tensor was read through its data pointer"
    assert any(not np.array_equal(bits(v), at_call[k]) for k, v in state.items())  # the step changed the state
    targets = {k: paddle.zeros_like(v) for k, v in state.items()}
    ck.load_state_dict(targets, str(tmp_path / "c"))
    for k, v in targets.items():
        assert np.array_equal(bits(v), at_call[k]), f"{k} saved with a value after the call"


@pytest.mark.parametrize("writer", ["add_", "set_value", "setitem", "assign_output", "copy_"])
def test_direct_write_to_a_device_parameter_waits_for_its_staged_copy(tmp_path, fake_device, gated, writer):
    """The guard compares device address ranges: a direct write to a device parameter waits for its copy."""
    gate, reached = gated
    lin, opt = _linear_and_adamw()
    state = _engine_state(lin, opt)
    at_call = {k: bits(v) for k, v in state.items()}
    h = ck.save_state_dict(state, str(tmp_path / "c"), async_save=True)

    def write():
        with paddle.no_grad():
            WRITES[writer](lin, opt)

    _write_while_gated(gate, reached, write)
    h.wait()
    assert not np.array_equal(bits(lin.weight), at_call["weight"])
    targets = {k: paddle.zeros_like(v) for k, v in state.items()}
    ck.load_state_dict(targets, str(tmp_path / "c"))
    for k, v in targets.items():
        assert np.array_equal(bits(v), at_call[k]), k


def test_volatile_device_tensors_are_staged_at_the_call(tmp_path, fake_device, gated, spy):
    gate, _reached = gated
    calls, pointer_reads = spy
    bn = paddle.nn.BatchNorm1D(5)
    bn.train()
    bn(paddle.rand([16, 5]) * 3)
    state = {"mean": bn._mean, "var": bn._variance, "w": bn.weight, "b": bn.bias}
    at_call = {k: bits(v) for k, v in state.items()}
    h = ck.save_state_dict(state, str(tmp_path / "c"), async_save=True)
    assert len(calls) == 1 and calls[0]["thread"] and calls[0]["n"] == 2  # mean + var, one batch, at the call
    bn(paddle.rand([16, 5]) * 7)  # forward rewrites the statistics right after the call
    gate.set()
    h.wait()
    assert len(calls) == 2 and not calls[1]["thread"] and calls[1]["n"] == 2  # w + b in the background
    assert all(pointer_reads)
    targets = {k: paddle.zeros_like(v) for k, v in state.items()}
    ck.load_state_dict(targets, str(tmp_path / "c"))
    for k, v in targets.items():
        assert np.array_equal(bits(v), at_call[k]), k


class _Rec:
    def __init__(self, key, tensor):
        self.key, self.tensor = key, tensor


@pytest.mark.parametrize("fake", [True, False])
def test_snapshot_stages_in_chunks_of_the_given_size(fake, spy):
    """Snapshot directly, small chunk: device tensors go through to_host in batches of about chunk_bytes;
    strided tensors (a transposed view) are staged too, with row-major bytes; mixed dtypes and empty ones."""
    before = device.options()
    device.set_options(device.DeviceOptions(fake_device=fake, emulate_gpu_collectives=fake))
    try:
        calls, pointer_reads = spy
        rs = np.random.default_rng(1)
        base = paddle.to_tensor(rs.normal(size=[6, 4]).astype("float32"))
        tensors = [paddle.to_tensor(rs.normal(size=[16]).astype("float32")) for _ in range(10)]
        tensors += [
            paddle.to_tensor(rs.integers(0, 9, size=[5]).astype("int64")),
            paddle.to_tensor(rs.normal(size=[8]).astype("float32")).astype("bfloat16"),
            paddle.zeros([0], dtype="float32"),
            base.transpose([1, 0]),
        ]
        records = [_Rec(f"t{i}", t) for i, t in enumerate(tensors)]
        snap = snapshot.Snapshot(records, lambda r: int(r.key[1:]) % 2 == 0, chunk_bytes=128)
        try:
            at_call = [np.ascontiguousarray(t.numpy()).view(np.uint8).ravel().copy() for t in tensors]
            assert snap.pending and snapshot_guard.snapshot_in_flight()
            snap.copy_deferred()
            assert not snap.pending
            for arr, want in zip(snap.arrays, at_call):
                assert np.array_equal(arr, want)
        finally:
            snap.written()
        staged = [t for t in tensors if _nbytes(t) and (fake or not t.is_contiguous())]
        if fake:
            assert sum(c["n"] for c in calls) == len(staged)
            assert sum(c["bytes"] for c in calls) == sum(_nbytes(t) for t in staged)
            assert len(calls) < len(staged)
            assert all(c["bytes"] <= 128 for c in calls)  # no batch exceeds a chunk
            assert all(pointer_reads)
        else:
            assert sum(c["n"] for c in calls) == 0  # host tensors are never copied through device.to_host
    finally:
        device.set_options(before)


def test_a_device_tensor_larger_than_a_chunk_is_staged_in_pieces(fake_device, spy, monkeypatch):
    """A large device tensor (a fused buffer shard) does not grow the staging buffer to its size."""
    calls, pointer_reads = spy
    staging = device.HostStaging()
    monkeypatch.setattr(snapshot, "_staging", staging)
    rs = np.random.default_rng(2)
    big = paddle.to_tensor(rs.normal(size=[10, 25]).astype("float32"))  # 1000 bytes
    strided = paddle.to_tensor(rs.normal(size=[30, 10]).astype("float32")).transpose([1, 0])  # 1200 bytes
    small = paddle.to_tensor(rs.normal(size=[3]).astype("float32"))
    tensors = [big, small, strided]
    at_call = [np.ascontiguousarray(t.numpy()).view(np.uint8).ravel().copy() for t in tensors]
    snap = snapshot.Snapshot([_Rec(f"t{i}", t) for i, t in enumerate(tensors)], lambda r: True, chunk_bytes=256)
    try:
        snap.copy_deferred()
        for arr, want in zip(snap.arrays, at_call):
            assert np.array_equal(arr, want)
    finally:
        snap.written()
    assert sum(c["bytes"] for c in calls) == sum(_nbytes(t) for t in tensors)
    assert all(c["bytes"] <= 256 for c in calls)
    assert 0 < staging.nbytes() <= 256  # the staging buffer is bounded by the chunk, not by the largest tensor
    assert all(pointer_reads)
