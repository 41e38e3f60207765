"""The one place that answers: is this a committed checkpoint, and why not (which one is latest and what may be
removed: selection.py, which asks here).

Also ``read_metadata``: the metadata of a committed checkpoint, and why a directory is not one (never committed,
a checkpoint root, stock paddle, foreign), so the error names the problem.

Why: these questions were answered in five files (manager, removal, stock/directories, format/commit, load);
now the manager, the save's commit, loads and verify ask here. Every answer is read through the storage
interface (io/storage.py) where it concerns a root of numbered checkpoints. What the commit record names now
(``commit_id``, ``removed_or``: a checkpoint removed under its reader) is commit_record.py's, below the reader.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
from dataclasses import dataclass

from . import errors as _errors
from .commit_record import removed_or
from .errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    MetadataError,
    NotACheckpointError,
)
from .format.metadata import (
    COMMIT_FILE,
    FORMAT_NAME,
    LATEST_FILE,
    METADATA_FILE,
    PARTS_DIR,
    CheckpointMetadata,
    check_file_name,
)
from .format.schema import parse_commit
from .format.strict_json import SMALL_FILE_BYTES, loads_strict
from .format.versions import loads_metadata
from .io.backends import backend_for
from .io.storage import Storage

logger = logging.getLogger(__name__)

STEP_PREFIX = "step_"
_STEP_RE = re.compile(r"^step_(\d+)$")
_STAGING_RE = re.compile(r"^step_\d+\.tmp-[0-9a-f]+$")


class StorageUnreadableError(CheckpointError):
    """A checkpoint root exists but cannot be listed (permissions, I/O error, a file where the root should be).

    Never taken for "no checkpoint": a resume that could not look must not start over."""


_errors.ERROR_CLASSES[StorageUnreadableError.__name__] = StorageUnreadableError


def step_dir_name(step: int) -> str:
    """Directory name of ``step`` (zero-padded so names sort like steps)."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    return f"{STEP_PREFIX}{step:08d}"


def parse_step(name: str) -> int | None:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def _committed(path: str, storage: Storage | None = None) -> bool:
    return COMMIT_FILE in (storage or backend_for(path)).list(path)


def read_latest(root: str, storage: Storage | None = None) -> str | None:
    """The name in ``root/latest`` when it is a plain directory name, else None (missing, empty, unsafe)."""
    try:
        raw = (storage or backend_for(root)).get(root, LATEST_FILE, 1 << 16)
        if raw is None:
            return None
        name = raw[:4096].decode().strip()
    except (OSError, UnicodeDecodeError):
        return None
    except CheckpointError as e:  # not a regular file
        logger.warning("ignoring %s/%s: %s", root, LATEST_FILE, e)
        return None
    try:
        return check_file_name(name)
    except Exception:  # noqa: BLE001 - an unsafe or garbled pointer is treated as no pointer
        logger.warning("ignoring %s/%s: %r is not a checkpoint directory name", root, LATEST_FILE, name[:100])
        return None


def committed_steps(root: str, storage: Storage | None = None) -> list[int]:
    """Steps of the committed ``step_*`` checkpoints in ``root``, ascending ([] only for a root that does not
    exist or holds none). StorageUnreadableError when the root cannot be listed: an unreadable root is never
    "no steps" (a restart would silently start over)."""
    storage = storage or backend_for(root)
    try:
        names = storage.children(root)
        if not names and "://" not in root and os.path.lexists(root) and not os.path.isdir(root):
            raise NotADirectoryError(f"{root} is not a directory")
        steps = [parse_step(n) for n in names]
        return sorted(s for s, n in zip(steps, names) if s is not None and _committed(storage.child(root, n), storage))
    except OSError as e:
        raise StorageUnreadableError(f"cannot list checkpoint root {root}: {e}") from None


def _location(path, storage: Storage | None = None) -> tuple[str, Storage]:
    """``path`` as a location (an absolute local path, or a URL of a registered scheme) and its backend."""
    from .paths import local_path

    where = local_path(path, storage)
    return where, storage or backend_for(where)


def is_checkpoint_root(path: str, storage: Storage | None = None) -> bool:
    path, storage = _location(path, storage)
    try:
        names = storage.list(path) + storage.children(path)
    except OSError:
        return False
    if COMMIT_FILE in names or METADATA_FILE in names:
        return False
    return LATEST_FILE in names or any(parse_step(n) is not None or _STAGING_RE.match(n) for n in names)


@dataclass(frozen=True)
class CommittedCheckpoint:
    """A committed checkpoint whose metadata was read once: what a caller checks before a load (state/resume.py)
    and what the engine then loads from (load/load.py ``run_load``), so nobody reads or parses it twice."""

    path: str  # the location (paths.py)
    metadata: CheckpointMetadata


def open_checkpoint(path: str, options=None, storage: Storage | None = None) -> CommittedCheckpoint:
    """The committed checkpoint at ``path``, its metadata read (:func:`read_metadata`: same errors)."""
    where, _ = _location(path, storage or getattr(options, "storage", None))
    return CommittedCheckpoint(where, read_metadata(where, options, storage))


def read_metadata(path: str, options=None, storage: Storage | None = None) -> CheckpointMetadata:
    """Metadata of a committed checkpoint (read through ``storage``; None: ``options.storage`` or the backend
    of the location's scheme); raises NotACheckpointError / IncompleteCheckpointError / MetadataError
    (CorruptCheckpointError for an I/O error such as EACCES or EIO: never a bare OSError)."""
    if options is None:
        from .options import resolve

        options = resolve(None)
    path, storage = _location(path, storage or options.storage)
    try:
        return _read_metadata(path, options.max_metadata_bytes, storage)
    except FileNotFoundError as e:  # the checkpoint went away under the reader (keep_last rotation)
        raise removed_or(path, CorruptCheckpointError(f"checkpoint {path}: {e}"), None, storage) from e
    except OSError as e:
        raise CorruptCheckpointError(f"checkpoint {path}: cannot read it: {type(e).__name__}: {e}") from e


def _not_there(path: str, storage: Storage) -> CheckpointError:
    """Why there is nothing at ``path``: a save that never committed (its staging next to it), or nothing."""
    parent, base = storage.parent(path), path.rstrip("/").rpartition("/")[2]
    try:
        near = sorted(n for n in storage.children(parent) if n.startswith((base + ".old-", base + ".tmp-")))
    except OSError:
        near = []
    staging = [n for n in near if n.startswith(base + ".tmp-")]
    # the one holding a commit record first: after a power loss an earlier save's half-removed `.old-*` (other
    # tools' files only) may sit beside it
    old = sorted((n for n in near if n.startswith(base + ".old-")), key=lambda n: not _committed_at(parent, n, storage))
    old_hint = (f"; {old[0]} holds the checkpoint that was being replaced (rename it back to {base})") if old else ""
    if staging:
        return IncompleteCheckpointError(
            f"checkpoint {path} is incomplete: it was never committed; "
            f"{_describe_staging(storage, _newest(parent, staging, storage))} left {staging[:3]} next to it{old_hint}"
        )
    try:
        is_file = base in storage.list(parent)
    except OSError:
        is_file = False
    what = "it is a file, not a checkpoint directory" if is_file else "no such directory"
    return NotACheckpointError(f"{path} is not a checkpoint: {what}{old_hint}")


def _committed_at(parent: str, name: str, storage: Storage) -> bool:
    try:
        return COMMIT_FILE in storage.list(storage.child(parent, name))
    except OSError:
        return False


def _not_committed(path: str, names: list[str], storage: Storage) -> CheckpointError:
    """Why ``path``, which holds ``names`` but no commit record, is not a checkpoint."""
    has_m = METADATA_FILE in names
    looks_partial = has_m or PARTS_DIR in names or any(n.endswith("_0.safetensors") for n in names)
    if looks_partial:
        missing = "the commit record COMMIT" + ("" if has_m else " and metadata.json")
        return IncompleteCheckpointError(
            f"checkpoint {path} is incomplete: {missing} is missing (the save did not finish)"
        )
    if LATEST_FILE in names:
        return NotACheckpointError(
            f"{path} is a checkpoint root ({LATEST_FILE} -> {_peek_latest(path, storage)}), not a checkpoint: pass "
            f"one of its checkpoint directories, or pass the root to load_checkpoint / CheckpointManager"
        )
    stock = any(n.endswith(".metadata") for n in names)
    shown = ", ".join(sorted(names)[:8] + (["..."] if len(names) > 8 else [])) or "empty"
    return NotACheckpointError(
        f"{path} is not a {FORMAT_NAME} checkpoint: no {METADATA_FILE} and no {COMMIT_FILE} "
        f"({'looks like a stock paddle checkpoint; ' if stock else ''}contents: {shown})"
    )


def _read_metadata(path: str, max_metadata_bytes: int, storage: Storage) -> CheckpointMetadata:
    if not storage.exists(path):
        raise _not_there(path, storage)
    where = f"{path}/{COMMIT_FILE}"
    try:
        raw = storage.get(path, COMMIT_FILE, SMALL_FILE_BYTES)
        if raw is None:
            raise _not_committed(path, storage.list(path) + storage.children(path), storage)
        cid, want_sha = parse_commit(loads_strict(raw, where), where)
    except MetadataError as e:
        raise MetadataError(f"checkpoint {path}: commit record {COMMIT_FILE} is damaged: {e}") from None
    data = storage.get(path, METADATA_FILE, max_metadata_bytes)
    if data is None:
        missing = CorruptCheckpointError(f"checkpoint {path}: {METADATA_FILE} is missing although it was committed")
        raise removed_or(path, missing, None, storage)
    if hashlib.sha256(data).hexdigest() != want_sha:
        raise MetadataError(
            f"checkpoint {path}: {METADATA_FILE} does not match the checksum in the commit record (damaged)"
        )
    md = loads_metadata(data, where=f"{path}/{METADATA_FILE}", fetch=index_fetch(path, storage))
    if md.index is not None:
        md.index.fetch.bytes += len(data)  # (metadata.json itself: the figures count every metadata byte read)
        md.index.fetch.objects.add(METADATA_FILE)
    if md.checkpoint_id != cid:
        raise MetadataError(f"checkpoint {path}: commit record and metadata name different checkpoints")
    return md


def index_fetch(path: str, storage: Storage | None = None):
    """``fetch(name, offset, length)`` of the index objects and checksum sidecars of the checkpoint at ``path``
    (format 2, format/index.py), read through ``storage`` (None: the location's backend): exactly ``length``
    bytes, fewer only at the end of the object. A missing object is CorruptCheckpointError (CheckpointRemovedError
    when the checkpoint went away), any other I/O error CorruptCheckpointError naming it."""
    storage = storage or backend_for(path)

    def fetch(name: str, offset: int, length: int) -> bytes:
        try:
            handle = storage.open_read(path, check_file_name(name))
            try:
                buf = bytearray(max(0, min(length, handle.size - offset)))
                got = handle.read_into(offset, buf) if buf else 0
                return bytes(buf[:got])
            finally:
                handle.close()
        except FileNotFoundError as e:  # missing, or the checkpoint went away under the reader (keep_last)
            missing = CorruptCheckpointError(f"checkpoint {path}: {name} is missing")
            raise removed_or(path, missing, None, storage) from e
        except OSError as e:  # EACCES, EIO, a denied request: named, never a bare OSError
            raise CorruptCheckpointError(f"checkpoint {path}: cannot read {name}: {type(e).__name__}: {e}") from e

    return fetch


def _newest(parent: str, names: list[str], storage: Storage) -> str:
    """The most recently changed of the locations ``names`` under ``parent`` (local: by mtime; else the last)."""

    def mtime(n: str) -> float:
        try:
            return os.path.getmtime(os.path.join(parent, n))
        except OSError:
            return 0.0

    return storage.child(parent, max(names, key=mtime))


def _describe_staging(storage: Storage, staging: str) -> str:
    """Why a staging location is there: a save that failed with an error, or one that was killed (or runs)."""
    parts = storage.child(staging, PARTS_DIR)
    try:
        names = storage.list(parts)
    except OSError:
        names = []
    errors = [n for n in names if _FAILURE_MARKER.match(n)]
    if errors:
        errors.sort(key=lambda n: (not n.endswith(".json") and n != "ABORT", n))  # details first, then tags
        n = errors[0]
        try:
            raw = (storage.get(parts, n, SMALL_FILE_BYTES) or b"")[:500]
            if n.endswith(".json"):
                why = loads_strict(raw, n).get("error")
            else:
                why = raw.decode(errors="replace") or n.split(".", 2)[-1]
        except (OSError, CheckpointError, AttributeError):
            why = "unknown error"
        return f"a save that failed ({why})"
    return "a save that was interrupted (or is still running)"


# failure markers of a save (save/markers.py): details in <rank>.failed.json / ABORT, the cause in the name otherwise
_FAILURE_MARKER = re.compile(r"^(\d+\.failed(\.json|\.[A-Za-z0-9_]+)?|ABORT(\.[A-Za-z0-9_]+)?)$")


def _peek_latest(root: str, storage: Storage) -> str:
    try:
        raw = storage.get(root, LATEST_FILE, SMALL_FILE_BYTES)
        return "missing" if raw is None else raw[:256].decode(errors="replace").strip() or "empty"
    except (OSError, CheckpointError):
        return "unreadable"
