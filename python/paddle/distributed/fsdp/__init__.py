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

# Import paths from before the runtime moved into packages (issue #53): every module that moved keeps its old
# path, for user code, upstream code and tests written against earlier versions. Each old name is the same module
# object as the new one (a ``sys.modules`` entry and an attribute of its parent package), so ``monkeypatch``,
# ``__name__`` and ``import paddle.distributed.fsdp.topology`` all see one module. test_runtime_layers.py checks
# every entry; new code imports the new paths.
MOVED_MODULES = {
    "fused_buffer": "buffers.fused_buffer",
    "fused_layout": "buffers.fused_layout",
    "lazy_init": "buffers.lazy_init",
    "memory_account": "buffers.memory_account",
    "param_grouping": "buffers.param_grouping",
    "comm_emulation": "comm.comm_emulation",
    "communication": "comm.communication",
    "expert_comm": "comm.expert_comm",
    "expert_parallel": "comm.expert_parallel",
    "hybrid_comm": "comm.hybrid_comm",
    "topology": "comm.topology",  # docs/expert-parallel.md: topology.new_group
    "buffer_memory": "devices.buffer_memory",
    "device": "devices.device",  # docs/gpu.md: host buffers made by paddle.distributed.fsdp.device
    "device_rules": "devices.device_rules",
    "device_streams": "devices.device_streams",
    "heap_trim": "devices.heap_trim",
    "host_mappings": "devices.host_mappings",
    "checkpoint.keywords": "keywords",
    "full_params": "state.full_params",
    "sharded_model": "state.sharded_model",
    "gradient_sync": "step.gradient_sync",
    "hooks": "step.hooks",
    "layer_integration": "step.layer_integration",
    "optimizer_integration": "step.optimizer_integration",
    "overlap": "step.overlap",
}


def _register_moved_modules() -> None:
    import importlib
    import sys

    for old, new in MOVED_MODULES.items():
        module = importlib.import_module(f"{__name__}.{new}")
        sys.modules[f"{__name__}.{old}"] = module
        parent, _, name = f"{__name__}.{old}".rpartition(".")
        setattr(sys.modules[parent], name, module)


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
