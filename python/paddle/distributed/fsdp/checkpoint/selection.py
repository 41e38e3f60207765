"""Which of a root's numbered checkpoints a resume picks and a rotation may remove: one answer for
CheckpointManager (``latest``, ``keep_last``, the memory tier's flush) and the PaddleFormers Trainer
(``resume_from_checkpoint=True``, ``save_total_limit``).

Why one module: both had the same hole. Counting every directory with a commit record by its step number, a
leftover of an earlier run with a higher step (or a torn copy that kept its commit record) was picked for the
resume and took a place among the "newest" that rotation keeps, so the run's own newest good checkpoint was
deleted. The rules (docs/reliability.md, "leftovers"):

* only complete checkpoints count (lineage.py ``examine``); a torn one is never picked, counted or removed;
* resume: the complete checkpoint committed last (by the commit record's lineage time; checkpoints without a
  lineage record come before those with one, by step); each committed checkpoint with a higher step that was
  passed over is named in a warning, with why (torn, another run, no lineage record);
* rotation: only checkpoints of this run (``Lineage.owns``) are counted and removed, the ``keep`` newest of them
  and the protected ones stay; everything else is left where it is and named in a warning (once per process).
  A run is a process's own unless it resumed from the root (root_runs.py): an earlier run's checkpoints, even
  the one ``latest`` named, are never removed by a run that did not resume from them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection

from .directory import (
    _STAGING_RE,
    StorageUnreadableError,
    _location,
    is_checkpoint_root,
    parse_step,
    read_latest,
)
from .errors import IncompleteCheckpointError, NotACheckpointError
from .format.metadata import COMMIT_FILE, LATEST_FILE
from .io.backends import backend_for
from .io.local import TRASH_PREFIX
from .io.storage import Storage
from .lineage import Found, Lineage, examine

logger = logging.getLogger(__name__)


def survey(root: str, parse: Callable[[str], int | None], storage: Storage) -> list[Found]:
    """Every committed checkpoint under ``root`` whose name ``parse`` gives a step, examined, by step.
    StorageUnreadableError when ``root`` cannot be listed (never taken for "no checkpoint")."""
    try:
        names = storage.children(root)
    except OSError as e:
        raise StorageUnreadableError(f"cannot list checkpoint root {root}: {e}") from None
    found = []
    for name in names:
        step = parse(name)
        if step is None:
            continue
        location = storage.child(root, name)
        try:
            if COMMIT_FILE not in storage.list(location):
                continue  # never committed: a crashed save's leftovers, not a checkpoint
        except (FileNotFoundError, NotADirectoryError):
            continue  # removed meanwhile, or a file of that name
        except OSError as e:
            raise StorageUnreadableError(f"cannot list checkpoint {location}: {e}") from None
        found.append(examine(location, step, storage))
    return sorted(found, key=lambda f: (f.step, f.name))


def pick_newest(found: list[Found], prefer_run: str | None = None) -> tuple[Found | None, list[Found]]:
    """The checkpoint to resume from (of run ``prefer_run`` when it has a complete one) and the committed ones
    with a higher step that were passed over."""
    complete = [f for f in found if f.complete]
    pool = [f for f in complete if prefer_run is not None and f.run == prefer_run] or complete
    pick = max(pool, key=Found.order, default=None)
    passed = [f for f in found if f is not pick and (pick is None or f.step > pick.step)]
    return pick, passed


def warn_passed(where: str, pick: Found | None, passed: list[Found]) -> None:
    """Name each checkpoint a resume passed over, and why."""
    chosen = pick.name if pick is not None else "none"
    for f in passed:
        why = f.describe()
        if f.complete and pick is not None and pick.run is not None:
            why += f"; {pick.name} (run {pick.run[:12]}) was committed later"
        logger.warning(
            "%s: not resuming from %s although its step %d is higher than %s's: %s. Remove or move it if it is a "
            "leftover of another run",
            where,
            f.location,
            f.step,
            chosen,
            why,
        )


def rotation_victims(
    found: list[Found], owner: Lineage | None, keep: int, protect: Collection[str] = ()
) -> tuple[list[Found], list[Found]]:
    """``(victims, left)``: this run's complete checkpoints beyond its ``keep`` (at least 1) newest, never one in
    ``protect`` (locations); and the checkpoints rotation leaves because they are not this run's or are torn."""
    mine = [f for f in found if f.complete and owner is not None and owner.owns(f)]
    kept = {f.location for f in sorted(mine, key=Found.order)[-max(keep, 1) :]} | set(protect)
    victims = [f for f in mine if f.location not in kept]
    left = [f for f in found if f not in mine and f.location not in kept]
    return victims, left


def warn_left(what: str, left: list[Found]) -> None:
    for f in left:
        logger.warning(
            "%s: leaving %s alone and not counting it (%s); remove it by hand if it is a leftover",
            what,
            f.location,
            f.describe(),
        )


def latest_checkpoint(root: str, storage: Storage | None = None) -> str | None:
    """Location of the checkpoint to resume from: what ``latest`` names when it is complete, else the newest
    complete one (of the run ``latest``'s target belongs to, when it has one), with a warning."""
    root, storage = _location(root, storage)
    name = read_latest(root, storage)
    prefer = None
    if name is not None:
        target = examine(storage.child(root, name), parse_step(name) or 0, storage)
        if target.complete:
            return target.location
        prefer = target.run
    pick, passed = pick_newest(survey(root, parse_step, storage), prefer)
    if pick is None:
        return None
    logger.warning(
        "%s/%s %s; using the newest complete checkpoint: %s",
        root,
        LATEST_FILE,
        "is missing or unreadable" if name is None else f"names {name!r}, which is not a complete checkpoint",
        pick.location,
    )
    warn_passed(f"checkpoint root {root}", pick, passed)
    return pick.location


def resolve_checkpoint(path: str, storage: Storage | None = None) -> str:
    """``path`` itself for a checkpoint; the latest complete checkpoint for a CheckpointManager root.

    A root without any complete checkpoint raises IncompleteCheckpointError when crashed saves left staging
    locations in it, else NotACheckpointError.
    """
    path, storage = _location(path, storage)
    if not storage.exists(path) or not is_checkpoint_root(path, storage):
        return path  # the engine's read_metadata reports what is wrong with it, if anything
    found = latest_checkpoint(path, storage)
    if found is not None:
        return found
    staging = sorted(n for n in storage.children(path) if _STAGING_RE.match(n))
    if staging:
        raise IncompleteCheckpointError(
            f"checkpoint root {path} holds no committed checkpoint: only interrupted saves ({staging[:3]})"
        )
    raise NotACheckpointError(f"checkpoint root {path} holds no committed checkpoint (none complete)")


_NAMED_LEFT: set[str] = set()  # the leftovers prune named already in this process (the coordinator's)


def prune(root: str, keep_last: int, protect: tuple[str, ...] = (), storage: Storage | None = None) -> list[str]:
    """Remove this run's complete checkpoints outside its ``keep_last`` newest (never ``protect`` or ``latest``'s
    target; "this run": the lineage of ``protect[0]``, the checkpoint just saved, else of ``latest``'s target),
    and staging leftovers of crashed saves. Returns the removed names. Best effort: never raises."""
    storage = storage or backend_for(root)
    latest = read_latest(root, storage)
    keep = {storage.child(root, n) for n in (*protect, latest) if n is not None}
    try:
        found = survey(root, parse_step, storage)
    except StorageUnreadableError as e:  # removes nothing it could not examine
        logger.warning("keep_last: %s", e)
        found = []
    by_name = {f.name: f for f in found}
    anchor = next((by_name[n] for n in (*protect, latest) if n in by_name), None)
    victims, left = rotation_victims(found, anchor.lineage() if anchor else None, keep_last, keep)
    fresh = [f for f in left if f.location not in _NAMED_LEFT]  # a run saving 1000 times names a leftover once
    _NAMED_LEFT.update(f.location for f in fresh)
    warn_left(f"keep_last={keep_last} in {root}", fresh)
    try:
        children = storage.children(root)
    except OSError:
        children = []
    names = [f.name for f in victims] + sorted(n for n in children if _STAGING_RE.match(n))
    removed = []
    for name in names:
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
