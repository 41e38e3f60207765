"""Peer copies: which rank holds whose memory copy (the partner map).

Why another node: a copy in the same node's memory dies with the node. The default partner of a rank is the same
local rank on the next node (ranks of a node are contiguous in paddle's launcher), so losing one node loses no
state as long as its partner node lives. Losing a node and its partner node at once is not covered.

Transport: a direct TCP connection between the two ranks (wire.py), not the process group.
"""

from __future__ import annotations

import os

from ..checkpoint.errors import CheckpointError


def local_size(world: int) -> int:
    """Ranks per node: the launcher's ``PADDLE_LOCAL_SIZE`` (else one node holds every rank)."""
    try:
        size = int(os.environ.get("PADDLE_LOCAL_SIZE", "0"))
    except ValueError:
        size = 0
    return size if 0 < size <= world and world % size == 0 else world


def default_partners(world: int, per_node: int) -> dict[int, int]:
    """The same local rank on the next node; {} on a single node (no peer copy possible)."""
    if per_node >= world:
        return {}
    return {r: (r + per_node) % world for r in range(world)}


def check_partners(partners: dict[int, int], world: int) -> dict[int, int]:
    """Validate a partner map ``{rank: rank holding its copy}``: every holder holds at most one copy."""
    if not isinstance(partners, dict):
        raise CheckpointError(f"partners must be a dict {{rank: holder}}, got {type(partners).__name__}")
    out = {}
    for src, dst in partners.items():
        if type(src) is not int or type(dst) is not int or not (0 <= src < world and 0 <= dst < world):
            raise CheckpointError(f"partners: {src!r} -> {dst!r} is not a pair of ranks in [0, {world})")
        if src == dst:
            raise CheckpointError(f"partners: rank {src} cannot hold its own peer copy")
        out[src] = dst
    holders = list(out.values())
    if len(set(holders)) != len(holders):
        raise CheckpointError(f"partners: a rank would hold more than one peer copy ({out})")
    return out


def source_of(partners: dict[int, int], rank: int) -> int | None:
    """The rank whose copy ``rank`` holds (None: it holds none)."""
    for src, dst in partners.items():
        if dst == rank:
            return src
    return None
