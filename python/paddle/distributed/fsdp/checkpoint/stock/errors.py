"""Errors of the stock-compatibility layer (all derive from the engine's CheckpointError family)."""

from __future__ import annotations

from ..errors import (
    ERROR_CLASSES,
    CorruptCheckpointError,
    InvalidStateDictError,
    NotACheckpointError,
    SaveFailedError,
)


class UnsafePickleError(CorruptCheckpointError):
    """A stock ``*.metadata`` / ``.distcp`` pickle names a global outside the small set stock paddle writes.

    Loading such a file with ``pickle`` (as stock's ``paddle.load`` does) could run arbitrary code; we refuse it.
    """


class StockVersionNotFoundError(NotACheckpointError):
    """The requested ``unique_id`` has no ``<id>.metadata`` (or no data files) in the directory."""


class StockFormatError(InvalidStateDictError):
    """The arguments ask for a file format that cannot hold this state dict (the message says what to pass)."""


class DirectoryMismatchError(SaveFailedError):
    """The ranks of one save do not see one shared directory (different paths or node-local disks)."""


# errors raised on one rank are rebuilt by name on the others (coordination.gather_errors)
ERROR_CLASSES.update(
    {
        cls.__name__: cls
        for cls in (UnsafePickleError, StockVersionNotFoundError, StockFormatError, DirectoryMismatchError)
    }
)
