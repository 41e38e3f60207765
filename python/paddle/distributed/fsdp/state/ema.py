"""An exponential moving average of the weights, sharded like the parameters (off unless created).

Why sharded: an EMA is one more fp32 copy of the model; kept whole on every rank it would cost the memory FSDP
saved. Here each rank keeps the fp32 EMA of its own shard of each trainable fused buffer (the same elements it
owns of the parameters), so the cost is ``4 bytes x parameters / world`` a rank and one fused ``lerp_`` per
buffer at each update, with no communication. PaddleFormers' zero-cost checkpoint keeps a CPU EMA with
``zcc_save_ema_coef``; this is its FSDP counterpart::

    ema = fsdp.ema(coef=0.999)              # initialised from the current parameters
    for batch in loader:
        ...; optimizer.step(); ema.update()   # explicit, after every optimizer step
    fsdp.save_checkpoint(path, optimizer=opt, ema=ema)   # and load_checkpoint(..., ema=ema), the memory tier

``update`` is an explicit call (not an optimizer hook) so that a step the GradScaler skipped (inf gradients) or
gradient accumulation decides nothing behind the caller's back: the caller updates after the steps it counts.
The update is ``ema = ema + (1 - coef) * (param - ema)`` in fp32 (``lerp_``), from the parameter's shard as the
optimizer left it (cast to fp32 for low-precision parameters). In a checkpoint each piece is a record
``<param key>.ema``, recorded like its parameter (so a load at another world size reshards it), and the value
``__fsdp__.ema`` holds ``{"coef", "updates"}``. ``paddle-fsdp-ckpt to-hf --ema`` exports the EMA as the model's
weights.
"""

from __future__ import annotations

import logging
import math

import paddle

from ..checkpoint import snapshot_guard
from ..checkpoint.errors import MetadataError
from ..checkpoint.format.reserved import EMA_SUFFIX

logger = logging.getLogger(__name__)


class ShardedEMA:
    """The fp32 EMA of this rank's shard of every trainable fused buffer of ``fsdp`` (see the module docstring).

    ``coef``: the weight of the old average at each update, in [0, 1) (0.999 typical). ``every``: average only
    every N-th call of :meth:`update`, with the weight ``coef ** N`` (the EMA of every N-th weight, as
    ema-pytorch's ``update_every``): 1/N of the cost, for steps too short to hide it (docs/resume-state.md)."""

    def __init__(self, fsdp, coef: float, every: int = 1) -> None:
        if type(coef) not in (int, float) or not 0.0 <= coef < 1.0:
            raise ValueError(f"ema coef must be a number in [0, 1), got {coef!r}")
        if type(every) is not int or every < 1:
            raise ValueError(f"ema every must be an int >= 1, got {every!r}")
        self.fsdp = fsdp
        self.coef, self.every = float(coef), every
        self.updates = 0  # calls of update() since the start (saved: which call averages next is resumed too)
        self.shards: list[tuple] = []  # (buffer, fp32 EMA of buffer.shard)
        for buffer in fsdp.buffers:
            if buffer.layout.trainable and buffer.layout.shard_numel > 0:
                self.shards.append((buffer, paddle.zeros([buffer.layout.shard_numel], dtype=paddle.float32)))
        self.reset()

    def reset(self) -> None:
        """Restart the average at the current parameters (``updates`` = 0)."""
        with paddle.no_grad():
            for buffer, ema in self.shards:
                paddle.assign(buffer.shard.astype(paddle.float32), output=ema)
        self.updates = 0

    def update(self) -> None:
        """One EMA step from the parameters as they are now: call it after each optimizer step that counts."""
        self.updates += 1
        if self.updates % self.every:
            return
        if snapshot_guard.snapshot_in_flight():  # an async save may still copy the EMA's memory
            snapshot_guard.wait_for_snapshot()
        weight = 1.0 - self.coef**self.every
        with paddle.no_grad():
            for buffer, ema in self.shards:
                shard = buffer.shard if buffer.shard.dtype == paddle.float32 else buffer.shard.astype(paddle.float32)
                ema.lerp_(shard, weight)

    def nbytes(self) -> int:
        return sum(int(ema.shape[0]) * 4 for _b, ema in self.shards)

    def records(self) -> dict:
        """``<param key>.ema`` -> ShardedWeight over this rank's piece of the EMA (views: a load writes into it)."""
        from .records import flattened_record

        out = {}
        mine = {id(buffer): ema for buffer, ema in self.shards}
        for key, _param, buffer, index in self.fsdp.managed_parameters():
            piece = buffer.pieces.get(index)
            ema = mine.get(id(buffer))
            if piece is None or ema is None:
                continue
            view = ema._slice(piece.shard_start, piece.shard_start + piece.length)
            out[key + EMA_SUFFIX] = flattened_record(
                key + EMA_SUFFIX, view, piece.slot.shape, piece.param_start, piece.param_stop
            )
        return out

    def value(self) -> dict:
        """The JSON value saved under ``__fsdp__.ema``."""
        return {"coef": self.coef, "updates": self.updates, "every": self.every}

    def decode(self, saved, where: str):
        """Check the saved ``__fsdp__.ema`` value; returns the function applying it (the tensors are loaded as
        records). The coefficient given now is kept (a run may change it); a different one is logged."""
        ok = type(saved) is dict and type(saved.get("updates")) is int and saved["updates"] >= 0
        coef = saved.get("coef") if type(saved) is dict else None
        if not ok or type(coef) not in (int, float) or not math.isfinite(coef):
            raise MetadataError(f"{where}: the EMA value must be {{'coef': number, 'updates': int >= 0}}")

        def apply() -> None:
            self.updates = saved["updates"]
            if float(coef) != self.coef or saved.get("every", 1) != self.every:
                logger.info("%s: EMA saved with coef %s every %s, continuing with %s every %s", where, coef,
                            saved.get("every", 1), self.coef, self.every)  # fmt: skip

        return apply
