"""Full-parameter access to a FullyShardFusion model: summon_full_params and full_state_dict.

At rest every parameter is this rank's 1-D piece. Code that needs whole parameters (printing values,
``save_pretrained``, evaluation, custom initialisation) runs inside :func:`summon_full_params`, a collective
context in which every parameter is bound to its full logical shape and value. :func:`full_state_dict`
gathers one buffer (one unit) at a time, so its transient memory is bounded by the largest unit, not the model.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict

import paddle

from .buffers import persistable_buffers
from .optimizer_state_creation import copy_into_state_
from .sharded_model import ShardedModel


@contextlib.contextmanager
def summon_full_params(fsdp: ShardedModel, writeback: bool = False, rank0_only: bool = False):
    """Every parameter full-size inside the context. Collective: every rank of the group enters and exits it.

    Args:
        writeback: copy what the parameters hold at exit back into each rank's shard (values changed in place
            or by ``set_value``/``set_state_dict``); without it, changes made inside are discarded. The fp32
            master weights of the optimizers that stepped (or ``init_optimizer_state``-ed) these parameters
            follow: every element whose value changed is re-cast into its master weight (the next
            multi-precision step computes the parameter from it and would otherwise undo the change); unchanged
            elements keep their master weight's full precision.
        rank0_only: only rank 0 keeps the full parameters (the others see their pieces); cannot be combined
            with ``writeback`` (the other ranks would have nothing to write back).

    Backward inside the context is refused (run evaluation under ``paddle.no_grad()``); forwards work.
    """
    if rank0_only and writeback:
        raise ValueError("summon_full_params: writeback=True needs rank0_only=False (every rank writes its shard)")
    if fsdp._summoned:
        raise RuntimeError("summon_full_params is already active for this model (contexts do not nest)")
    keep = not rank0_only or fsdp._checkpoint_rank == 0
    backups = []
    gathered = []
    try:
        for buffer in fsdp.buffers:
            # one rank holds the whole buffer as its shard: the gathered view would alias it, so keep a copy
            # that an exit without writeback restores
            if fsdp.world_size == 1 and not writeback and keep:
                backups.append((buffer, buffer.shard.clone()))
            buffer.gather(full_precision=True)
            gathered.append(buffer)
            if not keep:
                buffer.release()
        fsdp._summoned = keep
        yield
    finally:
        fsdp._summoned = False
        try:
            if writeback:
                optimizers = list(fsdp._optimizers)
                for buffer in gathered:
                    _write_back(buffer, optimizers)
        finally:
            for buffer in gathered:
                buffer.release()
            with paddle.no_grad():
                for buffer, saved in backups:
                    paddle.assign(saved, output=buffer.shard)


def _write_back(buffer, optimizers: list) -> None:
    """Copy this rank's piece of every parameter, as it is now, into the shard; master weights follow."""
    with paddle.no_grad():
        for index, param in enumerate(buffer.params):
            slot = buffer.layout.slots[index]
            if list(param.shape) != list(slot.shape):
                raise ValueError(
                    f"summon_full_params(writeback=True): {slot.key} changed shape inside the context "
                    f"({list(slot.shape)} -> {list(param.shape)}); parameters keep their shape"
                )
            piece = buffer.pieces.get(index)
            if piece is None:
                continue
            value = param.reshape([-1])[piece.param_start : piece.param_stop]
            if value.dtype != buffer.shard.dtype:
                value = value.astype(buffer.shard.dtype)
            piece_view = buffer.local_view(index)
            paddle.assign(value, output=piece_view)
            for optimizer in optimizers:
                _follow_master_weight(optimizer, param, piece_view)


def _follow_master_weight(optimizer, param, piece: paddle.Tensor) -> None:
    """Re-cast into ``param``'s fp32 master weight the elements of ``piece`` (its new value) that differ from the
    master's cast: those were written; the others keep the master's precision (a parameter is the cast of its
    master after every multi-precision step)."""
    master = getattr(optimizer, "_master_weights", {}).get(param.name)
    if master is None or list(master.shape) != list(piece.shape):
        return
    changed = paddle.cast(master, piece.dtype) != piece
    if bool(changed.any()):
        copy_into_state_(master, paddle.where(changed, paddle.cast(piece, master.dtype), master))


def full_state_dict(fsdp: ShardedModel, rank0_only: bool = True, offload_to_cpu: bool = True) -> OrderedDict:
    """The model's ``state_dict()`` with whole parameters, gathered one buffer at a time. Collective.

    Keys and order are those of the unwrapped model's ``state_dict()`` (tied parameters under each of their
    names, persistable buffers included), so ``unwrapped.set_state_dict(full)`` loads it. With ``rank0_only``
    the other ranks return an empty dict. Tensors are copies (on CPU with ``offload_to_cpu``).
    """
    keep = not rank0_only or fsdp._checkpoint_rank == 0
    names_of: dict[int, list[str]] = {}
    order: list[str] = []
    for prefix, layer in fsdp.model.named_sublayers(include_self=True):
        for name, value in list(layer._parameters.items()) + list(layer._buffers.items()):
            if value is None or (name in layer._buffers and name in layer._non_persistable_buffer_names_set):
                continue
            key = f"{prefix}.{name}" if prefix else name
            names_of.setdefault(id(value), []).append(key)
            order.append(key)
    values: dict[str, paddle.Tensor] = {}

    def take(tensor: paddle.Tensor) -> paddle.Tensor:
        copy = tensor.detach()
        if offload_to_cpu and not copy.place.is_cpu_place():
            return copy.cpu()
        return copy.clone()

    slot_keys: dict[str, list[str]] = {}  # under EP: a local expert key -> that slot's key on every EP rank
    for buffer in fsdp.buffers:
        was_gathered = buffer.is_gathered
        buffer.gather(full_precision=True)
        try:
            if keep:
                for param in buffer.params:
                    value = take(param)
                    for key in names_of.get(id(param), []):
                        values[key] = value
            peers, keys_by_rank = expert_peers(fsdp, buffer)
            if keep and peers:
                values.update((key, take(tensor)) for key, tensor in peers.items())
                for k, slot in enumerate(buffer.layout.slots):
                    slot_keys[slot.key] = [keys[k] for keys in keys_by_rank]
        finally:
            if not was_gathered:
                buffer.release()
    if not keep:
        return OrderedDict()
    for key, tensor in persistable_buffers(fsdp.model).items():
        value = take(tensor)
        for name in names_of.get(id(tensor), [key]):
            values[name] = value
    return OrderedDict((key, values[key]) for key in _with_peer_experts(order, slot_keys) if key in values)


def _with_peer_experts(order: list[str], slot_keys: dict[str, list[str]]) -> list[str]:
    """The one-process order: each run of consecutive local expert keys (one expert list's experts of this EP rank)
    becomes that run as EP rank 0 names it, then as EP rank 1 does, ... (EP rank p holds the p-th block of
    experts)."""
    if not slot_keys:
        return order

    def expert_list(key: str) -> tuple[str, ...]:  # the path components the EP ranks' names share: the list
        names = [k.split(".") for k in slot_keys[key]]
        common = []
        for parts in zip(*names):
            if len(set(parts)) > 1:
                break
            common.append(parts[0])
        return tuple(common)

    out: list[str] = []
    run: list[str] = []
    for key in [*order, None]:
        if key is not None and key in slot_keys and (not run or expert_list(key) == expert_list(run[0])):
            run.append(key)
            continue
        if run:
            ranks = len(slot_keys[run[0]])
            out.extend(slot_keys[k][p] for p in range(ranks) for k in run)
            run = []
        if key is not None and key in slot_keys:
            run = [key]
        elif key is not None:
            out.append(key)
    return out


def expert_peer_parameters(fsdp: ShardedModel, buffer) -> dict[str, paddle.Tensor]:
    """The other EP ranks' whole parameters at ``buffer``'s positions, by key (see :func:`expert_peers`)."""
    return expert_peers(fsdp, buffer)[0]


def expert_peers(fsdp: ShardedModel, buffer) -> tuple[dict[str, paddle.Tensor], list[list[str]]]:
    """Under expert parallelism, for a gathered expert buffer: the whole parameters the *other* EP ranks hold at
    the same buffer positions, by key, and every EP rank's keys of the buffer's slots (by EP rank). Collective over
    the EP group for expert buffers; ``({}, [])`` (no collective) for every other buffer. The layouts are the same
    on every EP rank (checked when wrapping), so one all_gather of the buffer and one of its keys suffice."""
    comm = getattr(fsdp, "expert_comm", None)
    if comm is None or buffer.comm is not comm or comm.ep_degree == 1:
        return {}, []
    slots = buffer.layout.slots
    fulls = comm.all_gather_experts(buffer.full)
    keys = comm.all_gather_object_experts([slot.key for slot in slots])
    out: dict[str, paddle.Tensor] = {}
    for ep_rank, (full, names) in enumerate(zip(fulls, keys)):
        if ep_rank == comm.parallel_group.rank:
            continue
        for slot, key in zip(slots, names):
            out[key] = full._slice(slot.offset, slot.end).reshape(list(slot.shape))
    return out, keys
