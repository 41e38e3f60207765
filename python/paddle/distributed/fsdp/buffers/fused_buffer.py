"""One fused buffer at run time: the rank's shard, the gathered full buffer, and the gradient path.

A parameter has two bindings, switched by re-pointing its tensor at different memory (its tensor object
never changes, so autograd's saved references stay valid):
  - at rest it is a 1-D view of the part of it this rank owns inside ``shard`` (possibly empty). The
    optimizer steps these views directly, so it only ever touches local slices;
  - while its layer runs forward or backward it is a full-shape view into the gathered buffer.

Gradients: autograd produces a full-shape gradient; a post-accumulation hook adds it into a full-size
fp32 (fp64 for fp64 params) buffer and drops it. The buffer is reduce-scattered (mean over ranks) into
``main_grad``, the fp32 gradient of the local shard, at a point every rank reaches in the same order
(step/gradient_sync.py): never when "all gradients arrived here", which differs between ranks that leave
different parameters unused. ``main_grad`` accumulates across micro-batches and is the source of truth;
at the end of backward each parameter's ``.grad`` is bound to its piece of it (or to a piece of one cast
of it for low-precision parameters without AMP master grads), so ``opt.step()`` and ``opt.clear_grad()``
work unchanged.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import paddle

from ..comm.communication import GATHER, REDUCE
from ..devices import host_mappings
from ..devices.buffer_memory import GATHERED, GRADIENT, GRADIENT_SHARD, maps_blocks, new_block
from ..devices.device import address, check_same_place, host_to_device
from .fused_layout import BufferLayout, LocalPiece

if TYPE_CHECKING:
    from ..comm.communication import ShardingComm

logger = logging.getLogger(__name__)


def amp_master_grad_enabled() -> bool:
    """Whether paddle AMP's master-grad mode (``paddle.amp.decorate(..., master_grad=True)``) is on."""
    from paddle.amp.auto_cast import amp_global_state

    return bool(getattr(amp_global_state(), "use_master_grad", False))


def _bind(param: paddle.Tensor, source: paddle.Tensor, shape: list[int]) -> None:
    source._share_buffer_to(param)
    param.get_tensor()._set_dims(shape)


def _differs_anywhere(copy: paddle.Tensor, main_grad: paddle.Tensor) -> paddle.Tensor:
    """A 0-d bool tensor on the device: whether the low-precision ``copy`` differs anywhere from ``main_grad``
    cast like it (compared in fp32, which every backend has kernels for)."""
    return paddle.any(copy.astype("float32") != main_grad.astype(copy.dtype).astype("float32"))


class FusedBuffer:
    """The run-time state of one :class:`BufferLayout` on this rank."""

    def __init__(self, layout: BufferLayout, params: list, comm: ShardingComm, owner, fill: bool = True) -> None:
        """``fill=False``: leave the shard zero and the parameters as they are (lazy ones uninitialised); the caller
        fills it with :meth:`fill_param` (lazy_init.py does, one parameter at a time in creation order)."""
        self.layout = layout
        self.params = params
        self.comm = comm
        self.owner = owner  # the FullyShardFusion this buffer belongs to
        self.index = len(owner.buffers)  # position in owner.buffers (same on every rank)
        self.pieces: dict[int, LocalPiece] = {}
        for piece in layout.local_pieces(comm.rank):
            self.pieces[layout.slots.index(piece.slot)] = piece
        self.full: paddle.Tensor | None = None
        self.full_grad: paddle.Tensor | None = None
        self.main_grad: paddle.Tensor | None = None
        self._grad_in_param_dtype: paddle.Tensor | None = None
        self._arrived: set[int] = set()  # gradients of the running backward (local; only frees memory early)
        self.received: set[int] = set()  # gradients since the last end of backward (exchanged there)
        self.has_grad: set[int] = set()  # parameters with a gradient in main_grad (same on every rank)
        self._bound_grads: set[int] = set()
        self.held_for_backward = False
        self.reduce_pending = False  # gathered for backward and not reduced yet (same on every rank)
        self._local_views: dict[int, paddle.Tensor] = {}  # local_view's views, kept while they still alias
        self._gathering: tuple | None = None  # (full, task) of a gather in flight (a prefetch, see step/overlap.py)
        self._reducing: tuple | None = None  # (local result, task) of a reduce-scatter in flight
        self.shard = paddle.zeros([layout.shard_numel], dtype=params[0].dtype)
        self._maps_blocks = maps_blocks(self.shard)  # gathered and gradient blocks: host mappings (buffer_memory)
        # gradients are reduced and accumulated in at least fp32 (fp64 params keep fp64)
        self.grad_dtype = paddle.float64 if self.shard.dtype == paddle.float64 else paddle.float32
        for index, param in enumerate(params):
            param._fsdp_buffer = self
            if layout.trainable:
                param._register_backward_hook(self._make_grad_hook(index))
        if fill:
            for index in range(len(params)):
                self.fill_param(index)
            self.release()  # frees the full-size storage the model was built with

    def fill_param(self, index: int) -> None:
        """Copy this rank's piece of parameter ``index`` (as it holds now, full-size) into the shard. A parameter in
        host memory (built on the CPU) is copied across to the shard's device (device.check_same_place)."""
        param, slot = self.params[index], self.layout.slots[index]
        across = check_same_place(slot.key, param, self.shard.place)
        piece = self.pieces.get(index)
        if piece is None:
            return
        with paddle.no_grad():
            part = param.reshape([-1])[piece.param_start : piece.param_stop]
            if across:
                host_to_device(part.contiguous(), self._shard_view(piece))
            else:
                paddle.assign(part, output=self._shard_view(piece))

    def bind_local(self, index: int) -> None:
        """Bind parameter ``index`` to its local piece (an empty view when it owns none), dropping its own storage."""
        piece = self.pieces.get(index)
        if piece is None:
            # an empty view must still own memory: sharing an uninitialised ``_slice(0, 0)`` is a no-op that left
            # the parameter holding its old storage (the model's, or the whole gathered buffer after a release)
            _bind(self.params[index], self.shard._slice(0, 1), [0])
        else:
            _bind(self.params[index], self._shard_view(piece), [piece.length])

    # ---- parameter bindings -------------------------------------------------------------------
    def _shard_view(self, piece: LocalPiece) -> paddle.Tensor:
        return self.shard._slice(piece.shard_start, piece.shard_start + piece.length)

    @property
    def is_gathered(self) -> bool:
        return self.full is not None

    def compute_dtype(self):
        """The dtype parameters are gathered in for forward and backward: the owner's ``compute_dtype`` for
        floating buffers of another dtype, else the shard's own."""
        wanted = getattr(self.owner, "compute_dtype", None)
        if wanted is None or wanted == self.shard.dtype or not self.shard.is_floating_point():
            return self.shard.dtype
        return wanted

    def gather(self, full_precision: bool = False) -> None:
        """Bind every parameter to a full-shape view of the gathered buffer (no-op when gathered); a gather
        already in flight (a prefetch) is waited for instead of issuing another.

        For forward and backward the buffer is gathered in :meth:`compute_dtype` (the owner's ``compute_dtype``):
        each rank casts its shard, the low-precision buffer is gathered, and the parameters *are* low-precision
        views while their unit runs. AMP then casts nothing, and what autograd saves for backward is the parameter
        itself, whose memory a release re-points (a cast would be a new tensor kept until backward: under O1 the
        whole model's weights). ``full_precision`` (summon_full_params, full_state_dict) gathers the shard's dtype.
        """
        dtype = self.shard.dtype if full_precision else self.compute_dtype()
        if self.full is not None:
            if self.full.dtype != dtype:
                raise RuntimeError(
                    f"FullyShardFusion: buffer {self.layout.name} is gathered in {self.full.dtype} for compute; "
                    f"full-precision access ({dtype}) needs it released first (outside forward and backward)"
                )
            return
        if self.comm.world_size == 1:
            with paddle.no_grad():
                self.full = self.shard if dtype == self.shard.dtype else self.shard.astype(dtype)
            self._bind_full()
            return
        if self._gathering is not None and self._gathering[0].dtype != dtype:
            self.drop_gather()  # a prefetch in the compute dtype; this caller wants full precision
        self.start_gather(dtype=dtype)
        self.finish_gather()

    def _new_block(self, dtype, kind: str, zero: bool = False) -> paddle.Tensor:
        """A block for ``kind`` (full-size, or shard-size for the gradient shard), given back when its last
        reference goes (devices/buffer_memory.py)."""
        numel = self.layout.shard_numel if kind == GRADIENT_SHARD else self.layout.padded_numel
        return new_block(numel, dtype, kind, self.owner.blocks, self._maps_blocks, zero=zero)

    @property
    def gather_in_flight(self) -> bool:
        return self._gathering is not None

    def start_gather(self, force: bool = False, dtype=None) -> bool:
        """Issue the all-gather of this buffer without waiting (a prefetch); True if one was issued.

        Skipped when one is in flight already, in a one-rank world, and (unless ``force``) when the buffer is
        gathered. Prefetch decisions must be the same on every rank; a buffer gathered here alone (released
        early elsewhere) must still join the collective, hence ``force``. ``dtype``: :meth:`compute_dtype`
        unless given."""
        if self._gathering is not None or self.comm.world_size == 1 or (self.full is not None and not force):
            return False
        dtype = self.compute_dtype() if dtype is None else dtype
        with paddle.no_grad():
            source = self.shard if dtype == self.shard.dtype else self.shard.astype(dtype)
            self.comm.agree(GATHER, self.index, self.owner._describe_buffer)
            full = self._new_block(dtype, GATHERED)
            # the cast source stays referenced until the task is waited for: the collective reads it
            self._gathering = (full, self.comm.all_gather_into(full, source, async_op=True), source)
        self.owner.schedule.record("AG", self.index, "issue")
        return True

    def finish_gather(self) -> None:
        """Wait for the gather in flight and bind to it (dropped if the buffer got gathered meanwhile)."""
        if self._gathering is None:
            return
        full, task, _source = self._gathering
        self._gathering = None
        task.wait()
        self.owner.schedule.record("AG", self.index, "wait")
        if self.full is None:
            self.full = full
            self._bind_full()

    def drop_gather(self) -> None:
        """Wait for a gather in flight and throw its result away (a prefetch its unit did not use)."""
        if self._gathering is not None:
            _full, task, _source = self._gathering
            self._gathering = None
            task.wait()
            self.owner.schedule.record("AG", self.index, "drop")

    def _bind_full(self) -> None:
        for param, slot in zip(self.params, self.layout.slots):
            _bind(param, self.full._slice(slot.offset, slot.end), list(slot.shape))

    def release(self) -> None:
        """Bind every parameter back to its local piece and drop the gathered buffer. A gather in flight is
        left alone: it was issued on every rank and is finished (or dropped) where every rank does so."""
        for index in range(len(self.params)):
            self.bind_local(index)
        self.full = None
        self.held_for_backward = False
        self._arrived.clear()
        host_mappings.release_unviewed()  # the gathered block, unless autograd still holds a view

    def local_view(self, index: int) -> paddle.Tensor | None:
        """This rank's piece of parameter ``index`` as a 1-D view of the shard, or None if it owns none.

        The view is made once and handed out again while it still covers its piece of the shard (address and
        shape checked, ~1 us): a ``_slice`` costs ~12 us, and every save and load asks for every piece."""
        piece = self.pieces.get(index)
        if piece is None:
            return None
        view = self._local_views.get(index)
        if view is None or not self._covers(view, piece):
            view = self._local_views[index] = self._shard_view(piece)
        return view

    def _covers(self, view: paddle.Tensor, piece: LocalPiece) -> bool:
        """Whether ``view`` is still the 1-D view of ``piece`` in the shard: a caller that re-pointed or
        resized it (``set_value`` with another shape, ``_share_buffer_to``) gets a fresh view instead."""
        try:
            start = address(self.shard) + piece.shard_start * self.shard.element_size()
            return view.shape == [piece.length] and address(view) == start
        except Exception:  # noqa: BLE001 - an uninitialised (cleared) view
            return False

    # ---- gradients ------------------------------------------------------------------------------
    def _make_grad_hook(self, index: int):
        def hook() -> None:
            self._on_grad_ready(index)

        return hook

    def _on_grad_ready(self, index: int) -> None:
        """Move a full-shape gradient into ``full_grad``. Never communicates: when to reduce is decided
        by events every rank sees in the same order (see step/gradient_sync.py), not by what arrived here."""
        param = self.params[index]
        grad = param._grad_ivar()
        if grad is None:
            return
        slot = self.layout.slots[index]
        with paddle.no_grad():
            if self.full_grad is None:
                self.full_grad = self._new_block(self.grad_dtype, GRADIENT, zero=True)
            flat = grad.reshape([-1])
            if flat.dtype != self.grad_dtype:
                flat = flat.astype(self.grad_dtype)
            self.full_grad._slice(slot.offset, slot.end).add_(flat)
        param.clear_gradient(False)
        if self.owner._rearm_backward_end:  # a nested backward ended; the enclosing one goes on (gradient_sync)
            self.owner._arm_backward_end()
        self.received.add(index)
        self._arrived.add(index)
        if len(self._arrived) == len(self.params):
            # every parameter has its gradient: nothing of this backward reads the gathered weights any more,
            # so give the memory back now (local, no collective); the reduction waits for its turn
            self._arrived.clear()
            self.release()

    def prepare_for_backward(self) -> None:
        """Before this buffer's backward: gather, and take back the gradients lent to ``param.grad``.

        Called through :func:`gradient_sync.before_backward_gather`, which first reduces the buffers whose
        backward is over. Autograd must find ``.grad`` empty to create a full-shape gradient, so the
        gradients bound between backward passes are taken back here (see :meth:`take_back_grads`).
        """
        self.take_back_grads()
        self.gather()
        self.held_for_backward = True
        if self.layout.trainable:
            self.reduce_pending = True

    def take_back_grads(self) -> None:
        """Fold what the user (or AMP) left in the bound ``.grad`` tensors back into ``main_grad``, unbind.

        ``main_grad`` is the source of truth. A ``.grad`` that *is* a piece of it already carries every
        in-place change (``clear_grad()`` zeroes it there). A dropped one (``clear_grad(set_to_zero=False)``)
        means zero and no gradient. A low-precision copy left untouched keeps the fp32 value (accumulation
        stays exact across micro-batches); a modified or replaced one (AMP's ``set_master_grads``, a
        GradScaler unscale, a user assignment) is taken as the new value. Whether the copy changed is decided
        on the device (no host sync), for the whole copy at once as before.
        """
        if not self._bound_grads:
            return
        self.finish_reduce()
        copy = self._grad_in_param_dtype
        with paddle.no_grad():
            # whether the copy changed anywhere (before main_grad changes below): a 0-d flag the host never reads
            copy_changed = _differs_anywhere(copy, self.main_grad) if copy is not None else None
            for index in self._bound_grads:
                param, piece = self.params[index], self.pieces[index]
                main_piece = self.main_grad._slice(piece.shard_start, piece.shard_start + piece.length)
                grad = param._grad_ivar()
                if grad is None:
                    main_piece.zero_()
                    self.has_grad.discard(index)
                elif grad._is_shared_buffer_with(self.main_grad):
                    pass
                elif copy is not None and grad._is_shared_buffer_with(copy):
                    taken = paddle.where(copy_changed, grad.reshape([-1]).astype(self.grad_dtype), main_piece)
                    paddle.assign(taken, output=main_piece)
                else:
                    paddle.assign(grad.reshape([-1]).astype(self.grad_dtype), output=main_piece)
                param.clear_gradient(False)
        self._bound_grads.clear()
        self._grad_in_param_dtype = None

    def reduce_gradients(self) -> None:
        """Reduce-scatter this backward's gradients into ``main_grad`` and wait (collective: every rank calls it
        at the same point, with zeros when no gradient arrived here)."""
        self.start_reduce()
        self.finish_reduce()

    def start_reduce(self, dtype=None) -> None:
        """Issue this backward's reduce-scatter without waiting; :meth:`finish_reduce` adds it to ``main_grad``.
        ``dtype``: reduce in that dtype (the ``reduce_dtype`` option), else in the gradient dtype."""
        self.finish_reduce()  # one in flight per buffer: main_grad is touched below and when it lands
        self.reduce_pending = False
        self.take_back_grads()  # main_grad changes below: a bound low-precision copy would go stale
        if self.full_grad is None and self.comm.world_size == 1:
            return
        with paddle.no_grad():
            self.comm.agree(REDUCE, self.index, self.owner._describe_buffer)
            full = self.full_grad
            if full is None:
                full = self._new_block(self.grad_dtype, GRADIENT, zero=True)
            self.full_grad = None
            self._reducing = self.comm.reduce_scatter_mean_async(full, dtype=dtype)
        self.owner.schedule.record("RS", self.index, "issue")

    @property
    def reduce_in_flight(self) -> bool:
        return self._reducing is not None

    @property
    def reduce_completed(self) -> bool:
        """Whether the reduce-scatter in flight has finished already (see CommTask.completed)."""
        return self._reducing is not None and self._reducing[1].completed

    def finish_reduce(self) -> None:
        """Wait for this buffer's reduce-scatter in flight, if any, and add it to ``main_grad``."""
        if self._reducing is None:
            return
        local, task = self._reducing
        self._reducing = None
        task.wait()
        self.owner.schedule.record("RS", self.index, "wait")
        with paddle.no_grad():
            if local.dtype != self.grad_dtype:
                local = local.astype(self.grad_dtype)
            if self.main_grad is None:
                self.main_grad = self._new_block(self.grad_dtype, GRADIENT_SHARD, zero=True)
            self.main_grad.add_(local)
        del local, task
        host_mappings.release_unviewed()  # the reduced gradient block, unless autograd still holds a view

    def release_grads(self, cleared: set[int]) -> bool:
        """After ``opt.clear_grad()``: free the gradient shard (``main_grad``) and unbind ``.grad`` (None until the
        next backward ends), as stock stage 3 frees gradients, when that optimizer cleared every parameter holding
        a gradient here (``cleared``: their ids) and nothing is pending. A zeroed and a freed gradient shard are
        the same to the next backward (it starts from zero), and parameters zeroed rather than dropped get a zero
        gradient bound again then (bind_grads), so training is unchanged; only the memory differs. True if freed."""
        if self.main_grad is None or self.reduce_pending or self._reducing is not None or self.received:
            return False
        if any(id(self.params[index]) not in cleared for index in self.has_grad | self._bound_grads):
            return False
        for index in self._bound_grads:
            param = self.params[index]
            if param._grad_ivar() is None:  # clear_grad(set_to_zero=False): no gradient any more, as stock
                self.has_grad.discard(index)
            param.clear_gradient(False)
        # set_to_zero=True keeps has_grad: those parameters are bound to zeros (at least) at the next end of
        # backward, so the optimizer still steps them as stock steps a zeroed gradient (weight decay, moments)
        self._bound_grads.clear()
        self.main_grad = None
        self._grad_in_param_dtype = None
        host_mappings.release_unviewed()
        return True

    def optimizer_grad_dtype(self):
        """The dtype ``.grad`` gets: the parameter's own, except under AMP master grads (fp32, as paddle's
        ``set_master_grads`` would make it)."""
        if self.shard.dtype == self.grad_dtype or amp_master_grad_enabled():
            return self.grad_dtype
        return self.shard.dtype

    def bind_grads(self) -> list[tuple]:
        """Bind ``.grad`` of every local piece that has a gradient to its piece of ``main_grad`` (or of one
        cast of it). Returns the (param, grad) pairs bound."""
        if not self.has_grad:
            return []
        if self.main_grad is None:  # released by clear_grad and no gradient since: zeros, as a zeroed .grad was
            self.main_grad = self._new_block(self.grad_dtype, GRADIENT_SHARD, zero=True)
        dtype = self.optimizer_grad_dtype()
        source = self.main_grad
        if dtype != self.grad_dtype:
            with paddle.no_grad():
                self._grad_in_param_dtype = source = self.main_grad.astype(dtype)
        bound = []
        for index in sorted(self.has_grad):
            piece = self.pieces.get(index)
            if piece is None or index in self._bound_grads:
                continue
            param = self.params[index]
            view = source._slice(piece.shard_start, piece.shard_start + piece.length)
            param.clear_gradient(False)
            if view.dtype == param.dtype:
                param._copy_gradient_from(view)
            else:  # fp32 gradient of a low-precision parameter: make a gradient of that dtype, then share
                param.grad = view
                view._share_buffer_to(param._grad_ivar())
            self._bound_grads.add(index)
            bound.append((param, param._grad_ivar()))
        return bound

    def param_position(self, param) -> int:
        """Index of ``param`` in this buffer (by identity: tensors compare elementwise)."""
        for index, mine in enumerate(self.params):
            if mine is param:
                return index
        raise KeyError(f"parameter {param.name} is not in buffer {self.layout.name}")

    def bound_grad_indices(self) -> set[int]:
        """Parameters whose ``.grad`` is currently bound to a piece of this buffer's gradient."""
        return set(self._bound_grads)

    def grad_source(self) -> paddle.Tensor | None:
        """The tensor every bound ``.grad`` is a view of: ``main_grad``, or its low-precision copy."""
        return self._grad_in_param_dtype if self._grad_in_param_dtype is not None else self.main_grad

    def check_intact(self) -> None:
        """Refuse parameters changed behind FSDP's back (e.g. cast by ``paddle.amp.decorate`` after wrapping)."""
        for param, slot in zip(self.params, self.layout.slots):
            if param.dtype != self.shard.dtype:
                raise RuntimeError(
                    f"FullyShardFusion: parameter {slot.key!r} is now {param.dtype}, its fused buffer holds "
                    f"{self.shard.dtype}: it was cast after wrapping. Call paddle.amp.decorate(...) (or .to(dtype)) "
                    "before FullyShardFusion(model, ...)"
                )
            if hasattr(param, "main_grad"):
                raise RuntimeError(
                    f"FullyShardFusion: parameter {slot.key!r} has a `main_grad` attribute: AMP's tensor-fusion "
                    "master-grad mode (FLAGS_enable_tensor_fusion) is not supported; FSDP keeps fp32 gradients "
                    "itself. Unset FLAGS_enable_tensor_fusion"
                )

    # ---- introspection --------------------------------------------------------------------------
    def resident_bytes(self) -> int:
        """Bytes of parameter storage this rank holds at rest (its shard)."""
        return self.layout.shard_numel * self.shard.element_size()
