"""When buffers are gathered and released: forward pre/post hooks and a pre-backward trigger.

Forward: a layer's buffers are gathered right before its forward and released right after, so at most
the running layer's parameters are full-size. Backward: paddle has no "before this layer's backward"
hook, so the layer's outputs pass through an identity PyLayer whose backward runs first among the
layer's gradient computations; it gathers the buffers again. The buffers are released by their own
gradient reduction (trainable) or at the next optimizer step / forward (frozen buffers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import paddle
from paddle.autograd import PyLayer

from .gradient_sync import before_backward_gather

if TYPE_CHECKING:
    from .fused_buffer import FusedBuffer


class _PreBackwardGather(PyLayer):
    """Identity in forward; gathers the layer's buffers when the gradient reaches its outputs."""

    @staticmethod
    def forward(ctx, buffers, *tensors):
        ctx.buffers = buffers
        return tensors if len(tensors) > 1 else tensors[0]

    @staticmethod
    def backward(ctx, *grads):
        before_backward_gather(ctx.buffers)
        return grads if len(grads) > 1 else grads[0]


def _differentiable_leaves(outputs) -> list[paddle.Tensor]:
    found: list[paddle.Tensor] = []

    def visit(value):
        if isinstance(value, paddle.Tensor):
            if not value.stop_gradient:
                found.append(value)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)

    visit(outputs)
    return found


def _replace_leaves(outputs, replacement: dict[int, paddle.Tensor]):
    if isinstance(outputs, paddle.Tensor):
        return replacement.get(id(outputs), outputs)
    if isinstance(outputs, (list, tuple)):
        items = [_replace_leaves(item, replacement) for item in outputs]
        return type(outputs)(items) if not hasattr(outputs, "_fields") else type(outputs)(*items)
    if isinstance(outputs, dict):
        return type(outputs)((k, _replace_leaves(v, replacement)) for k, v in outputs.items())
    return outputs


class LayerHooks:
    """Gathers ``buffers`` around every forward of ``layer`` and arms their pre-backward gather."""

    def __init__(self, layer: paddle.nn.Layer, buffers: list[FusedBuffer]) -> None:
        self.layer = layer
        self.buffers = buffers
        self._handles = [
            layer.register_forward_pre_hook(self._pre_forward),
            layer.register_forward_post_hook(self._post_forward),
        ]

    def _pre_forward(self, layer, inputs):
        for buffer in self.buffers:
            buffer.gather()
        return None

    def _post_forward(self, layer, inputs, outputs):
        leaves = _differentiable_leaves(outputs) if paddle.is_grad_enabled() else []
        for buffer in self.buffers:
            if not buffer.held_for_backward:
                buffer.release()
        if not leaves:
            return None
        wrapped = _PreBackwardGather.apply(self.buffers, *leaves)
        if isinstance(wrapped, paddle.Tensor):
            wrapped = (wrapped,)
        return _replace_leaves(outputs, {id(a): b for a, b in zip(leaves, wrapped)})

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
