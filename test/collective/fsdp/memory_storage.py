"""An in-memory Storage: the reference implementation of the storage contract, for the interface tests.

Why: the contract tests (test_storage_contract.py) run against every backend; this one has no file system
behind it, so a test that passes here and on LocalStorage shows the engine relies on the interface only. It is
process-local (every rank has its own: like node-local disks). It lives with the tests: no production code
uses it (the host-memory tier with peer copies is its own backend).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from paddle.distributed.fsdp.checkpoint import checksums
from paddle.distributed.fsdp.checkpoint.errors import MetadataError
from paddle.distributed.fsdp.checkpoint.io.storage import DigestFn, Piece, Storage, StorageError

SCHEME = "mem://"


class _Bytes:
    """A read handle over an immutable bytes object."""

    def __init__(self, data: bytes):
        self._data = data
        self.size = len(data)

    def read_into(self, offset: int, buf) -> int:
        mv = memoryview(buf).cast("B")
        chunk = self._data[offset : offset + len(mv)]
        mv[: len(chunk)] = chunk
        return len(chunk)

    def close(self) -> None:
        self._data = b""


class MemoryStorage(Storage):
    """Locations ``mem://a/b`` held in a dict of dicts. ``publish`` swaps under a lock (atomic)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._locs: dict[str, dict[str, bytes]] = {}

    @staticmethod
    def _norm(location: str) -> str:
        if not isinstance(location, str) or not location.startswith(SCHEME):
            raise StorageError(f"memory location {location!r} must start with {SCHEME}")
        return location.rstrip("/")

    def child(self, parent: str, name: str) -> str:
        if not name or "/" in name:
            raise StorageError(f"location name {name!r} must be non-empty without '/'")
        return f"{self._norm(parent)}/{name}"

    def parent(self, location: str) -> str:
        return self._norm(location).rpartition("/")[0]

    def children(self, parent: str) -> list[str]:
        p = self._norm(parent) + "/"
        with self._lock:
            return sorted({k[len(p) :].split("/")[0] for k in self._locs if k.startswith(p)})

    def list(self, location: str) -> list[str]:
        with self._lock:
            return sorted(self._locs.get(self._norm(location), {}))

    def exists(self, location: str) -> bool:
        with self._lock:
            return self._norm(location) in self._locs

    def begin(self, final: str, checkpoint_id: str) -> str:
        staging = f"{self._norm(final)}.tmp-{checkpoint_id}"
        with self._lock:
            self._locs.setdefault(staging, {})
            self._locs.setdefault(self.parent(staging), {})
        return staging

    def write_object(
        self,
        location: str,
        name: str,
        header: bytes,
        pieces: Sequence[Piece],
        chunk_bytes: int,
        digest: DigestFn | None,
        *,
        should_stop: Callable[[], None] | None = None,
    ) -> tuple[int, list[list[int]]]:
        out, sums = [bytes(header)], []
        for arr in pieces:
            if should_stop is not None:
                should_stop()
            if callable(arr):
                arr, _owner = arr()
            mv = memoryview(arr).cast("B")
            sums.append(checksums.chunk_digests(mv, chunk_bytes, digest) if digest is not None else [])
            out.append(bytes(mv))
        data = b"".join(out)
        self.put(location, name, data)
        return len(data), sums

    def put(self, location: str, name: str, data: bytes, *, durable: bool = True) -> None:
        if not name or "/" in name:
            raise StorageError(f"object name {name!r} must be non-empty without '/'")
        with self._lock:
            self._locs.setdefault(self._norm(location), {})[name] = bytes(data)

    def delete(self, location: str, name: str) -> None:
        with self._lock:
            self._locs.get(self._norm(location), {}).pop(name, None)

    def publish(self, staging: str, final: str) -> None:
        staging, final = self._norm(staging), self._norm(final)
        with self._lock:
            objs = self._locs.pop(staging, None)
            if objs is None:
                raise FileNotFoundError(f"staging {staging} does not exist")
            self._locs[final] = objs

    def remove(self, location: str, wait: bool = False) -> None:
        loc = self._norm(location)
        with self._lock:
            for k in [k for k in self._locs if k == loc or k.startswith(loc + "/")]:
                del self._locs[k]

    def get(self, location: str, name: str, limit: int | None = None) -> bytes | None:
        with self._lock:
            data = self._locs.get(self._norm(location), {}).get(name)
        if data is not None and limit is not None and len(data) > limit:
            raise MetadataError(f"{location}/{name} has {len(data)} bytes, more than the limit of {limit} bytes")
        return data

    def open_read(self, location: str, name: str) -> _Bytes:
        with self._lock:
            data = self._locs.get(self._norm(location), {}).get(name)
        if data is None:
            raise FileNotFoundError(f"{location}/{name}")
        return _Bytes(data)
