"""device.py: host/device memory helpers, fake-device mode, and RNG state saved per generator kind.

Fake-device mode is switched on and off inside this process with ``device.set_options``; every test
restores the options it found.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

import numpy as np
import paddle
import pytest
from paddle.distributed.fsdp import FullyShardFusion
from paddle.distributed.fsdp.checkpoint.errors import MetadataError
from paddle.distributed.fsdp.devices import device, device_rules
from paddle.distributed.fsdp.state import rng


@pytest.fixture
def fake_device():
    before = device.options()
    device.set_options(device.DeviceOptions(fake_device=True, emulate_gpu_collectives=True))
    try:
        yield
    finally:
        device.set_options(before)


def test_fake_device_tensors_are_not_host_and_refuse_raw_pointers(fake_device):
    from paddle.distributed.fsdp.checkpoint import host_memory as storage

    t = paddle.arange(6, dtype="float32")
    assert not device.is_host(t) and not storage.is_host_contiguous(t)
    with pytest.raises(device.DeviceMemoryAccessError):
        device.data_ptr(t)
    with pytest.raises(ValueError, match="not a contiguous host tensor"):  # the engine's in-place view refuses
        storage.raw_view(t, allow_copy=False)
    arr, keep = storage.raw_view(t)  # ... and copies through to_host when allowed
    assert device.is_host(keep) and np.array_equal(arr.view(np.float32), np.arange(6, dtype="float32"))
    (ctypes.c_ubyte * 24).from_address(t.data_ptr())  # stock and third-party callers are not guarded


def test_bench_view_refuses_device_memory(fake_device, monkeypatch):
    tools = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tools")
    monkeypatch.syspath_prepend(os.path.normpath(tools))
    from ckpt_bench import phases

    with pytest.raises(device.DeviceMemoryAccessError, match="not contiguous host memory"):
        phases.tensor_bytes_view(paddle.ones([4]))
    assert phases.tensor_bytes_view(device.host_empty([4], "float32")).nbytes == 16


def test_without_fake_device_cpu_tensors_are_host():
    if device.options().fake_device:
        pytest.skip("session runs in fake-device mode (--fake-device)")
    t = paddle.arange(6, dtype="float32")
    assert device.is_host(t) and t.data_ptr() == device.data_ptr(t)


def test_to_host_copies_every_dtype_into_flat_views_of_one_reusable_staging_buffer(fake_device):
    """Multi-dim and strided device tensors land in flat (1-D) views: no op but the copy runs on the host side."""
    rs = np.random.default_rng(0)
    tensors = [
        paddle.to_tensor(rs.normal(size=[3, 5]).astype("float32")),
        paddle.to_tensor(rs.normal(size=[7]).astype("float32")).astype("bfloat16"),
        paddle.to_tensor(rs.integers(0, 100, size=[2, 2, 2]).astype("int64")),
        paddle.zeros([0], dtype="float32"),
        paddle.to_tensor(rs.normal(size=[4, 2]).astype("float64")).transpose([1, 0]),
    ]
    staging = device.HostStaging()
    host = device.to_host(tensors, staging)
    for src, out in zip(tensors, host):
        assert device.is_host(out) and out.shape == [src.size] and out.dtype == src.dtype
        np.testing.assert_array_equal(out.numpy(), np.ascontiguousarray(src.numpy()).ravel())
        if out.shape[0]:
            out.data_ptr()  # host views are readable in place
    size = staging.nbytes()
    assert size == sum(t.numel().item() * t.element_size() for t in tensors)  # one region per dtype, no slack
    again = device.to_host(tensors[:2], staging)  # reused: no new allocation
    assert staging.nbytes() == size and staging.allocations == 4
    np.testing.assert_array_equal(again[1].numpy(), tensors[1].numpy().ravel())


def test_to_host_returns_host_tensors_as_they_are(fake_device):
    host = device.host_empty([4], "float32")
    assert device.to_host([host])[0] is host
    view = host._slice(1, 3)  # views of host memory are host memory too
    assert device.is_host(view)


def test_host_to_device_copies_in_place_and_checks_shapes(fake_device):
    dst = paddle.zeros([2, 3], dtype="float32")
    src = device.host_empty([2, 3], "float32")
    src.copy_(paddle.arange(6, dtype="float32").reshape([2, 3]), True)
    device.host_to_device(src, dst)
    np.testing.assert_array_equal(dst.numpy(), np.arange(6, dtype="float32").reshape(2, 3))
    with pytest.raises(ValueError, match="host_to_device"):
        device.host_to_device(src, paddle.zeros([3, 2], dtype="float32"))


def test_pinned_request_falls_back_with_a_log_line(caplog, monkeypatch):
    monkeypatch.setattr(device, "_pin_fallback_logged", False)
    with caplog.at_level(logging.INFO, logger=device.__name__):
        t = device.host_empty([8], "float32", pinned=True)
    assert device.is_host_place(t.place)
    if not paddle.is_compiled_with_cuda() and not device.options().fake_device:
        assert any("pageable" in r.getMessage() for r in caplog.records)
    if paddle.is_compiled_with_cuda():  # the first GPU run: the pinned request must give pinned memory
        assert t.place.is_cuda_pinned_place(), f"pinned staging allocated on {t.place}"


def test_pinned_staging_is_pinned_explicitly_and_checked(fake_device, monkeypatch, caplog):
    """Host memory allocated as host memory, then pinned (emulated in fake mode); a pin step that hands back
    device memory (what paddle 3.3.1's creation op on CUDAPinnedPlace does on a GPU) is a named error; a pin
    step that refuses is a logged fallback to pageable host memory."""
    t = device.host_empty([2, 3], "float32")
    assert device_rules.is_fake_pinned(t) and device.is_host(t) and t.shape == [2, 3]
    monkeypatch.setattr(paddle.Tensor, "pin_memory", lambda self, blocking=True: paddle.zeros(self.shape, self.dtype))
    with pytest.raises(device.HostAllocationError, match="device memory in fake-device mode"):
        device.host_empty([4], "float32")
    with pytest.raises(device.HostAllocationError):  # ... also through the staging buffers
        device.to_host([paddle.ones([4])])

    def refuse(self, blocking=True):
        raise RuntimeError("cudaHostAlloc failed: out of memory")

    monkeypatch.setattr(paddle.Tensor, "pin_memory", refuse)
    monkeypatch.setattr(device, "_pin_fallback_logged", False)
    with caplog.at_level(logging.WARNING, logger=device.__name__):
        t = device.host_empty([4], "float32")
    assert device.is_host(t) and not device_rules.is_fake_pinned(t)
    assert any("pageable" in r.getMessage() and "cudaHostAlloc" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(paddle, "empty", lambda *a, **k: _on_device())  # a "gpu" result for a host request
    with pytest.raises(device.HostAllocationError, match="paddle.empty"):
        device.host_empty([4], "float32", pinned=False)


class _DevicePlace:
    def is_cpu_place(self):
        return False

    def is_cuda_pinned_place(self):
        return False

    def __str__(self):
        return "Place(gpu:0)"


class _OnDevice:
    place = _DevicePlace()


def _on_device():
    return _OnDevice()


@pytest.mark.parametrize(
    "op",
    [
        lambda h: h.reshape([2, 2]),
        lambda h: paddle.reshape(h, [2, 2]),
        lambda h: h + 1,
        lambda h: h[1:3],
        lambda h: paddle.assign(h),
        lambda h: paddle.concat([h, h]),
        lambda h: h.astype("float64"),
        lambda h: h._slice(0, 2).flatten(),
    ],
)
def test_ops_on_host_staging_memory_are_refused(fake_device, op):
    host = device.to_host([paddle.arange(4, dtype="float32")])[0]
    with pytest.raises(device_rules.HostStagingOpError):
        op(host)


def test_slices_and_copies_of_host_staging_memory_are_allowed(fake_device):
    host = device.host_empty([4], "float32")
    host.copy_(paddle.arange(4, dtype="float32"), True)
    part = host._slice(1, 3)
    dst = paddle.zeros([2], dtype="float32")
    dst.copy_(part, True)
    np.testing.assert_array_equal(dst.numpy(), [1, 2])
    np.testing.assert_array_equal(part.numpy(), [1, 2])


def test_device_synchronisations_are_logged_with_thread_and_gil(fake_device):
    device_rules.syncs(reset=True)
    t = paddle.ones([3])
    t.cpu()
    paddle.device.synchronize()
    device.to_host([t])
    done = []
    worker = threading.Thread(target=lambda: done.append(device.to_host([t])), name="bg")
    worker.start()
    worker.join()
    log = device_rules.syncs(reset=True)
    assert [(r.kind, r.main_thread, r.gil_held) for r in log[:2]] == [
        ("Tensor.cpu", True, True),
        ("paddle.device.synchronize", True, True),
    ]
    polls = [r for r in log[2:] if r.kind == "copy event poll"]
    assert polls and all(not r.gil_held for r in polls) and {r.thread for r in polls} == {"MainThread", "bg"}
    assert not [r for r in log if not r.main_thread and r.gil_held]


def test_parameter_on_another_place_is_refused_by_name():
    class Gpu0:  # a device place (none can be made on a CPU-only build)
        def is_cpu_place(self) -> bool:
            return False

        def is_cuda_pinned_place(self) -> bool:
            return False

        def __str__(self) -> str:
            return "Place(gpu:0)"

    class Placed:
        place = Gpu0()

    with pytest.raises(ValueError, match=r"'blocks.0.w' is on Place\(gpu:0\).*shards onto Place\(cpu\)"):
        device.check_same_place("blocks.0.w", Placed(), paddle.CPUPlace())


# ---- RNG state -------------------------------------------------------------------------------------------


def _draws() -> np.ndarray:
    return paddle.rand([5]).numpy()


def test_rng_round_trip_by_entries():
    saved = [rng.capture()]
    assert set(saved[0]) >= {"format", "cpu"}
    first = _draws()
    rng.validate(saved, 0)
    rng.restore(saved, 0)
    np.testing.assert_array_equal(_draws(), first)


def test_rng_device_entry_in_fake_device_mode(fake_device):
    saved = [rng.capture()]
    assert saved[0]["device"]["type"] == "fake_device"
    kind, generator = rng.current_device_generator()
    state_before = generator.get_state().__getstate__()
    generator.manual_seed(12345)
    rng.validate(saved, 0)
    rng.restore(saved, 0)
    assert generator.get_state().__getstate__() == state_before


def test_rng_mismatches_are_refused(fake_device):
    with_device = [rng.capture()]
    cpu_only = [{k: v for k, v in with_device[0].items() if k != "device"}]
    with pytest.raises(rng.RngStateMismatchError, match="CPU-only"):
        rng.validate(cpu_only, 0)
    legacy = [[list(s.__getstate__()) for s in paddle.get_rng_state()] * 2]  # saved with one more device visible
    with pytest.raises(rng.RngStateMismatchError, match="device visibility differs"):
        rng.validate(legacy, 0)
    with pytest.raises(MetadataError, match="known format"):
        rng.validate([{"format": "other"}], 0)
    damaged = [dict(with_device[0], cpu=with_device[0]["cpu"][:3] + [with_device[0]["cpu"][3][:-7]])]
    with pytest.raises(MetadataError, match="damaged"):
        rng.validate(damaged, 0)
    rng.validate([], 0)  # no random state saved (a converted checkpoint): nothing to restore


def test_load_refuses_rng_mismatch_before_writing(tmp_path):
    """A checkpoint saved on CPU, loaded where a device generator exists (fake device): refused, nothing
    written (checked before the engine is called at all)."""
    if device.options().fake_device:
        pytest.skip("needs a save outside fake-device mode")
    paddle.seed(4)
    model = paddle.nn.Sequential(paddle.nn.Linear(4, 4), paddle.nn.Linear(4, 2))
    fsdp = FullyShardFusion(model)
    path = os.path.join(tmp_path, "ckpt")
    fsdp.save_checkpoint(path)
    with paddle.no_grad():
        for p in model.parameters():
            p.set_value(paddle.full(p.shape, 3.0, dtype=p.dtype))
    before = {k: v.numpy().copy() for k, v in model.named_parameters()}
    saved_options = device.options()
    device.set_options(device.DeviceOptions(fake_device=True))
    try:
        with pytest.raises(rng.RngStateMismatchError, match="CPU-only"):
            fsdp.load_checkpoint(path)
    finally:
        device.set_options(saved_options)
    for key, value in model.named_parameters():
        np.testing.assert_array_equal(value.numpy(), before[key])


def test_an_op_between_a_copy_batch_start_and_its_copies_is_refused(fake_device):
    """On a GPU the copy stream waits only for work queued before the batch's start event: a source made after
    it (a contiguous() of a strided tensor) could be read before it is written."""
    from paddle.distributed.fsdp.devices import device_streams

    strided = paddle.arange(6, dtype="float32").reshape([2, 3]).transpose([1, 0])
    dst = device.host_empty([6], "float32")
    batch = device_streams.begin("fake")
    with pytest.raises(device_rules.CopyOrderError):
        batch.copy([(dst, device.flat_source(strided))])
    src = device.flat_source(strided)
    batch = device_streams.begin("fake")
    batch.copy([(dst, src)])
    batch.finish().wait()
    np.testing.assert_array_equal(dst.numpy(), [0, 3, 1, 4, 2, 5])
    with pytest.raises(ValueError, match="mode"):
        device_streams.begin("gpu")
