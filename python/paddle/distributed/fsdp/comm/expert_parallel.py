"""Expert parallelism (EP): which parameters are experts, which ranks they are sharded over, what is refused.

Under EP a mixture-of-experts layer keeps E / P of its E experts on each of the P ranks of an expert-parallel
group; tokens travel to their experts (all_to_all, or any dispatch the model implements). Every other parameter
is data-parallel over the whole world as usual. So FullyShardFusion keeps two kinds of fused buffers:

* dense buffers, sharded over the sharding group (under EP: the whole world) as without EP;
* expert buffers, holding only this rank's experts, sharded over the expert-data-parallel group (fleet's
  ``moe_sharding`` group: the ranks at the same EP position, which hold the same experts). Their gradients are
  reduced over that group only, scaled by 1 / world (expert_comm.py: the dispatch's backward already summed
  the contributions of the EP group's tokens).

Which parameters are experts: those marked ``param.expert = True`` (PaddleFormers' MoELayer marks its experts
so under EP), and those of sublayers whose class is named in ``moe_layers_name`` *and* that are members of an
expert list (their structured name ends in an index: ``mlp.experts.5``; a shared expert or a dense MLP of the
same class is not an expert).

Keys: an expert's structured name must carry its global expert index (``experts.5`` on the EP rank holding
expert 5; PaddleFormers' MoELayer keeps ``None`` for the experts of other ranks). Then a checkpoint saved at any
EP degree has the keys and full shapes of EP=1, and loads at any other degree by key and range like any
checkpoint. A model naming its experts by local index (``experts.0`` on every EP rank) is refused by name:
its keys would collide across EP ranks.

Refused (:class:`UnsupportedGroupLayoutError`, on every rank, before the model changes): expert parameters
without an expert-parallel group (or EP without expert parameters); groups that do not tile the world as
``moe_sharding x ep``; EP combined with hybrid sharding of the dense part; expert keys held by two EP ranks or
differing inside an expert-data-parallel group; dense keys that differ between ranks (an expert not marked as
one); fleet configured with ``ep_degree > 1`` whose ``order`` lacks ``"ep"`` (fleet then ignores the degree).
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

import paddle
import paddle.distributed as dist

from .topology import GroupLayout, UnsupportedGroupLayoutError

#: Expert classes recognised without ``moe_layers_name`` (upstream FullyShardFusion's default list).
DEFAULT_MOE_LAYERS = ("Qwen3MoeMLP", "StandardMLPExpert")
#: Attribute PaddleFormers' MoELayer sets on expert parameters under EP (``p.expert = True``).
EXPERT_ATTR = "expert"
_MEMBER_OF_LIST = re.compile(r"(^|\.)\d+$")


@dataclass(frozen=True)
class ExpertLayout:
    """The groups of the expert buffers: ``shard_group`` (the expert-data-parallel group; None: one rank holds
    each expert) and ``parallel_group`` (the EP group: the ranks holding different experts)."""

    parallel_group: Any
    shard_group: Any = None

    @property
    def ep_degree(self) -> int:
        return int(self.parallel_group.nranks)

    @property
    def ep_rank(self) -> int:
        return int(self.parallel_group.rank)

    @property
    def shard_degree(self) -> int:
        return 1 if self.shard_group is None else int(self.shard_group.nranks)


def expert_parameter_ids(model: paddle.nn.Layer, moe_layers_name) -> set[int]:
    """Ids of the parameters that are experts (see the module docstring)."""
    classes = set(DEFAULT_MOE_LAYERS if moe_layers_name is None else moe_layers_name)
    out = {id(p) for p in model.parameters() if getattr(p, EXPERT_ATTR, False) is True}
    for prefix, layer in model.named_sublayers():
        if type(layer).__name__ in classes and _MEMBER_OF_LIST.search(prefix):
            out.update(id(p) for p in layer.parameters())
    return out


def _fleet_expert_groups():
    """(ep group, moe_sharding group) from fleet's hybrid group when it has ``ep_degree > 1``, else None.
    Refuses a strategy asking for EP that fleet silently ignored."""
    from paddle.distributed import fleet

    hcg = getattr(fleet.fleet, "_hcg", None)
    if hcg is None:
        return None
    getter = getattr(hcg, "get_expert_parallel_world_size", None)
    if getter is None or int(getter()) <= 1:
        strategy = getattr(fleet.fleet, "_user_defined_strategy", None)
        configs = getattr(strategy, "hybrid_configs", None)
        wanted = int(configs["ep_degree"]) if configs is not None and "ep_degree" in configs else 1
        if wanted > 1:
            raise UnsupportedGroupLayoutError(
                f"FullyShardFusion: fleet's hybrid_configs ask for ep_degree={wanted}, but fleet built no expert-"
                "parallel group: its 'order' lacks 'ep' and 'moe_sharding', and fleet then ignores both degrees. "
                'Add "order": ["pp", "moe_sharding", "ep", "dp", "sharding", "sep", "cp", "mp"] to hybrid_configs'
            )
        return None
    return hcg.get_expert_parallel_group(), hcg.get_moe_sharding_parallel_group()


def resolve_expert_layout(
    expert_parallel_group=None, expert_shard_group=None, use_fleet: bool = True
) -> ExpertLayout | None:
    """The expert groups: explicit ones, else fleet's EP groups (``ep_degree > 1``) when ``use_fleet`` (the dense
    groups come from fleet too: who passes their own groups passes their own expert groups), else None (no EP)."""
    if expert_parallel_group is None:
        if expert_shard_group is not None:
            raise ValueError("FullyShardFusion: expert_shard_group needs expert_parallel_group too")
        found = _fleet_expert_groups() if use_fleet else None
        if found is None:
            return None
        expert_parallel_group, expert_shard_group = found
    for group, what in ((expert_parallel_group, "expert_parallel_group"), (expert_shard_group, "expert_shard_group")):
        if group is not None and not (isinstance(getattr(group, "nranks", None), int) and hasattr(group, "rank")):
            raise TypeError(f"FullyShardFusion: {what} must be a paddle.distributed process group, got {group!r}")
    if expert_shard_group is not None and expert_shard_group.nranks == 1:
        expert_shard_group = None
    return ExpertLayout(expert_parallel_group, expert_shard_group)


def _digest(items) -> str:
    return hashlib.sha256(repr(items).encode()).hexdigest()


def check_expert_layout(
    layout: ExpertLayout | None, dense: GroupLayout, model: paddle.nn.Layer, expert_ids: set[int], world: int
) -> frozenset[str]:
    """Refuse (on every rank alike) what EP cannot train right; see the module docstring. Collective over the
    world (one small exchange) when there is more than one rank. Returns the expert keys of every EP rank (a
    checkpoint of this model holds them all: a load must not take the other ranks' experts for foreign keys)."""
    keyed = _keys_and_shapes(model)
    experts = [(k, s) for pid, (k, s) in keyed.items() if pid in expert_ids]  # model order: the buffers' order
    dense_items = [(k, s) for pid, (k, s) in keyed.items() if pid not in expert_ids]
    problem = _local_problem(layout, dense, experts, world)
    me = dist.get_rank() if world > 1 else 0
    position = None
    if layout is not None and problem is None:
        shard_rank = 0 if layout.shard_group is None else int(layout.shard_group.rank)
        position = (layout.ep_rank, shard_rank, list(layout.parallel_group.ranks), _ranks(layout.shard_group, me))
    # digests, and the lists themselves only where needed (rank 0's dense keys, one expert list per EP position):
    # what every rank receives grows with the model's keys, not with the world times the keys
    shard_rank = position[1] if position is not None else 0
    mine = {
        "problem": problem,
        "position": position,
        "dense": _digest(dense_items),
        "experts": _digest(experts),
        "expert_list": experts if shard_rank == 0 else None,
    }
    every = _exchange(mine, world)
    for rank, entry in enumerate(every):
        if entry["problem"] is not None:
            raise UnsupportedGroupLayoutError(f"FullyShardFusion: {entry['problem']} (rank {rank})")
    odd = [r for r, entry in enumerate(every) if entry["dense"] != every[0]["dense"]]
    if odd:  # a second exchange, on every rank alike: who differs, by key
        lists = _exchange(dense_items if dist.get_rank() in (0, odd[0]) else None, world)
        _refuse_dense_keys(lists[0], lists[odd[0]], odd[0])
    if layout is None:
        return frozenset()
    _check_tiling([entry["position"] for entry in every], world)
    _check_expert_keys(every)
    return frozenset(key for entry in every if entry["expert_list"] for key, _shape in entry["expert_list"])


def _exchange(obj, world: int) -> list:
    if world <= 1:
        return [obj]
    from .communication import all_gather_object

    return all_gather_object(obj, None)


def _ranks(group, me: int) -> list[int]:
    return [me] if group is None else list(group.ranks)


def _keys_and_shapes(model: paddle.nn.Layer) -> dict[int, tuple[str, tuple]]:
    out: dict[int, tuple[str, tuple]] = {}
    for key, param in model.named_parameters():
        out.setdefault(id(param), (key, tuple(param.shape)))
    return out


def _local_problem(layout, dense: GroupLayout, experts: list, world: int) -> str | None:
    if layout is None:
        if experts:
            return (
                f"{len(experts)} parameters are marked as experts (e.g. {experts[0][0]!r}: param.expert=True or a "
                "class in moe_layers_name) but there is no expert-parallel group: pass expert_parallel_group= or "
                "configure fleet with ep_degree > 1 (or unmark them to train the experts data-parallel)"
            )
        return None
    if layout.parallel_group.rank < 0 or (layout.shard_group is not None and layout.shard_group.rank < 0):
        return "this process is not a member of the expert groups it was given"
    if not experts:
        return (
            f"expert parallelism is on (ep_degree={layout.ep_degree}) but no parameter is an expert: name the expert "
            "class in moe_layers_name (its instances must be members of an expert list, e.g. mlp.experts.3) or set "
            "param.expert = True on expert parameters"
        )
    if dense.replicate_degree > 1:
        return (
            "expert parallelism with hybrid sharding (replicate_group / fleet dp_degree > 1) of the dense parameters "
            "is not supported: shard the dense parameters over the whole world (fleet: sharding_degree = world)"
        )
    dense_ranks = world if dense.shard_group is None else int(dense.shard_group.nranks)
    if dense_ranks != world:
        return f"the dense sharding group has {dense_ranks} of the {world} ranks; under EP it must be the whole world"
    if layout.ep_degree * layout.shard_degree != world:
        return (
            f"ep_degree {layout.ep_degree} x expert shard degree {layout.shard_degree} = "
            f"{layout.ep_degree * layout.shard_degree} ranks, but the world has {world}: every rank must hold one "
            "shard of one EP rank's experts (fleet: moe_sharding_degree x ep_degree = world)"
        )
    return None


def _refuse_dense_keys(first: list, other: list, rank: int) -> None:
    """Dense parameters are data-parallel: every rank must have the same keys and shapes."""
    a, b = dict(first), dict(other)
    diff = sorted(set(a) ^ set(b)) or sorted(k for k in a if a[k] != b[k])
    raise UnsupportedGroupLayoutError(
        f"FullyShardFusion: ranks 0 and {rank} hold different non-expert parameters (e.g. {diff[:4]}). Parameters "
        "that exist on some ranks only are experts: mark them (moe_layers_name=[<expert class>] or param.expert = "
        "True) and use expert parallelism; otherwise every rank must build the same model"
    )


def _check_tiling(positions: list, world: int) -> None:
    """The EP groups and the expert shard groups tile the world: each (ep rank, shard rank) once; an EP group's
    members share a shard position, an expert shard group's members share an EP position."""
    pairs = [(p[0], p[1]) for p in positions]
    if len(set(pairs)) != world:
        raise UnsupportedGroupLayoutError(
            f"FullyShardFusion: (ep rank, expert shard rank) by rank is {pairs}: the expert groups do not tile the "
            "world (each pair must occur once)"
        )
    for rank, (ep_rank, shard_rank, ep_members, shard_members) in enumerate(positions):
        if sorted(positions[m][1] for m in ep_members) != [shard_rank] * len(ep_members):
            raise UnsupportedGroupLayoutError(
                f"FullyShardFusion: rank {rank}'s EP group {ep_members} mixes expert shard positions"
            )
        if {positions[m][0] for m in shard_members} != {ep_rank}:
            raise UnsupportedGroupLayoutError(
                f"FullyShardFusion: rank {rank}'s expert shard group {shard_members} holds different EP positions: "
                "its members must hold the same experts"
            )


def _check_expert_keys(every: list) -> None:
    """An expert key is held by one EP position (its global index names it); holders of a position agree."""
    digest_of: dict[int, tuple[int, str]] = {}
    lists: dict[int, list] = {}
    for rank, entry in enumerate(every):
        ep_rank = entry["position"][0]
        first = digest_of.setdefault(ep_rank, (rank, entry["experts"]))
        if first[1] != entry["experts"]:
            raise UnsupportedGroupLayoutError(
                f"FullyShardFusion: ranks {first[0]} and {rank} hold EP position {ep_rank} but different experts "
                "(keys or shapes): the members of an expert shard group must build the same experts"
            )
        if entry["expert_list"] is not None:
            lists[ep_rank] = entry["expert_list"]
    owner: dict[str, int] = {}
    for ep_rank, experts in sorted(lists.items()):
        for key, _shape in experts:
            if key in owner:
                raise UnsupportedGroupLayoutError(
                    f"FullyShardFusion: expert parameter {key!r} exists on EP ranks {owner[key]} and {ep_rank}. Under "
                    "EP an expert's key must name its global index (experts.<global index>, None in the list for "
                    "the experts of other EP ranks, as PaddleFormers' MoELayer does), so that checkpoints do not "
                    "depend on the EP degree"
                )
            owner[key] = ep_rank
    shapes = {ep: [s for _k, s in experts] for ep, experts in lists.items()}
    if len({repr(v) for v in shapes.values()}) > 1:
        raise UnsupportedGroupLayoutError(
            f"FullyShardFusion: EP ranks hold different expert layouts ({ {ep: len(v) for ep, v in shapes.items()} } "
            "expert parameters): experts must be split evenly, the same layout on every EP rank"
        )
