"""Exceptions raised by the checkpoint engine.

Every error carries a message that names the checkpoint path, the key and/or the file involved.
All of them derive from :class:`CheckpointError` so callers can catch the whole family. This module is their public
home (``__all__``); ``paddle.distributed.fsdp.checkpoint`` exports only the base and the families callers catch.
"""

from __future__ import annotations

from ..env_switches import EnvSwitchError

__all__ = [
    "CheckpointError",
    "NotACheckpointError",
    "CheckpointRemovedError",
    "IncompleteCheckpointError",
    "CorruptCheckpointError",
    "MetadataError",
    "UnsafePathError",
    "NotARegularFileError",
    "SafetensorsHeaderError",
    "MissingDependencyError",
    "StateDictMismatchError",
    "MissingKeyError",
    "DerivedKeyError",
    "ShapeMismatchError",
    "DtypeMismatchError",
    "UnexpectedKeyError",
    "RngStateMismatchError",
    "OptimizerMismatchError",
    "GradScalerMismatchError",
    "FrozenBaseMismatchError",
    "InvalidStateDictError",
    "UnrepresentableKeyError",
    "SaveFailedError",
    "LoadFailedError",
    "DirectoryMismatchError",
    "TargetNotADirectoryError",
    "PartiallyLoadedError",
    "ToolError",
    "CheckpointEnvError",
    "ExtensionError",
    "ReservedKeyError",
    "LossyCheckpointError",
]


class CheckpointError(RuntimeError):
    """Base class of every error raised by the checkpoint engine."""


class CheckpointEnvError(CheckpointError, EnvSwitchError):
    """A checkpoint environment switch (``PADDLE_FSDP_CKPT_*``, the memory tier's) holds a value it does not
    accept (env_switches.py; also a ValueError)."""


class NotACheckpointError(CheckpointError):
    """The path does not exist or holds no checkpoint of this engine."""


class IncompleteCheckpointError(CheckpointError):
    """The directory looks like a checkpoint but was never committed (no commit record)."""


class CorruptCheckpointError(CheckpointError):
    """Data or metadata on disk is damaged: checksum mismatch, truncated or missing file."""


class MetadataError(CorruptCheckpointError):
    """metadata.json (or the commit record) cannot be parsed or is inconsistent."""


class NotARegularFileError(CorruptCheckpointError):
    """A file of the checkpoint is a FIFO, a device, a directory or a socket (never opened for reading)."""


class CheckpointRemovedError(NotACheckpointError):
    """The checkpoint was removed (e.g. by ``keep_last`` rotation) while it was being read."""


class SafetensorsHeaderError(CorruptCheckpointError):
    """A safetensors file's header is malformed, implausible or does not fit the file."""


class UnsafePathError(MetadataError):
    """A file name in the metadata would escape the checkpoint directory."""


class MissingDependencyError(CheckpointError, ImportError):
    """A feature needs an optional dependency that is not installed (``s3://`` URLs: the ``s3`` extra); the
    message says what to install."""


class ToolError(ValueError):
    """Bad input to a checkpoint tool or the one-process writer (one_process.py, staged_output.py): not a
    checkpoint, a bad rules file, a name collision, an unknown dtype, an output that exists...

    Not a CheckpointError (a tool's input, not the engine's state): the CLI reports both as one line. Defined here
    because the engine's one-process writer, which the tools and the memory tier's flush share, raises it; the
    tools import it from tools/errors.py."""


S3_EXTRA_HINT = 's3:// URLs need the s3 extra ({missing} is not installed): pip install "paddle-fsdp-fork[s3]"'


class StateDictMismatchError(CheckpointError):
    """The requested state dict does not match the checkpoint (base of the three below)."""


class MissingKeyError(StateDictMismatchError):
    """A requested key is absent from the checkpoint."""


class DerivedKeyError(MissingKeyError):
    """A requested key is a derived weight (format 4, format/derived.py) whose master weight is not in the
    checkpoint, so it cannot be derived."""


class ShapeMismatchError(StateDictMismatchError, ValueError):
    """A requested key has another global shape in the checkpoint."""


class DtypeMismatchError(StateDictMismatchError):
    """A requested key has another dtype in the checkpoint."""


class UnexpectedKeyError(StateDictMismatchError):
    """The checkpoint holds keys the model does not have (a checkpoint of another model)."""


class RngStateMismatchError(StateDictMismatchError):
    """The saved random state belongs to another device setup (another device type, or an old-style entry for
    another number of visible devices): refused before anything is written."""


class OptimizerMismatchError(StateDictMismatchError, ValueError):
    """The optimizer given to a load is of another class than the saved one, or none was saved."""


class GradScalerMismatchError(StateDictMismatchError, ValueError):
    """The loss scaler given to a load is enabled, but the checkpoint holds a disabled one's (empty) state."""


class FrozenBaseMismatchError(StateDictMismatchError, ValueError):
    """The checkpoint was saved without its frozen base (the default), and the model's frozen parameters are not
    the base it was trained on (another content fingerprint, another set of frozen parameters)."""


class InvalidStateDictError(CheckpointError, ValueError):
    """The state dict given to save/load is malformed (bad record, inconsistent ranks, ...)."""


class UnrepresentableKeyError(InvalidStateDictError):
    """A key the on-disk formats reserve (``__metadata__`` in a safetensors header) or cannot represent (not valid
    Unicode, longer than a reader accepts, two nested keys with one flat name): refused before anything is written."""


class SaveFailedError(CheckpointError):
    """A save did not commit (a rank failed, or the commit timed out)."""


class LoadFailedError(CheckpointError):
    """A load did not happen because a rank failed before anything was written, with an error that is not one of
    the engine's own (its state collection, a storage layer, a bug): the message names the rank and the cause,
    every rank raises it, the failing one with its original error chained."""


class DirectoryMismatchError(SaveFailedError):
    """The ranks of one save were given different checkpoint names (a node-local ``path`` is fine)."""


class TargetNotADirectoryError(SaveFailedError):
    """A save's target path is an existing file (or another non-directory): nothing is written over it."""


class PartiallyLoadedError(CheckpointError):
    """A load failed after it had begun writing the targets (e.g. a corrupt chunk found mid-read by a
    memory-bounded load): the tensors of the ranks that read data hold a mix of old and loaded bytes and must not
    be used. Raised on every rank. ``load_checkpoint(root)`` then falls back to the newest older checkpoint;
    ``atomic=True`` loads keep an undo copy instead (see load/load.py)."""


class ReservedKeyError(UnrepresentableKeyError):
    """A model, optimizer or EMA key starts with the reserved ``__fsdp__.`` prefix (a sublayer named ``__fsdp__``):
    the one-call API's own values live there (format/reserved.py); refused before anything is written."""


class ExtensionError(CheckpointError):
    """User code plugged into the engine (a storage layer, a backend factory, a trace hook) is not what it must
    be, or returned the wrong thing; the message names the extension (its qualified name)."""


def extension_name(extension: object) -> str:
    """``module.qualname`` of a function or class (the object's repr for anything else), for error messages."""
    name = getattr(extension, "__qualname__", None) or getattr(type(extension), "__qualname__", None)
    module = getattr(extension, "__module__", None) or getattr(type(extension), "__module__", "")
    return f"{module}.{name}" if name else repr(extension)


ERROR_CLASSES = {
    cls.__name__: cls
    for cls in (
        CheckpointError,
        ExtensionError,
        CheckpointEnvError,
        ReservedKeyError,
        NotACheckpointError,
        IncompleteCheckpointError,
        CorruptCheckpointError,
        MetadataError,
        SafetensorsHeaderError,
        UnsafePathError,
        NotARegularFileError,
        MissingDependencyError,
        CheckpointRemovedError,
        StateDictMismatchError,
        MissingKeyError,
        DerivedKeyError,
        ShapeMismatchError,
        DtypeMismatchError,
        UnexpectedKeyError,
        OptimizerMismatchError,
        GradScalerMismatchError,
        RngStateMismatchError,
        InvalidStateDictError,
        SaveFailedError,
        LoadFailedError,
        DirectoryMismatchError,
        TargetNotADirectoryError,
        PartiallyLoadedError,
    )
}


def _named_class(type_name: str) -> type:
    """The CheckpointError class called ``type_name``: the engine's own, or any subclass loaded in this process
    (the S3 backend's errors, ...), else CheckpointError."""
    cls = ERROR_CLASSES.get(type_name)
    todo = [CheckpointError]
    while cls is None and todo:
        for sub in todo.pop().__subclasses__():
            if sub.__name__ == type_name:
                return sub
            todo.append(sub)
    return cls or CheckpointError


def names_rank(message: str, rank: int) -> bool:
    """Whether ``message`` already says that ``rank`` failed (errors named where they happened)."""
    return f"rank {rank} failed" in message


def rebuild_remote_error(type_name: str, message: str, rank: int) -> CheckpointError:
    """Re-create, on a rank that did not fail itself, the error another rank reported (the same class), its
    message naming the failed rank (once: a message that names it already is kept as it is)."""
    named = message if names_rank(message, rank) else f"rank {rank} failed: {message}"
    try:
        return _named_class(type_name)(named)
    except TypeError:  # a class whose constructor takes other arguments
        return CheckpointError(f"rank {rank} failed: {type_name}: {message}")


#: at most this many ranks' causes are spelled out in an agreed error (the count of the others follows)
AGREED_RANKS_SHOWN = 4


def agreed_error(failed: list[tuple[int, str, str]]) -> CheckpointError | None:
    """One error, the same text on every rank, from every failed rank's ``(rank, class name, message)`` (in rank
    order): the lowest failed rank's class, each rank's cause. None unless every class is a CheckpointError's
    (anything else, e.g. a bug, stays the failing rank's own error)."""
    if not failed or any(_named_class(name).__name__ != name for _r, name, _m in failed):
        return None
    first = failed[0][1]
    parts = [f"rank {r} failed: {msg if name == first else f'{name}: {msg}'}" for r, name, msg in failed]
    text = "; ".join(parts[:AGREED_RANKS_SHOWN])
    if len(parts) > AGREED_RANKS_SHOWN:
        text += f" (and {len(parts) - AGREED_RANKS_SHOWN} more rank(s) failed)"
    try:
        return _named_class(first)(text)
    except TypeError:  # a class whose constructor takes other arguments
        return CheckpointError(f"{first}: {text}")


class LossyCheckpointError(StateDictMismatchError):
    """``load_checkpoint(..., exact=True)`` of a checkpoint whose optimizer moments are quantized (lossy.py): it
    cannot resume bit-exactly."""
