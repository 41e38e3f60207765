"""Fused-buffer fully sharded data parallel (FSDP) training and its sharded checkpoints.

This package overlays stock ``paddle.distributed.fsdp`` (see docs/internals.md: installed next to stock paddle,
activated by an import hook); upstream's ``fully_shard`` is re-exported unchanged.
"""

from paddle_fsdp_fork_activate import ensure_fork_import

ensure_fork_import(__name__)  # refuse the private install name; check the paddle version

from .fully_shard import fully_shard  # noqa: E402  # stock paddle's module, found through the overlay's search path
from .fully_shard_fusion import FullyShardFusion  # noqa: E402
from .group_startup import GroupCreationError  # noqa: E402
from .topology import UnsupportedGroupLayoutError, barrier_after_new_group, hybrid_groups  # noqa: E402

__all__ = [
    "fully_shard",
    "FullyShardFusion",
    "UnsupportedGroupLayoutError",
    "hybrid_groups",  # HSDP: the replicate and shard groups (docs/training.md)
    "barrier_after_new_group",  # fleet's hybrid init with gloo (docs/expert-parallel.md)
    "GroupCreationError",  # a group that did not come up within barrier_after_new_group's attempts
]
