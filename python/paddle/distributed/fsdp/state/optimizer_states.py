# Copyright (c) 2025 PaddlePaddle Authors. All Rights Reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""Stable names and kinds of dygraph optimizer state, and the discovery of every state tensor of a param.

Why this module exists: a sharded checkpoint must name every piece of optimizer
state independently of paddle's unique-name counters and of the optimizer's
``name=`` argument (tensor names look like ``linear_0.w_0_opt_moment1_0``), must
know how each state tensor relates to its parameter so it can be sharded like
it, and must be able to make the state exist before a load. Everything here is
driven by the ``_accumulators`` dict *keys* mapped through an explicit table per
optimizer class; tensor names are never parsed.

Where paddle keeps the state (dygraph, paddle 3.3.1):

* ``opt._accumulators[acc_key][target_name]`` where ``acc_key`` is the class's
  accumulator string, prefixed by ``f"{opt._name}_"`` when the optimizer was
  built with ``name=``, and ``target_name`` is ``param.name`` or, for a
  low-precision param with ``multi_precision=True``, the name of its fp32
  master weight (the accumulators then belong to the master weight).
* ``opt._master_weights[param.name]``: fp32 copy of a bf16/fp16 param.
* ``opt._learning_rate``: a python float (changed by ``set_lr``) or an
  ``LRScheduler`` whose ``state_dict()`` is the only non-tensor state that
  changes during training. No optimizer class of 3.3.1 keeps a python step
  counter. Other python attributes that change at the first step are derived
  from the configuration only: Rprop ``_sign``/``_etas``/
  ``_learning_rate_range`` (lists turned into tensors), ASGD ``_n_tensor``
  (``batch_num`` as a tensor), Lamb ``_used_master_weights`` (a name lookup
  for static graphs), and hyper-parameters re-read from each param group
  before every use. ``CosineAnnealingWarmRestarts.state_dict()`` drops
  ``T_cur``/``T_i``, so ``optimizer_json_state.py`` adds them.

Kinds, measured against the parameter's current shape (for FSDP the param
is a 1-D piece ``[n]`` and so are its elementwise accumulators):

* ``elementwise``: same number of elements as the param; flat element ``i``
  belongs to flat element ``i`` of the param, so it is sharded like the param.
* ``scalar``: one element (``[1]``), one value per param, replicated.
* ``stacked``: ``[k, *param_shape]``; ``k`` is a hyper-parameter and every
  row is sharded like the param.

Shapes alone are ambiguous for a 1-element param (``elementwise`` and
``scalar`` coincide), so each class table also declares the kind; the shapes
must agree with it or the state is refused. An empty piece (``[0]``, a rank
holding nothing of a param) is stepped normally: elementwise state ``[0]``,
scalar state ``[1]``, stacked ``[k, 0]``.

Accumulators and kinds as measured in paddle 3.3.1 (CPU, dygraph); the
canonical state name equals the accumulator string except for Adadelta,
whose leading underscore is dropped:

================  ===================================================
optimizer         accumulator -> kind
================  ===================================================
Adam, AdamW       moment1, moment2, moment2_max (amsgrad only):
                  elementwise; beta1_pow_acc, beta2_pow_acc: scalar
                  (``[1]``, placed on CPU even on GPU runs)
Adamax            moment, inf_norm: elementwise; beta1_pow_acc: scalar
RMSProp           momentum, mean_square, mean_grad: elementwise (all
                  three exist for plain, centered and momentum configs)
Adadelta          _avg_squared_grad, _avg_squared_update: elementwise
NAdam             momentum_decay_pow, beta2_pow, mu_product, moment1,
                  moment2: all elementwise (the "pow" states are
                  param-shaped, not scalars)
RAdam             beta1_pow, beta2_pow, rho, moment1, moment2: all
                  elementwise
Momentum          velocity: elementwise (also with use_nesterov and
                  use_multi_tensor)
Lamb              moment1, moment2: elementwise; beta1_pow_acc,
                  beta2_pow_acc: scalar
Adagrad           moment: elementwise
ASGD              d: elementwise; y: stacked ``[batch_num, *shape]``;
                  m: scalar (int64 ``[1]``, number of steps taken)
Rprop             prevs, learning_rates: elementwise
SGD               none
all of the above  master_weight (``_master_weights``): elementwise fp32
================  ===================================================

On CPU only SGD and Rprop have bf16 kernels, so they are the only classes
whose master weights can be exercised there; Rprop's accumulators then keep
the param's bf16 dtype while its master weight is fp32.

Siblings: ``optimizer_json_state.py`` (the non-tensor state as JSON: learning rate, scheduler) and
``optimizer_state_creation.py`` (making the state exist before a load, writing into it in place).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import paddle
from paddle.optimizer import Optimizer

from ..checkpoint.errors import InvalidStateDictError

__all__ = [
    "ELEMENTWISE",
    "SCALAR",
    "STACKED",
    "MASTER_WEIGHT",
    "OptimizerStateEntry",
    "UnsupportedOptimizerStateError",
    "unwrap_optimizer",
    "accumulator_table",
    "accumulator_kinds",
    "optimizer_state_entries",
    "all_optimizer_state_entries",
    "state_names_of_class",
]

ELEMENTWISE = "elementwise"
SCALAR = "scalar"
STACKED = "stacked"
MASTER_WEIGHT = "master_weight"


# acc string (as passed to ``_add_accumulator``) -> (canonical name, kind).
# Literal strings on purpose: a paddle upgrade that renames or adds an
# accumulator must fail loudly here instead of being guessed.
_E, _S, _K = ELEMENTWISE, SCALAR, STACKED
_ADAM_STATES: dict[str, tuple[str, str]] = {
    "moment1": ("moment1", _E),
    "moment2": ("moment2", _E),
    "moment2_max": ("moment2_max", _E),
    "beta1_pow_acc": ("beta1_pow_acc", _S),
    "beta2_pow_acc": ("beta2_pow_acc", _S),
}
_STATE_TABLE: dict[type, dict[str, tuple[str, str]]] = {
    paddle.optimizer.Adam: dict(_ADAM_STATES),
    paddle.optimizer.AdamW: dict(_ADAM_STATES),
    paddle.optimizer.Adamax: {
        "moment": ("moment", _E),
        "inf_norm": ("inf_norm", _E),
        "beta1_pow_acc": ("beta1_pow_acc", _S),
    },
    paddle.optimizer.RMSProp: {
        "momentum": ("momentum", _E),
        "mean_square": ("mean_square", _E),
        "mean_grad": ("mean_grad", _E),
    },
    paddle.optimizer.Adadelta: {
        "_avg_squared_grad": ("avg_squared_grad", _E),
        "_avg_squared_update": ("avg_squared_update", _E),
    },
    paddle.optimizer.NAdam: {
        "momentum_decay_pow": ("momentum_decay_pow", _E),
        "beta2_pow": ("beta2_pow", _E),
        "mu_product": ("mu_product", _E),
        "moment1": ("moment1", _E),
        "moment2": ("moment2", _E),
    },
    paddle.optimizer.RAdam: {
        "beta1_pow": ("beta1_pow", _E),
        "beta2_pow": ("beta2_pow", _E),
        "rho": ("rho", _E),
        "moment1": ("moment1", _E),
        "moment2": ("moment2", _E),
    },
    paddle.optimizer.Momentum: {"velocity": ("velocity", _E)},
    paddle.optimizer.Lamb: {
        "moment1": ("moment1", _E),
        "moment2": ("moment2", _E),
        "beta1_pow_acc": ("beta1_pow_acc", _S),
        "beta2_pow_acc": ("beta2_pow_acc", _S),
    },
    paddle.optimizer.Adagrad: {"moment": ("moment", _E)},
    paddle.optimizer.ASGD: {
        "d": ("d", _E),
        "y": ("y", _K),
        "m": ("m", _S),
    },
    paddle.optimizer.Rprop: {
        "prevs": ("prevs", _E),
        "learning_rates": ("learning_rates", _E),
    },
    paddle.optimizer.SGD: {},
}

# Attributes through which fleet/dygraph wrappers reach the wrapped optimizer.
_WRAPPER_ATTRS = ("_inner_opt", "inner_opt")


class UnsupportedOptimizerStateError(InvalidStateDictError):
    """Optimizer state that cannot be named or sharded safely.

    Raised instead of skipping the state, so a checkpoint is never silently
    incomplete. A checkpoint error (and a ValueError): raised on one rank while
    a save collects its state, every rank raises it by name (issue #50).
    """

    def __init__(
        self,
        message: str,
        optimizer_class: str | None = None,
        accumulator: str | None = None,
    ) -> None:
        super().__init__(message)
        self.optimizer_class = optimizer_class
        self.accumulator = accumulator


@dataclass(frozen=True)
class OptimizerStateEntry:
    """One tensor of optimizer state belonging to one parameter.

    ``tensor`` is the optimizer's live tensor: loading must write into it in
    place (see :func:`copy_into_state_`), never rebind it.
    """

    state_name: str
    tensor: paddle.Tensor
    kind: str
    accumulator_key: str = ""  # raw key in opt._accumulators (diagnostics)


def optimizer_class_name(opt: object) -> str:
    """``module.Class`` of ``opt``, for messages."""
    cls = type(opt)
    return f"{cls.__module__}.{cls.__qualname__}"


def unwrap_optimizer(opt: Any) -> Optimizer:
    """Return the paddle optimizer that owns the state behind fleet wrappers.

    Wrappers (HybridParallelOptimizer, DygraphShardingOptimizer,
    MixPrecisionOptimizer, fleet meta optimizers) forward attribute lookups,
    so the chain is followed through the instance ``__dict__`` only. A wrapper
    that holds optimizer state of its own is refused: unwrapping it would drop
    that state.
    """
    current = opt
    seen: set[int] = set()
    while True:
        if id(current) in seen:
            raise ValueError(f"optimizer wrapper chain of {optimizer_class_name(opt)} is cyclic")
        seen.add(id(current))
        attrs = getattr(current, "__dict__", {})
        inner = next(
            (attrs[name] for name in _WRAPPER_ATTRS if attrs.get(name) is not None),
            None,
        )
        if inner is None:
            break
        if attrs.get("_accumulators") or attrs.get("_master_weights"):
            raise UnsupportedOptimizerStateError(
                f"{optimizer_class_name(current)} wraps {optimizer_class_name(inner)} but also "
                "holds optimizer state of its own; refusing to drop it",
                optimizer_class=optimizer_class_name(current),
            )
        current = inner
    if not isinstance(current, Optimizer):
        raise TypeError(
            f"{optimizer_class_name(opt)} does not unwrap to a paddle.optimizer.Optimizer (got {optimizer_class_name(current)})"
        )
    return current


def declared_states(opt: Optimizer) -> dict[str, tuple[str, str]]:
    """(canonical name, kind) per accumulator string for ``opt``'s class."""
    for cls in type(opt).__mro__:
        if cls in _STATE_TABLE:
            return _STATE_TABLE[cls]
    raise UnsupportedOptimizerStateError(
        f"optimizer class {optimizer_class_name(opt)} has no accumulator table; its "
        "state cannot be checkpointed (supported: "
        f"{', '.join(sorted(c.__name__ for c in _STATE_TABLE))})",
        optimizer_class=optimizer_class_name(opt),
    )


def state_names_of_class(class_name: str) -> set[str] | None:
    """Canonical state names (plus ``master_weight``) of the optimizer class called ``class_name``; None if the
    table has no such class. For readers of a checkpoint that only know the saved class name (the tools)."""
    for cls, states in _STATE_TABLE.items():
        if cls.__name__ == class_name:
            return {canonical for canonical, _ in states.values()} | {MASTER_WEIGHT}
    return None


def accumulator_table(opt: Any) -> dict[str, str]:
    """Accumulator string -> canonical state name for ``opt``'s class.

    Keys are the strings the class passes to ``_add_accumulator``, i.e. the
    ``_accumulators`` keys *before* the ``f"{name}_"`` prefix that a named
    optimizer adds. A subclass of a known class uses its parent's table, so
    it is accepted only as long as it creates nothing new.
    """
    declared = declared_states(unwrap_optimizer(opt))
    return {acc: canonical for acc, (canonical, _) in declared.items()}


def accumulator_kinds(opt: Any) -> dict[str, str]:
    """Accumulator string -> expected kind for ``opt``'s class."""
    declared = declared_states(unwrap_optimizer(opt))
    return {acc: kind for acc, (_, kind) in declared.items()}


def _strip_optimizer_name(opt: Optimizer, key: str) -> str | None:
    """Undo the ``name=`` prefix that ``Optimizer._add_accumulator`` adds."""
    if opt._name is None:
        return key
    prefix = f"{opt._name}_"
    return key[len(prefix) :] if key.startswith(prefix) else None


def _resolve_accumulator(opt: Optimizer, key: str) -> tuple[str, str]:
    """Canonical name and declared kind for an ``_accumulators`` key."""
    declared = declared_states(opt)
    base = _strip_optimizer_name(opt, key)
    if base is None or base not in declared:
        raise UnsupportedOptimizerStateError(
            f"optimizer {optimizer_class_name(opt)} has accumulator {key!r}, which "
            "is not in the accumulator table of its class; declare it before "
            "checkpointing this optimizer",
            optimizer_class=optimizer_class_name(opt),
            accumulator=key,
        )
    return declared[base]


def _compatible_kinds(state_shape: list[int], param_shape: list[int]) -> set[str]:
    """Every kind that the two shapes allow (a 1-element param allows both
    ``elementwise`` and ``scalar``; the class table decides)."""
    state_numel = math.prod(state_shape)
    param_numel = math.prod(param_shape)
    kinds = set()
    if state_numel == param_numel:
        kinds.add(ELEMENTWISE)
    if state_numel == 1:
        kinds.add(SCALAR)
    if len(state_shape) >= 2 and math.prod(state_shape[1:]) == param_numel:
        kinds.add(STACKED)
    return kinds


def _checked_kind(
    opt: Optimizer,
    key: str,
    declared_kind: str,
    tensor: paddle.Tensor,
    param: paddle.Tensor,
) -> str:
    state_shape = tensor.shape
    param_shape = param.shape
    # the usual cases first, without building the set below (a save checks every entry)
    if declared_kind == ELEMENTWISE and math.prod(state_shape) == math.prod(param_shape):
        return declared_kind
    if declared_kind == SCALAR and math.prod(state_shape) == 1:
        return declared_kind
    if declared_kind not in _compatible_kinds(state_shape, param_shape):
        raise UnsupportedOptimizerStateError(
            f"optimizer {optimizer_class_name(opt)} accumulator {key!r} of param "
            f"{param.name!r} has shape {state_shape}, which is not "
            f"{declared_kind} for the param's current shape {param_shape}",
            optimizer_class=optimizer_class_name(opt),
            accumulator=key,
        )
    return declared_kind


def _state_target_name(opt: Optimizer, param: paddle.Tensor) -> str:
    """Name under which ``param``'s accumulators are stored (mirrors
    ``Optimizer._get_accumulator_master``)."""
    master = opt._master_weights.get(param.name)
    return param.name if master is None else master.name


def validate_all_keys(opt: Optimizer) -> None:
    """Refuse an unknown class, and unknown accumulators even if this param
    has none of them."""
    declared_states(opt)
    for key in opt._accumulators:
        _resolve_accumulator(opt, key)


def optimizer_state_entries(opt: Any, param: paddle.Tensor) -> list[OptimizerStateEntry]:
    """Every tensor state that ``opt`` keeps for ``param``.

    Includes the master weight. Raises :class:`UnsupportedOptimizerStateError`
    for an accumulator that the class table does not declare (anywhere in the
    optimizer) or whose shape does not fit its declared kind; nothing is ever
    skipped. Returns ``[]`` for a param the optimizer has not touched yet.
    """
    inner = unwrap_optimizer(opt)
    validate_all_keys(inner)
    return _entries_of(inner, param, {key: _resolve_accumulator(inner, key) for key in inner._accumulators})


def _entries_of(inner: Optimizer, param: paddle.Tensor, resolved: dict[str, tuple[str, str]]) -> list:
    """``param``'s entries of the unwrapped, validated ``inner``; ``resolved``: accumulator key -> (canonical
    name, declared kind), resolved once per optimizer (a save lists every parameter's state)."""
    target = _state_target_name(inner, param)
    entries: list[OptimizerStateEntry] = []
    for key, per_param in inner._accumulators.items():
        tensor = per_param.get(target)
        if tensor is None:
            continue
        canonical, declared_kind = resolved[key]
        kind = _checked_kind(inner, key, declared_kind, tensor, param)
        entries.append(OptimizerStateEntry(canonical, tensor, kind, key))
    master = inner._master_weights.get(param.name)
    if master is not None:
        kind = _checked_kind(inner, MASTER_WEIGHT, ELEMENTWISE, master, param)
        entries.append(OptimizerStateEntry(MASTER_WEIGHT, master, kind, MASTER_WEIGHT))
    names = [e.state_name for e in entries]
    if len(set(names)) != len(names):
        raise UnsupportedOptimizerStateError(
            f"optimizer {optimizer_class_name(inner)} maps two accumulators of param "
            f"{param.name!r} to the same state name: {sorted(names)}",
            optimizer_class=optimizer_class_name(inner),
        )
    return entries


def all_optimizer_state_entries(opt: Any, params: Iterable[paddle.Tensor]) -> dict[str, list[OptimizerStateEntry]]:
    """Entries of every param (keyed by ``param.name``), checking that they
    cover *all* of the optimizer's state.

    Raises if an accumulator or master weight belongs to none of ``params``,
    so a caller that saves these entries cannot silently lose state.
    """
    inner = unwrap_optimizer(opt)
    validate_all_keys(inner)
    resolved = {key: _resolve_accumulator(inner, key) for key in inner._accumulators}
    result: dict[str, list[OptimizerStateEntry]] = {}
    claimed: set[int] = set()
    for param in params:
        entries = _entries_of(inner, param, resolved)
        result[param.name] = entries
        claimed.update(id(e.tensor) for e in entries)
    for key, per_param in inner._accumulators.items():
        for owner, tensor in per_param.items():
            if id(tensor) not in claimed:
                raise UnsupportedOptimizerStateError(
                    f"optimizer {optimizer_class_name(inner)} accumulator {key!r} of "
                    f"{owner!r} belongs to none of the given params",
                    optimizer_class=optimizer_class_name(inner),
                    accumulator=key,
                )
    for owner, tensor in inner._master_weights.items():
        if id(tensor) not in claimed:
            raise UnsupportedOptimizerStateError(
                f"optimizer {optimizer_class_name(inner)} master weight of {owner!r} belongs to none of the given params",
                optimizer_class=optimizer_class_name(inner),
                accumulator=MASTER_WEIGHT,
            )
    return result
