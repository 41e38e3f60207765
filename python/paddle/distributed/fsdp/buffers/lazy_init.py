"""Wrapping models larger than one device: parameters built lazily (``paddle.LazyGuard``) or in host memory.

A model built under ``with paddle.LazyGuard():`` holds no parameter memory: each parameter keeps its initializer.
FullyShardFusion materialises them **one parameter at a time**: run the initializer, copy this rank's piece into
its shard, drop the full tensor. Peak memory is the rank's shards plus the largest parameter, never the model.
A model built on the CPU (``paddle.set_device("cpu")`` while building) wraps too: the rank's pieces are copied
into shards on the device (:func:`device.check_same_place` accepts host parameters), and each parameter's host
storage is dropped once its pieces are copied.

Values equal an eagerly built model's with the same seed: initializers draw from the global generator, so they
run in the order the parameters were *created* (stamped when their initializer is attached, by a hook installed
when this package is imported), not in model order. Parameters created before the import carry no stamp and run
in model order (logged). Random numbers drawn during construction outside initializers (a buffer made with
``paddle.randn`` in ``__init__``) shift the stream either way and break the equality; nothing here can see them.
"""

from __future__ import annotations

import itertools
import logging
from typing import TYPE_CHECKING

import paddle
from paddle.base.framework import EagerParamBase

if TYPE_CHECKING:
    from .fused_buffer import FusedBuffer

logger = logging.getLogger(__name__)

_STAMP = "_fsdp_creation_order"
_counter = itertools.count()
_original_set_init_func = EagerParamBase.set_init_func


def _stamping_set_init_func(self, obj):
    setattr(self, _STAMP, next(_counter))
    return _original_set_init_func(self, obj)


def install_creation_stamps() -> None:
    """Stamp every lazily initialised parameter with a creation counter (idempotent)."""
    if EagerParamBase.set_init_func is not _stamping_set_init_func:
        EagerParamBase.set_init_func = _stamping_set_init_func


def is_lazy(param: paddle.Tensor) -> bool:
    """A parameter built under ``paddle.LazyGuard`` and not initialised yet (no memory, an initializer pending)."""
    return getattr(param, "_init_func", None) is not None and not param._is_initialized()


def lazy_parameters(model: paddle.nn.Layer) -> list:
    """The model's uninitialised lazy parameters (each once), in creation order (model order for unstamped)."""
    seen: dict[int, paddle.Tensor] = {}
    for param in model.parameters():
        if id(param) not in seen and is_lazy(param):
            seen[id(param)] = param
    params = list(seen.values())
    unstamped = [p.name for p in params if not hasattr(p, _STAMP)]
    if unstamped:
        logger.warning(
            "FullyShardFusion: %d lazy parameter(s) (%s...) were created before paddle.distributed.fsdp was imported:"
            " they are initialised in model order, so their values may differ from an eagerly built model's",
            len(unstamped),
            unstamped[0],
        )
    order = {id(p): k for k, p in enumerate(params)}
    return sorted(params, key=lambda p: (getattr(p, _STAMP, float("inf")), order[id(p)]))


def materialise_into_shards(model: paddle.nn.Layer, buffers: list[FusedBuffer]) -> None:
    """Fill every buffer's shard from its parameters, one parameter at a time, lazy ones initialised in creation
    order; each parameter is bound to its local piece (its full storage dropped) as soon as it is copied.
    Lazy parameters outside every buffer (replicated ones) are initialised in the same order and kept whole."""
    where: dict[int, tuple[FusedBuffer, int]] = {}
    for buffer in buffers:
        for index, param in enumerate(buffer.params):
            where[id(param)] = (buffer, index)
    lazy = lazy_parameters(model)
    lazy_ids = {id(p) for p in lazy}
    for buffer in buffers:  # parameters already in memory first: their order draws no random numbers
        for index, param in enumerate(buffer.params):
            if id(param) not in lazy_ids:
                buffer.fill_param(index)
                buffer.bind_local(index)
    for param in lazy:
        with paddle.no_grad():
            param.initialize()
        if id(param) in where:
            buffer, index = where[id(param)]
            buffer.fill_param(index)
            buffer.bind_local(index)
