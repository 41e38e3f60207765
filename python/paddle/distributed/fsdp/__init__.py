"""Fused-buffer fully sharded data parallel (FSDP) training and its sharded checkpoints.

This package overlays stock ``paddle.distributed.fsdp`` (see README: installed next to stock paddle,
activated by an import hook); upstream's ``fully_shard`` is re-exported unchanged.
"""

from .fully_shard import fully_shard  # stock paddle's module, found through the overlay's search path
from .fully_shard_fusion import FullyShardFusion

__all__ = ["fully_shard", "FullyShardFusion"]
