"""``S3Storage``: the storage interface (io/storage.py) over S3, for ``s3://bucket/prefix`` locations.

Why this layout: S3 has no rename, so a checkpoint cannot be staged next to its final name and moved. A save's
objects are written once, under a *version* of the final location (``final/.v-<checkpoint id>/``); ``publish``
is one small object, ``final/.s3-published``, naming the version, written with a conditional put: If-None-Match:
* when ``final`` was never published, If-Match: <its ETag> when it replaces a checkpoint. Readers of ``final``
follow that pointer, so they see the old version or the new one, never a mix; a version without the pointer (a
save that failed or whose writer was killed) is never read, listed as a child, or counted. Two jobs publishing
the same step at once: one pointer write wins, the other raises S3CommitConflictError (a SaveFailedError).
The replaced version is deleted only after the new pointer exists; ``remove`` deletes the pointer first.

``backend_for("s3://...")`` (io/backends.py, which maps ``s3://`` here) uses a shared ``S3Storage(S3Options())``
configured by the AWS environment (``default_storage``); pass ``S3Storage(options)`` to choose the options.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence

from .. import checksums
from ..errors import MetadataError
from ..io.storage import DigestFn, Piece, Storage, StorageError
from .errors import S3CommitConflictError
from .objects import S3Objects
from .stream import StreamUpload
from .url import S3Options, S3Url

LOG = logging.getLogger(__name__)
VERSION = ".v-"  # a save's objects live under final/.v-<checkpoint id>/
POINTER = ".s3-published"  # in final: the name of the published version
BEGUN = ".s3-begun"  # in a version: written by begin(), so that an empty staging exists
HIDDEN = ".s3-"  # object names of this backend, never listed
STOP_EVERY = 64 << 20  # should_stop() is called at least every this many bytes of a write
READ_MIN = 8 << 20  # a large read is split into parallel GETs of at least this many bytes


class _Handle:
    """Ranged reads of one object: ``read_into`` splits a read into up to ``concurrency`` parallel GETs (each at
    least READ_MIN, at most part_size bytes) straight into the caller's buffer."""

    def __init__(self, objects: S3Objects, key: str, size: int) -> None:
        self.o, self.key, self.size = objects, key, size

    def read_into(self, offset: int, buf) -> int:
        mv = memoryview(buf).cast("B")
        n = max(0, min(len(mv), self.size - offset))
        if n:
            step = min(self.o.opts.part_size, max(READ_MIN, -(-n // self.o.opts.concurrency)))
            starts = range(0, n, step)
            self.o.read_ranges(
                self.key,
                [(offset + a, offset + min(n, a + step)) for a in starts],
                [mv[a : min(n, a + step)] for a in starts],
            )
        return n

    def close(self) -> None:
        self.o = None


class S3Storage(Storage):
    """Checkpoint locations ``s3://bucket/prefix`` (see the module docstring). Thread-safe."""

    # saves compress their chunks by default (CheckpointOptions.codec "auto"): a PUT is slower than the encoder
    compress_by_default = True

    def __init__(self, options: S3Options | None = None, who: str = "") -> None:
        self.opts = options if options is not None else S3Options()
        if not isinstance(self.opts, S3Options):
            raise StorageError(f"S3Storage options must be S3Options, got {type(options).__name__}")
        self.who = who
        self._lock = threading.Lock()
        self._buckets: dict[str, S3Objects] = {}

    # ------------------------------------------------------------------------------------------ helpers
    def _split(self, location: str) -> tuple[S3Objects, str]:
        """(the bucket's object layer, key prefix) of a location; the bucket is checked once per process."""
        url = S3Url.parse(location)
        with self._lock:
            objs = self._buckets.get(url.bucket)
            if objs is None:
                objs = S3Objects(S3Url(url.bucket), self.opts, who=self.who)
                objs.check_bucket()  # wrong endpoint, missing bucket, denied credentials: named, before any write
                self._buckets[url.bucket] = objs
        return objs, url.prefix

    @staticmethod
    def _join(prefix: str, name: str) -> str:
        return f"{prefix}/{name}" if prefix else name

    def _pointer(self, objs: S3Objects, prefix: str) -> tuple[str, str] | None:
        """(published version name, pointer ETag) of a location, None if it was never published."""
        got = objs.get_small(self._join(prefix, POINTER))
        return None if got is None else (got[0].decode(), got[1])

    def _resolve(self, location: str) -> tuple[S3Objects, str]:
        """Where the objects of ``location`` are: its published version, else the location itself."""
        objs, prefix = self._split(location)
        ptr = self._pointer(objs, prefix) if not prefix.rpartition("/")[2].startswith(VERSION) else None
        return objs, self._join(prefix, ptr[0]) if ptr else prefix

    @staticmethod
    def _check_name(name: str) -> None:
        if not isinstance(name, str) or not name or "/" in name or name.startswith(HIDDEN) or name in (".", ".."):
            raise StorageError(f"object name {name!r} must be non-empty, without '/', not starting with {HIDDEN!r}")

    # ------------------------------------------------------------------------------------------ names
    def child(self, parent: str, name: str) -> str:
        if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
            raise StorageError(f"location name {name!r} must be non-empty without '/'")
        return str(S3Url.parse(parent).child(name))

    def parent(self, location: str) -> str:
        url = S3Url.parse(location)
        return str(S3Url(url.bucket, url.prefix.rpartition("/")[0]))

    def children(self, parent: str) -> list[str]:
        objs, prefix = self._split(parent)
        _, dirs = objs.list_level(prefix)
        return sorted(d for d in dirs if not d.startswith(VERSION))

    def list(self, location: str) -> list[str]:
        objs, prefix = self._resolve(location)
        found, _ = objs.list_level(prefix)  # ("" is a file-system-backed store's directory entry, no object)
        return sorted(o.name for o in found if o.name and not o.name.startswith(HIDDEN))

    def stagings(self, final: str) -> list[str]:
        """The versions under ``final`` that are not the published one (failed, killed or running saves)."""
        objs, prefix = self._split(final)
        _, dirs = objs.list_level(prefix)
        ptr = self._pointer(objs, prefix)
        return [self.child(final, d) for d in dirs if d.startswith(VERSION) and (ptr is None or d != ptr[0])]

    def exists(self, location: str) -> bool:
        objs, prefix = self._split(location)
        head, _, last = prefix.rpartition("/")
        if last.startswith(VERSION):  # a staging: exists until it is published (then it is final's content)
            ptr = self._pointer(objs, head)
            return (ptr is None or ptr[0] != last) and objs.size(self._join(prefix, BEGUN)) is not None
        found, dirs = objs.list_level(prefix)
        return bool(found) or any(not d.startswith(VERSION) for d in dirs)

    # ------------------------------------------------------------------------------------------ writes
    def begin(self, final: str, checkpoint_id: str) -> str:
        if not isinstance(checkpoint_id, str) or not checkpoint_id or "/" in checkpoint_id:
            raise StorageError(f"checkpoint id {checkpoint_id!r} must be non-empty without '/'")
        staging = self.child(final, VERSION + checkpoint_id)
        objs, prefix = self._split(staging)
        objs.put(self._join(prefix, BEGUN), b"")  # idempotent: every rank may write it
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
        self._check_name(name)
        objs, prefix = self._resolve(location)
        sums: list[list[int]] = []
        with StreamUpload(objs, self._join(prefix, name)) as up:
            if header:
                up.write(memoryview(header))
            for piece in pieces:
                owner = None
                if callable(piece):
                    piece, owner = piece()
                mv = memoryview(piece).cast("B")
                sums.append(checksums.chunk_digests(mv, chunk_bytes, digest) if digest is not None else [])
                for off in range(0, max(len(mv), 1), STOP_EVERY):
                    if should_stop is not None:
                        should_stop()
                    up.write(mv[off : off + STOP_EVERY], keep=owner)
            size = up.finish().size
        return size, sums

    def put(self, location: str, name: str, data: bytes, *, durable: bool = True) -> None:
        self._check_name(name)
        objs, prefix = self._resolve(location)
        objs.put(self._join(prefix, name), data)  # a PUT is atomic and durable when it returns

    def put_all(self, location: str, objects: Mapping[str, bytes]) -> None:
        """The PUTs at once (up to ``concurrency`` in flight): the commit's metadata objects cost one round trip."""
        for name in objects:
            self._check_name(name)
        objs, prefix = self._resolve(location)
        futures = [objs._pool.submit(objs.put, self._join(prefix, n), d) for n, d in objects.items()]
        cf.wait(futures)  # every PUT ended (none left running behind a failure), then the first failure is raised
        for fut in futures:
            fut.result()

    def delete(self, location: str, name: str) -> None:
        self._check_name(name)
        objs, prefix = self._resolve(location)
        objs.delete([self._join(prefix, name)])

    def publish(self, staging: str, final: str) -> None:
        objs, fprefix = self._split(final)
        sobjs, sprefix = self._split(staging)
        head, _, version = sprefix.rpartition("/")
        if sobjs is not objs or head != fprefix or not version.startswith(VERSION):
            raise StorageError(f"{staging} is not a staging of {final} (made by begin({final!r}, ...))")
        begun = objs._pool.submit(objs.size, self._join(sprefix, BEGUN))  # both requests at once
        current = self._pointer(objs, fprefix)
        if begun.result() is None and (current is None or current[0] != version):
            raise FileNotFoundError(f"staging {staging} does not exist")
        if current is not None and current[0] == version:
            return  # already published (another rank, or a retry)
        key = self._join(fprefix, POINTER)
        try:
            if current is None:
                objs.put(key, version.encode(), if_absent=True)
            else:
                objs.put(key, version.encode(), if_match=current[1])
        except S3CommitConflictError as exc:
            raise S3CommitConflictError(
                f"{self.who + ': ' if self.who else ''}publish {staging} as {final}: another save published {final} "
                f"at the same time; this one is not visible ({exc})"
            ) from exc
        if current is not None:  # the replaced version goes only now that the new pointer exists
            self._remove_prefix(objs, self._join(fprefix, current[0]))

    def remove(self, location: str, wait: bool = False) -> None:
        objs, prefix = self._split(location)
        head, _, last = prefix.rpartition("/")
        if last.startswith(VERSION) and (self._pointer(objs, head) or ("",))[0] == last:
            return  # a published staging is gone (it is final's content): as for a renamed local staging
        if not last.startswith(VERSION) and not objs.list(prefix) and not objs.pending_uploads(prefix + "/"):
            return  # nothing stored there (e.g. a save's failure records, usually absent): two requests, not five
        objs.delete([self._join(prefix, POINTER)])  # first: the checkpoint stops being visible at once
        self._remove_prefix(objs, prefix)
        if last.startswith(VERSION):  # an abandoned staging: its never-published final goes too when left empty
            found, dirs = objs.list_level(head)
            if not any(o.name for o in found) and not dirs:
                objs.delete([head + "/"])

    def _remove_prefix(self, objs: S3Objects, prefix: str) -> None:
        objs.abort_pending(prefix + "/")  # uploads of a writer killed mid-save: no orphan parts left billing
        names = [o.name for o in objs.list(prefix)]
        objs.delete(names)
        # stores backed by a file system (SeaweedFS's filer) keep emptied "directories" and list them as common
        # prefixes; deleting "dir/" removes them (on AWS it deletes nothing and succeeds). Deepest first.
        dirs = {prefix + "/"} | {n[: i + 1] for n in names for i in range(len(prefix) + 1, len(n)) if n[i] == "/"}
        for depth in sorted({d.count("/") for d in dirs}, reverse=True):
            objs.delete(sorted(d for d in dirs if d.count("/") == depth))

    # ------------------------------------------------------------------------------------------ reads
    def get(self, location: str, name: str, limit: int | None = None) -> bytes | None:
        self._check_name(name)
        objs, prefix = self._resolve(location)
        key = self._join(prefix, name)
        size = objs.size(key)
        if size is None:
            return None
        if limit is not None and size > limit:
            raise MetadataError(f"{location}/{name} has {size} bytes, more than the limit of {limit} bytes")
        return objs.read(key)

    def open_read(self, location: str, name: str) -> _Handle:
        self._check_name(name)
        objs, prefix = self._resolve(location)
        key = self._join(prefix, name)
        size = objs.size(key)
        if size is None:
            raise FileNotFoundError(f"{location}/{name}")
        return _Handle(objs, key, size)


_default: S3Storage | None = None
_default_lock = threading.Lock()


def default_storage() -> S3Storage:
    """The process's shared S3Storage with options from the AWS environment (the ``s3://`` factory); its errors
    name the rank (``PADDLE_TRAINER_ID``, set by paddle's launcher)."""
    global _default
    with _default_lock:
        if _default is None:
            rank = os.environ.get("PADDLE_TRAINER_ID")
            _default = S3Storage(who=f"rank {rank}" if rank else "")
        return _default
