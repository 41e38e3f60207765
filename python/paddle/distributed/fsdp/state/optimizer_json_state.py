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
"""The non-tensor optimizer state of a checkpoint, as JSON: the learning rate or the LR scheduler's state.

Why a module of its own: this is the only optimizer state that is not a tensor (paddle 3.3.1 optimizers keep no
python step counter; see ``optimizer_states.py``), and it is saved as plain JSON under
``__fsdp__.optimizer.global_state``. A load checks every field of it before anything changes
(:func:`decode_optimizer_global_state`), so a bad checkpoint never half-applies.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import paddle
from paddle.optimizer.lr import CosineAnnealingWarmRestarts, LRScheduler

from .optimizer_states import UnsupportedOptimizerStateError, declared_states, optimizer_class_name, unwrap_optimizer

__all__ = ["optimizer_global_state", "decode_optimizer_global_state"]

_GLOBAL_STATE_VERSION = 1

# Scheduler attributes that change while stepping but are missing from the
# scheduler's own state_dict() in paddle 3.3.1.
_SCHEDULER_EXTRA_STATE: dict[type, tuple[str, ...]] = {
    CosineAnnealingWarmRestarts: ("T_cur", "T_i"),
}


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
    declared_states(inner)  # refuse unknown classes here too
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
            f"optimizer {optimizer_class_name(inner)} has a learning rate of type "
            f"{type(lr).__name__}; only float and LRScheduler are supported",
            optimizer_class=optimizer_class_name(inner),
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
