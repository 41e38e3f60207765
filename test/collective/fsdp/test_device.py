"""device.py: host/device memory helpers, fake-device mode, and RNG state saved per generator kind.

Fake-device mode is switched on and off inside this process with ``device.set_options``; every test
restores the options it found.
"""

from __future__ import annotations

import ctypes
import logging
import os

import numpy as np
import paddle
import pytest
from paddle.distributed.fsdp import FullyShardFusion, device
from paddle.distributed.fsdp.checkpoint.errors import MetadataError
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


@pytest.mark.parametrize("chunk_bytes", [1, 64, device.DEFAULT_CHUNK_BYTES])
def test_to_host_copies_every_dtype_into_one_reusable_staging_buffer(fake_device, chunk_bytes):
    rs = np.random.default_rng(0)
    tensors = [
        paddle.to_tensor(rs.normal(size=[3, 5]).astype("float32")),
        paddle.to_tensor(rs.normal(size=[7]).astype("float32")).astype("bfloat16"),
        paddle.to_tensor(rs.integers(0, 100, size=[4]).astype("int64")),
        paddle.zeros([0], dtype="float32"),
        paddle.to_tensor(rs.normal(size=[2, 2]).astype("float64")),
    ]
    staging = device.HostStaging()
    host = device.to_host(tensors, staging, chunk_bytes=chunk_bytes)
    for src, out in zip(tensors, host):
        assert device.is_host(out) and out.shape == src.shape and out.dtype == src.dtype
        np.testing.assert_array_equal(out.numpy(), src.numpy())
        if out.shape[0]:
            out.data_ptr()  # host views are readable in place
    size = staging.nbytes()
    assert size == sum(t.numel().item() * t.element_size() for t in tensors)  # one region per dtype, no slack
    again = device.to_host(tensors[:2], staging, chunk_bytes=chunk_bytes)  # reused: no new allocation
    assert staging.nbytes() == size
    np.testing.assert_array_equal(again[1].numpy(), tensors[1].numpy())


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
    assert t.place.is_cpu_place() or t.place.is_cuda_pinned_place()
    if not paddle.is_compiled_with_cuda():
        assert any("pageable" in r.getMessage() for r in caplog.records)


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
