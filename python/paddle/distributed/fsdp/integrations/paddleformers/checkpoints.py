"""The Trainer's ``output_dir/checkpoint-N`` directories as engine checkpoints: which are committed, which is the
newest, which rotation removes.

Why not the Trainer's own helpers: ``get_last_checkpoint`` takes the highest ``checkpoint-N`` even when its save
never finished, and ``_rotate_checkpoints`` may delete by count whatever exists. Here a ``checkpoint-N`` counts
only once the engine committed it (its commit record is there); a save that crashed left only its staging
(``checkpoint-N.tmp-<id>`` on a local disk, an unpublished version on S3), never a ``checkpoint-N`` a resume would
pick. Every name is read through the engine's storage interface, so ``s3://`` output dirs work alike.
"""

from __future__ import annotations

import logging
import os
import re

from ...checkpoint import writer
from ...checkpoint.format.metadata import COMMIT_FILE
from ...checkpoint.io.backends import backend_for
from ...checkpoint.io.storage import Storage
from ...checkpoint.paths import local_path, url_scheme

logger = logging.getLogger(__name__)

PREFIX = "checkpoint"  # PaddleFormers' PREFIX_CHECKPOINT_DIR
_NAME_RE = re.compile(rf"^{PREFIX}-(\d+)$")
_STAGING_RE = re.compile(rf"^{PREFIX}-\d+\.tmp-[0-9A-Za-z]+$")


def checkpoint_dir(output_dir: str, step: int) -> str:
    """Location of the checkpoint of ``step`` under ``output_dir`` (a local path or an ``s3://`` URL)."""
    root = local_path(output_dir)
    return backend_for(root).child(root, f"{PREFIX}-{step}")


def is_committed(location: str, storage: Storage | None = None) -> bool:
    storage = storage or backend_for(location)
    try:
        return COMMIT_FILE in storage.list(location)
    except OSError:
        return False


def make_root_durable(output_dir: str) -> None:
    """The Trainer's ``__init__`` creates ``output_dir`` with a plain ``os.makedirs``: fsync its parent so the root
    (and every checkpoint published in it) survives a power loss. Object stores need nothing."""
    root = local_path(output_dir)
    if url_scheme(root) is None and os.path.isdir(root):
        writer.fsync_dir(os.path.dirname(os.path.abspath(root)))


def committed_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """``(step, location)`` of every committed ``checkpoint-N`` under ``output_dir``, by step."""
    root = local_path(output_dir)
    storage = backend_for(root)
    try:
        names = storage.children(root)
    except OSError:
        return []
    found = []
    for name in names:
        m = _NAME_RE.match(name)
        if m and is_committed(storage.child(root, name), storage):
            found.append((int(m.group(1)), storage.child(root, name)))
    return sorted(found)


def newest_committed(output_dir: str) -> str | None:
    found = committed_checkpoints(output_dir)
    return found[-1][1] if found else None


def rotate(output_dir: str, keep: int | None, protect: tuple[str, ...] = ()) -> list[str]:
    """Remove the oldest committed checkpoints beyond the ``keep`` newest (None or <= 0: keep all), never the
    newest committed one nor ``protect`` (the best model's); then the stagings crashed saves left. Call it only
    when no save to ``output_dir`` is in flight (its staging would look crashed). Returns the removed names."""
    root = local_path(output_dir)
    storage = backend_for(root)
    found = committed_checkpoints(root)
    keep_locations = {loc for _, loc in found[-max(keep or 0, 1) :]} | {local_path(p) for p in protect if p}
    victims = [loc for _, loc in found if loc not in keep_locations] if keep and keep > 0 else []
    victims += _crashed_stagings(root, storage)
    removed = []
    for loc in victims:
        try:
            storage.remove(loc)
            removed.append(loc)
        except OSError as e:
            logger.warning("checkpoint rotation: could not remove %s: %s", loc, e)
    if removed:
        logger.info("checkpoint rotation (save_total_limit=%s): removed %s", keep, removed)
    return removed


def _crashed_stagings(root: str, storage: Storage) -> list[str]:
    """Stagings of unpublished saves to any ``checkpoint-N``: siblings ``checkpoint-N.tmp-<id>`` on a local disk,
    versions under the checkpoint's own prefix on S3 (``Storage.stagings``)."""
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
        elif _STAGING_RE.match(name) and storage.child(root, name) not in out:
            out.append(storage.child(root, name))
    return out
