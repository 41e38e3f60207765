"""From the fused layout to checkpoint records: each rank's pieces become flattened ShardedWeights.

A parameter piece is (key, flattened range, global shape): the rank's slice of the fused buffer, recorded
without any all_gather. Optimizer state follows its parameter:
  - elementwise accumulators (moments, master weights) have the piece's shape: same range, key
    ``<param key>.<state name>``;
  - scalar accumulators (beta powers, ASGD's step count) are one value per parameter, identical on the
    ranks that hold a piece: recorded as a replicated tensor, restored into each holder;
  - stacked accumulators (ASGD's ``y``: ``[k, *param_shape]``) are recorded as a 2-D box
    ``[k, numel]`` whose columns are the piece's range.
State names come from the per-class table in optimizer_states; anything it does not know raises.
"""

from __future__ import annotations

import paddle
from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

from . import optimizer_states as names
from .buffers import persistable_buffers
from .optimizer_state_creation import create_optimizer_state, refresh_master_weight_
from .sharded_model import ShardedModel


def flattened_record(key: str, local: paddle.Tensor, shape: tuple[int, ...], start: int, stop: int):
    return ShardedWeight(
        key=key,
        local_tensor=local,
        local_shape=tuple(shape),
        global_shape=tuple(shape),
        global_offset=(0,) * len(shape),
        is_flattened=True,
        flattened_range=slice(start, stop),
    )


def model_sharded_state_dict(fsdp: ShardedModel) -> dict:
    """Every parameter piece this rank holds, keyed by structured name (tied params appear once), and every
    persistable buffer as a replicated tensor (see buffers.py: saved from rank 0, loaded on every rank)."""
    records = parameter_records(fsdp)
    records.update(persistable_buffers(fsdp.model))
    return records


def parameter_records(fsdp: ShardedModel) -> dict:
    """Every parameter piece this rank holds, keyed by structured name (tied params appear once)."""
    records: dict = {}
    for key, _param, buffer, index in fsdp.managed_parameters():
        piece = buffer.pieces.get(index)
        if piece is None:
            continue
        records[key] = flattened_record(
            key, buffer.local_view(index), piece.slot.shape, piece.param_start, piece.param_stop
        )
    return records


def _optimizer_params(optimizer) -> dict[int, paddle.Tensor]:
    from ..step.optimizer_integration import optimizer_parameters

    return {id(p): p for p in optimizer_parameters(names.unwrap_optimizer(optimizer))}


def optimizer_sharded_state_dict(fsdp: ShardedModel, optimizer) -> dict:
    """Records of every optimizer state tensor of the pieces this rank holds.

    Raises :class:`UnsupportedOptimizerStateError` for state the table cannot map, and ``ValueError``
    when the optimizer holds state for parameters this FullyShardFusion does not manage (they would be
    lost silently otherwise).
    """
    inner = names.unwrap_optimizer(optimizer)
    in_optimizer = _optimizer_params(inner)
    managed = []
    for key, param, buffer, index in fsdp.managed_parameters():
        if id(param) in in_optimizer and buffer.pieces.get(index) is not None:
            managed.append((key, param, buffer.pieces[index]))
    entries = names.all_optimizer_state_entries(inner, [param for _, param, _ in managed])
    records: dict = {}
    for key, param, piece in managed:
        numel = piece.slot.numel
        for entry in entries[param.name]:
            state_key = f"{key}.{entry.state_name}"
            if entry.kind == names.ELEMENTWISE:
                # the optimizer created it from the 1-D piece, so it is [length]: record the live
                # tensor itself (a reshape could copy, and loads must land in the optimizer's memory)
                records[state_key] = flattened_record(
                    state_key,
                    entry.tensor,
                    piece.slot.shape,
                    piece.param_start,
                    piece.param_stop,
                )
            elif entry.kind == names.SCALAR:
                records[state_key] = entry.tensor
            elif entry.kind == names.STACKED:
                rows = entry.tensor.shape[0]
                records[state_key] = ShardedWeight(
                    key=state_key,
                    local_tensor=entry.tensor,  # [rows, length]: created from the 1-D piece
                    local_shape=(rows, piece.length),
                    global_shape=(rows, numel),
                    global_offset=(0, piece.param_start),
                )
            else:  # the table only yields the kinds above; a new kind must be mapped here first
                raise names.UnsupportedOptimizerStateError(
                    f"{type(inner).__name__}: state {entry.state_name!r} of kind {entry.kind!r} "
                    "has no checkpoint mapping",
                    optimizer_class=type(inner).__name__,
                    accumulator=entry.state_name,
                )
    return records


def init_optimizer_state(fsdp: ShardedModel, optimizer) -> None:
    """Create the accumulators of every trainable piece this rank holds, as a first step would."""
    in_optimizer = _optimizer_params(optimizer)
    fsdp._optimizers.add(names.unwrap_optimizer(optimizer))  # its master weights follow writebacks (full_params)
    params = [
        param
        for _key, param, buffer, index in fsdp.managed_parameters()
        if id(param) in in_optimizer and not param.stop_gradient and buffer.pieces.get(index) is not None
    ]
    create_optimizer_state(optimizer, params)


def refresh_master_weights(fsdp: ShardedModel, optimizer, loaded_keys) -> list[str]:
    """After a load: re-cast the master weight of every parameter piece the load wrote without its master weight.

    Why: on GPU paddle's multi-precision kernels compute a low-precision parameter from its fp32 master weight at
    every step, so a master weight left at its pre-load value would overwrite the loaded parameter at the next
    step. A load writes a parameter without its master weight when the checkpoint has none for it (saved before
    the parameter's first step, or by a run without ``multi_precision``) and ``strict=False`` let it through.
    Returns the keys of the parameters whose master weights were refreshed.
    """
    loaded = set(loaded_keys)
    in_optimizer = _optimizer_params(optimizer)
    refreshed = []
    for key, param, buffer, index in fsdp.managed_parameters():
        if key not in loaded or f"{key}.{names.MASTER_WEIGHT}" in loaded or id(param) not in in_optimizer:
            continue
        piece = buffer.local_view(index)  # what the load wrote (the param may be bound to a gathered copy)
        if piece is not None and refresh_master_weight_(optimizer, param, piece):
            refreshed.append(key)
    return refreshed
