"""The one place that answers: is this a committed checkpoint, which one is latest, what may be removed.

Why: these questions were answered in five files (manager, removal, stock/directories, format/commit, load);
now the manager, the save's commit, loads and verify ask here. Every answer is read through the storage
interface (io/storage.py) where it concerns a root of numbered checkpoints; ``removed_or`` tells a checkpoint
removed under a reader (keep_last rotation, a replacing save) apart from a corrupt one, so that
``load_checkpoint(root)`` can retry with what ``latest`` names now and never call a sound checkpoint corrupt.
"""

from __future__ import annotations

import logging
import os
import re

from .errors import CheckpointError, CheckpointRemovedError, IncompleteCheckpointError, NotACheckpointError
from .format.metadata import COMMIT_FILE, LATEST_FILE, METADATA_FILE, check_file_name
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
