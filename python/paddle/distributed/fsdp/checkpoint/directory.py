"""The one place that answers: is this a committed checkpoint, which one is latest, what may be removed.

Also ``read_metadata``: the metadata of a committed checkpoint, and why a directory is not one (never committed,
a checkpoint root, stock paddle, foreign), so the error names the problem.

Why: these questions were answered in five files (manager, removal, stock/directories, format/commit, load);
now the manager, the save's commit, loads and verify ask here. Every answer is read through the storage
interface (io/storage.py) where it concerns a root of numbered checkpoints; ``removed_or`` tells a checkpoint
removed under a reader (keep_last rotation, a replacing save) apart from a corrupt one, so that
``load_checkpoint(root)`` can retry with what ``latest`` names now and never call a sound checkpoint corrupt.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re

from .errors import (
    CheckpointError,
    CheckpointRemovedError,
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
    resolve_member,
)
from .format.schema import parse_commit
from .format.strict_json import SMALL_FILE_BYTES, loads_strict, read_capped
from .io.local import TRASH_PREFIX
from .io.storage import Storage, backend_for

logger = logging.getLogger(__name__)

STEP_PREFIX = "step_"
_STEP_RE = re.compile(r"^step_(\d+)$")
_STAGING_RE = re.compile(r"^step_\d+\.tmp-[0-9a-f]+$")


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
    """Steps of the committed ``step_*`` checkpoints in ``root``, ascending."""
    storage = storage or backend_for(root)
    try:
        names = storage.children(root)
    except OSError:
        return []
    steps = [parse_step(n) for n in names]
    return sorted(s for s, n in zip(steps, names) if s is not None and _committed(storage.child(root, n), storage))


def latest_checkpoint(root: str) -> str | None:
    """Path of the checkpoint to resume from: what ``latest`` names, else the highest committed step."""
    root = os.path.abspath(os.fspath(root))
    name = read_latest(root)
    if name is not None and _committed(os.path.join(root, name)):
        return os.path.join(root, name)
    steps = committed_steps(root)
    if steps:
        fallback = os.path.join(root, step_dir_name(steps[-1]))
        logger.warning(
            "%s/%s %s; using the committed checkpoint with the highest step: %s",
            root,
            LATEST_FILE,
            "is missing or unreadable" if name is None else f"names {name!r}, which is not committed",
            fallback,
        )
        return fallback
    return None


def is_checkpoint_root(path: str) -> bool:
    try:
        names = os.listdir(path)
    except OSError:
        return False
    if COMMIT_FILE in names or METADATA_FILE in names:
        return False
    return LATEST_FILE in names or any(parse_step(n) is not None or _STAGING_RE.match(n) for n in names)


def resolve_checkpoint(path: str) -> str:
    """``path`` itself for a checkpoint directory; the latest committed checkpoint for a CheckpointManager root.

    A root without any committed checkpoint raises IncompleteCheckpointError when crashed saves left staging
    directories in it, else NotACheckpointError.
    """
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path) or not is_checkpoint_root(path):
        return path  # the engine's read_metadata reports what is wrong with it, if anything
    found = latest_checkpoint(path)
    if found is not None:
        return found
    staging = sorted(n for n in os.listdir(path) if _STAGING_RE.match(n))
    if staging:
        raise IncompleteCheckpointError(
            f"checkpoint root {path} holds no committed checkpoint: only interrupted saves ({staging[:3]})"
        )
    raise NotACheckpointError(f"checkpoint root {path} holds no committed checkpoint")


def prune(root: str, keep_last: int, protect: tuple[str, ...] = (), storage: Storage | None = None) -> list[str]:
    """Remove committed checkpoints outside the ``keep_last`` highest steps (never ``protect`` or ``latest``'s
    target) and staging leftovers of crashed saves. Returns the removed names. Best effort: never raises."""
    storage = storage or backend_for(root)
    keep = set(protect)
    latest = read_latest(root, storage)
    if latest is not None:
        keep.add(latest)
    steps = committed_steps(root, storage)
    keep.update(step_dir_name(s) for s in steps[-keep_last:])
    victims = [step_dir_name(s) for s in steps if step_dir_name(s) not in keep]
    try:
        children = storage.children(root)
    except OSError:
        children = []
    victims += sorted(n for n in children if _STAGING_RE.match(n))
    removed = []
    for name in victims:
        try:  # Storage.remove is atomic: the checkpoint disappears whole, never half-deleted under its own name
            storage.remove(storage.child(root, name))
            removed.append(name)
        except OSError as e:
            logger.warning("keep_last: could not remove %s/%s: %s", root, name, e)
    for name in children:  # left by a process that died while deleting
        if name.startswith(TRASH_PREFIX):
            try:
                storage.remove(storage.child(root, name))
            except OSError as e:
                logger.warning("keep_last: could not clean %s/%s: %s", root, name, e)
    if removed:
        logger.info("keep_last=%d: removed %s from %s", keep_last, removed, root)
    return removed


def commit_id(path: str, storage: Storage | None = None) -> str | None:
    """The checkpoint id the commit record at ``path`` names now (None: absent or unreadable): the truth about
    whether (and which) checkpoint is committed there."""
    from .format.schema import parse_commit
    from .format.strict_json import SMALL_FILE_BYTES, loads_strict

    where = f"{path}/{COMMIT_FILE}"
    try:
        raw = (storage or backend_for(path)).get(path, COMMIT_FILE, SMALL_FILE_BYTES)
        return None if raw is None else parse_commit(loads_strict(raw, where), where)[0]
    except (OSError, CheckpointError):
        return None


def removed_or(path: str, error: CheckpointError, checkpoint_id: str | None = None) -> CheckpointError:
    """CheckpointRemovedError when the checkpoint at ``path`` is gone (no commit record) or, given the
    ``checkpoint_id`` being read, was replaced by another one; else ``error``."""
    now = commit_id(path)
    if now is None:
        return CheckpointRemovedError(
            f"checkpoint {path} was removed while it was being read (keep_last rotation or a replacing save?)"
        )
    if checkpoint_id is not None and now != checkpoint_id:
        return CheckpointRemovedError(
            f"checkpoint {path} was replaced by another save while it was being read (checkpoint id "
            f"{checkpoint_id} -> {now})"
        )
    return error


def read_metadata(path: str, options=None) -> CheckpointMetadata:
    """Metadata of a committed checkpoint; raises NotACheckpointError / IncompleteCheckpointError / MetadataError
    (CorruptCheckpointError for an I/O error such as EACCES or EIO: never a bare OSError)."""
    path = os.path.abspath(os.fspath(path))
    if options is None:
        from .options import resolve

        options = resolve(None)
    try:
        return _read_metadata(path, options.max_metadata_bytes)
    except FileNotFoundError as e:  # the directory went away under the reader (keep_last rotation)
        raise removed_or(path, CorruptCheckpointError(f"checkpoint {path}: {e}")) from e
    except OSError as e:
        raise CorruptCheckpointError(f"checkpoint {path}: cannot read it: {type(e).__name__}: {e}") from e


def _read_metadata(path: str, max_metadata_bytes: int) -> CheckpointMetadata:
    if not os.path.isdir(path):
        parent = os.path.dirname(path)
        base = os.path.basename(path)
        try:
            near = sorted(n for n in os.listdir(parent) if n.startswith((base + ".old-", base + ".tmp-")))
        except OSError:
            near = []
        staging = [n for n in near if n.startswith(base + ".tmp-")]
        old = [n for n in near if n.startswith(base + ".old-")]
        old_hint = (
            (f"; {old[0]} holds the checkpoint that was being replaced (rename it back to {base})") if old else ""
        )
        if staging:
            raise IncompleteCheckpointError(
                f"checkpoint {path} is incomplete: it was never committed; "
                f"{_describe_staging(_newest(parent, staging))} left {staging[:3]} next to it{old_hint}"
            )
        raise NotACheckpointError(f"{path} is not a checkpoint: no such directory{old_hint}")
    mpath = os.path.join(path, METADATA_FILE)
    cpath = os.path.join(path, COMMIT_FILE)
    has_m, has_c = os.path.isfile(mpath), os.path.isfile(cpath)
    if not has_c:
        names = os.listdir(path)
        looks_partial = has_m or PARTS_DIR in names or any(n.endswith("_0.safetensors") for n in names)
        if looks_partial:
            missing = "the commit record COMMIT" + ("" if has_m else " and metadata.json")
            raise IncompleteCheckpointError(
                f"checkpoint {path} is incomplete: {missing} is missing (the save did not finish)"
            )
        if LATEST_FILE in names:
            raise NotACheckpointError(
                f"{path} is a checkpoint root ({LATEST_FILE} -> {_peek_latest(path)}), not a checkpoint: pass one "
                f"of its checkpoint directories, or pass the root to load_checkpoint / CheckpointManager"
            )
        stock = any(n.endswith(".metadata") for n in names)
        raise NotACheckpointError(
            f"{path} is not a {FORMAT_NAME} checkpoint: no {METADATA_FILE} and no {COMMIT_FILE} "
            f"({'looks like a stock paddle checkpoint; ' if stock else ''}contents: {_describe_dir(path)})"
        )
    try:
        cid, want_sha = parse_commit(
            loads_strict(read_capped(cpath, SMALL_FILE_BYTES, COMMIT_FILE), f"{path}/{COMMIT_FILE}"),
            f"{path}/{COMMIT_FILE}",
        )
    except MetadataError as e:
        raise MetadataError(f"checkpoint {path}: commit record {COMMIT_FILE} is damaged: {e}") from None
    except FileNotFoundError:
        raise removed_or(path, CorruptCheckpointError(f"checkpoint {path}: {COMMIT_FILE} vanished")) from None
    missing = CorruptCheckpointError(f"checkpoint {path}: {METADATA_FILE} is missing although it was committed")
    if not has_m:
        raise removed_or(path, missing)
    try:
        data = read_capped(mpath, max_metadata_bytes, METADATA_FILE)
    except FileNotFoundError:
        raise removed_or(path, missing) from None
    if hashlib.sha256(data).hexdigest() != want_sha:
        raise MetadataError(
            f"checkpoint {path}: {METADATA_FILE} does not match the checksum in the commit record (damaged)"
        )
    md = CheckpointMetadata.loads(data, where=f"{path}/{METADATA_FILE}", fetch=index_fetch(path))
    if md.index is not None:
        md.index.fetch.bytes += len(data)  # (metadata.json itself: the figures count every metadata byte read)
        md.index.fetch.objects.add(METADATA_FILE)
    if md.checkpoint_id != cid:
        raise MetadataError(f"checkpoint {path}: commit record and metadata name different checkpoints")
    return md


def index_fetch(path: str):
    """``fetch(name, offset, length)`` of the index objects and checksum sidecars of the checkpoint at ``path``
    (format 2, format/index.py): exactly ``length`` bytes, fewer only at the end of the object."""

    def fetch(name: str, offset: int, length: int) -> bytes:
        fd = os.open(resolve_member(path, name), os.O_RDONLY | os.O_CLOEXEC)
        try:
            out = bytearray()
            while len(out) < length:
                got = os.pread(fd, length - len(out), offset + len(out))
                if not got:
                    break
                out += got
            return bytes(out)
        finally:
            os.close(fd)

    return fetch


def _describe_dir(path: str) -> str:
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return "unreadable"
    if len(names) > 8:
        names = names[:8] + ["..."]
    return ", ".join(names) or "empty"


def _newest(parent: str, names: list[str]) -> str:
    def mtime(n: str) -> float:
        try:
            return os.path.getmtime(os.path.join(parent, n))
        except OSError:
            return 0.0

    return os.path.join(parent, max(names, key=mtime))


def _describe_staging(staging: str) -> str:
    """Why a staging directory is there: a save that failed with an error, or one that was killed (or runs)."""
    parts = os.path.join(staging, PARTS_DIR)
    try:
        names = sorted(os.listdir(parts))
    except OSError:
        names = []
    errors = [n for n in names if _FAILURE_MARKER.match(n)]
    if errors:
        errors.sort(key=lambda n: (not n.endswith(".json") and n != "ABORT", n))  # details first, then tags
        n = errors[0]
        try:
            raw = read_capped(os.path.join(parts, n), SMALL_FILE_BYTES, n)[:500]
            if n.endswith(".json"):
                why = loads_strict(raw, n).get("error")
            else:
                why = raw.decode(errors="replace") or n.split(".", 2)[-1]
        except (OSError, CheckpointError, AttributeError):
            why = "unknown error"
        return f"a save that failed ({why})"
    return "a save that was interrupted (or is still running)"


# failure markers of a save (save.py): details in <rank>.failed.json / ABORT, the cause in the name otherwise
_FAILURE_MARKER = re.compile(r"^(\d+\.failed(\.json|\.[A-Za-z0-9_]+)?|ABORT(\.[A-Za-z0-9_]+)?)$")


def _peek_latest(root: str) -> str:
    try:
        raw = read_capped(os.path.join(root, LATEST_FILE), SMALL_FILE_BYTES, LATEST_FILE)
        return raw[:256].decode(errors="replace").strip() or "empty"
    except (OSError, CheckpointError):
        return "unreadable"
