"""What stock ``paddle.nn.Layer`` methods do on a model whose parameters are sharded FSDP pieces.

Installed once per process (like the optimizer integration) and inert for every layer without
FullyShardFusion parameters at rest, which keeps stock behaviour for everything stock accepts:

* ``repr(layer)`` / ``print(model)``: layers describe themselves from their parameters' shapes (``Linear``
  reads ``weight.shape[1]``); while the description is built, sharded parameters report their logical shape.
  Only the shape metadata changes, for the duration of ``repr``; no value is read or gathered.
* ``state_dict()`` and ``set_state_dict()`` (``set_dict``, ``load_dict``): at rest they would hand out, or
  silently skip loading into, flattened 1-D pieces, so they raise :class:`ShardedStateDictError` naming the
  alternatives. Inside ``fsdp.summon_full_params()`` the parameters are whole and the stock methods run.
  They do not gather implicitly: a collective hidden in a method that code often calls on one rank only
  (``if rank == 0: paddle.save(model.state_dict(), ...)``) would hang instead of failing.
"""

from __future__ import annotations

import functools
import threading

import paddle

_WRAPPED_FLAG = "__fsdp_wrapped__"
_presenting = threading.local()


class ShardedStateDictError(RuntimeError):
    """``state_dict()``/``set_state_dict()`` was called on a model whose parameters are sharded pieces."""


def sharded_parameters_at_rest(layer: paddle.nn.Layer, include_sublayers: bool = True) -> list:
    """(param, logical shape) for every FSDP parameter of ``layer`` currently bound to its local piece."""
    out = []
    positions: dict[int, dict[int, int]] = {}  # id(buffer) -> {id(param): index in the buffer}
    for param in layer.parameters(include_sublayers=include_sublayers):
        buffer = getattr(param, "_fsdp_buffer", None)
        if buffer is None or buffer.is_gathered:
            continue
        index_of = positions.get(id(buffer))
        if index_of is None:
            index_of = positions[id(buffer)] = {id(p): i for i, p in enumerate(buffer.params)}
        out.append((param, buffer.layout.slots[index_of[id(param)]].shape))
    return out


def _repr_with_logical_shapes(original):
    @functools.wraps(original)
    def __repr__(self):
        if getattr(_presenting, "active", False):
            return original(self)
        at_rest = sharded_parameters_at_rest(self)
        if not at_rest:
            return original(self)
        saved = [list(param.shape) for param, _ in at_rest]
        _presenting.active = True
        try:
            for param, shape in at_rest:
                param.get_tensor()._set_dims(list(shape))
            return original(self)
        finally:
            for (param, _), shape in zip(at_rest, saved):
                param.get_tensor()._set_dims(shape)
            _presenting.active = False

    return __repr__


def _refuse_when_sharded(original, what: str):
    @functools.wraps(original)
    def method(self, *args, **kwargs):
        if sharded_parameters_at_rest(self):
            raise ShardedStateDictError(
                f"{type(self).__name__}.{what}() on a FullyShardFusion model: its parameters are sharded 1-D "
                "pieces here. Use `with fsdp.summon_full_params(): ...` (writeback=True to load values), "
                "fsdp.full_state_dict() (gathered unit by unit), fsdp.sharded_state_dict() with "
                "dist.save_state_dict/load_state_dict, or fsdp.save_checkpoint/load_checkpoint"
            )
        return original(self, *args, **kwargs)

    return method


def install_layer_integration() -> None:
    """Wrap ``Layer.__repr__``, ``state_dict`` and ``set_state_dict`` (+ its aliases) once per process."""
    layer = paddle.nn.Layer
    if getattr(layer.__repr__, _WRAPPED_FLAG, False):
        return
    wrapped = {"__repr__": _repr_with_logical_shapes(layer.__repr__)}
    for name in ("state_dict", "set_state_dict", "set_dict", "load_dict"):
        wrapped[name] = _refuse_when_sharded(getattr(layer, name), name)
    for name, method in wrapped.items():
        setattr(method, _WRAPPED_FLAG, True)
        setattr(layer, name, method)
