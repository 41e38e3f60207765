"""One fused buffer at run time: the rank's shard, the gathered full buffer, and the gradient path.

A parameter has two bindings, switched by re-pointing its tensor at different memory (its tensor object
never changes, so autograd's saved references stay valid):
  - at rest it is a 1-D view of the part of it this rank owns inside ``shard`` (possibly empty). The
    optimizer steps these views directly, so it only ever touches local slices;
  - while its layer runs forward or backward it is a full-shape view into the gathered buffer.

Gradients: autograd produces a full-shape gradient; a post-accumulation hook copies it into a full-size
fp32 (fp64 for fp64 params) buffer and drops it. When every trainable parameter of the buffer has reported, the buffer is
reduce-scattered (mean over ranks) and added into ``main_grad``, the fp32 gradient of the local shard,
which also accumulates across micro-batches. Each parameter's ``.grad`` is then bound to its piece of
that gradient, so ``opt.step()`` and ``opt.clear_grad()`` work unchanged.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import paddle

from .fused_layout import BufferLayout, LocalPiece

if TYPE_CHECKING:
    from .communication import ShardingComm

logger = logging.getLogger(__name__)


def _bind(param: paddle.Tensor, source: paddle.Tensor, shape: list[int]) -> None:
    source._share_buffer_to(param)
    param.get_tensor()._set_dims(shape)


class FusedBuffer:
    """The run-time state of one :class:`BufferLayout` on this rank."""

    def __init__(self, layout: BufferLayout, params: list, comm: ShardingComm, owner) -> None:
        self.layout = layout
        self.params = params
        self.comm = comm
        self.owner = owner  # the FullyShardFusion this buffer belongs to
        self.pieces: dict[int, LocalPiece] = {}
        for piece in layout.local_pieces(comm.rank):
            self.pieces[layout.slots.index(piece.slot)] = piece
        self.full: paddle.Tensor | None = None
        self.full_grad: paddle.Tensor | None = None
        self.main_grad: paddle.Tensor | None = None
        self._grad_in_param_dtype: paddle.Tensor | None = None
        self._arrived: set[int] = set()
        self._bound_grads: set[int] = set()
        self.held_for_backward = False
        self.shard = paddle.zeros([layout.shard_numel], dtype=params[0].dtype)
        # gradients are reduced and accumulated in at least fp32 (fp64 params keep fp64)
        self.grad_dtype = paddle.float64 if self.shard.dtype == paddle.float64 else paddle.float32
        with paddle.no_grad():
            for index, piece in self.pieces.items():
                flat = params[index].reshape([-1])
                paddle.assign(
                    flat[piece.param_start : piece.param_stop],
                    output=self._shard_view(piece),
                )
        for index, param in enumerate(params):
            param._fsdp_buffer = self
            if layout.trainable:
                param._register_backward_hook(self._make_grad_hook(index))
        self.release()  # frees the full-size storage the model was built with

    # ---- parameter bindings -------------------------------------------------------------------
    def _shard_view(self, piece: LocalPiece) -> paddle.Tensor:
        return self.shard._slice(piece.shard_start, piece.shard_start + piece.length)

    @property
    def is_gathered(self) -> bool:
        return self.full is not None

    def gather(self) -> None:
        """Bind every parameter to a full-shape view of the gathered buffer (no-op when gathered)."""
        if self.full is not None:
            return
        with paddle.no_grad():
            if self.comm.world_size == 1:
                self.full = self.shard
            else:
                self.full = paddle.empty([self.layout.padded_numel], dtype=self.shard.dtype)
                self.comm.all_gather_into(self.full, self.shard)
        for param, slot in zip(self.params, self.layout.slots):
            _bind(param, self.full._slice(slot.offset, slot.end), list(slot.shape))

    def release(self) -> None:
        """Bind every parameter back to its local piece and drop the gathered buffer."""
        for index, param in enumerate(self.params):
            piece = self.pieces.get(index)
            if piece is None:
                _bind(param, self.shard._slice(0, 0), [0])
            else:
                _bind(param, self._shard_view(piece), [piece.length])
        self.full = None
        self.held_for_backward = False

    def local_view(self, index: int) -> paddle.Tensor | None:
        """This rank's piece of parameter ``index`` as a 1-D view of the shard, or None if it owns none."""
        piece = self.pieces.get(index)
        return None if piece is None else self._shard_view(piece)

    # ---- gradients ------------------------------------------------------------------------------
    def _make_grad_hook(self, index: int):
        def hook() -> None:
            self._on_grad_ready(index)

        return hook

    def _on_grad_ready(self, index: int) -> None:
        param = self.params[index]
        grad = param._grad_ivar()
        if grad is None:
            return
        slot = self.layout.slots[index]
        with paddle.no_grad():
            if self.full_grad is None:
                self.full_grad = paddle.zeros([self.layout.padded_numel], dtype=self.grad_dtype)
            target = self.full_grad._slice(slot.offset, slot.end)
            flat = grad.reshape([-1])
            if flat.dtype != self.grad_dtype:
                flat = flat.astype(self.grad_dtype)
            if index in self._arrived:  # a second backward before the reduce: accumulate
                target.add_(flat)
            else:
                paddle.assign(flat, output=target)
        param.clear_gradient(False)
        self._arrived.add(index)
        if len(self._arrived) == len(self.params):
            self.reduce_gradients()

    def prepare_for_backward(self) -> None:
        """Before this buffer's backward: gather, and take back the gradients lent to ``param.grad``.

        ``param.grad`` stays bound to a piece of ``main_grad`` between backward passes, so that the user
        and the optimizer see it. Autograd must find ``.grad`` empty to create a full-shape gradient,
        so the bound pieces are unbound here; whatever the user did to them meanwhile is honoured:
        zeroed in place (``clear_grad()``) or dropped (``clear_grad(set_to_zero=False)``) both mean zero.
        """
        self.gather()
        self.held_for_backward = True
        self.owner.arm_backward_end()
        if not self._bound_grads:
            return
        with paddle.no_grad():
            for index in self._bound_grads:
                param, piece = self.params[index], self.pieces[index]
                main_piece = self.main_grad._slice(piece.shard_start, piece.shard_start + piece.length)
                grad = param._grad_ivar()
                if grad is None:
                    main_piece.zero_()
                elif grad.dtype != self.grad_dtype:
                    paddle.assign(grad.astype(self.grad_dtype), output=main_piece)
                param.clear_gradient(False)
        self._bound_grads.clear()

    def reduce_gradients(self) -> list[tuple]:
        """Reduce-scatter the gathered gradients into ``main_grad``, release, bind ``.grad`` pieces.

        Returns the (param, grad) pairs it bound. A no-op when no gradient arrived since the last call.
        """
        if not self._arrived:
            return []
        with paddle.no_grad():
            local = self.comm.reduce_scatter_mean(self.full_grad)
            if self.main_grad is None:
                self.main_grad = paddle.zeros([self.layout.shard_numel], dtype=self.grad_dtype)
            self.main_grad.add_(local)
            self.full_grad = None
            if self.shard.dtype == self.grad_dtype:
                grad_source = self.main_grad
            else:
                self._grad_in_param_dtype = self.main_grad.astype(self.shard.dtype)
                grad_source = self._grad_in_param_dtype
        self.release()
        bound = []
        for index in sorted(self._arrived):
            piece = self.pieces.get(index)
            if piece is None:
                continue
            param = self.params[index]
            param.clear_gradient(False)
            param._copy_gradient_from(grad_source._slice(piece.shard_start, piece.shard_start + piece.length))
            self._bound_grads.add(index)
            bound.append((param, param._grad_ivar()))
        self._arrived.clear()
        return bound

    # ---- introspection --------------------------------------------------------------------------
    def resident_bytes(self) -> int:
        """Bytes of parameter storage this rank holds at rest (its shard)."""
        return self.layout.shard_numel * self.shard.element_size()
