"""Numbered checkpoints under one root directory, a ``latest`` pointer, and keep-last-K.

Why: a long run keeps several checkpoints and resumes from the newest one that is complete. The pointer and
the pruning must never name or delete anything before the new checkpoint is committed. Layout::

    root/
      step_00000100/        committed checkpoints: each is a checkpoint directory of the engine (save/save.py)
      step_00000200/
      latest                one line, e.g. "step_00000200": the most recently committed checkpoint

``CheckpointManager(root, keep_last=K).save(step, state_dict)`` (collective) runs:

1. the engine's save of ``root/step_<step:08d>`` (staging dir, checksums, COMMIT last, atomic rename; save/save.py);
2. the coordinator rewrites ``latest`` atomically and durably (tmp file + fsync + rename + directory fsync). The
   other ranks return only once they see the commit AND ``latest`` naming it, so after ``save`` returns
   ``latest()`` gives the new checkpoint on every rank (async saves: after ``handle.wait()``);
3. with ``keep_last=K`` the coordinator removes the run's complete checkpoints outside its K newest, never the
   one ``latest`` names (selection.py: "the run" is the lineage in the commit record: the run this process
   resumed from the root, else a run of its own, root_runs.py; an earlier run's checkpoints, another run's and
   torn copies are left and named once): each is first renamed to a hidden ``.trash-*`` name (atomic: it stops being a
   checkpoint at once, never half-deleted under its own name), then deleted in a background (non-daemon)
   thread. Staging directories left by crashed saves (``step_*.tmp-*``) are removed the same way.

A crash (kill -9 of any rank) at any point leaves either the previous state (old checkpoints, ``latest`` naming
the previous one; the partial save is ``step_*.tmp-*``, reported by loads of ``root/step_<step>`` as
IncompleteCheckpointError) or the new checkpoint committed, maybe not yet named by ``latest`` (crash between
steps 1 and 2: ``latest`` still names the previous one) and old ones maybe not yet removed (the next save
removes them). ``latest()`` returns the directory ``latest`` names if it is complete (lineage.py ``examine``);
when the pointer is missing, unreadable or names no complete checkpoint, it falls back (with a warning naming
what it passed over) to the complete checkpoint committed last (of the run ``latest``'s target belongs to, when
it has one); None when there is none.

Saving a step that exists replaces that checkpoint atomically (save/save.py); ``latest`` then names it even if
higher steps exist (latest = most recently saved) and keep_last keeps it too. One job per root: two jobs
saving into one root race on ``latest`` and on pruning (each checkpoint directory itself stays consistent).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from ..keywords import check_keywords, keyword_names
from . import lossy, root_runs
from .coordination import Comm, gather_errors, stage_error
from .directory import (  # noqa: F401 - the manager's functions, answered in directory.py and selection.py
    STEP_PREFIX,
    committed_steps,
    is_checkpoint_root,
    parse_step,
    read_latest,
    step_dir_name,
)
from .errors import (
    CheckpointRemovedError,
    LoadFailedError,
    SaveFailedError,
)
from .format.metadata import LATEST_FILE
from .io.backends import backend_for
from .io.storage import Storage
from .lineage import Lineage, examine
from .load import LoadReport, load_state_dict, run_load
from .load_checks import named_read_error
from .options import resolve as resolve_options
from .paths import local_path, url_scheme
from .save.request import SaveRequest, save_request
from .save.save import SaveHandle, run_save, save_state_dict
from .selection import latest_checkpoint, prune, resolve_checkpoint  # noqa: F401
from .writer import makedirs_durable

logger = logging.getLogger(__name__)

_MANAGED = ("state_dict", "path", "process_group", "coordinator_rank")  # set by the manager, not by its caller

__all__ = [
    "CheckpointManager",
    "step_dir_name",
    "read_latest",
    "latest_checkpoint",
    "committed_steps",
    "resolve_checkpoint",
]


# a load that lost a race with keep_last rotation (or a replacing save) retries with what `latest` names now
REMOVED_RETRIES = 3
_T = TypeVar("_T")


def retry_removed(load: Callable[[], _T], what: str, may_retry: Callable[[BaseException], bool] = lambda e: True) -> _T:
    """``load()``, called again (at most ``REMOVED_RETRIES`` times) while it raises CheckpointRemovedError (on every
    rank alike: the engine exchanges errors) and ``may_retry(error)`` agrees (decided alike on every rank).

    Why one helper: CheckpointManager.load_latest and load_checkpoint (state/resume.py) both resolve ``latest``
    again after a race with keep_last rotation; the fallback to an older step after a failed load is
    load_checkpoint's own (state/resume.py ``load_checkpoint``)."""
    for attempt in range(REMOVED_RETRIES + 1):
        try:
            return load()
        except CheckpointRemovedError as e:
            if attempt == REMOVED_RETRIES or not may_retry(e):
                raise
            logger.warning("%s: %s; retrying with what %s names now", what, e, LATEST_FILE)
    raise AssertionError("unreachable")  # pragma: no cover


def resolve_checkpoint_collective(path: str, comm, coordinator: int = 0) -> str:
    """:func:`resolve_checkpoint` by the coordinator alone, its answer (or its error, named) on every rank.

    Why one rank: resolving a root examines the checkpoint ``latest`` names (a stat of every data file it lists,
    selection.py), so every rank doing it would cost world x files requests at each resume; one answer also
    means the ranks can never pick different checkpoints when ``latest`` moves meanwhile."""
    err, resolved = None, None
    if comm.rank == coordinator:
        try:
            resolved = resolve_checkpoint(path)
        except Exception as e:  # noqa: BLE001 - a storage layer's or the file system's error too: named, exchanged
            err = stage_error(named_read_error(path, e), f"load of {path} failed", comm.rank, LoadFailedError)
    return gather_errors(comm, err, resolved)[coordinator]


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


def root_lineage(root: str, storage: Storage) -> Lineage:
    """The run of the checkpoint ``latest`` names in ``root`` (a new run when there is none), adopted by a writer
    that acts for the job whose run that is (flush-memory writes the job's memory copies). A manager's save asks
    root_runs.lineage_for instead: it adopts the root's run only when its process resumed from that root. A
    leftover that ``latest`` never named is never adopted. Never raises: a lineage that cannot be read starts a new
    run (logged)."""
    try:
        name = read_latest(root, storage)
        if name is not None:
            found = examine(storage.child(root, name), 0, storage)
            if found.checkpoint_id is not None:
                return Lineage.continuing(found)
    except Exception as e:  # noqa: BLE001 - a commit must not fail because its predecessor cannot be examined
        logger.warning("cannot read the lineage of %s (%s): the save starts a new run", root, e)
    return Lineage.fresh()


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
        self.root = local_path(root)  # a local directory, or a URL of a served scheme (s3://bucket/prefix)
        self.keep_last = keep_last
        self.process_group = process_group
        self.coordinator_rank = coordinator_rank

    def path_for(self, step: int) -> str:
        return backend_for(self.root).child(self.root, step_dir_name(step))

    def save(self, step: int, state_dict: dict, **save_kwargs) -> SaveHandle | None:
        """Save ``state_dict`` as ``step``; ``latest`` moves after the commit, then old ones are pruned.

        ``save_kwargs`` go to the engine's ``save_state_dict`` (``async_save``, ``options``, ...); an unknown
        one is a TypeError naming the nearest valid one. ``quantize_moments="int8"|"int4"``: the optimizer
        moments ``<param>.moment1/2`` of ``state_dict`` are stored lossily (lossy.py; collective).
        """
        mode = lossy.check_mode(save_kwargs.pop("quantize_moments", None))
        check_keywords("CheckpointManager.save", save_kwargs, keyword_names(save_state_dict, _MANAGED))
        if mode is not None:
            threads = resolve_options(save_kwargs.get("options")).codec_threads
            state_dict, quantized = lossy.quantize_state(state_dict, mode, Comm(self.process_group), threads=threads)
            if save_kwargs.get("deferred_keys") is not None:
                save_kwargs["deferred_keys"] = [k for k in save_kwargs["deferred_keys"] if k not in set(quantized)]
        return run_save(self.save_request(step, state_dict, save_kwargs))

    def save_request(
        self,
        step: int,
        state_dict: dict,
        checked: Mapping[str, Any],
        lineage: Lineage | None = None,
        caller_error: BaseException | None = None,
    ) -> SaveRequest:
        """The engine's request (save/request.py) of saving ``state_dict`` as ``step``, publishing ``latest`` and
        pruning after the commit. ``checked``: ``save_state_dict``'s keywords as a dict, checked by the caller's
        door (``save`` above, or ``save_checkpoint``), so an unknown one is reported once, naming that door.
        ``caller_error``: what the calling door's own stage raised on this rank; it, or what resolving the root
        raises here on this rank, is reported by the save's exchange (every rank raises it).
        ``lineage``: the run the checkpoint belongs to (None: the run this process resumed from the root, else
        its own run there, root_runs.py; asked by the coordinator at its commit)."""
        name = step_dir_name(step)
        path, publisher, failed = f"{self.root.rstrip('/')}/{name}", None, caller_error
        try:  # what fails here on one rank (a storage layer, the root's file system) goes to the save's exchange
            storage = backend_for(self.root, getattr(checked.get("options"), "storage", None))
            if url_scheme(self.root) is None:
                try:
                    makedirs_durable(self.root)  # the first save's new root survives a power loss
                except OSError as e:  # read-only file system, permissions: a named error, like any failed save
                    raise SaveFailedError(f"save to {self.root}: cannot create the checkpoint root: {e}") from e
            path, publisher = storage.child(self.root, name), _LatestPublisher(self.root, name, self.keep_last, storage)
        except Exception as e:  # noqa: BLE001 - every rank raises it after the exchange
            failed = failed or e
        return save_request(
            state_dict,
            path,
            self.process_group,
            self.coordinator_rank,
            publisher,
            caller_error=failed,
            lineage=lineage.record if lineage is not None else lambda: self._run(storage).record(),
            **checked,
        )

    def _run(self, storage: Storage) -> Lineage:
        """The run this process's saves into the root belong to (root_runs.py), asked by the coordinator."""
        return root_runs.lineage_for(self.root, storage)

    def latest(self) -> str | None:
        """Path of the checkpoint to resume from (what ``latest`` names, when complete), or None."""
        return latest_checkpoint(self.root)

    def latest_step(self) -> int | None:
        path = self.latest()
        return None if path is None else parse_step(path.rstrip("/").rpartition("/")[2])

    def steps(self) -> list[int]:
        """Steps of all committed checkpoints, ascending."""
        return committed_steps(self.root)

    def load_latest(self, state_dict: dict, **load_kwargs) -> LoadReport:
        """Load the newest committed checkpoint into ``state_dict`` (engine's ``load_state_dict``); a load that
        loses a race with keep_last rotation (CheckpointRemovedError on every rank) retries with the new latest.
        ``load_kwargs`` go to ``load_state_dict``; an unknown one is a TypeError naming the nearest valid one."""
        check_keywords("CheckpointManager.load_latest", load_kwargs, keyword_names(load_state_dict, _MANAGED))
        comm = Comm(self.process_group)
        return retry_removed(
            lambda: run_load(
                state_dict,
                resolve_checkpoint_collective(self.root, comm, self.coordinator_rank),
                self.process_group,
                self.coordinator_rank,
                **load_kwargs,
            ),
            f"load_latest({self.root})",
        )
