"""The Trainer's ``output_dir/checkpoint-N`` directories as engine checkpoints: which are complete and of this run,
which one a resume picks, which rotation removes.

Why not the Trainer's own helpers: ``get_last_checkpoint`` takes the highest ``checkpoint-N`` even when its save
never finished, and ``_rotate_checkpoints`` may delete by count whatever exists, so a leftover of an earlier run
with a higher step, or a torn copy that kept its commit record, made it delete this run's only good checkpoint.
Here the engine's selection (checkpoint/selection.py) decides: a ``checkpoint-N`` counts only when it is complete
(commit record, metadata, every data file with its size: checkpoint/lineage.py ``examine``); a resume picks the
complete one committed last; rotation counts and removes only this run's (the lineage in its commit record), and
names what it leaves. A save that crashed left only its staging (``checkpoint-N.tmp-<id>`` on a local disk, an
unpublished version on S3), removed by the next rotation. Every name is read through the engine's storage
interface, so ``s3://`` output dirs work alike.
"""

from __future__ import annotations

import logging
import os
import re

from ...checkpoint import writer
from ...checkpoint.directory import StorageUnreadableError
from ...checkpoint.format.metadata import COMMIT_FILE
from ...checkpoint.io.backends import backend_for
from ...checkpoint.io.local import TRASH_PREFIX
from ...checkpoint.io.storage import Storage
from ...checkpoint.lineage import Found, Lineage, examine
from ...checkpoint.paths import local_path, url_scheme
from ...checkpoint.selection import pick_newest, rotation_victims, survey, warn_left, warn_passed

logger = logging.getLogger(__name__)

PREFIX = "checkpoint"  # PaddleFormers' PREFIX_CHECKPOINT_DIR
_NAME_RE = re.compile(rf"^{PREFIX}-(\d+)$")
_STAGING_RE = re.compile(rf"^{PREFIX}-\d+\.tmp-[0-9A-Za-z]+$")


def checkpoint_dir(output_dir: str, step: int) -> str:
    """Location of the checkpoint of ``step`` under ``output_dir`` (a local path or an ``s3://`` URL)."""
    root = local_path(output_dir)
    return backend_for(root).child(root, f"{PREFIX}-{step}")


def parse_name(name: str) -> int | None:
    m = _NAME_RE.match(name)
    return int(m.group(1)) if m else None


def is_committed(location: str, storage: Storage | None = None) -> bool:
    storage = storage or backend_for(location)
    try:
        return COMMIT_FILE in storage.list(location)
    except OSError:
        return False


def make_root_durable(output_dir: str) -> None:
    """The Trainer's ``__init__`` creates ``output_dir`` with a plain ``os.makedirs``, possibly several levels: fsync
    the parent of every level up to its file system's mount point, so the root (and every checkpoint published in
    it) survives a power loss. Which levels that ``makedirs`` created is not known here, and a new level whose name
    is not durable takes everything under it along (#54). Levels above one this process may not read are left
    (they existed before: nobody could have created them here). Object stores need nothing."""
    root = local_path(output_dir)
    if url_scheme(root) is not None or not os.path.isdir(root):
        return
    path = os.path.abspath(root)
    while True:
        parent = os.path.dirname(path)
        try:
            writer.fsync_dir(parent)
        except PermissionError:
            return
        if parent == path or os.path.ismount(parent):
            return
        path = parent


def checkpoints_found(output_dir: str) -> list[Found]:
    """Every committed ``checkpoint-N`` under ``output_dir``, examined (complete? which run?), by step; [] when
    ``output_dir`` does not exist."""
    root = local_path(output_dir)
    if "://" not in root and not os.path.lexists(root):
        return []
    return survey(root, parse_name, backend_for(root))


def complete_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """``(step, location)`` of every complete ``checkpoint-N`` under ``output_dir``, by step."""
    return [(f.step, f.location) for f in checkpoints_found(output_dir) if f.complete]


def newest_complete(output_dir: str) -> Found | None:
    """The ``checkpoint-N`` ``resume_from_checkpoint=True`` picks: the complete one committed last (selection.py);
    each passed-over one with a higher step is named in a warning."""
    pick, passed = pick_newest(checkpoints_found(output_dir))
    warn_passed(f"resume_from_checkpoint=True in {local_path(output_dir)}", pick, passed)
    return pick


def examine_checkpoint(location: str) -> Found:
    """``checkpoint-N`` at ``location`` examined (its step from its name; 0 when it is named otherwise)."""
    location = local_path(location)
    step = parse_name(location.rstrip("/").rpartition("/")[2])
    return examine(location, step or 0, backend_for(location))


def run_lineage(output_dir: str, resume_from: str | None, from_memory: bool = False) -> Lineage:
    """The run a Trainer's saves into ``output_dir`` belong to, so what its rotation may remove: a new run unless
    ``train()`` resumes (``resume_from``: the checkpoint it resumes from, whose run it continues; ``from_memory``:
    the memory tier's copies, which continue the run of the newest complete ``checkpoint-N``). A run that starts
    over in an ``output_dir`` of an earlier run never adopts it: that run's checkpoints are left, named once."""
    if from_memory:
        newest = newest_complete(output_dir)
        return Lineage.continuing(newest) if newest is not None else Lineage.fresh()
    if resume_from is None:
        return Lineage.fresh()
    return Lineage.continuing(examine_checkpoint(str(resume_from)))


def rotate(
    output_dir: str, keep: int | None, owner: Lineage | None, protect: tuple[str, ...] = (), warned: set | None = None
) -> list[str]:
    """Remove ``owner``'s complete checkpoints beyond its ``keep`` newest (None or <= 0: keep all), never its
    newest nor ``protect`` (the best model's); then the stagings crashed saves left. Checkpoints of other runs and
    torn ones are left and named in a warning (once per location when ``warned`` collects them). Call it only when
    no save to ``output_dir`` is in flight (its staging would look crashed). Returns the removed locations."""
    root = local_path(output_dir)
    storage = backend_for(root)
    try:
        found = checkpoints_found(root)
    except StorageUnreadableError as e:  # a committed save is not failed by its rotation: nothing removed
        logger.warning("checkpoint rotation skipped: %s", e)
        return []
    limited = bool(keep and keep > 0)
    victims, left = rotation_victims(
        found, owner, keep if limited else len(found), {local_path(p) for p in protect if p}
    )
    if limited:
        fresh = [f for f in left if warned is None or f.location not in warned]
        warn_left(f"checkpoint rotation (save_total_limit={keep})", fresh)
        if warned is not None:
            warned.update(f.location for f in fresh)
    targets = ([f.location for f in victims] if limited else []) + _crash_leftovers(root, storage)
    removed = []
    for loc in targets:
        try:
            storage.remove(loc)
            removed.append(loc)
        except OSError as e:
            logger.warning("checkpoint rotation: could not remove %s: %s", loc, e)
    if removed:
        logger.info("checkpoint rotation (save_total_limit=%s): removed %s", keep, removed)
    return removed


def _crash_leftovers(root: str, storage: Storage) -> list[str]:
    """Stagings of unpublished saves to any ``checkpoint-N``: siblings ``checkpoint-N.tmp-<id>`` on a local disk,
    versions under the checkpoint's own prefix on S3 (``Storage.stagings``); and the ``.trash-*`` directories of
    removals a crash interrupted (renamed away, not yet deleted: CheckpointManager's prune removes them too)."""
    try:
        children = storage.children(root)
    except OSError:
        return []
    out: list[str] = []
    for name in sorted(children):
        if _NAME_RE.match(name):
            try:
                out += [s for s in storage.stagings(storage.child(root, name)) if s not in out]
            except OSError:
                pass
        elif (_STAGING_RE.match(name) or name.startswith(TRASH_PREFIX)) and storage.child(root, name) not in out:
            out.append(storage.child(root, name))
    return out
