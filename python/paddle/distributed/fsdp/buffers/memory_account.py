"""The memory account of FullyShardFusion: what its buffers reference now, by role, and the mapped blocks alive.

Why a module of its own: it reads both the buffers (fused_buffer.py) and the ledger of mapped blocks
(devices/buffer_memory.py), and fused_buffer.py takes its blocks from devices/buffer_memory.py; the account sits above both.
"""

from __future__ import annotations

import paddle

from ..devices.buffer_memory import KINDS, BlockLedger
from .fused_buffer import FusedBuffer


def _nbytes(tensor: paddle.Tensor | None) -> int:
    if tensor is None or not tensor._is_initialized():
        return 0
    return tensor._numel() * tensor.element_size()


def buffer_account(buffer: FusedBuffer) -> dict[str, int]:
    """Bytes one buffer references now, by role."""
    gathered = _nbytes(buffer.full) if buffer.full is not buffer.shard else 0
    staging = _nbytes(buffer._grad_in_param_dtype)
    if buffer._gathering is not None:
        full, _task, source = buffer._gathering
        gathered += _nbytes(full)
        staging += _nbytes(source) if source is not buffer.shard else 0
    reducing = 0
    if buffer._reducing is not None:
        reducing = sum(_nbytes(t) for t in buffer._reducing[1]._keep) or _nbytes(buffer._reducing[0])
    return {
        "parameter_shard": _nbytes(buffer.shard),
        "gradient_shard": _nbytes(buffer.main_grad),
        "gathered_units": gathered,
        "gradient_buffers": _nbytes(buffer.full_grad) + reducing,
        "staging": staging,
    }


def memory_account(buffers: list[FusedBuffer], ledger: BlockLedger) -> dict[str, int]:
    """What the buffers reference now, by role, summed; plus the mapped blocks alive (which autograd may still
    reference after a release) and their count by kind (``mapped_outside_allocator``: bytes paddle's allocator
    statistics do not see)."""
    total: dict[str, int] = {}
    for buffer in buffers:
        for role, nbytes in buffer_account(buffer).items():
            total[role] = total.get(role, 0) + nbytes
    for kind in KINDS:
        total[f"mapped_{kind}"] = ledger.live[kind]
    total["mapped_blocks"] = sum(ledger.count.values())
    total["mapped_outside_allocator"] = sum(ledger.live.values())
    return total
