"""Which ranks FullyShardFusion shards over, which it replicates over, and the layouts it refuses.

FSDP is only correct when, after a step, every rank that holds a copy of a parameter slice has applied the
same gradient, averaged over every rank that saw data. A layout where some data-parallel ranks never exchange
gradients with each other (fleet's ``dp_degree x sharding_degree`` without replica averaging, a sharding group
that is a strict subset of the world) trains silently wrong: replicas drift apart and a checkpoint holds one
replica's state. Such layouts are refused here, before anything is sharded, with
:class:`UnsupportedGroupLayoutError`.

Group creation: with gloo and 4+ processes, ``new_group`` fails with "Connection refused" when a member
connects before its peer listens; a global barrier after each ``new_group`` avoids it. :func:`new_group`
does that, and :func:`barrier_after_new_group` applies it to group creation done by others (``fleet.init``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import paddle.distributed as dist

logger = logging.getLogger(__name__)


class UnsupportedGroupLayoutError(ValueError):
    """The process groups describe a layout FullyShardFusion cannot train correctly."""


def new_group(ranks: list[int], **kwargs: Any):
    """``dist.new_group(ranks)`` followed by a global barrier (collective: every rank calls it with the same
    ranks, as ``dist.new_group`` requires); see the module docstring for why."""
    if not isinstance(ranks, (list, tuple)) or not all(isinstance(r, int) for r in ranks):
        raise TypeError(f"new_group expects a list of int ranks, got {ranks!r}")
    group = dist.new_group(list(ranks), **kwargs)
    dist.barrier()
    return group


@contextlib.contextmanager
def barrier_after_new_group() -> Iterator[None]:
    """Inside the block, every ``paddle.distributed.new_group`` call is followed by a global barrier.

    For group creation the project does not own, e.g. ``with barrier_after_new_group(): fleet.init(...)``
    (fleet's hybrid topology calls ``paddle.distributed.new_group`` for each of its groups, on every rank)."""
    import paddle.distributed as pdist

    original = pdist.new_group

    def wrapped(*args: Any, **kwargs: Any):
        group = original(*args, **kwargs)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
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
    if dp > 1 and sharding > 1:
        raise UnsupportedGroupLayoutError(
            f"FullyShardFusion: fleet's hybrid config dp_degree={dp} x sharding_degree={sharding} (hybrid sharding) "
            "is not supported: gradients would never be averaged across the replicas, which drift apart. Use "
            "sharding_degree=<world size> (or dp_degree=<world size>) to shard over every rank"
        )
    if sharding > 1:
        return GroupLayout(shard_group=hcg.get_sharding_parallel_group())
    return GroupLayout()


def resolve_layout(group=None) -> GroupLayout:
    """The groups to shard and replicate over, from an explicit ``group`` or fleet's hybrid config; refuses
    (:class:`UnsupportedGroupLayoutError`) a layout where data-parallel ranks would not average gradients."""
    world = _world_size()
    if group is not None:
        nranks = getattr(group, "nranks", None)
        if not isinstance(nranks, int):
            raise TypeError(f"FullyShardFusion: group must be a paddle.distributed process group, got {group!r}")
        if nranks != world:
            raise UnsupportedGroupLayoutError(
                f"FullyShardFusion: the sharding group has {nranks} of the {world} ranks; the ranks outside it "
                "would never average gradients with it (their copies drift apart). Shard over the whole world "
                "(group=None)"
            )
        return GroupLayout(shard_group=group)
    hcg = _fleet_hcg()
    if hcg is not None:
        return _check_fleet(hcg)
    return GroupLayout()
