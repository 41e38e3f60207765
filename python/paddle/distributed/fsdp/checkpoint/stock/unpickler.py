"""Restricted unpickling of stock paddle's checkpoint files: ``<id>.metadata`` and ``<rank>_<id>.distcp``.

Stock ``paddle.load`` unpickles both with the full ``pickle`` machinery, so a crafted file runs code. Stock writes
only a handful of globals into them: its three metadata dataclasses, and numpy's array reconstruction for tensor
data. :class:`RestrictedUnpickler` resolves exactly those and refuses every other global (and persistent ids) with
:class:`UnsafePickleError` before anything is called. Instantiating the admitted classes runs no user code
(``cls.__new__`` plus a ``__dict__`` update; numpy's reconstruction copies bytes).
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
import pickletools
from typing import Any

import numpy as np

from ..errors import CorruptCheckpointError, MetadataError
from ..format.strict_json import open_regular
from .errors import UnsafePickleError

#: Modules under which stock paddle pickles its metadata dataclasses (3.x; the 2.x/3.0 module name).
METADATA_MODULES = ("paddle.distributed.flex_checkpoint.dcp.metadata", "paddle.distributed.checkpoint.metadata")
METADATA_CLASSES = ("Metadata", "LocalTensorMetadata", "LocalTensorIndex")
#: numpy globals used by ``ndarray.__reduce__`` (numpy 1.x and 2.x module names).
ARRAY_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
}
#: Bound on a metadata pickle; a real one is a few KiB per thousand tensors.
MAX_METADATA_BYTES = 1 << 30


def _metadata_class(name: str):
    from paddle.distributed.flex_checkpoint.dcp import metadata as stock_metadata

    return getattr(stock_metadata, name)


class RestrictedUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only the globals in ``allowed`` (pairs of module, name)."""

    def __init__(self, file, allowed: set[tuple[str, str]], where: str):
        super().__init__(file)
        self._allowed = allowed
        self._where = where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._allowed:
            raise UnsafePickleError(
                f"{self._where}: refusing to unpickle global {module}.{name}; a stock paddle checkpoint holds only "
                f"{sorted(f'{m}.{n}' for m, n in self._allowed)} (the file was not written by paddle, or was "
                f"tampered with)"
            )
        if module in METADATA_MODULES:
            return _metadata_class(name)
        if name == "_reconstruct":
            for candidate in ("numpy._core.multiarray", "numpy.core.multiarray"):
                try:
                    return importlib.import_module(candidate)._reconstruct
                except (ImportError, AttributeError):
                    continue
        return getattr(np, name)

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(f"{self._where}: refusing a pickle persistent id ({type(pid).__name__})")


class _ViewReader:
    """A file over ``data`` whose large reads are zero-copy views, for :func:`check_declared_lengths`."""

    def __init__(self, data: bytes):
        self._view, self._pos = memoryview(data), 0

    def read(self, n: int = -1):
        end = len(self._view) if n < 0 else min(self._pos + n, len(self._view))
        out = self._view[self._pos : end]
        self._pos = end
        return out if len(out) > 64 else bytes(out)

    def readline(self) -> bytes:
        rest = self._view[self._pos :]
        i = bytes(rest[: 1 << 16]).find(b"\n")  # pickle text lines are short; a longer one is cut and fails to parse
        line = bytes(rest[: i + 1]) if i >= 0 else bytes(rest[: 1 << 16])
        self._pos += len(line)
        return line

    def tell(self) -> int:
        return self._pos


def check_declared_lengths(data: bytes, where: str) -> None:
    """Walk the pickle's opcodes without building anything: every length an opcode declares (bytes, bytearray,
    strings, frames) must fit in the data, so the unpickler never allocates by a declared size."""
    try:
        for _ in pickletools.genops(_ViewReader(data)):
            pass
    except Exception as e:  # noqa: BLE001 - truncated / garbage pickles raise many types
        raise CorruptCheckpointError(f"{where}: not a readable stock paddle pickle ({type(e).__name__}: {e})") from None


def _restricted_load(data: bytes, allowed: set[tuple[str, str]], where: str) -> Any:
    check_declared_lengths(data, where)
    try:
        return RestrictedUnpickler(io.BytesIO(data), allowed, where).load()
    except UnsafePickleError:
        raise
    except Exception as e:  # truncated / garbage pickles: any of a dozen exception types
        raise CorruptCheckpointError(f"{where}: not a readable stock paddle pickle ({type(e).__name__}: {e})") from None


def _read_bounded(path: str, limit: int | None) -> bytes:
    with os.fdopen(open_regular(path), "rb") as f:  # never blocks on a FIFO, never reads a device
        size = os.fstat(f.fileno()).st_size
        if limit is not None and size > limit:
            raise MetadataError(f"{path}: {size} bytes is too large for a stock metadata file (limit {limit})")
        return f.read()


def load_stock_metadata(path: str) -> Any:
    """Unpickle a stock ``*.metadata`` file, admitting only stock's metadata dataclasses."""
    allowed = {(m, c) for m in METADATA_MODULES for c in METADATA_CLASSES}
    md = _restricted_load(_read_bounded(path, MAX_METADATA_BYTES), allowed, path)
    if type(md) is not _metadata_class("Metadata"):
        raise MetadataError(f"{path}: holds a {type(md).__name__}, not stock paddle's Metadata")
    return md


#: Key stock adds to every ``.distcp`` file: structured name -> parameter name (not a tensor).
NAME_TABLE_KEY = "StructuredToParameterName@@"


def load_distcp(path: str) -> dict[str, np.ndarray]:
    """Unpickle a stock ``.distcp`` data file (``paddle.save`` of a dict of tensors) into numpy arrays by key."""
    obj = _restricted_load(_read_bounded(path, None), set(ARRAY_GLOBALS), path)
    if not isinstance(obj, dict):
        raise CorruptCheckpointError(f"{path}: a stock data file holds a dict, found {type(obj).__name__}")
    out: dict[str, np.ndarray] = {}
    for key, val in obj.items():
        if key == NAME_TABLE_KEY:
            continue
        if isinstance(val, tuple) and len(val) == 2 and isinstance(val[0], str):  # (name, array) of a named tensor
            val = val[1]
        if not isinstance(key, str) or not isinstance(val, np.ndarray) or val.dtype.kind not in "biufc":
            raise CorruptCheckpointError(f"{path}: entry {key!r} is not a numeric array ({type(val).__name__})")
        out[key] = val
    return out
