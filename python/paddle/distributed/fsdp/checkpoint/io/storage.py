"""The storage interface: every byte and every name of a checkpoint goes through one ``Storage``.

Why: the save/load protocol (plan, write, commit, publish, rotate, read) must not care whether the bytes land on
a shared POSIX file system, a node-local disk, host memory or an object store. The engine speaks only to this
interface; a new backend is one module that implements it (and, optionally, registers a URL scheme with
``io.backends.register_backend``), with no change anywhere else. Anchors: PyTorch DCP ``storage.py`` (StorageWriter /
StorageReader), Orbax ``_src/path/atomicity.py`` (temporary location + finalize).

Vocabulary. A *location* is a string the backend understands (a directory for ``LocalStorage``, ``s3://b/p``
for an object store); a checkpoint is one location. Inside a location there are *objects* with flat names (no
``/``). Locations may have child locations (``child(parent, name)``): a CheckpointManager root holds one
location per step. Nothing here assumes directories, renames of single objects or file descriptors.

Call order of a save of a checkpoint to ``final`` (save/save.py, save/commit.py)::

    staging = storage.begin(final, checkpoint_id)      # every rank, same string; the staging is invisible at final
    size, sums = storage.write_object(staging, name, header, pieces, ...)   # each rank: its data object, durable
    # -- the commit decision travels through the process group / TCP store, never through storage --
    storage.put_all(staging, {"metadata.json": data, ...})   # coordinator: index, metadata, stock "0.metadata"
    storage.put(staging, "COMMIT", record)              # coordinator, LAST: the commit record
    storage.publish(staging, final)                     # coordinator: atomic; readers see old or new, never a mix
    storage.publish(staging, final)                     # other ranks, only where they did not see the
                                                        # coordinator's staging (node-local disks): their objects
    storage.put(root, "latest", name)                   # CheckpointManager: move the pointer (durable, atomic)
    storage.remove(old_location)                        # rotation; also abandon(staging) after a failed save

Call order of a load / verify (load/load.py, verify.py, directory.py)::

    storage.get(loc, "COMMIT"); storage.get(loc, "metadata.json", limit)   # small objects, whole
    h = storage.open_read(loc, name); h.read_into(offset, buf) ...; h.close()   # ranges of data objects
    storage.list(loc); storage.children(root)          # names, for diagnosis, rotation and cleanup

Guarantees a backend gives: ``write_object`` and ``put`` are durable when they return; ``put`` is atomic (a
reader sees the old object, the new one, or none, never a part) and creates its location; ``publish`` and
``remove`` are atomic per location; objects of a staging location are invisible at ``final`` before
``publish``. Node-local storage: every rank calls ``begin`` and ``write_object`` on its own backend; a rank whose
``final`` shows no commit record of this checkpoint after the coordinator's publish publishes its own staging
(save/commit.py), so ``publish`` must work per rank too. ``get`` of a missing object returns None;
``open_read`` of a missing object raises FileNotFoundError.

Fast paths: a ``ReadHandle`` may expose ``fileno()`` (an OS file descriptor) and ``path``; the engine's readers
then use preadv / O_DIRECT / page-cache residency on it (io/local.py). Backends without them are read with
``read_into``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, runtime_checkable

from ..errors import CheckpointError

# A piece of a data object: a uint8 array (anything with the buffer protocol), or a callable returning
# ``(array, owner of its memory)`` that is called just before the piece is written (one device copy at a time).
Piece = object
DigestFn = Callable  # checksums.DigestFn: bytes-like -> int


class StorageError(CheckpointError):
    """A location or object name a backend cannot use (bad name, unknown scheme)."""


@runtime_checkable
class ReadHandle(Protocol):
    """Ranged reads of one object. ``size`` is its length in bytes."""

    size: int

    def read_into(self, offset: int, buf) -> int:
        """Read ``len(buf)`` bytes at ``offset`` into ``buf``; returns the count (fewer only at the end)."""

    def close(self) -> None: ...


class Storage(ABC):
    """Where checkpoint bytes live. Methods are called in the order of the module docstring; every method may
    be called from the background save thread; implementations are thread-safe for distinct objects."""

    #: whether ``CheckpointOptions(codec="auto")`` compresses a process's first save to a storage root, before
    #: its saves have measured the storage (codec_choice.py): True where storing a byte usually costs more than
    #: encoding it (object stores), False where the encoder would usually slow the save (a local disk)
    compress_by_default: bool = False

    # ------------------------------------------------------------------------------------------ names
    @abstractmethod
    def child(self, parent: str, name: str) -> str:
        """The location ``name`` under ``parent`` (a step under a manager root)."""

    @abstractmethod
    def parent(self, location: str) -> str:
        """The location that holds ``location`` (where its staging and ``latest`` live)."""

    @abstractmethod
    def children(self, parent: str) -> list[str]:
        """Names of the locations directly under ``parent`` (committed or not); [] when it does not exist."""

    @abstractmethod
    def list(self, location: str) -> list[str]:
        """Names of the objects in ``location``; [] when it does not exist."""

    @abstractmethod
    def exists(self, location: str) -> bool:
        """True when ``location`` exists (it may be empty)."""

    # ------------------------------------------------------------------------------------------ writes
    @abstractmethod
    def begin(self, final: str, checkpoint_id: str) -> str:
        """Create (idempotently: every rank calls it) the staging location of a save to ``final``."""

    @abstractmethod
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
        """Write ``header`` then every piece as one new object, durably. Returns (size, per-piece checksums of
        every ``chunk_bytes`` chunk with ``digest``; [] per piece when None). ``should_stop()`` is called at
        at least every 64 MiB and raises to give up."""

    @abstractmethod
    def put(self, location: str, name: str, data: bytes, *, durable: bool = True) -> None:
        """Write a small object atomically (and durably unless ``durable=False``); creates ``location``."""

    def put_all(self, location: str, objects: Mapping[str, bytes]) -> None:
        """``put`` every ``name: data`` of ``objects`` (durable, each atomic; no order among them). Default: one
        after the other; a backend where each put is a round trip (S3) sends them at once."""
        for name, data in objects.items():
            self.put(location, name, data)

    @abstractmethod
    def delete(self, location: str, name: str) -> None:
        """Remove one object (missing: no error)."""

    @abstractmethod
    def publish(self, staging: str, final: str) -> None:
        """Atomically make ``staging``'s objects the content of ``final`` (replacing a previous ``final``); the
        staging location is gone afterwards. The replaced content is removed, possibly in the background."""

    @abstractmethod
    def remove(self, location: str, wait: bool = False) -> None:
        """Remove a whole location (rotation, an abandoned staging), atomically as readers see it: it stops
        existing whole (never half deleted under its own name); the bytes may go in the background unless
        ``wait`` (a failed save frees its space before it reports). Missing: no error."""

    # ------------------------------------------------------------------------------------------ reads
    @abstractmethod
    def get(self, location: str, name: str, limit: int | None = None) -> bytes | None:
        """A small object whole, or None when missing. More than ``limit`` bytes: MetadataError."""

    @abstractmethod
    def open_read(self, location: str, name: str) -> ReadHandle:
        """A handle for ranged reads of one object (FileNotFoundError when missing)."""

    def stagings(self, final: str) -> list[str]:
        """The staging locations of unpublished saves to ``final`` (made by ``begin``), for the clean-up of failed
        ones (markers.remove_failed_stagings). Default: the sibling locations ``<final>.tmp-*``."""
        parent, base = self.parent(final), final.rstrip("/").rpartition("/")[2]
        return [self.child(parent, n) for n in self.children(parent) if n.startswith(f"{base}.tmp-")]

    def sync(self, location: str) -> None:  # noqa: B027 (optional hook)
        """Make the names in ``location`` durable (local: fsync of the directory). Default: nothing to do."""
