"""When buffers are gathered and released: forward pre/post hooks and a pre-backward trigger.

Forward: a layer's buffers are gathered right before its forward and released right after, so at most
the running layer's parameters are full-size. Backward: paddle has no "before this layer's backward"
hook, so a gradient hook is registered on every differentiable tensor the layer returns: paddle runs a
tensor's hooks right before the node that produced it, i.e. before the layer's own gradient computations,
and the hook gathers the buffers again. A tensor hook leaves the output itself untouched (no new tensor,
no version bump), so ops that save their output for backward (tanh, sigmoid, softmax, exp) keep working.
The buffers are released by their own gradient reduction (trainable) or when backward ends (frozen ones).

What the hook cannot see is refused at the first forward, naming the layer: an output object that is not
a tensor, list, tuple, dict or dataclass (its tensors would reach backward with the parameters sharded).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING

import paddle

from .gradient_sync import before_backward_gather

if TYPE_CHECKING:
    from ..buffers.fused_buffer import FusedBuffer

_PLAIN_VALUES = (type(None), bool, int, float, complex, str, bytes)


class UnsupportedUnitOutputError(TypeError):
    """A wrapped layer returned an object whose tensors FSDP cannot find (it could not gather for backward)."""


def _differentiable_outputs(layer_name: str, outputs, exclude: set[int]) -> list[paddle.Tensor]:
    """The non-leaf tensors requiring grad inside ``outputs``, each once; ``exclude`` holds ids to skip."""
    found: dict[int, paddle.Tensor] = {}

    def visit(value, where: str):
        if isinstance(value, paddle.Tensor):
            if not value.stop_gradient and not value.is_leaf and id(value) not in exclude:
                found.setdefault(id(value), value)
        elif isinstance(value, Mapping):
            for key, item in value.items():
                visit(item, f"{where}[{key!r}]")
        elif isinstance(value, (list, tuple)):
            for k, item in enumerate(value):
                visit(item, f"{where}[{k}]")
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for f in dataclasses.fields(value):
                visit(getattr(value, f.name, None), f"{where}.{f.name}")
        elif not isinstance(value, _PLAIN_VALUES) and not _is_numpy(value):
            raise UnsupportedUnitOutputError(
                f"FullyShardFusion: layer {layer_name} returned {where} of type {type(value).__name__}, which "
                "FSDP cannot look into: return tensors inside a tuple, list, dict or dataclass (or compute it "
                "under paddle.no_grad()), so that its parameters can be gathered before its backward"
            )

    visit(outputs, "output")
    return list(found.values())


def _is_numpy(value) -> bool:
    return type(value).__module__ == "numpy"


def _tensor_ids(inputs) -> set[int]:
    ids: set[int] = set()

    def visit(value):
        if isinstance(value, paddle.Tensor):
            ids.add(id(value))
        elif isinstance(value, Mapping):
            for item in value.values():
                visit(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)

    visit(inputs)
    return ids


class LayerHooks:
    """Gathers ``buffers`` around every forward of ``layer`` and arms their pre-backward gather."""

    def __init__(
        self,
        layer: paddle.nn.Layer,
        buffers: list[FusedBuffer],
        name: str,
        enclosing: set[int] | None = None,
        fallback: bool = False,
    ) -> None:
        self.layer = layer
        self.all_buffers = buffers
        self.buffers = buffers  # those this forward gathered (a fallback takes only what no one holds)
        # fallback: the layer registers root parameters; it gathers them only when called outside the root's
        # forward (nothing holds them then) and is inert inside it, so it adds no rank-dependent collective
        self.fallback = fallback
        self._taken: list[list[FusedBuffer]] = []
        # buffers gathered by layers enclosing this one: their backward is not over when this one's starts
        self.enclosing = set(enclosing or ())
        self.name = f"{name or '<root>'} ({type(layer).__name__})"
        self._handles = [
            layer.register_forward_pre_hook(self._pre_forward),
            layer.register_forward_post_hook(self._post_forward),
        ]

    def _pre_forward(self, layer, inputs):
        if self.fallback:
            self._taken.append([b for b in self.all_buffers if not b.is_gathered])
            for buffer in self._taken[-1]:
                buffer.gather()
            return None
        self.buffers[0].owner.schedule.before_forward(self.buffers)  # gathers, and prefetches (overlap.py)
        return None

    def _post_forward(self, layer, inputs, outputs):
        if self.fallback:
            taken = self._taken.pop() if self._taken else []
            if not taken:
                return None
            self.buffers = taken
        try:
            outs = _differentiable_outputs(self.name, outputs, _tensor_ids(inputs)) if paddle.is_grad_enabled() else []
        finally:
            self._release()
        for tensor in outs:
            tensor.register_hook(self._before_backward)
        return None

    def _release(self) -> None:
        for buffer in self.buffers:
            if not buffer.held_for_backward and not buffer.owner._summoned:
                buffer.release()

    def _before_backward(self, grad):
        for buffer in self.buffers:
            if buffer.owner._summoned:
                raise RuntimeError(
                    f"FullyShardFusion: backward through {self.name} inside summon_full_params() is not "
                    "supported; run evaluation under paddle.no_grad(), train outside the context"
                )
        before_backward_gather(self.buffers, still_running=self.enclosing)
        return None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
