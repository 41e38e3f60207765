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
"""Making optimizer state exist before a load, and writing loaded values into it in place.

Why: a load writes into the optimizer's live tensors (the optimizer and its multi-tensor lists hold references
to them), so the state must exist first, created exactly as the first step would create it
(:func:`create_optimizer_state`), and be written without rebinding (:func:`copy_into_state_`). A master weight is
a cast of its param at creation time, so a load that writes the param alone re-casts it
(:func:`refresh_master_weight_`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import numpy as np
import paddle
from paddle.optimizer import Optimizer

from .optimizer_states import declared_states, optimizer_class_name, unwrap_optimizer, validate_all_keys

__all__ = ["create_optimizer_state", "copy_into_state_", "refresh_master_weight_"]

logger = logging.getLogger(__name__)

# Attribute that _add_accumulator may legitimately (re)bind while creating.
_CREATION_REBINDS = frozenset({"helper"})


def _trainable_groups(opt: Optimizer, params: list[paddle.Tensor] | None) -> list[list[paddle.Tensor] | dict[str, Any]]:
    """The param lists/group dicts that ``opt.step()`` would hand to
    ``_create_accumulators`` (group dicts carry per-group hyper-parameters,
    e.g. Adagrad's initial accumulator value)."""
    groups = opt._param_groups
    if not groups:
        raise ValueError(
            f"optimizer {optimizer_class_name(opt)} has no parameters; build it with parameters= in dygraph mode"
        )
    grouped = isinstance(groups[0], dict)
    known = [p for g in groups for p in (g["params"] if grouped else [g])]
    known_ids = {id(p) for p in known}
    wanted = None if params is None else {id(p) for p in params}
    foreign = [p for p in params or [] if id(p) not in known_ids]
    if foreign and grouped:
        raise ValueError(
            f"params {[p.name for p in foreign]} are in none of the param "
            f"groups of {optimizer_class_name(opt)}, so their hyper-parameters are "
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
    declared_states(inner)
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
    validate_all_keys(inner)
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
