"""Bytes between memory and storage. ``storage.py`` is the interface every save, load, commit, publish, rotation
and verify goes through; ``local.py`` the POSIX backend (O_DIRECT writes, streamed and page-cache reads);
``memory.py`` an in-memory reference backend for contract tests; ``backends.py`` which backend serves a
location (URL schemes, above the interface and the backends). This package knows no protocol: it never
imports save, load, commit, markers, manager, verify or stock/."""

from .backends import backend_for, register_backend
from .storage import ReadHandle, Storage, StorageError

__all__ = ["ReadHandle", "Storage", "StorageError", "backend_for", "register_backend"]
