"""FullyShardFusion: fused-buffer FSDP for a dygraph model, with a plain training loop.

::

    fsdp = FullyShardFusion(model, fsdp_unit_layers=["Block"])
    opt = paddle.optimizer.AdamW(parameters=model.parameters(), ...)
    loss = model(x); loss.backward(); opt.step(); opt.clear_grad()

Data flows one way: model -> parameter groups (param_grouping) -> buffer layouts (fused_layout) ->
run-time buffers (fused_buffer) -> shard records (state/records.py) -> storage (checkpoint/).
"""

from __future__ import annotations

import logging
import weakref
from typing import Callable

import paddle

from .buffers.fused_buffer import FusedBuffer
from .buffers.fused_layout import BufferLayout
from .buffers.lazy_init import install_creation_stamps, is_lazy, materialise_into_shards
from .buffers.memory_account import memory_account
from .buffers.param_grouping import plan_param_groups
from .comm.communication import ShardingComm, check_interval_from_env
from .comm.expert_comm import ExpertComm
from .comm.expert_parallel import check_expert_layout, expert_parameter_ids, resolve_expert_layout
from .comm.hybrid_comm import HybridComm
from .comm.topology import _world_size, resolve_layout
from .devices.buffer_memory import BlockLedger
from .devices.heap_trim import HeapTrim
from .step import gradient_sync
from .step.hooks import LayerHooks
from .step.layer_integration import install_layer_integration
from .step.optimizer_integration import install_optimizer_integration
from .step.overlap import OverlapSchedule

logger = logging.getLogger(__name__)


class FullyShardFusion:
    """Shard ``model``'s parameters over the sharding group, each rank keeping a slice of fused buffers.

    Args:
        model: the dygraph model; it is modified in place (parameters become shard views, hooks added).
        fsdp_unit_layers: class names of sublayers that are gathered as one unit (e.g. transformer
            blocks). Parameters outside units belong to the root: gathered for the root's whole forward and
            backward (list large loose layers, e.g. the embedding and lm head classes, to bound that).
        group: the process group to shard over; default: fleet's sharding group if fleet set one up
            with ``sharding_degree > 1``, else the global group, else a single process. Layouts where some
            data-parallel ranks would not average gradients (a group smaller than the world; fleet with
            ``mp/pp/sep_degree > 1``) raise ``UnsupportedGroupLayoutError`` (comm/topology.py).
        replicate_group, shard_group: hybrid sharding (HSDP): shard over ``shard_group`` (alias ``group``),
            replicate over ``replicate_group`` (e.g. from ``topology.hybrid_groups(R)``); fleet's ``dp_degree x
            sharding_degree`` config gives the same. Gradients are averaged over both; checkpoints are written
            once (replicas split the writing) in the same format as plain FSDP's (state/replicas.py).
        no_weight_decay_fn: optional ``fn(structured_name) -> bool`` marking extra parameters exempt
            from weight decay (as ``param.no_weight_decay = True`` does).
        compute_dtype: gather parameters in this dtype for forward and backward (e.g. ``"bfloat16"`` under
            AMP O1 with fp32 parameters): half the gather bytes, and autograd saves the unit's low-precision
            parameters, freed with the unit, instead of a cast per op kept for the whole forward (the model's
            weights resident again). Every op then sees low-precision parameters: ops AMP runs in fp32 get
            fp32(bf16(w)), not w (as PyTorch FSDP2's ``param_dtype``). Gradients still accumulate in fp32.
        prefetch_depth: how many units ahead all-gathers are issued asynchronously, in forward and backward
            order, while the current unit computes; also how many reduce-scatters may be in flight. 0 makes
            every collective synchronous. Results are bit-identical for every depth. None (default): 1, except 0
            where every collective finishes inside its call (paddle's plain gloo, CPU training: a prefetch
            overlaps nothing there and holds one more gathered unit). See step/overlap.py.
        reduce_dtype: dtype fp32 gradients are reduce-scattered in: None or "float32" (default, exact), or
            "bfloat16" (half the bytes; the sum over ranks is rounded to bf16, accumulation stays fp32).
        moe_layers_name, expert_parallel_group, expert_shard_group: expert parallelism (EP, see
            comm/expert_parallel.py). Expert parameters (those of sublayers whose class is named in ``moe_layers_name``
            and that are members of an expert list, e.g. ``mlp.experts.5``; default: upstream's ``Qwen3MoeMLP``,
            ``StandardMLPExpert``; and any parameter with ``param.expert = True``) go to buffers of their own,
            sharded over ``expert_shard_group`` (fleet's moe_sharding group; None: one rank per expert) with
            gradients reduced there only; ``expert_parallel_group`` (fleet's EP group) links the ranks holding
            different experts. Default: fleet's groups when its ``ep_degree > 1`` and no group is passed. An
            expert's key must name its global index (checkpoints then do not depend on the EP degree). Layouts EP
            cannot train right raise ``UnsupportedGroupLayoutError``. See docs/expert-parallel.md.
        check_collective_order: run the collective-order check (raises ``CollectiveOrderError`` on every rank
            when ranks are about to issue different FSDP collectives; costs a host round trip before every
            collective) during the first backward pass and every N-th after it; 0 never. None: the
            ``PADDLE_FSDP_CHECK_COLLECTIVE_ORDER`` environment variable (unset: 0).

    Parameters must be initialised identically on every rank (same seed); each rank keeps its slice. A model
    larger than one device can be built under ``paddle.LazyGuard()`` (materialised one parameter at a time into
    the shards, values equal to an eager build) or on the CPU (pieces copied to the device): see buffers/lazy_init.py.
    """

    def __init__(
        self,
        model: paddle.nn.Layer,
        fsdp_unit_layers: list[str] | None = None,
        group=None,
        no_weight_decay_fn: Callable[[str], bool] | None = None,
        compute_dtype: str | None = None,
        prefetch_depth: int | None = None,
        reduce_dtype: str | None = None,
        check_collective_order: int | None = None,
        *,
        replicate_group=None,
        shard_group=None,
        moe_layers_name: list[str] | None = None,
        expert_parallel_group=None,
        expert_shard_group=None,
    ) -> None:
        if not isinstance(model, paddle.nn.Layer):
            raise TypeError(f"FullyShardFusion expects a paddle.nn.Layer, got {type(model).__name__}")
        if getattr(model, "_fsdp", None) is not None:
            raise ValueError("this model is already wrapped by a FullyShardFusion")
        if not paddle.in_dynamic_mode():
            raise RuntimeError("FullyShardFusion works in dygraph mode only")
        self.compute_dtype = _check_compute_dtype(compute_dtype)
        # refuses layouts FSDP would train wrong, before anything changes
        self.group_layout = resolve_layout(group, replicate_group, shard_group)
        own_groups = group is not None or shard_group is not None or replicate_group is not None
        self.expert_layout = resolve_expert_layout(expert_parallel_group, expert_shard_group, use_fleet=not own_groups)
        # without EP only parameters marked ``expert = True`` count (refused: they would be trained as dense)
        expert_ids = expert_parameter_ids(model, moe_layers_name if self.expert_layout is not None else ())
        #: every EP rank's expert keys (this rank's included): all belong to this model's checkpoints
        self._expert_keys: frozenset[str] = frozenset()
        world = _world_size()
        if world > 1:  # one small exchange: every rank refuses alike (comm/expert_parallel.py)
            self._expert_keys = check_expert_layout(self.expert_layout, self.group_layout, model, expert_ids, world)
        if self.expert_layout is None:
            expert_ids = set()
        install_optimizer_integration()
        install_layer_integration()
        self.model = model
        self._backward_end_armed = False
        self._rearm_backward_end = False  # a nested backward ended while the enclosing one runs on
        self._summoned = False  # inside summon_full_params: every buffer stays gathered
        #: where the frozen base came from (a path or hub name), recorded in checkpoints (state/frozen_base.py)
        self.base_source: str | None = None
        self._frozen_base_fingerprint: dict | None = None  # computed once per run (state/frozen_base.py)
        # optimizers that stepped or initialised state for these parameters: summon_full_params(writeback=True)
        # re-casts their fp32 master weights where a written-back value changed (state/full_params.py)
        self._optimizers: weakref.WeakSet = weakref.WeakSet()
        self.blocks = BlockLedger()  # per-step blocks mapped in host memory, by kind (devices/buffer_memory.py)
        layout = self.group_layout
        if layout.replicate_degree > 1:
            self.comm: ShardingComm = HybridComm(layout.shard_group, layout.replicate_group)
        else:
            self.comm = ShardingComm(layout.shard_group)
        self.expert_comm: ExpertComm | None = None
        if self.expert_layout is not None:
            ep = self.expert_layout
            self.expert_comm = ExpertComm(ep.shard_group, ep.parallel_group, world)
        if check_collective_order is None:
            check_collective_order = check_interval_from_env()
        self.schedule = OverlapSchedule(self, prefetch_depth, reduce_dtype, check_collective_order)
        groups = plan_param_groups(model, fsdp_unit_layers, no_weight_decay_fn, expert_ids)
        # lazily built (paddle.LazyGuard) parameters are materialised one at a time after planning (buffers/lazy_init.py)
        one_by_one = any(is_lazy(p) for p in model.parameters())
        self.buffers: list[FusedBuffer] = []
        self._param_keys: dict[int, str] = {}  # id(param) -> structured key
        self._param_index: dict[int, int] = {}  # id(param) -> position in model order, same on every rank
        layer_buffers: dict[int, tuple[paddle.nn.Layer, list[FusedBuffer]]] = {}
        fallback_buffers: dict[int, tuple[paddle.nn.Layer, list[FusedBuffer]]] = {}
        for index, group_plan in enumerate(groups):
            first = group_plan.params[0]
            comm = self.expert_comm if group_plan.attrs.get("expert") else self.comm
            layout = BufferLayout.plan(
                name=f"{index}:{group_plan.name}",
                dtype=str(first.dtype).replace("paddle.", ""),
                element_size=first.element_size(),
                trainable=group_plan.trainable,
                params=[(k, tuple(p.shape)) for k, p in zip(group_plan.keys, group_plan.params)],
                world_size=comm.world_size,
                attrs=group_plan.attrs,
            )
            buffer = FusedBuffer(layout, group_plan.params, comm, owner=self, fill=not one_by_one)
            self.buffers.append(buffer)
            for key, param in zip(group_plan.keys, group_plan.params):
                self._param_keys[id(param)] = key
                self._param_index[id(param)] = len(self._param_index)
            for layer in group_plan.scope_layers:
                layer_buffers.setdefault(id(layer), (layer, []))[1].append(buffer)
            for layer in group_plan.fallback_layers:
                fallback_buffers.setdefault(id(layer), (layer, []))[1].append(buffer)
        if one_by_one:
            materialise_into_shards(model, self.buffers)
        #: trims malloc's heap at the start of each forward and backward, in host memory (devices/heap_trim.py)
        self.heap_trim = HeapTrim(enabled=any(buffer._maps_blocks for buffer in self.buffers))
        self._install_hooks(model, layer_buffers, fallback_buffers)
        model._fsdp = self
        model.sharded_state_dict = self.sharded_state_dict
        logger.debug(
            "FullyShardFusion: %d params in %d buffers over %d ranks; this rank holds %d of %d bytes",
            len(self._param_keys),
            len(self.buffers),
            self.comm.world_size,
            self.resident_parameter_bytes(),
            self.total_parameter_bytes(),
        )

    def _install_hooks(self, model: paddle.nn.Layer, layer_buffers: dict, fallback_buffers: dict) -> None:
        """The root's forward hooks (the schedule's, registered first: they bracket the others), then each
        gathering layer's (step/hooks.py)."""
        prefixes = {id(layer): prefix for prefix, layer in model.named_sublayers(include_self=True)}
        ancestors = _ancestors(model)
        self._root_hooks = [
            model.register_forward_pre_hook(self.schedule.root_pre_forward),
            model.register_forward_post_hook(self.schedule.root_post_forward),
        ]
        self._hooks = [
            LayerHooks(
                layer,
                bufs,
                prefixes.get(id(layer), ""),
                enclosing={id(b) for a in ancestors.get(id(layer), ()) for b in layer_buffers.get(a, (None, []))[1]},
                fallback=fallback,
            )
            for table, fallback in ((layer_buffers, False), (fallback_buffers, True))
            for layer, bufs in table.values()
        ]

    def _describe_buffer(self, index: int) -> str:
        """A buffer's name and first parameter, for error messages."""
        if not 0 <= index < len(self.buffers):
            return f"#{index}"
        layout = self.buffers[index].layout
        return f"{layout.name} ({layout.slots[0].key}, ...)"

    # ---- layout queries (the checkpoint and the tools are built on these) ----------------------
    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def _checkpoint_group(self):
        """The group checkpoints are saved and loaded over: every rank under HSDP (None: the global group), else
        the sharding group."""
        return None if self.group_layout.replicate_degree > 1 else self.comm.group

    @property
    def _checkpoint_rank(self) -> int:
        """This rank's position in :attr:`_checkpoint_group` (indexes the saved RNG states)."""
        if self.group_layout.replicate_degree > 1:
            import paddle.distributed as dist

            return dist.get_rank()
        return self.comm.rank

    def managed_parameters(self):
        """(structured key, parameter, buffer, index in buffer) for every parameter, in model order."""
        for buffer in self.buffers:
            for index, (param, slot) in enumerate(zip(buffer.params, buffer.layout.slots)):
                yield slot.key, param, buffer, index

    def resident_parameter_bytes(self) -> int:
        return sum(buffer.resident_bytes() for buffer in self.buffers)

    def total_parameter_bytes(self) -> int:
        return sum(b.layout.used_numel * b.shard.element_size() for b in self.buffers)

    def memory_account(self) -> dict[str, int]:
        """Bytes this rank's buffers hold now, by role (parameter_shard, gradient_shard, gathered_units,
        gradient_buffers, staging) and the mapped host blocks alive (see devices/buffer_memory.py); peaks in ``blocks.peak``."""
        return memory_account(self.buffers, self.blocks)

    # ---- training-loop support --------------------------------------------------------------------
    def _arm_backward_end(self) -> None:
        """Finish gradients when the running backward pass ends (see step/gradient_sync.py)."""
        gradient_sync.arm_backward_end(self)

    def _flush_gradients(self) -> list[tuple]:
        """Finish a backward pass whose end was not seen (a safety net run at ``opt.step()``); returns the
        (param, grad) pairs it bound. Collective only when every rank has something pending."""
        return gradient_sync.flush_before_step(self)

    def full_parameters(self) -> dict[str, paddle.Tensor]:
        """Gathered copies of every parameter by key, every EP rank's experts included (collective; for tests and
        small models)."""
        from .state.full_params import expert_peer_parameters

        out = {}
        for buffer in self.buffers:
            was_gathered = buffer.is_gathered
            buffer.gather(full_precision=True)
            for param, slot in zip(buffer.params, buffer.layout.slots):
                out[slot.key] = param.detach().clone()
            out.update((k, v.clone()) for k, v in expert_peer_parameters(self, buffer).items())  # other EP ranks'
            if not was_gathered:
                buffer.release()
        for prefix, layer in self.model.named_sublayers(include_self=True):  # replicated (never sharded) ones
            for name, param in layer._parameters.items():
                if param is not None and not hasattr(param, "_fsdp_buffer"):
                    out.setdefault(f"{prefix}.{name}" if prefix else name, param.detach().clone())
        return out

    # ---- full parameters (state/full_params.py) -----------------------------------------------------
    def summon_full_params(self, writeback: bool = False, rank0_only: bool = False):
        """Context manager (collective): every parameter whole inside, e.g. for ``print``, ``save_pretrained``,
        evaluation or custom initialisation; ``writeback=True`` scatters changes made inside back to the shards."""
        from .state.full_params import summon_full_params

        return summon_full_params(self, writeback=writeback, rank0_only=rank0_only)

    def full_state_dict(self, rank0_only: bool = True, offload_to_cpu: bool = True) -> dict:
        """The unwrapped model's ``state_dict()`` (whole parameters + persistable buffers), gathered one unit at a
        time (collective); other ranks get ``{}`` with ``rank0_only``."""
        from .state.full_params import full_state_dict

        return full_state_dict(self, rank0_only=rank0_only, offload_to_cpu=offload_to_cpu)

    # ---- checkpoint API (state/records.py builds the records) -------------------------------
    def sharded_state_dict(self) -> dict:
        """This rank's model state as flattened ShardedWeight records keyed by structured name."""
        from .state.records import model_sharded_state_dict

        return model_sharded_state_dict(self)

    def optimizer_sharded_state_dict(self, optimizer) -> dict:
        """This rank's optimizer state as ``<param key>.<state name>`` records (see state/records.py)."""
        from .state.records import optimizer_sharded_state_dict

        return optimizer_sharded_state_dict(self, optimizer)

    def init_optimizer_state(self, optimizer) -> None:
        """Create ``optimizer``'s accumulators for the local pieces, so a load has targets to fill."""
        from .state.records import init_optimizer_state

        init_optimizer_state(self, optimizer)

    def save_checkpoint(self, path: str, optimizer=None, extra_state: dict | None = None, **kwargs):
        """Model + optimizer + LR scheduler + RNG + ``extra_state``, in one collective call.

        ``step=N`` treats ``path`` as a root (``root/step_<N>`` and a ``latest`` pointer moved after the
        commit); ``keep_last=K`` then removes older steps; ``async_save=True`` returns a handle to wait on;
        ``grad_scaler=`` a ``paddle.amp.GradScaler`` saved too (pass it to :meth:`load_checkpoint` as well).
        """
        from .keywords import check_keywords, keyword_names
        from .state.resume import save_checkpoint

        check_keywords("save_checkpoint", kwargs, keyword_names(save_checkpoint, ("fsdp",)))
        return save_checkpoint(self, path, optimizer=optimizer, extra_state=extra_state, **kwargs)

    def memory_tier(self, optimizer=None, *, durable_root: str, **kwargs):
        """A MemoryTier (memtier/manager.py) over this model and ``optimizer``, already restored (collective):
        ``tier.start_step`` is the step every rank resumed from (0: a fresh start), ``tier.restored`` the result."""
        from .keywords import check_keywords, keyword_names
        from .memtier import MemoryTier

        check_keywords("memory_tier", kwargs, keyword_names(MemoryTier.__init__, ("self", "fsdp", "optimizer")))
        tier = MemoryTier(self, optimizer, durable_root=durable_root, **kwargs)
        tier.restore()
        return tier

    def ema(self, coef: float, every: int = 1):
        """A ShardedEMA of this model's weights (state/ema.py): fp32, over this rank's shard, initialised from the
        current weights; call ``ema.update()`` after each optimizer step and pass ``ema=`` to the checkpoint calls
        (``every=N``: average every N-th call, at 1/N of the cost)."""
        from .state.ema import ShardedEMA

        return ShardedEMA(self, coef, every)

    def load_checkpoint(self, path: str, optimizer=None, **kwargs) -> dict:
        """Restore what :meth:`save_checkpoint` wrote (a checkpoint, or a root: its ``latest``).

        Returns the saved ``extra_state`` as a dict that also carries ``.report`` (the LoadReport),
        ``.path`` (the directory loaded), ``.step`` (for ``step_<N>`` directories) and ``.fallback_from``
        (newer checkpoints of a root that failed mid-load, see state/resume.py).
        """
        from .keywords import check_keywords, keyword_names
        from .state.resume import load_checkpoint

        check_keywords("load_checkpoint", kwargs, keyword_names(load_checkpoint, ("fsdp",)))
        return load_checkpoint(self, path, optimizer=optimizer, **kwargs)


def _check_compute_dtype(dtype):
    """``compute_dtype`` as a paddle dtype (None stays None); ValueError for anything but a floating dtype."""
    if dtype is None:
        return None
    allowed = {"float16": paddle.float16, "bfloat16": paddle.bfloat16, "float32": paddle.float32}
    name = str(dtype).replace("paddle.", "")
    if name not in allowed:
        raise ValueError(f"compute_dtype must be one of {sorted(allowed)} (or None), got {dtype!r}")
    return allowed[name]


install_creation_stamps()  # before any model is built under paddle.LazyGuard (buffers/lazy_init.py)


def _ancestors(model: paddle.nn.Layer) -> dict[int, set[int]]:
    """Layer id -> ids of the layers enclosing it (not itself); a layer under several names gets the union."""
    out: dict[int, set[int]] = {}

    def walk(layer, above: tuple[int, ...]):
        seen = out.setdefault(id(layer), set())
        before = len(seen)
        seen.update(above)
        if before and len(seen) == before:
            return
        for child in layer._sub_layers.values():
            if child is not None and id(child) not in above:
                walk(child, (*above, id(layer)))

    walk(model, ())
    return out
