"""FullyShardFusion returns malloc's free heap pages at the start of each forward and backward in host memory
(heap_trim.py), never on devices or in fake-device mode, and trains exactly as before; and the default
prefetch_depth is 0 where collectives finish inside their call (plain gloo), 1 elsewhere (overlap.py).

What the trims save per rank, measured, is in docs/performance.md (tools/train_bench/run.py), not asserted here.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import types

import numpy as np
import paddle
import pytest
from paddle.distributed.fsdp import FullyShardFusion
from paddle.distributed.fsdp.devices import device, heap_trim
from paddle.distributed.fsdp.step.overlap import default_prefetch_depth

MIB = 1 << 20


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.skipif(not heap_trim.available(), reason="malloc_trim is glibc's")
def test_trim_returns_free_pages_inside_the_heap():
    """Pages freed in the heap's middle stay resident (glibc returns only the top); trim_heap gives them back."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size, count = 64 * 1024, 512  # 32 MiB in chunks below malloc's mmap threshold: heap memory
    blocks = [libc.malloc(size) for _ in range(count)]
    assert all(blocks)
    try:
        for block in blocks:
            ctypes.memset(block, 1, size)  # resident
        for block in blocks[:-1]:  # the last one keeps the freed ones away from the heap's top
            libc.free(block)
        before = _rss_bytes()
        heap_trim.trim_heap()
        after = _rss_bytes()
    finally:
        libc.free(blocks[-1])
    assert before - after >= 16 * MIB, (before / MIB, after / MIB)


class _Net(paddle.nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.units = paddle.nn.LayerList([paddle.nn.Linear(8, 8) for _ in range(3)])

    def forward(self, x):
        for unit in self.units:
            x = paddle.tanh(unit(x))
        return (x * x).mean()


def _train(wrap: bool, steps: int = 3):
    paddle.seed(3)
    model = _Net()
    fsdp = FullyShardFusion(model, ["Linear"]) if wrap else None
    opt = paddle.optimizer.AdamW(0.05, parameters=model.parameters(), weight_decay=0.1)
    rng = np.random.default_rng(1)
    for _ in range(steps):
        model(paddle.to_tensor(rng.standard_normal([4, 8]).astype("float32"))).backward()
        opt.step()
        opt.clear_grad()
    params = fsdp.full_parameters() if wrap else {k: v.detach().clone() for k, v in model.state_dict().items()}
    return fsdp, params


def test_host_memory_trims_at_each_forward_and_backward_and_trains_as_before():
    fsdp, params = _train(True)
    _, ref = _train(False)
    trims = heap_trim.available() and fsdp.buffers[0]._maps_blocks  # host memory (not a --fake-device run)
    assert fsdp.heap_trim.enabled == trims
    assert fsdp.heap_trim.calls == (2 * 3 if trims else 0), fsdp.heap_trim.calls
    for key, value in ref.items():
        np.testing.assert_array_equal(params[key].numpy(), value.numpy(), err_msg=key)


def test_fake_device_mode_never_trims():
    before = device.options()
    device.set_options(device.DeviceOptions(fake_device=True))
    try:
        fsdp, _ = _train(True, steps=2)
    finally:
        device.set_options(before)
    assert not fsdp.heap_trim.enabled and fsdp.heap_trim.calls == 0


def _comm(world: int, inside: bool):
    return types.SimpleNamespace(world_size=world, completes_inside_call=inside)


@pytest.mark.parametrize(
    "comms, depth",
    [
        ([_comm(2, True)], 0),  # plain gloo: nothing overlaps
        ([_comm(2, True), _comm(4, True)], 0),  # and its expert group too
        ([_comm(2, False)], 1),  # NCCL, or the emulated GPU stream
        ([_comm(2, True), _comm(2, False)], 1),  # one group can overlap
        ([_comm(1, True), None], 1),  # one rank: nothing is gathered anyway; the documented default
        ([], 1),
    ],
)
def test_default_prefetch_depth(comms, depth):
    assert default_prefetch_depth(comms) == depth


def test_explicit_prefetch_depth_is_kept():
    model = _Net()
    assert FullyShardFusion(model, ["Linear"], prefetch_depth=2).schedule.depth == 2
    assert FullyShardFusion(_Net(), ["Linear"]).schedule.depth == 1  # one rank: the documented default
