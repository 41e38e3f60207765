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
"""Stable names, kinds and (re)creation of dygraph optimizer state.

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
  ``T_cur``/``T_i``, so :func:`optimizer_global_state` adds them.

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
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import paddle
from paddle.optimizer import Optimizer
from paddle.optimizer.lr import CosineAnnealingWarmRestarts, LRScheduler

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
    "optimizer_global_state",
    "decode_optimizer_global_state",
    "create_optimizer_state",
    "copy_into_state_",
    "refresh_master_weight_",
    "state_names_of_class",
]

logger = logging.getLogger(__name__)

ELEMENTWISE = "elementwise"
SCALAR = "scalar"
STACKED = "stacked"
MASTER_WEIGHT = "master_weight"

_GLOBAL_STATE_VERSION = 1

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

# Scheduler attributes that change while stepping but are missing from the
# scheduler's own state_dict() in paddle 3.3.1.
_SCHEDULER_EXTRA_STATE: dict[type, tuple[str, ...]] = {
    CosineAnnealingWarmRestarts: ("T_cur", "T_i"),
}

# Attributes through which fleet/dygraph wrappers reach the wrapped optimizer.
_WRAPPER_ATTRS = ("_inner_opt", "inner_opt")

# Attribute that _add_accumulator may legitimately (re)bind while creating.
_CREATION_REBINDS = frozenset({"helper"})


class UnsupportedOptimizerStateError(ValueError):
    """Optimizer state that cannot be named or sharded safely.

    Raised instead of skipping the state, so a checkpoint is never silently
    incomplete.
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


def _class_name(opt: object) -> str:
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
            raise ValueError(f"optimizer wrapper chain of {_class_name(opt)} is cyclic")
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
                f"{_class_name(current)} wraps {_class_name(inner)} but also "
                "holds optimizer state of its own; refusing to drop it",
                optimizer_class=_class_name(current),
            )
        current = inner
    if not isinstance(current, Optimizer):
        raise TypeError(
            f"{_class_name(opt)} does not unwrap to a paddle.optimizer.Optimizer (got {_class_name(current)})"
        )
    return current


def _declared_states(opt: Optimizer) -> dict[str, tuple[str, str]]:
    """(canonical name, kind) per accumulator string for ``opt``'s class."""
    for cls in type(opt).__mro__:
        if cls in _STATE_TABLE:
            return _STATE_TABLE[cls]
    raise UnsupportedOptimizerStateError(
        f"optimizer class {_class_name(opt)} has no accumulator table; its "
        "state cannot be checkpointed (supported: "
        f"{', '.join(sorted(c.__name__ for c in _STATE_TABLE))})",
        optimizer_class=_class_name(opt),
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
    declared = _declared_states(unwrap_optimizer(opt))
    return {acc: canonical for acc, (canonical, _) in declared.items()}


def accumulator_kinds(opt: Any) -> dict[str, str]:
    """Accumulator string -> expected kind for ``opt``'s class."""
    declared = _declared_states(unwrap_optimizer(opt))
    return {acc: kind for acc, (_, kind) in declared.items()}


def _strip_optimizer_name(opt: Optimizer, key: str) -> str | None:
    """Undo the ``name=`` prefix that ``Optimizer._add_accumulator`` adds."""
    if opt._name is None:
        return key
    prefix = f"{opt._name}_"
    return key[len(prefix) :] if key.startswith(prefix) else None


def _resolve_accumulator(opt: Optimizer, key: str) -> tuple[str, str]:
    """Canonical name and declared kind for an ``_accumulators`` key."""
    declared = _declared_states(opt)
    base = _strip_optimizer_name(opt, key)
    if base is None or base not in declared:
        raise UnsupportedOptimizerStateError(
            f"optimizer {_class_name(opt)} has accumulator {key!r}, which "
            "is not in the accumulator table of its class; declare it before "
            "checkpointing this optimizer",
            optimizer_class=_class_name(opt),
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
            f"optimizer {_class_name(opt)} accumulator {key!r} of param "
            f"{param.name!r} has shape {state_shape}, which is not "
            f"{declared_kind} for the param's current shape {param_shape}",
            optimizer_class=_class_name(opt),
            accumulator=key,
        )
    return declared_kind


def _state_target_name(opt: Optimizer, param: paddle.Tensor) -> str:
    """Name under which ``param``'s accumulators are stored (mirrors
    ``Optimizer._get_accumulator_master``)."""
    master = opt._master_weights.get(param.name)
    return param.name if master is None else master.name


def _validate_all_keys(opt: Optimizer) -> None:
    """Refuse an unknown class, and unknown accumulators even if this param
    has none of them."""
    _declared_states(opt)
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
    _validate_all_keys(inner)
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
            f"optimizer {_class_name(inner)} maps two accumulators of param "
            f"{param.name!r} to the same state name: {sorted(names)}",
            optimizer_class=_class_name(inner),
        )
    return entries


def all_optimizer_state_entries(opt: Any, params: Iterable[paddle.Tensor]) -> dict[str, list[OptimizerStateEntry]]:
    """Entries of every param (keyed by ``param.name``), checking that they
    cover *all* of the optimizer's state.

    Raises if an accumulator or master weight belongs to none of ``params``,
    so a caller that saves these entries cannot silently lose state.
    """
    inner = unwrap_optimizer(opt)
    _validate_all_keys(inner)
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
                    f"optimizer {_class_name(inner)} accumulator {key!r} of "
                    f"{owner!r} belongs to none of the given params",
                    optimizer_class=_class_name(inner),
                    accumulator=key,
                )
    for owner, tensor in inner._master_weights.items():
        if id(tensor) not in claimed:
            raise UnsupportedOptimizerStateError(
                f"optimizer {_class_name(inner)} master weight of {owner!r} belongs to none of the given params",
                optimizer_class=_class_name(inner),
                accumulator=MASTER_WEIGHT,
            )
    return result


# ---------------------------------------------------------------- global state

_NONFINITE = "__nonfinite_float__"


def _to_json(value: Any, where: str) -> Any:
    """Plain-JSON copy of scheduler state (inf/nan encoded, since strict
    JSON has no literal for them)."""
    if isinstance(value, (bool, str)) or value is None:
        return value
    if isinstance(value, paddle.Tensor):
        if value.size != 1:
            raise TypeError(f"{where}: tensor with {value.size} elements")
        value = value.item()
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {_NONFINITE: repr(value)}
    if isinstance(value, Mapping):
        return {str(k): _to_json(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_to_json(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise TypeError(f"{where}: {type(value).__name__} is not JSON-serializable state")


def _from_json(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {_NONFINITE}:
            text = value[_NONFINITE]
            if text not in ("inf", "-inf", "nan"):
                from ..checkpoint.errors import MetadataError

                raise MetadataError(f"bad encoded non-finite number {text!r} in optimizer state")
            return float(text)
        return {k: _from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    return value


def _scheduler_extra_attrs(scheduler: LRScheduler) -> tuple[str, ...]:
    for cls, attrs in _SCHEDULER_EXTRA_STATE.items():
        if isinstance(scheduler, cls):
            return attrs
    return ()


def optimizer_global_state(opt: Any) -> dict[str, Any]:
    """Non-tensor optimizer state needed for a bit-exact resume, as JSON data.

    That is the learning rate: the float set by the constructor or ``set_lr``,
    or the LR scheduler's ``state_dict()`` plus the attributes it forgets.
    The 3.3.1 optimizers keep no other python-side counter (see the module
    docstring).
    """
    inner = unwrap_optimizer(opt)
    _declared_states(inner)  # refuse unknown classes here too
    lr = inner._learning_rate
    if isinstance(lr, LRScheduler):
        extra = {a: getattr(lr, a) for a in _scheduler_extra_attrs(lr)}
        lr_state = {
            "type": "scheduler",
            "scheduler_class": type(lr).__name__,
            "state": _to_json(lr.state_dict(), "lr_scheduler"),
            "extra": _to_json(extra, "lr_scheduler_extra"),
        }
    elif isinstance(lr, (int, float)) and not isinstance(lr, bool):
        lr_state = {"type": "float", "value": _to_json(float(lr), "lr")}
    else:
        raise UnsupportedOptimizerStateError(
            f"optimizer {_class_name(inner)} has a learning rate of type "
            f"{type(lr).__name__}; only float and LRScheduler are supported",
            optimizer_class=_class_name(inner),
        )
    return {
        "version": _GLOBAL_STATE_VERSION,
        "optimizer_class": type(inner).__name__,
        "learning_rate": lr_state,
    }


def _same_kind(saved: Any, current: Any, where: str) -> None:
    """``saved`` (decoded from a checkpoint) has the JSON kind of ``current`` (the live value it replaces), at
    every level: bool/int/float/str/None, lists of the same length, dicts with the same keys. An int is accepted
    for a float; a live ``None`` (e.g. ReduceOnPlateau's ``best`` before its first step) accepts a number."""
    from ..checkpoint.errors import MetadataError

    def bad(want: str) -> MetadataError:
        shown = repr(saved)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        return MetadataError(f"optimizer state field {where} must be {want}, got {shown} ({type(saved).__name__})")

    if isinstance(current, paddle.Tensor) and current.size == 1:
        current = current.item()
    if isinstance(current, np.generic):
        current = current.item()
    if current is None:
        if saved is not None and (type(saved) not in (int, float)):
            raise bad("null or a number")
    elif isinstance(current, bool):
        if type(saved) is not bool:
            raise bad("a bool")
    elif isinstance(current, int):
        if type(saved) is not int:
            raise bad("an integer")
    elif isinstance(current, float):
        if type(saved) not in (int, float) or math.isnan(saved):
            raise bad("a number")
    elif isinstance(current, str):
        if type(saved) is not str:
            raise bad("a string")
    elif isinstance(current, (list, tuple)):
        if type(saved) is not list or len(saved) != len(current):
            raise bad(f"a list of {len(current)} items")
        for i, (s, c) in enumerate(zip(saved, current)):
            _same_kind(s, c, f"{where}[{i}]")
    elif isinstance(current, Mapping):
        if type(saved) is not dict or set(saved) != {str(k) for k in current}:
            raise bad(f"an object with the keys {sorted(str(k) for k in current)}")
        for k, c in current.items():
            _same_kind(saved[str(k)], c, f"{where}.{k}")
    else:
        raise bad(f"like the live {type(current).__name__}")


def decode_optimizer_global_state(opt: Any, state: Any):
    """Check ``state`` (from a checkpoint) against ``opt`` completely and return a function that applies it.

    Every field is checked before anything changes, so the returned function cannot fail half-way: the format
    (MetadataError naming the field), the optimizer class, the learning-rate kind, the scheduler class and every
    scheduler field with its type against the live scheduler (OptimizerMismatchError when the saved state does not
    belong to this optimizer). Used by load_checkpoint before any tensor is written.
    """
    from ..checkpoint.errors import MetadataError, OptimizerMismatchError

    inner = unwrap_optimizer(opt)
    where = "__fsdp__.optimizer.global_state"

    def field(d: Any, name: str, path: str) -> Any:
        if type(d) is not dict:
            raise MetadataError(f"optimizer state field {path} must be an object, got {type(d).__name__}")
        if name not in d:
            raise MetadataError(f"optimizer state field {path}.{name} is missing")
        return d[name]

    version = field(state, "version", where)
    if type(version) is not int or version != _GLOBAL_STATE_VERSION:
        raise MetadataError(f"unsupported optimizer global state version {version!r}")
    saved_class = field(state, "optimizer_class", where)
    if type(saved_class) is not str:
        raise MetadataError(f"optimizer state field {where}.optimizer_class must be a string")
    if saved_class != type(inner).__name__:
        raise OptimizerMismatchError(
            f"optimizer state was saved from {saved_class}, cannot load it into {type(inner).__name__}"
        )
    lr_state = field(state, "learning_rate", where)
    kind = field(lr_state, "type", f"{where}.learning_rate")
    lr = inner._learning_rate
    if kind == "scheduler":
        saved_sched = field(lr_state, "scheduler_class", f"{where}.learning_rate")
        if type(saved_sched) is not str:
            raise MetadataError(f"optimizer state field {where}.learning_rate.scheduler_class must be a string")
        if not isinstance(lr, LRScheduler):
            raise OptimizerMismatchError(
                f"LR scheduler {saved_sched} was saved, the optimizer now uses a constant learning rate"
            )
        if type(lr).__name__ != saved_sched:
            raise OptimizerMismatchError(f"LR scheduler was {saved_sched}, the optimizer now uses {type(lr).__name__}")
        sched_state = _from_json(field(lr_state, "state", f"{where}.learning_rate"))
        _same_kind(sched_state, lr.state_dict(), f"{where}.learning_rate.state")
        attrs = _scheduler_extra_attrs(lr)
        extra = _from_json(field(lr_state, "extra", f"{where}.learning_rate"))
        _same_kind(extra, {a: getattr(lr, a) for a in attrs}, f"{where}.learning_rate.extra")

        def apply() -> None:
            lr.set_state_dict(sched_state)
            for attr, value in extra.items():
                setattr(lr, attr, value)

        return apply
    if kind == "float":
        if isinstance(lr, LRScheduler):
            raise OptimizerMismatchError(
                f"a constant learning rate was saved, the optimizer now uses {type(lr).__name__}"
            )
        value = _from_json(field(lr_state, "value", f"{where}.learning_rate"))
        if type(value) not in (int, float) or not math.isfinite(value):
            raise MetadataError(
                f"optimizer state field {where}.learning_rate.value must be a finite number, got {value!r}"
            )
        return lambda: inner.set_lr(float(value))
    raise MetadataError(f"optimizer state field {where}.learning_rate.type: unknown learning-rate state {kind!r}")


# -------------------------------------------------------------------- creation


def _trainable_groups(opt: Optimizer, params: list[paddle.Tensor] | None) -> list[list[paddle.Tensor] | dict[str, Any]]:
    """The param lists/group dicts that ``opt.step()`` would hand to
    ``_create_accumulators`` (group dicts carry per-group hyper-parameters,
    e.g. Adagrad's initial accumulator value)."""
    groups = opt._param_groups
    if not groups:
        raise ValueError(f"optimizer {_class_name(opt)} has no parameters; build it with parameters= in dygraph mode")
    grouped = isinstance(groups[0], dict)
    known = [p for g in groups for p in (g["params"] if grouped else [g])]
    known_ids = {id(p) for p in known}
    wanted = None if params is None else {id(p) for p in params}
    foreign = [p for p in params or [] if id(p) not in known_ids]
    if foreign and grouped:
        raise ValueError(
            f"params {[p.name for p in foreign]} are in none of the param "
            f"groups of {_class_name(opt)}, so their hyper-parameters are "
            "unknown"
        )

    def keep(p: paddle.Tensor) -> bool:
        return not p.stop_gradient and (wanted is None or id(p) in wanted)

    if grouped:
        result: list[list[paddle.Tensor] | dict[str, Any]] = []
        for group in groups:
            selected = [p for p in group["params"] if keep(p)]
            if selected:
                result.append({**group, "params": selected})
        return result
    # Without groups, step() hands over whatever tensors it steps on (e.g.
    # FSDP buffers), so params outside _parameter_list are accepted.
    selected = [p for p in known if keep(p)]
    selected += [p for p in foreign if not p.stop_gradient]
    return [selected] if selected else []


def create_optimizer_state(opt: Any, params: Iterable[paddle.Tensor] | None = None) -> None:
    """Make the optimizer state of ``params`` exist, as the first step would.

    Calls the class's own ``_create_accumulators`` (which also creates master
    weights) exactly like ``Optimizer._apply_optimize`` does, under the same
    program guard, per param group, so initial values (beta powers, Adagrad's
    initial value, Rprop's initial learning rates, ...) are the ones a lazy
    first step would produce. Params, gradients, the learning rate and the
    scheduler are not touched, and hyper-parameter attributes that a group
    dict rebinds are restored. ``params`` defaults to every trainable param
    of the optimizer; frozen params get no state (step would create none).
    An optimizer without param groups also accepts tensors outside its
    parameter list (step() may be handed other tensors, e.g. FSDP buffers).

    A master weight is a cast of the param *at creation time*: a load that
    writes a param but not its master weight must re-cast it with
    :func:`refresh_master_weight_` (``load_checkpoint`` does).
    """
    inner = unwrap_optimizer(opt)
    _declared_states(inner)
    if not paddle.in_dynamic_mode():
        raise RuntimeError("create_optimizer_state works in dygraph mode only")
    groups = _trainable_groups(inner, None if params is None else list(params))
    before = dict(vars(inner))
    with paddle.static.program_guard(
        paddle.static.default_main_program(),
        paddle.static.default_startup_program(),
    ):
        block = paddle.static.default_main_program().global_block()
        with paddle.base.framework.dygraph_guard_if_declarative():
            for group in groups:
                inner._create_accumulators(block, group)
    after = vars(inner)
    for attr, value in before.items():
        if attr not in _CREATION_REBINDS and after.get(attr) is not value:
            logger.debug(
                "create_optimizer_state: restoring %s.%s rebound by _create_accumulators",
                type(inner).__name__,
                attr,
            )
            setattr(inner, attr, value)
    _validate_all_keys(inner)
    logger.debug(
        "created optimizer state of %s: %d accumulators, %d master weights",
        type(inner).__name__,
        sum(len(v) for v in inner._accumulators.values()),
        len(inner._master_weights),
    )


def copy_into_state_(tensor: paddle.Tensor, value: paddle.Tensor | np.ndarray) -> None:
    """Write ``value`` into a live state tensor without rebinding it.

    The optimizer (and multi-tensor lists) hold references to the tensor, and
    beta powers live on CPU even on GPU runs, so place, dtype and identity
    must be preserved. Shapes must match exactly; dtypes must match too.
    Empty tensors are left alone.
    """
    if not isinstance(value, paddle.Tensor):
        value = paddle.to_tensor(value, place=paddle.CPUPlace())
    if list(value.shape) != list(tensor.shape):
        raise ValueError(f"cannot load shape {list(value.shape)} into {tensor.name} of shape {list(tensor.shape)}")
    if value.dtype != tensor.dtype:
        raise ValueError(f"cannot load {value.dtype} into {tensor.name} of {tensor.dtype}")
    if tensor.size == 0:
        # Nothing to write, and copy_ into an empty param (a rank holding no
        # piece of it) makes the param lose its gradient in later backwards.
        return
    if not value.place._equals(tensor.place):
        value = value._copy_to(tensor.place, True)
    with paddle.no_grad():
        tensor.copy_(value, True)


def refresh_master_weight_(opt: Any, param: paddle.Tensor, value: paddle.Tensor | None = None) -> bool:
    """Re-cast ``param`` (or ``value``, its current contents when ``param`` is bound elsewhere) into its master
    weight in place; False when it has none.

    Why: paddle's multi-precision kernels (GPU) compute the param from its master weight at every step
    (``param_out = cast(master_out)``), so a master weight that a load left at its old value would overwrite
    the loaded param at the next step. For a param loaded from a checkpoint that holds no master weight for it
    (saved before its first step, or loaded with ``strict=False``); the lazy path would have cast the loaded
    value.
    """
    inner = unwrap_optimizer(opt)
    master = inner._master_weights.get(param.name)
    if master is None:
        return False
    copy_into_state_(master, paddle.cast(param if value is None else value, master.dtype))
    return True
