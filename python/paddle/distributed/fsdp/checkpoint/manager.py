"""Numbered checkpoints under one root directory, a ``latest`` pointer, and keep-last-K.

Why: a long run keeps several checkpoints and resumes from the newest one that is complete. The pointer and
the pruning must never name or delete anything before the new checkpoint is committed. Layout::

    root/
      step_00000100/        committed checkpoints: each is a checkpoint directory of the engine (save.py)
      step_00000200/
      latest                one line, e.g. "step_00000200": the most recently committed checkpoint

``CheckpointManager(root, keep_last=K).save(step, state_dict)`` (collective) runs:

1. the engine's save of ``root/step_<step:08d>`` (staging dir, checksums, COMMIT last, atomic rename; save.py);
2. the coordinator rewrites ``latest`` atomically and durably (tmp file + fsync + rename + directory fsync). The
   other ranks return only once they see the commit AND ``latest`` naming it, so after ``save`` returns
   ``latest()`` gives the new checkpoint on every rank (async saves: after ``handle.wait()``);
3. with ``keep_last=K`` the coordinator removes every committed checkpoint outside the K highest steps, except
   the one ``latest`` names: each is first renamed to a hidden ``.trash-*`` name (atomic: it stops being a
   checkpoint at once, never half-deleted under its own name), then deleted in a background (non-daemon)
   thread. Staging directories left by crashed saves (``step_*.tmp-*``) are removed the same way.

A crash (kill -9 of any rank) at any point leaves either the previous state (old checkpoints, ``latest`` naming
the previous one; the partial save is ``step_*.tmp-*``, reported by loads of ``root/step_<step>`` as
IncompleteCheckpointError) or the new checkpoint committed, maybe not yet named by ``latest`` (crash between
steps 1 and 2: ``latest`` still names the previous one) and old ones maybe not yet removed (the next save
removes them). ``latest()`` returns the directory ``latest`` names if it is committed; when the pointer is
missing, unreadable or names no committed checkpoint, it falls back (with a warning) to the committed checkpoint
with the highest step; None when there is none.

Saving a step that exists replaces that checkpoint atomically (save.py); ``latest`` then names it even if
higher steps exist (latest = most recently saved) and keep_last keeps it too. One job per root: two jobs
saving into one root race on ``latest`` and on pruning (each checkpoint directory itself stays consistent).
"""

from __future__ import annotations

import logging
import os
import re

from .coordination import Comm, gather_errors
from .errors import (
    CheckpointError,
    CheckpointRemovedError,
    IncompleteCheckpointError,
    NotACheckpointError,
    SaveFailedError,
)
from .format.metadata import COMMIT_FILE, LATEST_FILE, METADATA_FILE, check_file_name
from .io.local import TRASH_PREFIX
from .io.storage import Storage, backend_for
from .load import LoadReport, load_state_dict
from .save import SaveHandle, save_and_publish

logger = logging.getLogger(__name__)

STEP_PREFIX = "step_"
_STEP_RE = re.compile(r"^step_(\d+)$")
_STAGING_RE = re.compile(r"^step_\d+\.tmp-[0-9a-f]+$")

__all__ = [
    "CheckpointManager",
    "step_dir_name",
    "read_latest",
    "latest_checkpoint",
    "committed_steps",
    "resolve_checkpoint",
]


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


def resolve_checkpoint_collective(path: str, comm) -> str:
    """:func:`resolve_checkpoint` on every rank, failing on all ranks together (no rank left in a collective)."""
    err, resolved = None, None
    try:
        resolved = resolve_checkpoint(path)
    except CheckpointError as e:
        err = e
    gather_errors(comm, err)
    return resolved


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


class _LatestPublisher:
    """The engine's post-commit hook for one CheckpointManager save (protocol: save.Publisher)."""

    def __init__(self, root: str, name: str, keep_last: int | None, storage: Storage) -> None:
        self.root, self.name, self.keep_last, self.storage = root, name, keep_last, storage

    def publish(self) -> None:
        self.storage.put(self.root, LATEST_FILE, f"{self.name}\n".encode())

    def is_published(self) -> bool:
        return read_latest(self.root, self.storage) == self.name

    def cleanup(self) -> None:
        if self.keep_last is not None:
            try:
                prune(self.root, self.keep_last, protect=(self.name,), storage=self.storage)
            except Exception as e:  # noqa: BLE001 - a failed cleanup must not fail a committed save
                logger.warning("keep_last: cleaning %s failed: %s", self.root, e)


class CheckpointManager:
    """Checkpoints ``root/step_<N>`` with a ``latest`` pointer and optional keep-last-K (see module docstring).

    Every rank of the group creates one with the same arguments; ``save`` and ``load_latest`` are collective.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        keep_last: int | None = None,
        process_group=None,
        coordinator_rank: int = 0,
    ) -> None:
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be a positive int or None, got {keep_last!r}")
        self.root = os.path.abspath(os.fspath(root))
        self.keep_last = keep_last
        self.process_group = process_group
        self.coordinator_rank = coordinator_rank

    def path_for(self, step: int) -> str:
        return os.path.join(self.root, step_dir_name(step))

    def save(self, step: int, state_dict: dict, **save_kwargs) -> SaveHandle | None:
        """Save ``state_dict`` as ``step``; ``latest`` moves after the commit, then old ones are pruned.

        ``save_kwargs`` go to the engine's ``save_state_dict`` (``async_save``, ``commit_timeout``, ...).
        """
        name = step_dir_name(step)
        try:
            os.makedirs(self.root, exist_ok=True)
        except OSError as e:  # read-only file system, permissions: a named error, like any failed save
            raise SaveFailedError(f"save to {self.root}: cannot create the checkpoint root: {e}") from e
        options = save_kwargs.get("options")
        storage = backend_for(self.root, getattr(options, "storage", None))
        return save_and_publish(
            state_dict,
            storage.child(self.root, name),
            _LatestPublisher(self.root, name, self.keep_last, storage),
            process_group=self.process_group,
            coordinator_rank=self.coordinator_rank,
            **save_kwargs,
        )

    def latest(self) -> str | None:
        """Path of the newest committed checkpoint (what ``latest`` names), or None."""
        return latest_checkpoint(self.root)

    def latest_step(self) -> int | None:
        path = self.latest()
        return None if path is None else parse_step(os.path.basename(path))

    def steps(self) -> list[int]:
        """Steps of all committed checkpoints, ascending."""
        return committed_steps(self.root)

    def load_latest(self, state_dict: dict, **load_kwargs) -> LoadReport:
        """Load the newest committed checkpoint into ``state_dict`` (engine's ``load_state_dict``); a load that
        loses a race with keep_last rotation (CheckpointRemovedError on every rank) retries with the new latest."""
        for attempt in range(4):
            try:
                return load_state_dict(
                    state_dict,
                    resolve_checkpoint_collective(self.root, Comm(self.process_group)),
                    process_group=self.process_group,
                    coordinator_rank=self.coordinator_rank,
                    **load_kwargs,
                )
            except CheckpointRemovedError as e:
                if attempt == 3:
                    raise
                logger.warning("load_latest(%s): %s; retrying with what %s names now", self.root, e, LATEST_FILE)
        raise AssertionError("unreachable")  # pragma: no cover
