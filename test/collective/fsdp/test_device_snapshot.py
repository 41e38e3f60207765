"""Async-save snapshot of device tensors (fake-device mode, switched on in-process as in test_device.py).

Device records are copied at the call in one copy batch (a copy stream and events, emulated here), volatile
ones first (the compute stream waits for those), and waited for on the save's background thread by polling
with the GIL released (the optimizer step and direct writes wait for that); device memory is never read
through a data pointer, results are byte for byte those of a sync save.
"""

from __future__ import annotations

import functools
import json
import threading

import numpy as np
import paddle
import paddle.distributed.fsdp.checkpoint as ck
import pytest
import test_async_snapshot as base
from paddle.distributed.fsdp.checkpoint import snapshot, snapshot_guard
from paddle.distributed.fsdp.devices import device, device_rules, device_streams

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
    """Records every copy batch: where its copies were issued (thread, tensor count, bytes) and where it was
    waited for (thread, polls); and every raw pointer read (True: of host memory)."""
    issued: list[dict] = []
    waits: list[dict] = []
    pointer_reads: list[bool] = []
    real_copy, real_wait, real_data_ptr = device_streams.CopyBatch.copy, device_streams.CopyBatch.wait, device.data_ptr

    def copy(self, pairs):
        pairs = list(pairs)
        if pairs:
            issued.append(
                {
                    "main": threading.current_thread() is threading.main_thread(),
                    "batch": id(self),
                    "n": len(pairs),
                    "bytes": sum(_nbytes(src) for _dst, src in pairs),
                }
            )
        return real_copy(self, pairs)

    def wait(self):
        real_wait(self)
        waits.append({"main": threading.current_thread() is threading.main_thread(), "polls": self.polls})

    def data_ptr(t):
        pointer_reads.append(device.is_host(t))
        return real_data_ptr(t)

    monkeypatch.setattr(device_streams.CopyBatch, "copy", copy)
    monkeypatch.setattr(device_streams.CopyBatch, "wait", wait)
    monkeypatch.setattr(device, "data_ptr", data_ptr)
    device_rules.syncs(reset=True)
    return issued, waits, pointer_reads


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


def _files(root) -> dict:
    """Per data file: its tensor table and data bytes (the header's ``__metadata__`` holds the checkpoint id)."""
    files = {}
    for p in sorted(root.rglob("*.safetensors")):
        raw = p.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        table = json.loads(raw[8 : 8 + n])
        table.pop("__metadata__", None)
        files[p.name] = (table, raw[8 + n :])
    assert files, f"no data files under {root}"
    return files


def test_async_save_of_device_tensors_copies_at_the_call_and_waits_off_the_training_thread(
    tmp_path, fake_device, gated, spy
):
    """One copy batch issued at the call (on the copy stream, fake-emulated); the wait for it runs on the
    background thread, polling with the GIL released, never a GIL-held device synchronisation there; the
    checkpoint holds the values at the call, byte for byte the same as a sync save at that moment."""
    gate, reached = gated
    issued, waits, pointer_reads = spy
    model, opt, state = _mlp_and_adamw()
    assert not any(device.is_host(t) for t in state.values())
    at_call = {k: bits(v) for k, v in state.items()}
    ck.save_state_dict(state, str(tmp_path / "sync"))
    sync_batches = len({c["batch"] for c in issued})
    issued.clear(), waits.clear()
    device_rules.syncs(reset=True)
    h = ck.save_state_dict(state, str(tmp_path / "async"), async_save=True, deferred_keys=list(state))
    assert len(issued) == 1 and issued[0]["main"] and issued[0]["n"] == len(state), issued  # at the call, batched
    assert issued[0]["bytes"] == sum(_nbytes(t) for t in state.values())
    assert not waits, "the training thread waited for the copies"

    def step():
        model(paddle.rand([4, 8])).sum().backward()
        opt.step()

    _write_while_gated(gate, reached, step)
    h.wait()
    assert len(waits) == 1 and not waits[0]["main"] and waits[0]["polls"] >= 1
    background = [r for r in device_rules.syncs() if not r.main_thread]
    assert background and not [r for r in background if r.gil_held], background
    assert all(pointer_reads), "a device tensor was read through its data pointer"
    assert any(not np.array_equal(bits(v), at_call[k]) for k, v in state.items())  # the step changed the state
    assert sync_batches < len(state)  # the sync save staged several records per batch too
    assert _files(tmp_path / "async") == _files(tmp_path / "sync")
    targets = {k: paddle.zeros_like(v) for k, v in state.items()}
    ck.load_state_dict(targets, str(tmp_path / "async"))
    for k, v in targets.items():
        assert np.array_equal(bits(v), at_call[k]), f"{k} saved with a value after the call"


def test_pinned_staging_is_reused_across_async_saves(tmp_path, fake_device, spy):
    """The device bytes of an async save land in the process's pinned staging once (not in the arena), and the
    next save reuses it: no allocation per save."""
    _model, _opt, state = _mlp_and_adamw()
    staging = snapshot.snapshot_staging._staging
    ck.save_state_dict(state, str(tmp_path / "a"), async_save=True).wait()
    allocations, size = staging.allocations, staging.nbytes()
    assert size >= sum(_nbytes(t) for t in state.values()) and allocations >= 1
    for i in range(2):
        ck.save_state_dict(state, str(tmp_path / f"b{i}"), async_save=True).wait()
    assert staging.allocations == allocations and staging.nbytes() == size
    assert _files(tmp_path / "a") == _files(tmp_path / "b1")


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


def test_volatile_device_tensors_are_copied_before_the_next_forward(tmp_path, fake_device, gated, spy):
    """Volatile device tensors (BatchNorm statistics) are copied first and the compute stream waits for them
    (fence): a forward right after the call rewrites them, the checkpoint holds the values at the call."""
    gate, _reached = gated
    issued, waits, pointer_reads = spy
    bn = paddle.nn.BatchNorm1D(5)
    bn.train()
    bn(paddle.rand([16, 5]) * 3)
    state = {"mean": bn._mean, "var": bn._variance, "w": bn.weight, "b": bn.bias}
    at_call = {k: bits(v) for k, v in state.items()}
    h = ck.save_state_dict(state, str(tmp_path / "c"), async_save=True)
    assert [(c["main"], c["n"]) for c in issued] == [(True, 2), (True, 2)]  # mean + var, then w + b: at the call
    assert len({c["batch"] for c in issued}) == 1
    bn(paddle.rand([16, 5]) * 7)  # forward rewrites the statistics right after the call
    gate.set()
    h.wait()
    assert len(waits) == 1 and not waits[0]["main"]
    assert all(pointer_reads)
    targets = {k: paddle.zeros_like(v) for k, v in state.items()}
    ck.load_state_dict(targets, str(tmp_path / "c"))
    for k, v in targets.items():
        assert np.array_equal(bits(v), at_call[k]), k


class _Rec:
    def __init__(self, key, tensor):
        self.key, self.tensor = key, tensor


def _zoo(seed: int) -> list:
    rs = np.random.default_rng(seed)
    base = paddle.to_tensor(rs.normal(size=[6, 4]).astype("float32"))
    tensors = [paddle.to_tensor(rs.normal(size=[16]).astype("float32")) for _ in range(6)]
    tensors += [
        paddle.to_tensor(rs.normal(size=[3, 4, 2]).astype("float32")),
        paddle.to_tensor(rs.integers(0, 9, size=[5, 2]).astype("int64")),
        paddle.to_tensor(rs.normal(size=[8]).astype("float32")).astype("bfloat16"),
        paddle.zeros([0], dtype="float32"),
        base.transpose([1, 0]),
    ]
    return tensors


@pytest.mark.parametrize("fake", [True, False])
def test_snapshot_holds_row_major_bytes_of_every_kind_of_tensor(fake, spy):
    """Snapshot directly: multi-dim, strided (a transposed view), mixed dtypes and empty tensors, half of them
    deferred: the arrays hold each tensor's row-major bytes at construction; device ones went through one copy
    batch, host ones never did."""
    before = device.options()
    device.set_options(device.DeviceOptions(fake_device=fake, emulate_gpu_collectives=fake))
    try:
        issued, waits, pointer_reads = spy
        tensors = _zoo(1)
        records = [_Rec(f"t{i}", t) for i, t in enumerate(tensors)]
        snap = snapshot.Snapshot(records, lambda r: int(r.key[1:]) % 2 == 0)
        try:
            at_call = [np.ascontiguousarray(t.numpy()).view(np.uint8).ravel().copy() for t in tensors]
            assert snap.pending and snapshot_guard.snapshot_in_flight()
            snap.copy_deferred()
            assert not snap.pending
            for arr, want in zip(snap.arrays, at_call):
                assert np.array_equal(arr, want)
        finally:
            snap.written()
        staged = [t for t in tensors if _nbytes(t)] if fake else []
        assert sum(c["n"] for c in issued) == len(staged)
        assert sum(c["bytes"] for c in issued) == sum(_nbytes(t) for t in staged)
        assert len({c["batch"] for c in issued}) == (1 if fake else 0)
        assert all(pointer_reads)
    finally:
        device.set_options(before)


def test_sync_save_stages_device_records_in_batches_of_a_chunk(fake_device, spy, monkeypatch):
    """A sync save's writer gets consecutive device records staged together (one copy batch, one wait, at most
    a chunk unless one record is larger), their staging handed back to a small pool once written."""
    issued, waits, pointer_reads = spy
    tensors = _zoo(2) + [paddle.to_tensor(np.random.default_rng(3).normal(size=[100]).astype("float32"))]
    providers = snapshot.lazy_views(tensors, chunk_bytes=128)
    got = []
    for p in providers:
        arr, owner = p()
        got.append(arr.copy())
        del arr, owner
    for arr, t in zip(got, tensors):
        assert np.array_equal(arr, np.ascontiguousarray(t.numpy()).view(np.uint8).ravel())
    device_bytes = [_nbytes(t) for t in tensors if _nbytes(t)]
    assert sum(c["n"] for c in issued) == len(device_bytes) and len(issued) < len(device_bytes)
    assert all(c["bytes"] <= 128 or c["n"] == 1 for c in issued)
    assert len(waits) == len(issued) and all(w["main"] for w in waits)
    assert len(snapshot.sync_pool._free) <= 2
    assert all(pointer_reads)
    pool = snapshot._StagingPool(keep=2, max_bytes=256)
    small, big = device.HostStaging(), device.HostStaging()
    small.buffer(paddle.float32, 16), big.buffer(paddle.float32, 100)
    pool.give(big), pool.give(small)  # one record larger than a chunk grew `big`: not kept pinned for later
    assert pool._free == [small] and pool.take() is small


def test_fingerprints_of_device_buffers_take_no_blocking_copy(fake_device, spy):
    """The per-save fingerprint of persistable buffers: one copy batch for all of them, no ``.cpu()``."""
    from paddle.distributed.fsdp.state import buffers

    issued, waits, _pointer_reads = spy
    layer = paddle.nn.Linear(4, 4)
    layer.register_buffer("ema", paddle.rand([3, 4]))
    layer.register_buffer("steps", paddle.to_tensor([7, 9], dtype="int64"))
    layer.register_buffer("scratch", paddle.rand([2]), persistable=False)
    found = buffers.persistable_buffers(layer)
    assert list(found) == ["ema", "steps"]
    prints = buffers.fingerprints(found)
    assert set(prints) == set(found) and len(issued) == 1 and issued[0]["n"] == len(found)
    assert not [r for r in device_rules.syncs() if r.kind == "Tensor.cpu"]
    for key, t in found.items():
        again = buffers.fingerprints({key: paddle.to_tensor(t.numpy())})
        assert again[key] == prints[key]
    t = next(iter(found.values()))
    flipped = t.numpy().copy()
    flipped.view(np.uint8)[0] ^= 1
    assert buffers.fingerprints({"x": paddle.to_tensor(flipped)})["x"] != buffers.fingerprints({"x": t})["x"]


def test_fsdp_checkpoints_take_no_gil_held_sync_off_the_training_thread(tmp_path, fake_device, spy):
    """A wrapped model with a persistable buffer and BatchNorm statistics, sync then async save_checkpoint:
    no blocking ``.cpu()`` anywhere, no GIL-held device sync on the background thread (it polls), and both
    checkpoints load back to the state at their call."""
    from paddle.distributed.fsdp import FullyShardFusion

    issued, waits, pointer_reads = spy
    paddle.seed(5)
    model = paddle.nn.Sequential(paddle.nn.Linear(8, 8), paddle.nn.BatchNorm1D(8), paddle.nn.Linear(8, 4))
    model.register_buffer("ema", paddle.rand([2, 3]))
    fsdp = FullyShardFusion(model)
    opt = paddle.optimizer.AdamW(parameters=model.parameters(), learning_rate=0.1)

    def step():
        model(paddle.rand([6, 8])).sum().backward()
        opt.step()
        opt.clear_grad()

    def local(f) -> dict:
        return {k: bits(getattr(v, "local_tensor", v)) for k, v in f.sharded_state_dict().items()}

    step()
    at_call = local(fsdp)
    device_rules.syncs(reset=True)
    fsdp.save_checkpoint(str(tmp_path / "sync"), optimizer=opt)
    h = fsdp.save_checkpoint(str(tmp_path / "async"), optimizer=opt, async_save=True)
    step()
    h.wait()
    log = device_rules.syncs(reset=True)
    assert not [r for r in log if r.kind == "Tensor.cpu"], log
    assert not [r for r in log if not r.main_thread and r.gil_held], log
    assert any(not r.main_thread and r.kind == "copy event poll" for r in log)
    assert all(pointer_reads)
    for kind in ("sync", "async"):
        paddle.seed(6)
        fresh = paddle.nn.Sequential(paddle.nn.Linear(8, 8), paddle.nn.BatchNorm1D(8), paddle.nn.Linear(8, 4))
        fresh.register_buffer("ema", paddle.zeros([2, 3]))
        fresh_fsdp = FullyShardFusion(fresh)
        fresh_fsdp.load_checkpoint(str(tmp_path / kind))
        got = local(fresh_fsdp)
        assert set(got) == set(at_call) and all(np.array_equal(v, at_call[k]) for k, v in got.items()), kind


@pytest.mark.parametrize("fake", [True, False])
def test_memory_tier_slot_holds_row_major_bytes_of_every_kind_of_tensor(tmp_path, fake, spy, monkeypatch):
    """A memory-tier save into its slot (memtier/copies.py), half of the records deferred: the copy holds each
    tensor's row-major bytes at the call (strided, bf16, empty ones too); every device copy was issued at the
    call on the training thread in one batch (a GPU's copy stream is the process's: never entered from the
    background thread), host ones never went through a batch, no device memory was read through a pointer."""
    from memtier_util import DURABLE_ID
    from paddle.distributed.fsdp.checkpoint.format.reserved import BUFFERS_KEY, EXTRA_KEY, RNG_KEY
    from paddle.distributed.fsdp.memtier.copies import SaveIntoSlot, offsets_of, read_copy
    from paddle.distributed.fsdp.memtier.slot import Slot
    from paddle.distributed.fsdp.memtier.state import _tier_state

    before = device.options()
    device.set_options(device.DeviceOptions(fake_device=fake, emulate_gpu_collectives=fake))
    try:
        issued, waits, pointer_reads = spy
        tensors = _zoo(2)
        state = _tier_state({f"t{i}": t for i, t in enumerate(tensors)}, {f"t{i}" for i in range(0, len(tensors), 2)})
        at_call = {r.key: bits(r.tensor) for r in state.records}
        path = str(tmp_path / "rank00000.own")
        slot = Slot.allocate(path, 1 << 16, offsets_of(state.layout)[1])
        expect = {"job": "j", "world": 1, "rank": 0, "durable_id": DURABLE_ID}
        values = {EXTRA_KEY: {}, BUFFERS_KEY: [], RNG_KEY: None}
        job = SaveIntoSlot(slot, state, dict(expect, step=1, values=values, descs=state.descs), "xxh3-64")
        assert all(c["main"] for c in issued) and not waits  # issued at the call, not waited for there
        errors: list = []

        def write():  # training goes on: its writes wait for the copies, which hold the values at the call
            for t in reversed(tensors):  # the strided one first (made contiguous for its copy: moved)
                if _nbytes(t) and t.is_contiguous():
                    t.scale_(3.0)

        writer = threading.Thread(target=lambda: _catch(write, errors))
        writer.start()
        real_wait = snapshot.StagedInto.wait
        # the device copies complete only once the writer ran or was held back long enough: a write let through
        # before them would end up in the copy
        monkeypatch.setattr(snapshot.StagedInto, "wait", lambda self: (writer.join(0.5), real_wait(self))[1])
        background = threading.Thread(target=lambda: _catch(job.finish, errors))  # the tier's background thread
        background.start()
        background.join(60)
        writer.join(60)
        assert errors == [] and not snapshot_guard.snapshot_in_flight()
        slot.close()
        copy, header, doff, dlen = read_copy(path, expect, state.layout)
        data = copy.data(doff, dlen)
        got = {key: data[off : off + n].copy() for key, _d, _s, off, n, _sums in header["records"]}
        copy.close()
        assert set(got) == set(at_call) and [k for k, v in at_call.items() if not np.array_equal(got[k], v)] == []
        staged = [t for t in tensors if _nbytes(t)] if fake else []
        assert sum(c["n"] for c in issued) == len(staged) and len({c["batch"] for c in issued}) == (1 if fake else 0)
        assert sum(c["bytes"] for c in issued) == sum(_nbytes(t) for t in staged)
        assert all(pointer_reads)
    finally:
        device.set_options(before)


def test_memory_tier_of_device_tensors_restores_each_save_bit_for_bit(tmp_path, fake_device, spy):
    """FSDP + AdamW with BatchNorm statistics (volatile records) in fake-device mode: memory-tier saves (one
    waited for, two with training going on at once) and a restore from the memory copy, and from the persisted
    checkpoint, give back each save's state bit for bit; no device memory is read through a pointer."""
    from memtier_util import small_fsdp, state_bytes, train_step
    from paddle.distributed.fsdp.memtier import MemoryTier

    issued, _waits, pointer_reads = spy
    build = functools.partial(small_fsdp, batch_norm=True)
    root, mem = str(tmp_path / "durable"), str(tmp_path / "mem")
    model, fsdp, opt = build(1)
    tier = MemoryTier(fsdp, opt, durable_root=root, memory_root=mem, persist_every=2, keep_last=None, job_id="j")
    wants = {}
    for step in (1, 2, 3):
        train_step(model, opt)
        issued.clear()
        tier.save(step, extra_state={"step": step})
        assert issued and all(c["main"] for c in issued), issued  # device copies issued at the call
        wants[step] = (state_bytes(fsdp, opt), opt.get_lr())
        if step == 1:
            tier.wait()
        else:
            train_step(model, opt)  # at once: the optimizer step waits for the deferred copies
            if step == 2:
                tier.wait_persisted()
    tier.wait()
    assert tier.skipped == [] and tier.durable_saves == [2] and tier.persist_errors == []
    assert any(v != wants[3][0][k] for k, v in state_bytes(fsdp, opt).items())  # training moved on
    assert all(pointer_reads)
    tier.close(remove=False)

    _m, fsdp2, opt2 = build(9)
    tier2 = MemoryTier(fsdp2, opt2, durable_root=root, memory_root=mem, persist_every=2, keep_last=None, job_id="j")
    got = tier2.restore()
    assert (got.step, got.sources, dict(got)) == (3, ["memory"], {"step": 3})
    want, lr = wants[3]
    assert [k for k, v in state_bytes(fsdp2, opt2).items() if v != want[k]] == [] and opt2.get_lr() == lr
    tier2.close()

    _m, fsdp3, opt3 = build(9)
    extra = fsdp3.load_checkpoint(str(tmp_path / "durable" / "step_00000002"), optimizer=opt3)
    want, lr = wants[2]
    assert dict(extra) == {"step": 2} and opt3.get_lr() == lr
    assert [k for k, v in state_bytes(fsdp3, opt3).items() if v != want[k]] == []


def _catch(fn, errors: list) -> None:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - the test asserts there is none
        errors.append(e)
