"""Which parameters share a fused buffer, and which layers gather it.

A buffer holds parameters with the same (scope, dtype, trainable, weight-decay policy, tied) key:
  - scope: the innermost FSDP unit (a sublayer whose class name is in ``fsdp_unit_layers``) holding
    the parameter, else the layer that registers it ("handled per layer");
  - tied: a parameter registered by several layers (embedding tied to the output head) gets a buffer
    of its own, gathered by every layer that registers it, so neither use sees it sharded.
Keys are the model's structured names; a tied parameter is known by its first name.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import paddle


@dataclass
class ParamGroup:
    name: str
    params: list  # Parameters, in model order
    keys: list[str]
    scope_layers: list  # layers whose forward needs the whole buffer
    trainable: bool
    attrs: dict = field(default_factory=dict)


def _owners(model: paddle.nn.Layer) -> tuple[dict[int, list], dict[int, str], dict[int, object]]:
    """For every parameter (by id): the layers registering it, its first structured name, the object."""
    owners: dict[int, list] = {}
    keys: dict[int, str] = {}
    objects: dict[int, object] = {}
    for prefix, layer in model.named_sublayers(include_self=True):
        for name, param in layer._parameters.items():
            if param is None:
                continue
            pid = id(param)
            owners.setdefault(pid, [])
            if all(owner is not layer for owner in owners[pid]):
                owners[pid].append(layer)
            keys.setdefault(pid, f"{prefix}.{name}" if prefix else name)
            objects[pid] = param
    return owners, keys, objects


def _unit_of(model: paddle.nn.Layer, unit_classes: set[str]) -> dict[int, tuple[str, object]]:
    """Map every layer (by id) to its innermost enclosing unit (prefix, layer), if any."""
    result: dict[int, tuple[str, object]] = {}

    def walk(prefix: str, layer, unit):
        if prefix and type(layer).__name__ in unit_classes:
            unit = (prefix, layer)
        if unit is not None:
            result[id(layer)] = unit
        for name, child in layer._sub_layers.items():
            if child is not None:
                walk(f"{prefix}.{name}" if prefix else name, child, unit)

    walk("", model, None)
    return result


def plan_param_groups(
    model: paddle.nn.Layer, fsdp_unit_layers: list[str] | None, no_weight_decay_fn=None
) -> list[ParamGroup]:
    """Group ``model``'s parameters into buffers, in model order."""
    unit_classes = set(fsdp_unit_layers or [])
    known = {type(layer).__name__ for layer in model.sublayers(include_self=False)}
    unknown = unit_classes - known
    if unknown:
        raise ValueError(
            f"fsdp_unit_layers names {sorted(unknown)}, but the model has no sublayer of that class "
            f"(classes present: {sorted(known)})"
        )
    owners, keys, objects = _owners(model)
    if not objects:
        raise ValueError(f"FullyShardFusion: the model {type(model).__name__} has no parameters to shard")
    units = _unit_of(model, unit_classes)
    layer_prefix = {id(layer): prefix for prefix, layer in model.named_sublayers(include_self=True)}
    groups: dict[tuple, ParamGroup] = {}
    for pid, param in objects.items():
        layers = owners[pid]
        tied = len(layers) > 1
        exempt = bool(getattr(param, "no_weight_decay", False)) or bool(
            no_weight_decay_fn is not None and no_weight_decay_fn(keys[pid])
        )
        trainable = not param.stop_gradient
        if tied:
            scope_name, scope_layers = f"tied:{keys[pid]}", layers
        elif id(layers[0]) in units:
            prefix, unit = units[id(layers[0])]
            scope_name, scope_layers = f"unit:{prefix}", [unit]
        else:
            scope_name, scope_layers = f"layer:{layer_prefix[id(layers[0])] or '<root>'}", layers
        group_key = (scope_name, str(param.dtype), trainable, exempt)
        if group_key not in groups:
            name = (
                f"{scope_name}|{str(param.dtype).replace('paddle.', '')}|"
                + ("trainable" if trainable else "frozen")
                + ("|no_decay" if exempt else "")
            )
            groups[group_key] = ParamGroup(
                name,
                [],
                [],
                scope_layers,
                trainable,
                {"scope": scope_name, "tied": tied, "no_weight_decay": exempt},
            )
        groups[group_key].params.append(param)
        groups[group_key].keys.append(keys[pid])
    return list(groups.values())
