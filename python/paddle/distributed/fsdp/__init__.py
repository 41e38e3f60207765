"""Fused-buffer fully sharded data parallel (FSDP) training and its sharded checkpoints.

This package overlays stock ``paddle.distributed.fsdp`` (see docs/internals.md: installed next to stock paddle,
activated by an import hook); upstream's ``fully_shard`` is re-exported unchanged.
"""

from paddle_fsdp_fork_activate import ensure_fork_import

ensure_fork_import(__name__)  # refuse the private install name; check the paddle version

from .comm.communication import CollectiveOrderError  # noqa: E402
from .comm.group_startup import GroupCreationError  # noqa: E402
from .comm.topology import UnsupportedGroupLayoutError, barrier_after_new_group, hybrid_groups  # noqa: E402
from .fully_shard import fully_shard  # noqa: E402  # stock paddle's module, found through the overlay's search path
from .fully_shard_fusion import FullyShardFusion  # noqa: E402
from .step.hooks import UnsupportedUnitOutputError  # noqa: E402
from .step.layer_integration import ShardedStateDictError  # noqa: E402

# Import paths from before the runtime moved into packages (issue #53) that users or upstream code use: the docs
# name them. Each old name is the same module object as the new one (a ``sys.modules`` entry and a package
# attribute), so ``monkeypatch``, ``__name__`` and ``import paddle.distributed.fsdp.topology`` all see one module.
# Every other old path is gone; test_runtime_layers.py checks that each listed path is the same object.
MOVED_MODULES = {
    "topology": "comm.topology",  # docs/expert-parallel.md: topology.new_group
    "device": "devices.device",  # docs/gpu.md: host buffers made by paddle.distributed.fsdp.device
}


def _register_moved_modules() -> None:
    import importlib
    import sys

    for old, new in MOVED_MODULES.items():
        module = importlib.import_module(f"{__name__}.{new}")
        sys.modules[f"{__name__}.{old}"] = module
        globals()[old] = module


_register_moved_modules()

__all__ = [
    "fully_shard",
    "FullyShardFusion",
    "UnsupportedGroupLayoutError",
    "hybrid_groups",  # HSDP: the replicate and shard groups (docs/training.md)
    "barrier_after_new_group",  # fleet's hybrid init with gloo (docs/expert-parallel.md)
    "GroupCreationError",  # a group that did not come up within barrier_after_new_group's attempts
    "CollectiveOrderError",  # ranks issued different collectives (docs/gpu.md, docs/training.md)
    "ShardedStateDictError",  # stock state_dict on sharded parameters (README, docs/training.md)
    "UnsupportedUnitOutputError",  # a unit's forward output the hooks cannot follow (docs/training.md)
]
