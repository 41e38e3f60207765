"""Persisting a memory copy: a committed checkpoint of exactly the bytes in the copy, not of the live state.

Why from the copy: a persist runs in the background while training moves on, so the live tensors hold a later
step by the time the bytes are written; the copy holds the step it names (its header), checksummed. And after a
crash the copy is all there is (flush.py). Both write today's committed format through the engine (loadable at
any world size, by the tools, by ``verify``): ``persist_copy`` as every rank's part of one collective save
(CheckpointManager: ``latest`` and ``keep_last`` as for a direct save), flush.py from one process.

A copy's header carries, per record, its description in the engine's wire form (``descs``: region, replicated),
and the values a direct save writes (state/resume_state.py: optimizer class and global state, buffer keys,
extra state, GradScaler, EMA, this rank's RNG and stateful objects), so the persisted checkpoint is the one ``save_checkpoint`` would have written at that step.

Bytes: the persist is an ordinary save of the copy's views with the tier's options, so it writes what a direct save
with them writes: each bf16/fp16 weight equal to its fp32 master cast is derived, not stored (checked by the engine
on the copy's bytes, save/derive.py), the data files go through the options' chunk codec (``auto``: compressed on
object storage), and the moments are quantized when the tier was given ``quantize_moments``. The copy itself keeps
every byte (a restore from memory reads them all; only what goes to storage shrinks).
"""

from __future__ import annotations

import logging
import time

import numpy as np

from ..checkpoint.planner import RecordDesc
from ..state.resume_state import PER_RANK_KEYS
from .errors import InvalidMemoryCopyError

logger = logging.getLogger(__name__)


def tensor_view(data: np.ndarray, dtype: str, shape: list[int]):
    """A paddle tensor of ``dtype``/``shape`` over ``data`` (uint8 bytes), zero-copy (DLPack + a dtype view)."""
    import paddle

    if data.size == 0:
        return paddle.zeros(shape, dtype=dtype)
    return paddle.utils.dlpack.from_dlpack(data).view(getattr(paddle, dtype)).reshape(shape)


def records_of(header: dict, where: str) -> list[tuple[list, RecordDesc]]:
    """``[(record, desc)]`` of a copy's header; InvalidMemoryCopyError when the descriptions are missing or do
    not match the records."""
    records, descs = header.get("records"), header.get("descs")
    if type(records) is not list or type(descs) is not list or len(records) != len(descs):
        raise InvalidMemoryCopyError(f"{where}: the header lacks the record descriptions a persist needs")
    out = []
    for rec, wire in zip(records, descs):
        try:
            desc = RecordDesc.from_wire(wire)
        except (TypeError, ValueError, KeyError, IndexError, AttributeError):
            raise InvalidMemoryCopyError(f"{where}: unreadable description of record {rec[0]!r}") from None
        if desc.key != rec[0] or desc.dtype != rec[1]:
            raise InvalidMemoryCopyError(f"{where}: description {desc.key!r} does not match record {rec[0]!r}")
        out.append((rec, desc))
    return out


def copy_state_dict(header: dict, data: np.ndarray, where: str) -> dict:
    """The state dict a direct save of this rank would pass to the engine, its tensors zero-copy views of the
    copy's ``data`` (the slot must stay mapped and unchanged until the save returns)."""
    state = dict(header["values"])
    for (key, dtype, shape, off, nbytes, _sums), desc in records_of(header, where):
        state[key] = sharded_view(desc, tensor_view(data[off : off + nbytes], dtype, shape))
    return state


def sharded_view(desc: RecordDesc, t):
    """``t`` as the record ``desc`` describes it: the tensor itself when replicated, else its ShardedWeight."""
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    if desc.replicated:
        return t
    r = desc.region
    flat = None if r.flat_range is None else slice(*r.flat_range)
    return ShardedWeight(desc.key, t, r.box_shape, r.shape, r.box_offset, flat is not None, flat)


def persist_copy(
    slot,
    header: dict,
    data_off: int,
    data_len: int,
    root: str,
    keep_last,
    group,
    options=None,
    quantize_moments: str | None = None,
) -> float:
    """Collective (every rank, its own copy of the same step): save the copy as ``root/step_<step>`` through the
    CheckpointManager, synchronously, on ``group`` (the tier's persist group: this runs on a background thread),
    with ``options`` (CheckpointOptions; None: from the environment) and ``quantize_moments`` (None: exact).
    Returns the seconds it took."""
    from ..checkpoint import CheckpointManager

    t0 = time.perf_counter()
    state = copy_state_dict(header, slot.data(data_off, data_len), f"memory copy {slot.path}")
    manager = CheckpointManager(root, keep_last=keep_last, process_group=group)
    per_rank = tuple(key for key in PER_RANK_KEYS if key in state)
    manager.save(
        int(header["step"]), state, per_rank_values=per_rank, options=options, quantize_moments=quantize_moments
    )
    dt = time.perf_counter() - t0
    logger.info("memory tier: rank %d persisted its memory copy of step %d to %s in %.0f ms",
                header["rank"], header["step"], root, dt * 1e3)  # fmt: skip
    return dt
