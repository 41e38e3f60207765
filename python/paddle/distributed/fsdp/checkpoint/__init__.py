"""Sharded checkpoint storage engine of the FSDP fork.

Per-rank safetensors data files + a JSON index (metadata.json) + a commit record; loading never unpickles.
See ``save.py`` and ``load.py`` for the protocol and behaviour (``api.py`` re-exports the public functions),
``metadata.py`` for the on-disk schema, ``manager.py`` for numbered checkpoints with a ``latest`` pointer and
keep-last-K, ``faults.py`` for the test-only crash hook.
"""

from .api import (  # noqa: F401
    LoadReport,
    SaveHandle,
    load_full_state_dict,
    load_state_dict,
    read_metadata,
    release_host_buffers,
    save_state_dict,
    snapshot_in_flight,
    verify_checkpoint,
    wait_for_snapshot,
)
from .api import __all__ as _engine_api
from .errors import (  # noqa: F401
    CheckpointError,
    CorruptCheckpointError,
    DtypeMismatchError,
    IncompleteCheckpointError,
    InvalidStateDictError,
    MetadataError,
    MissingKeyError,
    NotACheckpointError,
    OptimizerMismatchError,
    PartiallyLoadedError,
    SaveFailedError,
    ShapeMismatchError,
    StateDictMismatchError,
    UnexpectedKeyError,
    UnsafePathError,
)
from .manager import (  # noqa: F401
    CheckpointManager,
    latest_checkpoint,
    resolve_checkpoint,
)
from .metadata import CheckpointMetadata  # noqa: F401

__all__ = [
    *_engine_api,
    "CheckpointManager",
    "latest_checkpoint",
    "resolve_checkpoint",
    "CheckpointMetadata",
    "CheckpointError",
    "CorruptCheckpointError",
    "DtypeMismatchError",
    "IncompleteCheckpointError",
    "InvalidStateDictError",
    "MetadataError",
    "MissingKeyError",
    "NotACheckpointError",
    "SaveFailedError",
    "PartiallyLoadedError",
    "ShapeMismatchError",
    "StateDictMismatchError",
    "OptimizerMismatchError",
    "UnexpectedKeyError",
    "UnsafePathError",
]
