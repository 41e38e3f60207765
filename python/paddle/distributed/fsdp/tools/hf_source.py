"""Where ``from-hf`` reads Hugging Face safetensors: a local directory or file, or a URL of a storage backend.

Why: a model's weights often sit in an object store (``s3://bucket/models/Qwen3-8B``). Read through the storage
interface, a safetensors header costs two ranged reads (its length, then its JSON: ``format/safetensors.
parse_header``) and every tensor is read by range straight into its buffer when it is converted, so nothing is
downloaded whole or twice. Local inputs keep their descriptors (``pread`` through the engine's read loop, and a
FIFO or device in a file's place is refused before it can block).

``HfDir`` is one input directory (local or remote); ``open_reader(path)`` opens one of its files for ranged reads
(``path`` as ``SafetensorsFile.path`` names it: a local path or a URL).
"""

from __future__ import annotations

import os

import numpy as np

from ..checkpoint.errors import CheckpointError, SafetensorsHeaderError
from ..checkpoint.format import safetensors
from ..checkpoint.format.safetensors import SafetensorsFile
from ..checkpoint.format.strict_json import open_regular, read_capped
from ..checkpoint.io.backends import backend_for
from ..checkpoint.io.storage import Storage
from ..checkpoint.paths import local_path, url_scheme
from . import ckpt_io
from .errors import ToolError


def _header_error(e: SafetensorsHeaderError) -> ToolError:
    return ToolError(str(e))


class HfDir:
    """One input directory: its file names, small files read whole, safetensors headers. ``root`` is an absolute
    local directory or a storage URL."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.remote = url_scheme(root) is not None
        self.storage: Storage | None = backend_for(root) if self.remote else None
        self._names: list[str] | None = None

    def where(self, name: str) -> str:
        """The path (or URL) of ``name`` in this directory, as messages and ``open_reader`` take it."""
        return self.storage.child(self.root, name) if self.remote else os.path.join(self.root, name)

    def exists(self) -> bool:
        return bool(self.names()) if self.remote else os.path.isdir(self.root)

    def names(self) -> list[str]:
        """Names of the entries (objects) directly in the directory, sorted."""
        if self._names is None:
            if self.remote:
                self._names = sorted(self.storage.list(self.root))
            else:  # every entry: a directory or FIFO named like an input is refused when read, never skipped
                self._names = sorted(os.listdir(self.root))
        return self._names

    def has(self, name: str) -> bool:
        return name in self.names() if self.remote else os.path.isfile(os.path.join(self.root, name))

    def read_small(self, name: str, limit: int, what: str) -> bytes:
        """A small file whole, at most ``limit`` bytes; ToolError naming ``what`` when missing, larger or
        unreadable."""
        path = self.where(name)
        try:
            if not self.remote:  # bounded, and only a regular file (a FIFO never blocks)
                return read_capped(path, limit, what)
            data = self.storage.get(self.root, name, limit)
        except OSError as e:
            raise ToolError(f"cannot read {what} {path}: {e.strerror or e}") from None
        except CheckpointError as e:
            raise ToolError(f"cannot read {what} {path}: {e}") from None
        if data is None:
            raise ToolError(f"cannot read {what} {path}: no such object")
        return data

    def header(self, name: str) -> SafetensorsFile:
        """The parsed and checked header of a safetensors file (its tensors are not read)."""
        path = self.where(name)
        try:
            if not self.remote:
                return safetensors.read_header(path)
            handle = self.storage.open_read(self.root, name)
        except SafetensorsHeaderError as e:
            raise _header_error(e) from None
        except FileNotFoundError:
            raise ToolError(f"{path}: no such object") from None
        try:
            return safetensors.parse_header(handle.size, lambda offset, n: _read_at(handle, offset, n), path)
        except SafetensorsHeaderError as e:
            raise _header_error(e) from None
        finally:
            handle.close()


def _read_at(handle, offset: int, n: int) -> bytes:
    buf = bytearray(n)
    got = handle.read_into(offset, buf)
    return bytes(buf[:got])


def read_small_file(path: str | os.PathLike, limit: int, what: str) -> bytes:
    """A small input file whole (a local path or a URL, e.g. ``config.json``); ToolError when it cannot be."""
    path = local_path(path)
    if url_scheme(path) is None:
        return HfDir(os.path.dirname(path)).read_small(os.path.basename(path), limit, what)
    storage = backend_for(path)
    return HfDir(storage.parent(path)).read_small(path.rpartition("/")[2], limit, what)


def split_input(hf_path: str | os.PathLike) -> tuple[HfDir, str | None]:
    """(the input's directory, the file's name when ``hf_path`` names one file, else None)."""
    path = local_path(hf_path)  # an absolute local path, or a URL of a served scheme (else UnsupportedURLError)
    if url_scheme(path) is None:
        if os.path.isfile(path):
            return HfDir(os.path.dirname(path)), os.path.basename(path)
        return HfDir(path), None
    storage = backend_for(path)
    parent, name = storage.parent(path), path.rpartition("/")[2]
    if parent != path and name in storage.list(parent):  # an object, not a "directory" of objects
        return HfDir(parent), name
    return HfDir(path), None


class _LocalReader:
    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = open_regular(path)  # never blocks on a FIFO swapped in since the header was read

    def read_exact(self, buf: np.ndarray, offset: int) -> None:
        ckpt_io.pread_exact(self.fd, buf, offset, self.path)

    def close(self) -> None:
        os.close(self.fd)


class _RemoteReader:
    def __init__(self, url: str) -> None:
        self.path = url
        storage = backend_for(url)
        try:
            self.handle = storage.open_read(storage.parent(url), url.rpartition("/")[2])
        except FileNotFoundError:
            raise ToolError(f"{url}: no such object (removed since its header was read?)") from None

    def read_exact(self, buf: np.ndarray, offset: int) -> None:
        want = memoryview(buf).nbytes
        got = self.handle.read_into(offset, memoryview(buf).cast("B"))
        if got < want:
            raise ToolError(f"{self.path} ends at byte {offset + got}, expected at least {offset + want} (truncated)")

    def close(self) -> None:
        self.handle.close()


def open_reader(path: str) -> _LocalReader | _RemoteReader:
    """Ranged reads (``read_exact(buf, offset)``, ``close()``) of one input file, a local path or a URL."""
    return _RemoteReader(path) if url_scheme(path) is not None else _LocalReader(path)
