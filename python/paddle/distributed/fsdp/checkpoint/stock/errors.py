"""Errors of the stock-compatibility layer (all derive from the engine's CheckpointError family)."""

from __future__ import annotations

from ..errors import (
    ERROR_CLASSES,
    CorruptCheckpointError,
    DirectoryMismatchError,  # noqa: F401 - re-exported (stock/__init__)
    InvalidStateDictError,
    MissingKeyError,
    NotACheckpointError,
)

# Where stock paddle raises a builtin type for an input, ours also derives from that type, so code written
# against stock (``except KeyError``, ``except AssertionError``, ``except FileNotFoundError``) keeps working.


class UnsafePickleError(CorruptCheckpointError):
    """A stock ``*.metadata`` / ``.distcp`` pickle names a global outside the small set stock paddle writes.

    Loading such a file with ``pickle`` (as stock's ``paddle.load`` does) could run arbitrary code; we refuse it.
    """


class StockVersionNotFoundError(NotACheckpointError, AssertionError):
    """The requested ``unique_id`` has no ``<id>.metadata`` (or no data files) in the directory (stock asserts)."""


class StockMissingKeyError(MissingKeyError, KeyError):
    """Keys of the state dict are not in a stock-format checkpoint (stock raises KeyError; nothing is loaded)."""

    __str__ = RuntimeError.__str__  # not KeyError's quoted repr


class StockIncompleteCheckpointError(CorruptCheckpointError, AssertionError):
    """A stock checkpoint's metadata names data files or tensors that are not there (stock asserts)."""


class CheckpointPathNotFoundError(NotACheckpointError, FileNotFoundError):
    """The checkpoint directory does not exist (stock: FileNotFoundError from ``os.listdir``)."""


class CheckpointPathNotADirectoryError(NotACheckpointError, NotADirectoryError):
    """The checkpoint path is a file (stock: NotADirectoryError from ``os.listdir``)."""


class NoCheckpointMetadataError(NotACheckpointError, AssertionError):
    """The directory holds no checkpoint metadata (stock asserts that a ``<id>.metadata`` file exists)."""


class InvalidArgumentError(ValueError, AssertionError):
    """An argument stock validates with ``assert`` (e.g. ``comm_method``)."""


class StockFormatError(InvalidStateDictError):
    """The arguments ask for a file format that cannot hold this state dict (the message says what to pass)."""


# errors raised on one rank are rebuilt by name on the others (coordination.gather_errors)
ERROR_CLASSES.update(
    {
        cls.__name__: cls
        for cls in (
            UnsafePickleError,
            StockVersionNotFoundError,
            StockFormatError,
            StockMissingKeyError,
            StockIncompleteCheckpointError,
            CheckpointPathNotFoundError,
            CheckpointPathNotADirectoryError,
            InvalidArgumentError,
            NoCheckpointMetadataError,
        )
    }
)
