"""Sharded checkpoint storage engine of the FSDP fork: the public surface.

Per-rank safetensors data files + a JSON index (metadata.json) + a commit record; loading never unpickles.

Saving and loading (collective over the process group; every rank gets the same named error on failure):

* ``save_state_dict(state_dict, path, ...)`` -> ``SaveHandle`` (async) or None; ``release_host_buffers()``
  (save/save.py: directory layout, save/commit protocol, crash safety, async saves).
* ``load_state_dict(state_dict, path, ...)`` -> ``LoadReport``, any world size, memory-bounded; all-or-nothing
  for everything checkable before writing, ``PartiallyLoadedError`` on every rank for data found corrupt while
  writing, or fully all-or-nothing with ``atomic=True`` (load/load.py).
* ``wait_for_snapshot()`` / ``snapshot_in_flight()``: an async save copies parameters and optimizer state after
  it returned; writers the engine cannot intercept wait with this first (snapshot_guard.py).
* ``load_full_state_dict(path, keys=None)``: whole tensors in one process, no collectives (load/load.py).
* ``read_metadata(path)`` -> ``CheckpointMetadata`` of a committed checkpoint (directory.py).
* ``verify_checkpoint(path)`` -> list of problems (verify.py).
* ``CheckpointManager``, ``latest_checkpoint``, ``resolve_checkpoint``: numbered checkpoints with a ``latest``
  pointer and keep-last-K (manager.py).
* ``CheckpointOptions`` (options.py): how saves and loads run (checksum algorithm, threads, commit timeout,
  heartbeat lease, storage backend, O_DIRECT, huge pages, in-place reads, read slab, tracing and ``trace_hook``
  receiving ``TraceRecord``s);
  passed as ``options=``; without it ``CheckpointOptions.from_env()`` reads the ``PADDLE_FSDP_CKPT_*``
  variables at call time.
* ``CheckpointError`` and the families callers catch: ``NotACheckpointError``, ``CorruptCheckpointError``,
  ``StateDictMismatchError``, ``PartiallyLoadedError``. Every named error is exported by ``checkpoint.errors``.

Names exported here before (every other exception, ``gather_errors``, ``CheckpointMetadata``, ``TraceRecord``)
still import from this package, resolved from their home module on first use (``__getattr__`` below).

Layout, by phase (issue #42): ``save/`` holds the modules only a save uses, ``load/`` those only a load uses; every
other module sits here, shared by both phases or used by ``verify.py``, ``manager.py``, ``memtier/``, ``state/`` or
``tools/``. Data flows one way: ``save/`` and ``load/`` import the shared modules, never each other.

Save path: ``save/save.py`` (calling thread; ``save/request.py`` the request it carries) -> ``background.py`` (the
one save in flight) -> ``save/commit.py`` (write, hand over, commit, publish) over ``save/channel.py`` (the TCP
store: decisions and heartbeats, no polled files; ``save/store_client.py``, its client: every call bounded) and ``io/storage.py`` (every byte and name; ``io/local.py``
POSIX; ``io/backends.py`` the registry and layers); ``save/markers.py`` records why a save failed, ``save/abandon.py`` how a rank
gives a save up. Save modules that others use too stay shared (the tools' one-process writer ``one_process.py``,
the memory tier, ``coordination.py``): ``planner.py`` / ``assign.py`` / ``first_save.py`` (the write assignment),
``save_index.py``, ``writer.py`` / ``direct_write.py`` (rank files), ``snapshot.py`` (async copies),
``stock_compat.py``. ``directory.py`` answers
"committed? removed under a reader?" and reads the metadata; ``lineage.py`` "complete? which run?";
``selection.py`` "which one to resume (``latest``), what may rotation remove" (CheckpointManager and the Trainer). ``process_state.py`` lists the
process-wide state (the tests reset it with their own helper).

Load path: ``load/load.py`` (entry points) -> ``load/job.py`` (validate, exchange, finish) with
``load/bounded.py`` (default) or ``load/atomic.py`` (``atomic=True``, reading in place through
``load/inplace.py``). Shared with ``verify.py``, the tools and ``state/``: ``load_checks.py`` (checks that read no
data) -> ``regions.py`` (what to read for a region: ``read_ops.py``'s typed reads) -> ``ranges.py`` /
``streamed.py`` (how a range is read) -> ``chunks.py`` (checksum checks) -> ``reader.py`` (``FileSet``: the data
objects' handles from ``Storage.open_read``; POSIX fast paths where a handle has a descriptor). ``s3/`` serves
``s3://`` locations (registered in ``io/storage.py`` without importing it; boto3 loads on first use); ``paths.py``
turns a path into a location and refuses URLs no backend serves.

What must never import what (test_checkpoint_layers.py checks it, naming the exceptions that remain):
1. ``format/`` imports nothing of the package but ``errors`` and ``gc_pause``.
2. ``io/`` never imports ``save/`` (its ``commit``, ``markers``, ``channel`` included), ``load/``, ``manager``,
   ``verify``, ``background`` or ``stock/``: it knows no protocol.
3. the engine (everything outside ``stock/``) never imports ``stock/``.
4. ``checkpoint/`` never imports ``state/`` or the training core, only the leaves ``device`` and ``communication``.
5. no import cycle; modules under 500 lines, functions under 80 lines of code.
6. ``save/`` and ``load/`` never import each other; a shared module imports neither, but this face and the
   orchestrators above both phases (``manager.py``, ``stock/dispatch.py``).

Where things live: ``format/`` owns the on-disk format (schema, commit record, safetensors headers, reserved
keys; no I/O); ``planner.py`` plans writes and reads; the file I/O is ``writer.py`` (rank files, durable
commit), ``reader.py`` (the read handles), ``host_memory.py`` (buffers, tensor views) and ``libc.py``;
``records.py`` normalises state-dict entries.
"""

from .directory import read_metadata
from .errors import (
    CheckpointError,
    CorruptCheckpointError,
    NotACheckpointError,
    PartiallyLoadedError,
    StateDictMismatchError,
)
from .load import LoadReport, load_full_state_dict, load_state_dict
from .manager import CheckpointManager, latest_checkpoint, resolve_checkpoint
from .options import CheckpointOptions
from .save import SaveHandle, release_host_buffers, save_state_dict
from .snapshot_guard import snapshot_in_flight, wait_for_snapshot
from .verify import verify_checkpoint

__all__ = [
    "save_state_dict",
    "load_state_dict",
    "load_full_state_dict",
    "read_metadata",
    "verify_checkpoint",
    "release_host_buffers",
    "wait_for_snapshot",
    "snapshot_in_flight",
    "SaveHandle",
    "LoadReport",
    "CheckpointManager",
    "latest_checkpoint",
    "resolve_checkpoint",
    "CheckpointOptions",
    "CheckpointError",
    "NotACheckpointError",
    "CorruptCheckpointError",
    "StateDictMismatchError",
    "PartiallyLoadedError",
]

# Names this package exported before its face was cut to the list above: still importable from here, resolved on
# first use from their home module (not in ``__all__`` or ``dir()``). Exceptions: ``checkpoint.errors``.
_MOVED = {
    "gather_errors": "coordination",
    "CheckpointMetadata": "format.metadata",
    "TraceRecord": "tracing",
    **{
        name: "errors"
        for name in (
            "DtypeMismatchError",
            "IncompleteCheckpointError",
            "InvalidStateDictError",
            "MetadataError",
            "MissingKeyError",
            "SafetensorsHeaderError",
            "CheckpointRemovedError",
            "MissingDependencyError",
            "NotARegularFileError",
            "SaveFailedError",
            "ShapeMismatchError",
            "TargetNotADirectoryError",
            "OptimizerMismatchError",
            "GradScalerMismatchError",
            "RngStateMismatchError",
            "UnexpectedKeyError",
            "UnrepresentableKeyError",
            "UnsafePathError",
        )
    },
}


def __getattr__(name: str):
    home = _MOVED.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
