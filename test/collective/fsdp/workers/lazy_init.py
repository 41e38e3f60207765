"""Models larger than one device: built under paddle.LazyGuard, or with parameters in host memory, they wrap
into shards equal to an eagerly built model's, with peak host memory bounded by one unit plus the rank's shards.

Usage: lazy_init.py. Each rank reports {case: "ok" | traceback, "figures": {...}}.
"""

from __future__ import annotations

import _paths  # noqa: F401  (puts launch_util on sys.path)
import numpy as np
import paddle
from launch_util import worker_main
from models import TinyLM
from paddle.base import core
from paddle.distributed.fsdp import FullyShardFusion
from paddle.distributed.fsdp.devices import device as fsdp_device

#: peak host bytes allocated while wrapping a lazy model <= RATIO x (largest unit + this rank's shards)
PEAK_RATIO = 1.25
WIDE, BLOCKS = 256, 12


class WideBlock(paddle.nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.up = paddle.nn.Linear(WIDE, 2 * WIDE)
        self.down = paddle.nn.Linear(2 * WIDE, WIDE)

    def forward(self, x):
        return x + self.down(paddle.nn.functional.relu(self.up(x)))


class WideModel(paddle.nn.Layer):
    """12 units of ~1 MiB each: the model is ~6x a unit plus a 2-rank shard share, so the bound discriminates."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = paddle.nn.LayerList([WideBlock() for _ in range(BLOCKS)])
        self.head = paddle.nn.Linear(WIDE, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x).mean()


def _equal(fsdp, ref) -> None:
    full = fsdp.full_parameters()
    for key, param in ref.named_parameters():
        assert np.array_equal(full[key].numpy(), param.numpy()), f"{key} differs from the eagerly built model"


def case_lazy_equals_eager(rank, world, figures) -> None:
    """TinyLM (its own parameter `pos` is created after the `embed` sublayer but listed before it: creation
    order matters) built under LazyGuard: shards bit-equal to the eager build, the generator where it would be."""
    paddle.seed(11)
    ref = TinyLM()
    FullyShardFusion(ref, fsdp_unit_layers=["Block"])
    after_eager = paddle.rand([4]).numpy()
    paddle.seed(11)
    with paddle.LazyGuard():
        model = TinyLM()
    assert any(not p._is_initialized() for p in model.parameters()), "LazyGuard built initialised parameters"
    fsdp = FullyShardFusion(model, fsdp_unit_layers=["Block"])
    after_lazy = paddle.rand([4]).numpy()
    assert np.array_equal(after_lazy, after_eager), "the random stream after wrapping differs from an eager build"
    paddle.seed(11)
    _equal(fsdp, TinyLM())
    for key, param, buffer, index in fsdp.managed_parameters():
        piece = buffer.pieces.get(index)
        assert param.shape == [piece.length if piece else 0], (key, param.shape)


def _peak_of(build) -> tuple[int, object]:
    before = core.host_memory_stat_current_value("Allocated", 0)
    core.host_memory_stat_reset_peak_value("Allocated", 0)
    out = build()
    return core.host_memory_stat_peak_value("Allocated", 0) - before, out


def case_lazy_peak_memory(rank, world, figures) -> None:
    def lazy():
        paddle.seed(5)
        with paddle.LazyGuard():
            model = WideModel()
        return FullyShardFusion(model, fsdp_unit_layers=["WideBlock"])

    peak, fsdp = _peak_of(lazy)
    unit = max(b.layout.padded_numel * b.shard.element_size() for b in fsdp.buffers)
    shards = fsdp.resident_parameter_bytes()
    total = fsdp.total_parameter_bytes()
    bound = PEAK_RATIO * (unit + shards)
    eager_peak, eager = _peak_of(lambda: (paddle.seed(5), FullyShardFusion(WideModel(), ["WideBlock"]))[1])
    figures.update(lazy_peak=peak, eager_peak=eager_peak, unit=unit, shards=shards, model=total, bound=bound)
    assert peak <= bound, f"lazy wrap peaked at {peak} bytes > {PEAK_RATIO} x (unit {unit} + shards {shards})"
    assert eager_peak >= total > bound, f"the bound does not discriminate: eager {eager_peak}, model {total}"
    full, ref = fsdp.full_parameters(), eager.full_parameters()
    for key in ref:
        assert np.array_equal(full[key].numpy(), ref[key].numpy()), f"{key} differs from the eagerly built model"


def _into_host_memory(model) -> None:
    """Re-home every parameter into host memory made by device.host_empty: what a model built on the CPU is
    when the shards live on a device (in fake-device mode, host_empty memory is the only host memory)."""
    for param in model.parameters():
        host = fsdp_device.host_empty(param.shape, param.dtype, pinned=False)
        host.copy_(param, True)
        host._share_buffer_to(param)
        assert fsdp_device.is_host(param)


def case_host_params_device_shards(rank, world, figures) -> None:
    paddle.seed(13)
    model = TinyLM()
    _into_host_memory(model)
    fsdp = FullyShardFusion(model, fsdp_unit_layers=["Block"])
    fake = fsdp_device.options().fake_device
    for key, param, _buffer, _index in fsdp.managed_parameters():
        assert fsdp_device.is_host(param) == (not fake), f"{key}: shard piece memory kind {fsdp_device.is_host(param)}"
    paddle.seed(13)
    _equal(fsdp, TinyLM())
    figures["fake_device"] = fake


CASES = {
    "lazy_equals_eager": case_lazy_equals_eager,
    "lazy_peak_memory": case_lazy_peak_memory,
    "host_params_device_shards": case_host_params_device_shards,
}


if __name__ == "__main__":
    worker_main(CASES)
