"""How an unmodified paddle optimizer steps FSDP parameters.

Every paddle optimizer (``Optimizer.step``, ``Adam.step``, ``AdamW.step``, grouped or not) funnels into
``Optimizer._apply_optimize``; stock paddle itself consults a global FSDP context there. We wrap that one
method, once per process, and act only when the optimizer holds parameters of a FullyShardFusion (found
through the parameters themselves, so several instances can coexist and nothing global is kept):

0. (every optimizer) Wait for an async checkpoint's background snapshot (checkpoint/snapshot_guard.py): a
   save returns before it copied the shards, and the step must not modify them before they are copied.
1. Flush gradients (a safety net: buffers whose parameters did not all receive a gradient, unused
   parameters, are normally reduced when backward ends; see gradient_sync.arm_backward_end).
2. Clip with norms over all ranks: parameters are local pieces at rest, so ``ClipGradByGlobalNorm`` and
   ``ClipGradByNorm`` need sums of squares all-reduced over the sharding group. ``ClipGradByValue`` is
   elementwise and runs as is.
2b. Skip steps together: a loss scaler's ``found_inf`` (``paddle.amp.GradScaler`` hands it to the optimizer
   as the auxiliary variable ``found_inf``) only covers this rank's shard, so it is all-reduced (MAX, a logical
   or) over every sharding group involved before the step is decided: every rank skips the same steps, and the
   scaler, which reads the variable back after the step, keeps the same loss scale everywhere.
3. Honour ``param.no_weight_decay = True`` for decoupled (AdamW-style ``apply_decay_param_fun``) and
   coupled (``weight_decay=`` regulariser) decay alike. Decay is decided per parameter, never per buffer,
   so a bias exempt from decay is never decayed because of its neighbours.
4. ``opt.clear_grad()`` frees the gradient shards it cleared (``.grad`` is None afterwards), as stock stage 3
   does: between steps a rank holds no gradient memory (fused_buffer.release_grads).
"""

from __future__ import annotations

import contextlib
import logging

import paddle
import paddle.distributed as dist
from paddle.nn.clip import ClipGradByGlobalNorm, ClipGradByNorm
from paddle.optimizer import Lamb, Optimizer

from ..checkpoint.snapshot_guard import wait_for_snapshot

logger = logging.getLogger(__name__)

_WRAPPED_FLAG = "__fsdp_wrapped__"


def install_optimizer_integration() -> None:
    """Wrap ``Optimizer._apply_optimize`` (idempotent; a no-op for optimizers without FSDP params)."""
    original = Optimizer._apply_optimize
    if getattr(original, _WRAPPED_FLAG, False):
        return

    def _apply_optimize(self, loss, startup_program, params_grads, param_group_idx=0):
        wait_for_snapshot()  # an async save may still be copying the shards this step modifies
        owners = fsdp_owners(self)
        if not owners or not paddle.in_dynamic_mode():
            return original(self, loss, startup_program, params_grads, param_group_idx)
        _warn_per_piece_norms(self, owners)
        for owner in owners:  # whose master weights a writeback must follow (state/full_params.py)
            owner._optimizers.add(self)
        _check_intact_once(self, owners)
        if isinstance(params_grads, list):
            params_grads = list(params_grads)
        params_grads = _flush_and_extend(self, owners, params_grads)
        _agree_found_inf(self, owners)
        with _fsdp_clip(self, owners, params_grads) as params_grads, _no_weight_decay(self):
            return original(self, loss, startup_program, params_grads, param_group_idx)

    setattr(_apply_optimize, _WRAPPED_FLAG, True)
    _apply_optimize.__wrapped__ = original
    Optimizer._apply_optimize = _apply_optimize
    _install_clear_grad()


def _install_clear_grad() -> None:
    """Wrap ``Optimizer.clear_grad``: after it, FSDP buffers whose gradients it cleared free their gradient shard
    (fused_buffer.release_grads; ``.grad`` is None afterwards, as after stock stage 3's clear_grad)."""
    original = Optimizer.clear_grad
    if getattr(original, _WRAPPED_FLAG, False):
        return

    def clear_grad(self, set_to_zero: bool = True) -> None:
        original(self, set_to_zero)
        owners = fsdp_owners(self)
        if owners and paddle.in_dynamic_mode():
            cleared = {id(p) for p in optimizer_parameters(self) if not p.stop_gradient}
            for owner in owners:
                for buffer in owner.buffers:
                    buffer.release_grads(cleared)

    setattr(clear_grad, _WRAPPED_FLAG, True)
    clear_grad.__wrapped__ = original
    Optimizer.clear_grad = clear_grad


def _warn_per_piece_norms(opt, owners) -> None:
    """Lamb's trust ratio uses the norm of the tensor it steps: here a piece, not the whole parameter."""
    if isinstance(opt, Lamb) and any(o.world_size > 1 for o in owners) and not getattr(opt, "_fsdp_warned", False):
        logger.warning(
            "Lamb under FullyShardFusion computes its trust ratio per local piece of each parameter, "
            "not per whole parameter: results differ from one-process Lamb"
        )
        opt._fsdp_warned = True


def _check_intact_once(opt, owners) -> None:
    """At the first step: refuse parameters cast after wrapping and unsupported AMP modes, by name."""
    if getattr(opt, "_fsdp_checked", False):
        return
    for owner in owners:
        for buffer in owner.buffers:
            buffer.check_intact()
    opt._fsdp_checked = True


def optimizer_parameters(opt) -> list:
    params = []
    for item in opt._parameter_list or []:
        if isinstance(item, dict):
            params.extend(item["params"])
        else:
            params.append(item)
    return params


def fsdp_owners(opt) -> list:
    """The FullyShardFusion instances whose parameters ``opt`` holds, in first-seen order."""
    owners: dict[int, object] = {}
    for param in optimizer_parameters(opt):
        buffer = getattr(param, "_fsdp_buffer", None)
        if buffer is not None:
            owners.setdefault(id(buffer.owner), buffer.owner)
    return list(owners.values())


def _flush_and_extend(opt, owners, params_grads):
    """Safety net: reduce gradients still pending (normally flushed at the end of backward already).

    Pending pairs join a plain step. A grouped step cannot tell which group is running (AdamW.step
    passes no group index), so there pending gradients are an error rather than a silent loss.
    """
    bound = [pair for owner in owners for pair in owner._flush_gradients()]
    if not bound:
        return params_grads
    if isinstance(params_grads, dict):
        raise RuntimeError(
            "FullyShardFusion: gradients were still pending at a grouped optimizer step; they are "
            "normally flushed when backward ends. Call opt.step() after loss.backward() has returned."
        )
    mine = {id(p) for p in optimizer_parameters(opt)}
    present = {id(p) for p, _ in params_grads}
    return params_grads + [(p, g) for p, g in bound if id(p) in mine and id(p) not in present and not p.stop_gradient]


def _agree_found_inf(opt, owners) -> None:
    """Replace a rank-local ``found_inf`` tensor by its logical or over every owner's sharding group.

    Collective when the variable is a tensor: a GradScaler sets it on every rank before each step (a program
    property, so every rank reduces or none does). Stock ``_create_optimization_pass`` turns it into a Python
    bool once consumed, so later parameter groups of the same step see a bool here and reduce nothing again."""
    found = opt._get_auxiliary_var("found_inf")
    if not isinstance(found, paddle.Tensor) or not any(o.world_size > 1 for o in owners):
        return
    with paddle.no_grad():
        flag = found.astype("int32").reshape([-1]).max().reshape([1])
        for owner in owners:
            if owner.world_size > 1:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=owner.comm.group)
        opt._set_auxiliary_var("found_inf", flag.astype(found.dtype).reshape(found.shape))


def _pairs(params_grads):
    return params_grads["params"] if isinstance(params_grads, dict) else params_grads


@contextlib.contextmanager
def _fsdp_clip(opt, owners, params_grads):
    """Clip with sums of squares reduced over every sharding group involved; stock clip disabled inside."""
    clip = params_grads.get("grad_clip") if isinstance(params_grads, dict) else opt._grad_clip
    sharded = any(o.world_size > 1 for o in owners)
    if isinstance(clip, ClipGradByGlobalNorm) and sharded:
        clipped = clip_by_global_norm(owners, _pairs(params_grads), clip)
    elif isinstance(clip, ClipGradByNorm) and sharded:
        clipped = _clip(owners, _pairs(params_grads), clip)
    else:
        # one rank: pieces are whole parameters and stock clipping is exact (bit-equal to a plain model's: the
        # fused sum of squares rounds differently on some CPUs, e.g. 1 ulp on 12% of a weight on an AMD EPYC)
        yield params_grads
        return
    if isinstance(params_grads, dict):
        params_grads = dict(params_grads, params=clipped, grad_clip=None)
    else:
        params_grads = clipped
    saved, opt._grad_clip = opt._grad_clip, None
    try:
        yield params_grads
    finally:
        opt._grad_clip = saved


def _buffer_grad_source(buffer, pairs_of_buffer: dict[int, object]):
    """The one tensor holding every gradient of ``buffer`` handed to this step, or None when the pairs are
    not exactly its bound gradients (then the per-parameter path is used)."""
    if set(pairs_of_buffer) != buffer.bound_grad_indices() or not pairs_of_buffer:
        return None
    source = buffer.grad_source()
    if source is None:
        return None
    for grad in pairs_of_buffer.values():
        if not grad._is_shared_buffer_with(source):
            return None
    return source


def clip_by_global_norm(owners, pairs, clip: ClipGradByGlobalNorm) -> list:
    """Stock ``ClipGradByGlobalNorm`` in a few kernels: one sum of squares per fused buffer (over the tensor
    its gradients are views of), one all-reduce per sharding group, one scaled copy per buffer.

    Parameters outside FSDP, and buffers whose gradients were replaced or only partly handed to the
    optimizer, fall back to a sum per parameter. The result is the same formula as stock paddle
    (scale = max_norm / max(norm, max_norm)), with the norm over all ranks.
    """
    selected = _clippable(pairs)
    out = list(pairs)
    # no early return for a rank without pairs (it owns no piece of this optimizer's parameters, e.g. a second
    # optimizer over a tiny head): it still joins every owner's all-reduce below, or the other ranks hang there
    by_buffer: dict[int, tuple[object, dict[int, object]]] = {}
    loose = []  # (k, param, grad) summed per parameter
    for k, param, grad in selected:
        buffer = getattr(param, "_fsdp_buffer", None)
        if buffer is None or buffer.owner not in owners:
            loose.append((k, param, grad))
            continue
        index = buffer.param_position(param)
        by_buffer.setdefault(id(buffer), (buffer, {}))[1][index] = grad
    fused: dict[int, paddle.Tensor] = {}  # id(buffer) -> the tensor its pairs are views of
    owner_sums: dict[int, paddle.Tensor] = {id(o): paddle.zeros([1], dtype="float64") for o in owners}
    for key, (buffer, grads) in by_buffer.items():
        source = _buffer_grad_source(buffer, grads)
        if source is not None:
            fused[key] = source
            flat = source.astype("float32") if source.dtype not in (paddle.float32, paddle.float64) else source
            partial = paddle.square(flat).sum().astype("float64").reshape([1])
        else:
            partial = paddle.zeros([1], dtype="float64")
            for grad in grads.values():
                partial = partial + _sum_of_squares(grad).reshape([1])
        owner_sums[id(buffer.owner)] = owner_sums[id(buffer.owner)] + partial
    total = paddle.zeros([1], dtype="float64")
    for owner in owners:  # under EP too: the dense group is the world, each expert piece has one holder in it
        total = total + owner.comm.all_reduce_sum(owner_sums[id(owner)])
    for _, _, grad in loose:  # replicated parameters: their sums are complete on every rank
        total = total + _sum_of_squares(grad).reshape([1])
    if not selected:
        return out
    max_norm = paddle.full([1], clip.clip_norm, dtype="float64")
    scale = max_norm / paddle.maximum(paddle.sqrt(total), max_norm)
    scaled_sources = {key: paddle.multiply(source, scale.astype(source.dtype)) for key, source in fused.items()}
    for k, param, grad in selected:
        buffer = getattr(param, "_fsdp_buffer", None)
        scaled = scaled_sources.get(id(buffer)) if buffer is not None else None
        if scaled is not None:
            piece = buffer.pieces[buffer.param_position(param)]
            out[k] = (param, scaled._slice(piece.shard_start, piece.shard_start + piece.length))
        else:
            out[k] = (param, paddle.multiply(grad, scale.astype(grad.dtype).reshape([])))
    return out


def _sum_of_squares(grad) -> paddle.Tensor:
    """In fp64: the sums of many ranks and parameters are added up, and fp64 params need it anyway."""
    flat = grad.reshape([-1]).astype("float64")
    return (flat * flat).sum()


def _complete_squared_norms(owners, selected) -> tuple[list[paddle.Tensor], paddle.Tensor]:
    """Squared gradient norms of whole parameters: one per selected (index, param, grad), and the total.

    Each FSDP owner all-reduces one vector indexed by its own parameter numbering, so every rank issues
    the same collectives with the same sizes even when it holds no piece of some parameters, and the
    total counts every parameter once. Parameters outside FSDP are replicated: their sums are complete.
    """
    squared = [_sum_of_squares(g) for _, _, g in selected]
    total = paddle.zeros([], dtype="float64")
    reduced = set()
    for owner in owners:
        if owner.world_size == 1:
            continue
        # under expert parallelism expert pieces are summed over their own shard group (the same position holds
        # different experts on different EP ranks), then their total over the EP group (comm/expert_comm.py)
        expert_comm = getattr(owner, "expert_comm", None)
        for comm in (owner.comm, expert_comm):
            if comm is None:
                continue
            vector = paddle.zeros([len(owner._param_keys)], dtype="float64")
            positions = []
            for k, (_, param, _) in enumerate(selected):
                buffer = getattr(param, "_fsdp_buffer", None)
                if buffer is not None and buffer.owner is owner and buffer.comm is comm:
                    positions.append((k, owner._param_index[id(param)]))
                    vector[positions[-1][1]] = squared[k]
            comm.all_reduce_sum(vector)
            part = vector.sum()
            total = total + (
                comm.all_reduce_sum_experts(part.reshape([1])).reshape([]) if comm is expert_comm else part
            )
            for k, position in positions:
                squared[k] = vector[position]
                reduced.add(k)
    for k, value in enumerate(squared):
        if k not in reduced:
            total = total + value
    return squared, total


def _clippable(pairs):
    return [(i, p, g) for i, (p, g) in enumerate(pairs) if g is not None and getattr(p, "need_clip", True)]


def _clip(owners, pairs, clip):
    """Stock paddle's formula (scale = max_norm / max(norm, max_norm)), with norms over all ranks."""
    selected = _clippable(pairs)
    squared, total = _complete_squared_norms(owners, selected)
    max_norm = paddle.full([], clip.clip_norm, dtype="float64")
    out = list(pairs)
    if not selected:
        return out
    if isinstance(clip, ClipGradByGlobalNorm):
        global_norm = paddle.sqrt(total)
        scales = [max_norm / paddle.maximum(global_norm, max_norm)] * len(selected)
    else:
        scales = [max_norm / paddle.maximum(paddle.sqrt(s), max_norm) for s in squared]
    for (i, param, grad), scale in zip(selected, scales):
        out[i] = (param, paddle.multiply(grad, scale.astype(grad.dtype)))
    return out


@contextlib.contextmanager
def _no_weight_decay(opt):
    """Exempt parameters flagged ``no_weight_decay`` from both kinds of weight decay, for this call."""
    exempt = {p.name for p in optimizer_parameters(opt) if getattr(p, "no_weight_decay", False)}
    if not exempt:
        yield
        return
    decay_fun = getattr(opt, "_apply_decay_param_fun", None)
    has_decoupled = hasattr(opt, "_apply_decay_param_fun")
    regularize = opt._create_regularization_of_grad

    def apply_decay(name: str) -> bool:
        return name not in exempt and (decay_fun is None or decay_fun(name))

    def create_regularization(param, grad, regularization):
        if param.name in exempt:
            return grad
        return regularize(param, grad, regularization)

    if has_decoupled:
        opt._apply_decay_param_fun = apply_decay
    opt._create_regularization_of_grad = create_regularization
    try:
        yield
    finally:
        if has_decoupled:
            opt._apply_decay_param_fun = decay_fun
        del opt._create_regularization_of_grad
