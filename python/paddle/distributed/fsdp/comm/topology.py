"""Which ranks FullyShardFusion shards over, which it replicates over, and the layouts it refuses.

Hybrid sharding (HSDP): parameters and optimizer state are sharded over a shard group (a node's ranks) and
replicated over a replicate group (the ranks at the same position in every shard group); see hybrid_comm.py.

FSDP is only correct when, after a step, every rank that holds a copy of a parameter slice has applied the
same gradient, averaged over every rank that saw data. A layout where some data-parallel ranks never exchange
gradients with each other (fleet's ``dp_degree x sharding_degree`` without replica averaging, a sharding group
that is a strict subset of the world) trains silently wrong: replicas drift apart and a checkpoint holds one
replica's state. Such layouts are refused here, before anything is sharded, with
:class:`UnsupportedGroupLayoutError`.

Group creation: with gloo and 4+ processes, paddle's ``new_group`` fails now and then ("Connection refused",
"address.cc ... 136 vs 45", a TIMEOUT). :func:`new_group` creates a group through
:func:`group_startup.create_group` (bounded attempts agreed by every rank, which is also a barrier of the world),
and :func:`barrier_after_new_group` applies it to group creation done by others (``fleet.init``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import paddle.distributed as dist

from .group_startup import ATTEMPTS, PROBE_TIMEOUT, check_options, create_group, dropped_group_ids

logger = logging.getLogger(__name__)


class UnsupportedGroupLayoutError(ValueError):
    """The process groups describe a layout FullyShardFusion cannot train correctly."""


def new_group(ranks: list[int], **kwargs: Any):
    """``dist.new_group(ranks)``, retried until every rank's attempt came up, and a barrier of the world
    (collective: every rank calls it with the same ranks, as ``dist.new_group`` requires); see the module
    docstring for why. Raises ``GroupCreationError`` on every rank after the allowed attempts."""
    if not isinstance(ranks, (list, tuple)) or not all(isinstance(r, int) for r in ranks):
        raise TypeError(f"new_group expects a list of int ranks, got {ranks!r}")
    from ..keywords import check_keywords, keyword_names

    check_keywords("new_group", kwargs, keyword_names(dist.new_group, ("ranks",)))  # stock's, with a hint
    return create_group(lambda: dist.new_group(list(ranks), **kwargs), ranks)


@contextlib.contextmanager
def barrier_after_new_group(
    reuse_identical: bool = False, attempts: int = ATTEMPTS, probe_timeout: float = PROBE_TIMEOUT
) -> Iterator[None]:
    """Inside the block, every ``paddle.distributed.new_group`` call goes through
    :func:`group_startup.create_group`: retried (at most ``attempts`` times, a new group id each time) until every
    rank's attempt came up and passed one barrier of the group within ``probe_timeout`` s, and followed by a
    barrier of the world. After the last failed attempt every rank raises ``GroupCreationError`` naming the
    group's ranks and each rank's error.

    For group creation the project does not own, e.g. ``with barrier_after_new_group(): fleet.init(...)``
    (fleet's hybrid topology calls ``paddle.distributed.new_group`` for each of its groups, on every rank).

    ``reuse_identical``: a group whose members equal an existing one's (the global group, groups made before the
    block or inside it) is that group. Fleet's expert-parallel init (``ep_degree > 1``) creates several groups of
    the same members (the sharding and context-sharding groups are both the world); with gloo and 4 processes that
    init failed in most runs here even with the barrier ("address.cc ... sizeof(impl_) == bytes.size()",
    "Connection refused"); the reuse creates fewer groups, so fewer handshakes can fail. Every rank has made the
    same groups in the same order (``new_group`` is collective), so the reuse is the same everywhere."""
    import paddle.distributed as pdist

    check_options(attempts, probe_timeout=probe_timeout)
    original = pdist.new_group
    made: dict[tuple, Any] = {}
    if reuse_identical and dist.is_initialized():
        from paddle.distributed.collective import _get_group_map

        dropped = dropped_group_ids()  # a failed attempt's group is in paddle's map too: never reuse it
        for gid, existing in sorted(_get_group_map().items(), key=lambda item: item[0]):
            if getattr(existing, "ranks", None) and gid not in dropped:
                made.setdefault(tuple(sorted(existing.ranks)), existing)

    def wrapped(ranks=None, *args: Any, **kwargs: Any):
        key = tuple(sorted(ranks)) if ranks is not None else None
        if reuse_identical and key is not None and key in made:
            return made[key]
        group = create_group(
            lambda: original(ranks, *args, **kwargs), ranks, attempts=attempts, probe_timeout=probe_timeout
        )
        if reuse_identical and key is not None:
            made[key] = group
        return group

    pdist.new_group = wrapped
    try:
        yield
    finally:
        pdist.new_group = original


@dataclass(frozen=True)
class GroupLayout:
    """The groups of one FullyShardFusion: ``shard_group`` (None: the global group, or a single process)
    holds one slice each; ``replicate_group`` (None: no replication) links the ranks holding the same slice."""

    shard_group: Any = None
    replicate_group: Any = None

    @property
    def replicate_degree(self) -> int:
        return 1 if self.replicate_group is None else self.replicate_group.nranks

    @property
    def replicate_rank(self) -> int:
        return 0 if self.replicate_group is None else self.replicate_group.rank


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _fleet_hcg():
    from paddle.distributed import fleet

    # fleet.init(is_collective=True, ...) sets _hcg; without it fleet has no hybrid group
    return getattr(fleet.fleet, "_hcg", None)


def _degrees(hcg) -> dict[str, int]:
    """Every parallel degree of fleet's hybrid group this build reports (missing getters count as 1)."""
    getters = {
        "dp_degree": "get_data_parallel_world_size",
        "sharding_degree": "get_sharding_parallel_world_size",
        "mp_degree": "get_model_parallel_world_size",
        "pp_degree": "get_pipe_parallel_world_size",
        "sep_degree": "get_sep_parallel_world_size",
    }
    out = {}
    for name, getter in getters.items():
        fn = getattr(hcg, getter, None)
        out[name] = int(fn()) if fn is not None else 1
    return out


def _check_fleet(hcg) -> GroupLayout:
    degrees = _degrees(hcg)
    split = {k: v for k, v in degrees.items() if k in ("mp_degree", "pp_degree", "sep_degree") and v > 1}
    if split:
        raise UnsupportedGroupLayoutError(
            f"FullyShardFusion: fleet's hybrid config has {split}; FSDP shards whole parameters over data-parallel "
            "ranks only and does not combine with tensor (mp), pipeline (pp) or sequence (sep) parallelism. "
            "Use dp_degree and/or sharding_degree only"
        )
    dp, sharding = degrees["dp_degree"], degrees["sharding_degree"]
    if dp > 1 and sharding > 1:  # hybrid sharding: shard in the sharding group, replicate over dp
        return GroupLayout(shard_group=hcg.get_sharding_parallel_group(), replicate_group=hcg.get_data_parallel_group())
    if sharding > 1:
        return GroupLayout(shard_group=hcg.get_sharding_parallel_group())
    return GroupLayout()


def _nranks(group, what: str) -> int:
    nranks = getattr(group, "nranks", None)
    if not isinstance(nranks, int) or not isinstance(getattr(group, "rank", None), int):
        raise TypeError(f"FullyShardFusion: {what} must be a paddle.distributed process group, got {group!r}")
    if group.rank < 0:
        raise UnsupportedGroupLayoutError(f"FullyShardFusion: this process is not a member of the {what} it was given")
    return nranks


def _check_hybrid(shard_group, replicate_group, world: int) -> GroupLayout:
    """An explicit (shard, replicate) pair must tile the world: S x R = world, S > 1, and the members of each
    replicate group hold the same shard position. Collective over the world (one small exchange), so that every
    rank refuses together."""
    problem = None
    try:
        s, r = _nranks(shard_group, "shard_group"), _nranks(replicate_group, "replicate_group")
        if s * r != world:
            problem = (
                f"shard_group ({s} ranks) x replicate_group ({r} ranks) = {s * r} ranks, but the world has {world}: "
                "every rank must hold one shard of one replica"
            )
        elif s < 2:
            problem = "a shard_group of one rank is plain data parallelism; shard over the whole world instead"
        me = (shard_group.rank, list(replicate_group.ranks))
    except UnsupportedGroupLayoutError as e:  # (a TypeError, a wrong argument, is raised at once)
        problem, me = str(e).removeprefix("FullyShardFusion: "), None
    from .communication import all_gather_object

    every = all_gather_object((problem, me), None) if world > 1 else [(problem, me)]
    for rank, (theirs, _mine) in enumerate(every):
        if theirs is not None:
            raise UnsupportedGroupLayoutError(f"FullyShardFusion: {theirs} (rank {rank})")
    for _theirs, (_position, members) in every:
        positions = [every[m][1][0] for m in members]
        if len(set(positions)) != 1:
            raise UnsupportedGroupLayoutError(
                f"FullyShardFusion: replicate group {members} holds shard positions {positions}; each replicate "
                "group must link the ranks holding the same shard (the same rank in their shard groups)"
            )
    if replicate_group.nranks == 1:
        return GroupLayout(shard_group=shard_group)
    return GroupLayout(shard_group=shard_group, replicate_group=replicate_group)


def hybrid_groups(replicate_degree: int) -> tuple[Any, Any]:
    """``(replicate_group, shard_group)`` of this rank for ``replicate_degree`` replicas of ``world /
    replicate_degree`` consecutive ranks each (a node's ranks shard, nodes replicate), as fleet's ``dp_degree x
    sharding_degree`` lays them out. Collective: every rank creates every group (with :func:`new_group`). With
    gloo, create them before ``fleet.init`` if both are used: after fleet's hybrid init, paddle 3.3.1's gloo
    ``new_group`` failed here ("address.cc ... sizeof(impl_) == bytes.size()")."""
    world = _world_size()
    if not isinstance(replicate_degree, int) or replicate_degree < 1 or world % replicate_degree:
        raise ValueError(
            f"replicate_degree must be a positive divisor of the world size {world}, got {replicate_degree!r}"
        )
    shard_degree = world // replicate_degree
    me = dist.get_rank()
    mine: dict[str, Any] = {}
    for r in range(replicate_degree):
        ranks = list(range(r * shard_degree, (r + 1) * shard_degree))
        group = new_group(ranks)
        if me in ranks:
            mine["shard"] = group
    for s in range(shard_degree):
        ranks = list(range(s, world, shard_degree))
        group = new_group(ranks)
        if me in ranks:
            mine["replicate"] = group
    return mine["replicate"], mine["shard"]


def resolve_layout(group=None, replicate_group=None, shard_group=None) -> GroupLayout:
    """The groups to shard and replicate over: explicit ``shard_group`` (alias ``group``) and ``replicate_group``,
    else fleet's hybrid config (``sharding_degree`` shards, ``dp_degree`` replicates), else the world. Refuses
    (:class:`UnsupportedGroupLayoutError`) a layout where data-parallel ranks would not average gradients."""
    world = _world_size()
    if group is not None and shard_group is not None and group is not shard_group:
        raise ValueError("FullyShardFusion: pass the sharding group once (group= or shard_group=, not both)")
    shard_group = shard_group if shard_group is not None else group
    if replicate_group is not None:
        if shard_group is None:
            raise ValueError("FullyShardFusion: replicate_group needs shard_group (the ranks of one replica)")
        return _check_hybrid(shard_group, replicate_group, world)
    if shard_group is not None:
        nranks = _nranks(shard_group, "group")
        if nranks != world:
            raise UnsupportedGroupLayoutError(
                f"FullyShardFusion: the sharding group has {nranks} of the {world} ranks; the ranks outside it "
                "would never average gradients with it (their copies drift apart). Shard over the whole world "
                "(group=None), or pass replicate_group= too (hybrid sharding)"
            )
        return GroupLayout(shard_group=shard_group)
    hcg = _fleet_hcg()
    if hcg is not None:
        return _check_fleet(hcg)
    return GroupLayout()
