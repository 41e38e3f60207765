"""Which parameters share a fused buffer, and which layers gather it.

A buffer holds parameters with the same (scope, dtype, trainable, weight-decay policy, tied) key:
  - scope: the innermost FSDP unit (a sublayer whose class name is in ``fsdp_unit_layers``) enclosing
    every layer that registers the parameter, else the root model. The scope's forward gathers the buffer,
    so the parameter is whole wherever the scope's code uses it.
  - tied: a parameter registered by several layers (embedding tied to the output head) gets a buffer
    of its own, in the innermost unit enclosing all its registering layers (else the root).
Why the root, not the registering layer, for parameters outside units (as PyTorch FSDP2 groups a root's
leftover parameters): a gather is a collective, so it must run on every rank in the same order. A layer
that runs on some ranks only (an MoE expert skipping tokenless batches, a branch on the data) would gather
on those ranks only and hang or mix up the collectives; and a parameter read by an enclosing layer's own
code (``matmul(h, self.embed.weight, transpose_y=True)`` in the root's forward, a tied head) would be seen
as its 1-D piece. Every rank runs the root's and each unit's forward, so their gathers line up. A layer
holding root parameters and called on its own (``model.backbone(x)``, outside the root's forward) gathers
them itself, as the root is not running (it must then run on every rank). The cost:
parameters outside units stay gathered for the root's whole forward and backward (put large layers that
run unconditionally in units to bound that).
Keys are the model's structured names; a tied parameter is known by its first name.

Not sharded at all: parameters the forward itself writes to (see :func:`is_replicated_parameter`). A write
into a gathered copy is lost when the copy is released, so these stay whole on every rank and are saved
and loaded like persistable buffers (state/buffers.py).
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
    # root scope only: the layers registering the parameters; they gather the buffer when called on their own
    # (outside the root's forward, e.g. ``model.backbone(x)``), as the root is not there to do it
    fallback_layers: list = field(default_factory=list)


#: Attribute a user sets on a parameter (``param.fsdp_replicated = True``) to keep it out of sharding.
REPLICATED_ATTR = "fsdp_replicated"


def is_replicated_parameter(layer: paddle.nn.Layer, name: str, param) -> bool:
    """Whether ``layer``'s parameter ``name`` stays whole on every rank: batch norm's running statistics
    (paddle keeps them as frozen parameters that batch_norm updates in place during a training forward) and
    parameters marked ``fsdp_replicated = True`` (custom layers that update a parameter in forward)."""
    from paddle.nn.layer.norm import _BatchNormBase

    if getattr(param, REPLICATED_ATTR, False):
        return True
    return isinstance(layer, _BatchNormBase) and name in ("_mean", "_variance")


def _owners(model: paddle.nn.Layer) -> tuple[dict[int, list], dict[int, str], dict[int, object]]:
    """For every parameter (by id): the layers registering it, its first structured name, the object."""
    owners: dict[int, list] = {}
    keys: dict[int, str] = {}
    objects: dict[int, object] = {}
    for prefix, layer in model.named_sublayers(include_self=True):
        for name, param in layer._parameters.items():
            if param is None or is_replicated_parameter(layer, name, param):
                continue
            pid = id(param)
            owners.setdefault(pid, [])
            if all(owner is not layer for owner in owners[pid]):
                owners[pid].append(layer)
            keys.setdefault(pid, f"{prefix}.{name}" if prefix else name)
            objects[pid] = param
    return owners, keys, objects


def _unit_chains(model: paddle.nn.Layer, unit_classes: set[str]) -> dict[int, list[tuple[str, object]]]:
    """Map every layer (by id) to its enclosing units (prefix, layer), outermost first; a unit encloses itself.
    A layer registered under several names keeps the chain of its first name."""
    result: dict[int, list[tuple[str, object]]] = {}

    def walk(prefix: str, layer, chain):
        if id(layer) in result:
            return
        if prefix and type(layer).__name__ in unit_classes:
            chain = [*chain, (prefix, layer)]
        result[id(layer)] = chain
        for name, child in layer._sub_layers.items():
            if child is not None:
                walk(f"{prefix}.{name}" if prefix else name, child, chain)

    walk("", model, [])
    return result


def _innermost_common_unit(chains: list[list[tuple[str, object]]]):
    """The innermost unit enclosing every chain's layer, or None (the root)."""
    common = None
    for depth, (prefix, unit) in enumerate(chains[0]):
        if all(len(c) > depth and c[depth][1] is unit for c in chains[1:]):
            common = (prefix, unit)
        else:
            break
    return common


def plan_param_groups(
    model: paddle.nn.Layer, fsdp_unit_layers: list[str] | None, no_weight_decay_fn=None, expert_ids=frozenset()
) -> list[ParamGroup]:
    """Group ``model``'s parameters into buffers, in model order. ``expert_ids``: ids of expert parameters (under
    expert parallelism): they get buffers of their own (sharded over another group, comm/expert_parallel.py)."""
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
    chains = _unit_chains(model, unit_classes)
    groups: dict[tuple, ParamGroup] = {}
    for pid, param in objects.items():
        layers = owners[pid]
        tied = len(layers) > 1
        exempt = bool(getattr(param, "no_weight_decay", False)) or bool(
            no_weight_decay_fn is not None and no_weight_decay_fn(keys[pid])
        )
        trainable = not param.stop_gradient
        unit = _innermost_common_unit([chains[id(layer)] for layer in layers])
        scope_name, scope_layers = (f"unit:{unit[0]}", [unit[1]]) if unit is not None else ("root", [model])
        if tied:
            scope_name = f"{scope_name}|tied:{keys[pid]}"
        expert = pid in expert_ids
        group_key = (scope_name, str(param.dtype), trainable, exempt, expert)
        if group_key not in groups:
            name = (
                f"{scope_name}|{str(param.dtype).replace('paddle.', '')}|"
                + ("trainable" if trainable else "frozen")
                + ("|no_decay" if exempt else "")
                + ("|expert" if expert else "")
            )
            groups[group_key] = ParamGroup(
                name,
                [],
                [],
                scope_layers,
                trainable,
                {"scope": scope_name, "tied": tied, "no_weight_decay": exempt, **({"expert": True} if expert else {})},
            )
        groups[group_key].params.append(param)
        groups[group_key].keys.append(keys[pid])
        if unit is None:
            fallback = groups[group_key].fallback_layers
            fallback.extend(x for x in layers if x is not model and all(x is not f for f in fallback))
    return list(groups.values())
