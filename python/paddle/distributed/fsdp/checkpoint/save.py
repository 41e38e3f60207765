"""Save path of the checkpoint engine: ``save_state_dict``, ``SaveHandle``, ``release_host_buffers``.

Layout of a committed checkpoint directory ``path``::

    path/
      0_0.safetensors  1_0.safetensors ...   one data file per saving rank (safetensors layout; may be empty)
      metadata.json                          the index (schema in metadata.py), JSON only
      0.metadata                             stock-paddle index (pickle) so stock ``dist.load_state_dict`` can
                                             read the checkpoint; written for stock, NEVER read by this engine
      COMMIT                                 commit record, written last: {"checkpoint_id", "metadata_sha256"}

Save protocol (all ranks call ``save_state_dict`` collectively):

1. every rank validates its records; one ``all_gather_object`` exchanges a digest of each rank's record
   descriptions, the values and any validation error (so all ranks fail together); the full descriptions follow
   in a second exchange unless every rank already holds the write assignment of these digests (a training job
   saves the same records every time; ``planner.AssignmentMemo``). Every rank then has the same assignment:
   replicas are written by the lowest rank that holds them and coverage (each element exactly once) is checked;
   the layout of every rank's file (offsets included) follows from it and is fixed before any byte is written.
2. every rank writes its own file into the staging directory ``<path>.tmp-<checkpoint_id>`` straight from tensor
   memory, computing per-chunk checksums on the way, fsyncs it once, then drops a small ``done`` marker (sizes +
   checksums; made visible atomically by rename) into ``<staging>/.parts/``. A rank that fails drops a
   ``failed`` marker instead.
3. the coordinator waits for all markers (file system polling, no collective), writes and fsyncs
   ``metadata.json``, ``0.metadata`` and ``COMMIT`` (last), fsyncs the directory and swaps it into ``path``
   atomically (``renameat2(RENAME_EXCHANGE)``; two renames where unsupported). The other ranks wait until they
   see ``path/COMMIT`` with this checkpoint's id (or an ``ABORT`` marker); for a CheckpointManager save also
   until ``latest`` names it. Every rank returns only after commit. Steps 2-3 use no collectives, which is what
   makes them safe to run in a background thread.

Saving twice to one path: saving to a path that holds a committed checkpoint replaces it atomically: readers see
either the old or the new checkpoint, never a mix; the old one is deleted only after the new one is in place (by
a non-daemon background thread, so the deletion does not delay the save). A path that exists and is neither
empty nor a checkpoint of this engine is refused.

Two saves in flight: the saves of one process never overlap, whatever thread they come from: a save (sync or
async) first waits for this process's previous save to commit (a load waits too), so they commit in call order
and, to one path, the later one wins. Two jobs saving to one path concurrently each commit atomically and the
last commit wins (a commit that finds the path just created by the other job replaces it); the non-coordinator
ranks of the job whose checkpoint was replaced before they saw it may time out (SaveFailedError) although it
committed. The staging directory is a sibling of ``path``, so all ranks must see the same file system (shared
FS); with node-local disks the commit would only happen on the coordinator's node.

Crashes (kill -9 of any rank at any stage; stages in ``faults.py``, which also holds the test-only
``PADDLE_FSDP_CKPT_FAULT`` hook that proves this): before the rename, ``path`` keeps the previous checkpoint
untouched (or stays absent) and the partial save is only ``<path>.tmp-<id>`` (never loadable at ``path``; safe
to delete; CheckpointManager removes it at its next save). Loading or verifying ``path`` when it is absent
but such a staging directory exists raises / reports IncompleteCheckpointError ("never committed", saying
whether the save failed with an error or was interrupted); the staging directory itself reports
IncompleteCheckpointError too until its COMMIT is written. The survivors of a killed rank do not hang: the
coordinator waits for the other ranks' data, and the other ranks wait for the commit, at most
``commit_timeout`` (default ``CheckpointOptions.commit_timeout``, 1800 s), then raise SaveFailedError; a rank
whose save fails with an error tells the others at once (``failed`` / ``ABORT`` markers); one that fails after its
``done`` marker (its file handed over) follows the coordinator's decision, taken once more right before ``COMMIT``.
A save that failed with an error removes its staging directory before it raises (the last rank to leave it,
abandon.py); only a killed save leaves one behind, for the next save to the path to remove.

Numbered checkpoints with a ``latest`` pointer and keep-last-K: ``manager.py`` (CheckpointManager).

``async_save=True`` (zero-stall): the caller is blocked for the exchange, the write assignment (remembered between
saves) and the copy of the *volatile* tensors only (everything but trainable parameters and optimizer state, see
snapshot.py); the file layout is computed and the parameters and optimizer state are copied to host by the
background thread (one per process; interpreter exit
waits for a save in flight) during the next forward and backward, and every writer of that memory (optimizer
step, in-place Tensor methods, ``set_value``, loads, ``wait_for_snapshot()``; snapshot_guard.py lists what is and
is not intercepted) waits for the copy first, so the checkpoint holds the values at the call. Writing, fsync and
commit follow on the same thread. The snapshot of host tensors goes into one per-process host buffer
(``host_memory.arena``) that is reused by every async save (grown when the state grows) and STAYS RESIDENT between
saves: an async-saving process holds about one extra copy of the bytes it writes, all the time (filling fresh memory
costs page faults, which made the snapshot several times slower than a copy into resident memory).
``release_host_buffers()`` frees it; the next async save allocates it again. Device (and strided) tensors are
snapshotted with their own host copy at the call instead. The returned SaveHandle's ``wait()`` returns after the commit (on
every rank) or raises the background error; an error not collected by ``wait()`` is raised by the next
``save_state_dict``. gloo collectives are never issued from the background thread (they would race with the training
loop's collectives), hence the file-based completion protocol.

Checksums: xxh3-64 (checksums.py) per 256 KiB chunk of each piece (``chunk_bytes`` in metadata.json; ``CheckpointOptions.checksum``), computed on
the tensor memory during the single write pass, piece by piece just before it is written. The coordinator's
choice of algorithm is used by every rank. Loads verify them (load.py).

Node-local disks: saving needs one file system visible to all ranks (see above); loading: see load.py.
``process_group``: ranks, file names and ``coordinator_rank`` are group-local ranks.

Cross-rank helpers shared with the load path (process group, error exchange, file polling): coordination.py.
"""

from __future__ import annotations

import _thread
import atexit
import errno
import json
import logging
import os
import queue
import re
import shutil
import threading
import time
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from . import checksums, faults, host_memory, snapshot, writer
from .abandon import leave_failed_save
from .coordination import Comm, check_target_path, gather_errors, poll, read_json
from .errors import CheckpointError, InvalidStateDictError, SaveFailedError
from .format import commit as format_commit
from .format.metadata import (
    COMMIT_FILE,
    DEFAULT_CHUNK_BYTES,
    LATEST_FILE,
    PARTS_DIR,
    CheckpointMetadata,
    FileMeta,
)
from .gc_pause import gc_paused
from .keywords import STOCK_SAVE_KEYWORDS, check_keywords, keyword_names
from .options import CheckpointOptions, resolve
from .planner import (
    AssignmentMemo,
    WriteAssignment,
    assign_writes,
    assignment_name,
    descs_digest,
    lay_out_files,
    merged_values,
)
from .records import collect
from .snapshot import Snapshot, default_deferred
from .stock.directories import adopt_foreign_entries, check_shared_directory_once, own_entry_names
from .tracing import Tracer

logger = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------------------ async state


class SaveHandle:
    """Handle of an async save. ``wait()`` blocks until the checkpoint is committed or raises its error."""

    def __init__(self, path: str, checkpoint_id: str):
        self.path = path
        self.checkpoint_id = checkpoint_id
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._reported = False
        self._done = threading.Event()

    def _run(self, fn) -> None:
        try:
            fn()
        except BaseException as e:  # surfaced by wait() or the next save
            self._error = e
        finally:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        if not self._done.wait(timeout):
            raise TimeoutError(f"async save to {self.path} still running after {timeout} s")
        if self._thread is not None:
            self._thread.join()
        if self._error is not None and not self._reported:
            self._reported = True
            raise self._error


_pending: SaveHandle | None = None
_pending_lock = threading.Lock()
_save_lock = threading.Lock()


class _BackgroundWorker:
    """The one long-lived thread that runs the background part of async saves (one at a time: saves of a
    process never overlap). Handing a save to a thread that already runs costs the caller a queue put; starting
    a ``threading.Thread`` per save made the caller wait until the new thread was scheduled (``start()`` waits for
    it; tens of ms on a busy machine), so the worker is started with ``_thread.start_new_thread``, which does not
    wait. It never keeps the interpreter alive; ``atexit`` waits for a save still in flight, so a checkpoint
    started before exit is still committed. It runs at normal CPU priority: a lower one (nice 10 for the write
    phase) was measured to slow training down, not to spare it: a writer descheduled while it holds the GIL
    blocks the training thread of its process until the kernel runs it again (priority inversion)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._started = False

    def submit(self, fn) -> None:
        with self._lock:
            if not self._started:
                _thread.start_new_thread(self._loop, ())
                atexit.register(wait_pending, False)
                self._started = True
        self._queue.put(fn)

    def _loop(self) -> None:
        threading.current_thread().name = "ckpt-save"
        while True:
            fn = self._queue.get()
            fn()


_worker = _BackgroundWorker()


class Publisher:
    """What CheckpointManager plugs into a save (duck-typed; this class documents the protocol)."""

    def publish(self) -> None:
        """Coordinator, right after the commit: make the new checkpoint the one ``latest`` names (durably)."""

    def is_published(self) -> bool:
        """Other ranks, after they saw the commit: True once ``publish`` has taken effect."""
        return True

    def cleanup(self) -> None:
        """Coordinator, after ``publish``: remove what is no longer kept (best effort, never raises)."""


def wait_pending(raise_error: bool) -> None:
    """Wait for this process's previous async save. Its uncollected error is raised here when
    ``raise_error`` (the next save), else kept for the next save (a load does not consume it)."""
    global _pending
    with _pending_lock:
        h = _pending
    if h is None:
        return
    h._done.wait()
    if h._thread is not None:
        h._thread.join()
    failed = h._error is not None and not h._reported
    with _pending_lock:
        if _pending is h and (raise_error or not failed):
            _pending = None
    if raise_error and failed:
        h._reported = True
        raise SaveFailedError(f"previous async save to {h.path} failed: {h._error}") from h._error


# ------------------------------------------------------------------------------------------------ save


@dataclass
class _SaveJob:
    path: str
    staging: str
    rank: int
    world: int
    coordinator: int
    checkpoint_id: str
    assignment: WriteAssignment
    values: dict  # the checkpoint's JSON values, but the per-rank ones
    per_rank_keys: tuple  # values every rank gives its own of (saved as the list by rank)
    rank_values: dict  # this rank's values of per_rank_keys (sent to the coordinator in the done marker)
    arrays: list  # uint8 arrays, one per piece this rank writes (in layout order)
    keepalive: list
    chunk_bytes: int
    checksum: str  # algorithm (checksums.py), the same on every rank
    timeout: float
    write_stock: bool
    options: CheckpointOptions = field(default_factory=CheckpointOptions)
    publisher: Any = None  # CheckpointManager hook: publish()/is_published()/cleanup(), see Publisher
    created: float = field(default_factory=time.time)
    release: Any = None  # async save: gives the snapshot arena back (called once the data file is written)
    snapshot: Any = None  # async save: the Snapshot whose deferred copies run first in the background thread
    plan: Any = None  # the SavePlan; laid out by run() (an async save's caller does not wait for it)

    def _written(self) -> None:
        self.arrays = self.keepalive = []  # release snapshot memory early
        release, self.release = self.release, None
        if release is not None:
            release()

    def run(self) -> None:
        """Write, then commit (coordinator) or wait for the commit; every failure is a SaveFailedError naming
        the rank that failed and its cause, on every rank, as soon as it is known (failure markers, below). A
        failed save's staging directory is removed by the last rank to leave it (abandon.py)."""
        try:
            self._run_checked()
        except Exception:
            leave_failed_save(self.staging, self.rank, self.world)
            raise

    def _run_checked(self) -> None:
        try:
            try:
                if self.snapshot is not None:  # async: copy the deferred tensors first (snapshot.py), then write
                    self.snapshot.copy_deferred()
                if self.plan is None:
                    self.plan = lay_out_files(self.assignment, self.values, self.checkpoint_id)
            except BaseException as e:
                _mark_failed(self.staging, self.rank, e)
                raise
            self._run()
        except SaveFailedError:
            raise
        except Exception as e:
            raise SaveFailedError(
                f"save to {self.path} failed: rank {self.rank} failed: {_cause(e)}; the previous checkpoint is "
                f"untouched"
            ) from e
        finally:
            self._written()

    def _run(self) -> None:
        tr = Tracer(f"save rank {self.rank}", self.options)
        parts = os.path.join(self.staging, PARTS_DIR)
        layout = self.plan.files[self.rank]
        data_path = os.path.join(self.staging, layout.name)
        handed_over = False  # this rank's done marker is visible: its data file belongs to the coordinator's commit
        try:
            os.makedirs(parts, exist_ok=True)
            faults.delay("before_data", self.rank)
            faults.point("before_data", self.rank)
            kill_at = layout.size // 2 if faults.hit("mid_data", self.rank) else None
            try:
                digest = None if self.checksum == checksums.NONE else checksums.digest_function(self.checksum)
                size, sums = writer.write_rank_file(
                    data_path,
                    layout.header,
                    self.arrays,
                    self.chunk_bytes,
                    digest,
                    kill_at=kill_at,
                    should_stop=lambda: self._peer_failure(parts),
                    direct=self.options.odirect is not False,
                )
            finally:
                self._written()
            tr.mark("write+fsync")
            # markers need atomic visibility, not durability: the data file itself is already fsynced
            writer.write_file(
                os.path.join(parts, f"{self.rank}.done.json"),
                json.dumps(
                    {"size": size, "checksums": sums, "rank_values": self.rank_values}, allow_nan=False
                ).encode(),
                fsync=False,
                atomic=True,
            )
            handed_over = True
            faults.delay("handed_over", self.rank)
            faults.point("after_data", self.rank)
        except _PeerFailed as e:  # another rank failed first: stop writing, free the space, say who failed
            _remove_quietly(data_path)
            err = SaveFailedError(f"save to {self.path} aborted: {e}; the previous checkpoint is untouched")
            if self.rank == self.coordinator:  # the decision: a rank that failed after its hand-over waits for it
                _mark_aborted(self.staging, self.rank, err)
            raise err from None
        except BaseException as e:
            _mark_failed(self.staging, self.rank, e)
            if handed_over and self.rank != self.coordinator and isinstance(e, Exception):
                # the coordinator may be committing with this rank's (complete, fsynced) file already: deleting it
                # could leave a committed checkpoint without it, and raising alone would make the ranks disagree.
                # The coordinator decides (it checks the failure markers once more right before the commit record);
                # this rank follows its decision
                self._follow_decision(parts, data_path, e, tr)
                return
            if isinstance(e, Exception):  # (an interrupt leaves the staging as a kill would)
                _remove_quietly(data_path)
            raise
        if self.rank == self.coordinator:
            try:
                self._commit(parts, tr)
            except BaseException as e:
                _mark_aborted(self.staging, self.rank, e)  # tells the waiting ranks at once
                if isinstance(e, Exception):  # (an interrupt leaves the staging as a kill would)
                    _remove_quietly(data_path)
                if isinstance(e, SaveFailedError) or not isinstance(e, Exception):
                    raise
                raise SaveFailedError(
                    f"save to {self.path} failed: rank {self.rank} (the coordinator) failed to commit: {_cause(e)}; "
                    f"the previous checkpoint is untouched"
                ) from e
            faults.point("after_rename", self.rank)
            if self.publisher is not None:
                try:
                    self.publisher.publish()
                except Exception as e:
                    # committed, but `latest` could not be moved: the waiting ranks must not wait for it
                    _mark_aborted(self.staging, self.rank, e)
                    raise SaveFailedError(
                        f"save to {self.path}: the checkpoint was committed, but rank {self.rank} could not move "
                        f"the '{LATEST_FILE}' pointer: {_cause(e)}"
                    ) from e
                tr.mark("publish")
                faults.point("before_prune", self.rank)
                self.publisher.cleanup()
        else:
            self._wait_commit(parts)
            tr.mark("wait-commit")
        tr.done()

    def _peer_failure(self, parts: str) -> None:
        """Raise _PeerFailed when another rank reported a failure (checked between slabs of a long write)."""
        failed = failures(self.staging)
        failed.pop(self.rank, None)
        if failed:
            r, why = sorted(failed.items())[0]
            raise _PeerFailed(f"rank {r} failed: {why}")

    def _commit(self, parts: str, tr: Tracer) -> None:
        """Coordinator: wait for every rank's data, write metadata.json, the stock index and COMMIT (last) into
        the staging directory, then swap it into ``path`` atomically."""
        status = self._wait_for_ranks(parts)
        tr.mark("wait-ranks")
        faults.point("before_metadata", self.rank)
        with gc_paused():  # the index of every piece: many small objects (gc_pause.py)
            md = self._metadata(status)
            # inside the (invisible) staging directory plain write+fsync is enough; order: data files (fsynced by
            # their ranks), metadata, stock index, then the commit record, then the directory, then the rename
            data = format_commit.write_metadata(self.staging, md, self.write_stock)
        tr.mark("metadata")
        faults.point("before_commit", self.rank)
        # the last point at which the save can still be aborted: a rank that failed after handing its data over
        # (its done marker seen above) waits for this decision (_follow_decision)
        late = failures(self.staging)
        if late:
            r, why = sorted(late.items())[0]
            raise SaveFailedError(
                f"save to {self.path} aborted: rank {r} failed: {why}; the previous checkpoint is untouched"
            )
        shutil.rmtree(parts, ignore_errors=True)
        format_commit.write_commit(self.staging, self.checkpoint_id, data)
        writer.fsync_dir(self.staging)
        tr.mark("commit-record")
        faults.point("before_rename", self.rank)
        # entries of other tools in the target directory are kept (hard links), then the directory is swapped
        adopt_foreign_entries(self.path, self.staging, own_entry_names(self.path))
        writer.replace_dir(self.staging, self.path, f"{self.path}.old-{self.checkpoint_id}")
        tr.mark("rename")

    def _wait_for_ranks(self, parts: str) -> dict:
        """Every rank's ``done`` marker (rank -> ("done", sizes + checksums)); SaveFailedError on the first
        ``failed`` marker or when a rank is silent for ``timeout``."""

        def all_parts():
            failed = failures(self.staging)
            if failed:
                return {"failed": failed}
            status = {}
            for r in range(self.world):
                d = read_json(os.path.join(parts, f"{r}.done.json"))
                if d is not None:
                    status[r] = d
            return status if len(status) == self.world else None

        try:
            status = poll(all_parts, self.timeout, f"all {self.world} ranks to finish writing {self.staging}")
        except SaveFailedError:
            have = [r for r in range(self.world) if os.path.exists(os.path.join(parts, f"{r}.done.json"))]
            missing = sorted(set(range(self.world)) - set(have))
            raise SaveFailedError(
                f"save to {self.path} aborted: ranks {missing} did not finish writing within {self.timeout:g} s "
                f"(did they die?); the previous checkpoint is untouched"
            ) from None
        if "failed" in status:
            r, why = sorted(status["failed"].items())[0]
            raise SaveFailedError(
                f"save to {self.path} aborted: rank {r} failed: {why}; the previous checkpoint is untouched"
            )
        return status

    def _metadata(self, status: dict) -> CheckpointMetadata:
        """The index of the checkpoint: the plan, with the sizes and checksums the ranks reported."""
        values = dict(self.plan.values)
        for key in self.per_rank_keys:
            values[key] = [status[r]["rank_values"].get(key) for r in range(self.world)]
        md = CheckpointMetadata(
            checkpoint_id=self.checkpoint_id,
            world_size=self.world,
            chunk_bytes=self.chunk_bytes,
            checksum=self.checksum,
            created_unix=self.created,
            values=values,
        )
        for r in range(self.world):
            layout = self.plan.files[r]
            done = status[r]
            if int(done["size"]) != layout.size or len(done["checksums"]) != len(layout.pieces):
                raise SaveFailedError(f"rank {r} reported a file that does not match the plan")
            md.files[layout.name] = FileMeta(rank=r, size=layout.size)
            for (_key, piece), sums in zip(layout.pieces, done["checksums"]):
                piece.checksums = [int(c) for c in sums]
        md.tensors = self.plan.tensors
        return md

    def _follow_decision(self, parts: str, data_path: str, error: Exception, tr: Tracer) -> None:
        """This rank failed after handing its data over: the coordinator's decision is the outcome on every rank.
        Aborted: raise this rank's own error (named by run()). Committed (the failure came after the decision;
        the checkpoint is complete, this rank's file included): return like every other rank, with the error
        logged."""
        try:
            self._wait_commit(parts, ignore_own_failure=True)
        except SaveFailedError:
            _remove_quietly(data_path)
            raise error from None
        stray = os.path.join(self.path, PARTS_DIR)  # our marker, if written after the coordinator removed .parts
        for n in os.listdir(stray) if os.path.isdir(stray) else []:
            if n.startswith(f"{self.rank}.failed"):
                _remove_quietly(os.path.join(stray, n))
        try:
            os.rmdir(stray)
        except OSError:
            pass
        logger.error(
            "save to %s: rank %d failed after its data was complete (%s); the coordinator had committed already, "
            "so the checkpoint is complete and this rank returns like the others",
            self.path,
            self.rank,
            _cause(error),
        )
        tr.done()

    def _wait_commit(self, parts: str, ignore_own_failure: bool = False) -> None:
        """Wait until the coordinator committed (and, for a CheckpointManager save, moved ``latest``)."""
        commit_path = os.path.join(self.path, COMMIT_FILE)
        seen_commit = False

        def mine() -> bool:
            c = read_json(commit_path)
            return isinstance(c, dict) and c.get("checkpoint_id") == self.checkpoint_id

        def state():
            nonlocal seen_commit
            if mine():
                seen_commit = True
            abort = aborted(self.staging)
            if abort is not None:
                return ("aborted", abort)
            if seen_commit:
                if self.publisher is None or self.publisher.is_published():
                    return ("committed", None)
                return None
            failed = failures(self.staging)
            if ignore_own_failure:
                failed.pop(self.rank, None)
            if failed:
                return ("failed", sorted(failed.items())[0])
            if not os.path.isdir(self.staging) and not mine():
                return ("aborted", "its staging directory was removed before the commit")
            return None

        try:
            st, info = poll(state, self.timeout, f"rank {self.coordinator} to commit {self.path}")
        except SaveFailedError:
            if seen_commit:
                raise SaveFailedError(
                    f"save to {self.path}: rank {self.coordinator} committed the checkpoint but did not move the "
                    f"'{LATEST_FILE}' pointer within {self.timeout:g} s (did it die?)"
                ) from None
            raise SaveFailedError(
                f"save to {self.path} did not commit: rank {self.coordinator} (the coordinator) did not commit "
                f"within {self.timeout:g} s (did it die?); the previous checkpoint is untouched"
            ) from None
        if st == "failed":
            r, why = info
            _remove_quietly(os.path.join(self.staging, self.plan.files[self.rank].name))
            raise SaveFailedError(
                f"save to {self.path} aborted: rank {r} failed: {why}; the previous checkpoint is untouched"
            )
        if st == "aborted":
            _remove_quietly(os.path.join(self.staging, self.plan.files[self.rank].name))
            if seen_commit:
                raise SaveFailedError(f"save to {self.path}: committed, but the coordinator failed after: {info}")
            raise SaveFailedError(
                f"save to {self.path} aborted by rank {self.coordinator} (the coordinator): {info}; the previous "
                f"checkpoint is untouched"
            )


# ------------------------------------------------------------------------------------------------ failure markers
# A failing rank (and an aborting coordinator) leaves markers in <staging>/.parts that every other rank polls.
# The details (the full cause) go first into a file made visible atomically, when the file system still takes it;
# then an empty marker whose *name* carries the cause (errno name; an empty file needs no data block, so it can be
# created on a full disk). That order is what gives every rank the same message: a rank that sees any marker sees
# the details too, unless they could not be written, and then the name alone still says errno and strerror.

_FAILED_RE = re.compile(r"^(\d+)\.failed(?:\.([A-Za-z0-9_]+))?$")
_ABORT_RE = re.compile(r"^ABORT(?:\.([A-Za-z0-9_]+))?$")


class _PeerFailed(Exception):
    """Another rank reported a failure while this one was still writing."""


def _cause(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _tag(e: BaseException) -> str:
    """The marker-name form of a cause: the errno name of an OSError, else the exception class name."""
    if isinstance(e, OSError) and e.errno is not None:
        return errno.errorcode.get(e.errno, type(e).__name__)
    return re.sub(r"[^A-Za-z0-9_]", "_", type(e).__name__)[:64]


def _touch(path: str) -> None:
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644))
    except OSError:
        pass


def _remove_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def failures(staging: str) -> dict[int, str]:
    """Ranks that reported a failure into ``staging`` and their causes."""
    parts = os.path.join(staging, PARTS_DIR)
    try:
        names = os.listdir(parts)
    except OSError:
        return {}
    out: dict[int, str] = {}
    for n in names:
        m = _FAILED_RE.match(n)
        if m is None:
            continue
        r = int(m.group(1))
        if m.group(2) is None and r in out:
            continue
        detail = read_json(os.path.join(parts, f"{r}.failed.json"))
        if isinstance(detail, dict) and isinstance(detail.get("error"), str):
            out[r] = detail["error"]
        elif m.group(2) is not None and m.group(2) != "json":
            out[r] = _describe_tag(m.group(2))
    return out


def _describe_tag(tag: str) -> str:
    """The cause a marker name carries, as a message: ``EIO`` -> ``OSError EIO (Input/output error)``."""
    code = getattr(errno, tag, None)
    return f"OSError {tag} ({os.strerror(code)})" if isinstance(code, int) else tag


def aborted(staging: str) -> str | None:
    """The coordinator's reason when it aborted the save in ``staging`` (None: not aborted)."""
    parts = os.path.join(staging, PARTS_DIR)
    try:
        names = os.listdir(parts)
    except OSError:
        return None
    tags = [m.group(1) for m in map(_ABORT_RE.match, names) if m is not None]
    if not tags:
        return None
    try:
        with open(os.path.join(parts, "ABORT"), "rb") as f:
            reason = f.read(4096).decode(errors="replace")
        if reason:
            return reason
    except OSError:
        pass
    tag = next((t for t in tags if t), None)
    return _describe_tag(tag) if tag else "unknown reason"


def _mark_aborted(staging: str, rank: int, e: BaseException) -> None:
    parts = os.path.join(staging, PARTS_DIR)
    try:
        os.makedirs(parts, exist_ok=True)
    except OSError:
        return
    try:  # details first: see the note on failure markers above
        writer.write_file(os.path.join(parts, "ABORT"), _cause(e).encode(), fsync=False, atomic=True)
    except OSError:
        pass
    faults.delay("markers", rank)
    _touch(os.path.join(parts, f"ABORT.{_tag(e)}"))


def release_host_buffers() -> bool:
    """Free the host buffer that async saves keep resident for their snapshots (and loads borrow as staging).

    Returns False (and frees nothing) while a save or load of this process is using it. The next async save
    allocates it again.
    """
    freed = host_memory.arena.free()
    return snapshot.snapshot_staging.free() and freed


def _mark_failed(staging: str, rank: int, e: BaseException) -> None:
    try:
        parts = os.path.join(staging, PARTS_DIR)
        os.makedirs(parts, exist_ok=True)
    except OSError:
        return
    try:  # details first: see the note on failure markers above
        writer.write_file(
            os.path.join(parts, f"{rank}.failed.json"),
            json.dumps({"error": _cause(e)}).encode(),
            fsync=False,
            atomic=True,
        )
    except OSError:
        pass
    faults.delay("markers", rank)
    _touch(os.path.join(parts, f"{rank}.failed.{_tag(e)}"))


def remove_failed_stagings(path: str) -> list[str]:
    """Remove the staging directories of earlier saves to ``path`` that failed with an error (they carry failure
    or abort markers; a save still running, or killed, has none and is left alone). Best effort."""
    parent, base = os.path.split(path)
    try:
        names = [n for n in os.listdir(parent) if n.startswith(f"{base}.tmp-")]
    except OSError:
        return []
    import shutil

    removed = []
    for n in names:
        staging = os.path.join(parent, n)
        if failures(staging) or aborted(staging) is not None:
            shutil.rmtree(staging, ignore_errors=True)
            removed.append(n)
    return removed


def save_state_dict(
    state_dict: dict,
    path: str,
    process_group=None,
    coordinator_rank: int = 0,
    *,
    async_save: bool = False,
    commit_timeout: float | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    write_stock_metadata: bool = True,
    deferred_keys: Collection[str] | None = None,
    per_rank_values: Collection[str] = (),
    options: CheckpointOptions | None = None,
    _publisher: Publisher | None = None,
    **unused_stock_kwargs,
) -> SaveHandle | None:
    """Save ``state_dict`` collectively into the checkpoint directory ``path`` (see the module docstring).

    ``deferred_keys`` (async saves): keys whose tensors change only through an optimizer step or a direct write
    the engine intercepts (snapshot_guard.py); their host copy runs after the call returns (snapshot.py).
    Default: the keys whose tensor is a trainable paddle Parameter. Every other tensor is copied at the call.
    ``per_rank_values``: JSON-value keys every rank gives its own value for (e.g. its RNG state); saved as the
    list of all ranks' values by rank (None for a rank without one), sent to the coordinator with the rank's
    data (no collective of their own).
    ``options`` (CheckpointOptions; None: ``CheckpointOptions.from_env()``, read now) sets the checksum
    algorithm, commit timeout and tracing; ``commit_timeout`` overrides ``options.commit_timeout``.
    ``_publisher`` is CheckpointManager's hook (moves ``latest`` after the commit); not for direct use.
    Stock's keywords ``unique_id``, ``safetensors``, ``save_replicas`` are accepted and ignored (one version per
    directory, safetensors); any other keyword is a TypeError naming the nearest valid one (keywords.py).
    """
    check_keywords("save_state_dict", unused_stock_kwargs, keyword_names(save_state_dict) + STOCK_SAVE_KEYWORDS)
    with _save_lock:  # saves of one process never overlap, whatever thread they come from
        return _save_locked(
            state_dict,
            path,
            process_group,
            coordinator_rank,
            async_save,
            commit_timeout,
            chunk_bytes,
            write_stock_metadata,
            deferred_keys,
            per_rank_values,
            options,
            _publisher,
        )


@dataclass
class _Local:
    """What this rank brings to the exchange of a save (step 1); ``error`` is reported to every rank."""

    records: list = field(default_factory=list)
    values: dict = field(default_factory=dict)
    descs: list = field(default_factory=list)
    algorithm: str | None = None
    error: BaseException | None = None
    all_values: list = field(default_factory=list)  # every rank's values, by rank (filled by the exchange)
    all_paths: list = field(default_factory=list)  # every rank's target path, by rank (filled by the exchange)


def _save_locked(
    state_dict: dict,
    path: str,
    process_group,
    coordinator_rank: int,
    async_save: bool,
    commit_timeout: float | None,
    chunk_bytes: int,
    write_stock_metadata: bool,
    deferred_keys: Collection[str] | None,
    per_rank_values: Collection[str],
    options: CheckpointOptions | None,
    publisher: Publisher | None,
) -> SaveHandle | None:
    """The save protocol, in steps: validate -> exchange + assignment -> piece sources -> file layout (an async
    save: on the background thread) -> write + commit."""
    try:
        opts, opts_error = resolve(options), None
    except CheckpointError as e:  # a malformed PADDLE_FSDP_CKPT_* variable: reported by the exchange below
        opts, opts_error = CheckpointOptions(), e
    tr = Tracer("save (calling thread)", opts)
    wait_pending(raise_error=True)
    tr.mark("wait-previous")
    path = os.path.abspath(os.fspath(path))
    comm = Comm(process_group)
    if not 0 <= coordinator_rank < comm.world:
        raise InvalidStateDictError(f"coordinator_rank {coordinator_rank} is outside the group of {comm.world}")
    timeout = opts.commit_timeout if commit_timeout is None else float(commit_timeout)

    local = _validate(state_dict, path, comm.rank, coordinator_rank, opts, opts_error)
    tr.mark("validate")
    # per-rank values reach the coordinator in the ranks' done markers, not through the exchange: only it needs
    # them (an RNG state is ~13 KB a rank, which would take every save's exchange to a second round)
    rank_values = {key: local.values[key] for key in per_rank_values if key in local.values}
    local.values.update(dict.fromkeys(rank_values))  # the key still goes with the exchange (its checks)
    checkpoint_id, algorithm, assignment, values = _exchange_and_assign(comm, local, coordinator_rank, tr, path)
    # different or node-local directories: fail now on every rank, not at the commit timeout
    check_shared_directory_once(path, local.all_paths, comm, coordinator_rank)
    staging = f"{path}.tmp-{checkpoint_id}"
    my_keys = assignment.keys_of(comm.rank)
    snap = plan = None
    if async_save:
        snap = _snapshot(my_keys, local, staging, comm.rank, comm.world, deferred_keys, opts)
        arrays, keep, release = snap.arrays, snap.keep, snap.written
    else:
        plan = lay_out_files(assignment, values, checkpoint_id)
        arrays, keep, release = _piece_sources(my_keys, local, staging, comm.rank, comm.world)
    tr.mark("snapshot (volatile part)" if async_save else "views")
    job = _SaveJob(
        path=path,
        staging=staging,
        rank=comm.rank,
        world=comm.world,
        coordinator=coordinator_rank,
        checkpoint_id=checkpoint_id,
        assignment=assignment,
        values=values,
        per_rank_keys=tuple(per_rank_values),
        rank_values=rank_values,
        plan=plan,
        arrays=arrays,
        keepalive=keep,
        chunk_bytes=chunk_bytes,
        checksum=algorithm,
        timeout=timeout,
        write_stock=write_stock_metadata,
        options=opts,
        publisher=publisher,
        release=release,
        snapshot=snap,
    )
    if not async_save:
        job.run()
        tr.mark("write+commit")
        tr.done()
        return None
    handle = _start_in_background(job)
    tr.mark("hand-over")
    tr.done()
    return handle


@gc_paused()
def _validate(
    state_dict: dict,
    path: str,
    rank: int,
    coordinator_rank: int,
    opts: CheckpointOptions,
    opts_error: BaseException | None,
) -> _Local:
    """Step 1: this rank's records, their small descriptions and the checksum algorithm; the target path check
    (coordinator). Never raises: the error goes to the exchange, so no rank is left waiting."""
    local = _Local()
    try:
        if opts_error is not None:
            raise opts_error
        local.algorithm = opts.checksum_algorithm()
        local.records, local.values = collect(state_dict)
        local.descs = [r.desc().to_wire() for r in local.records]
        if rank == coordinator_rank:
            remove_failed_stagings(path)  # what earlier failed saves left (their space is needed now)
            check_target_path(path)
    except CheckpointError as e:  # reported to every rank by the exchange
        local.error = e
    except Exception as e:  # an I/O error or a bug: named, with the rank and the cause
        local.error = SaveFailedError(f"save to {path} failed: rank {rank} failed: {_cause(e)}")
        local.error.__cause__ = e
    return local


_assignments = AssignmentMemo()  # used under _save_lock only


@gc_paused()
def _exchange_and_assign(comm: Comm, local: _Local, coordinator_rank: int, tr: Tracer, path: str):
    """Step 2: one exchange of every rank's description digest, values and target path (and errors: all ranks
    fail together), then the same checked write assignment on every rank: remembered when every rank holds it
    for these digests, else from a second exchange of the full descriptions (decided alike on every rank, from
    the first one). Returns ``(checkpoint_id, algorithm, assignment, values)``: the coordinator's id and algorithm,
    the values of the lowest rank that has each key."""
    my_id = uuid.uuid4().hex
    ok = local.error is None
    gathered = gather_errors(
        comm,
        local.error,
        (
            descs_digest(local.descs) if ok else b"",
            _assignments.names() if ok else (),
            local.values if ok else {},
            my_id,
            local.algorithm,
            path,
        ),
    )
    local.all_paths = [g[5] for g in gathered]
    checkpoint_id, algorithm = gathered[coordinator_rank][3], gathered[coordinator_rank][4]
    local.all_values = [g[2] for g in gathered]
    values = merged_values(local.all_values)
    name = assignment_name([g[0] for g in gathered], values)
    tr.mark("exchange")
    if all(name in g[1] for g in gathered):
        assignment = _assignments.get(name)
    else:
        assignment = assign_writes(comm.all_gather_object(local.descs), values)
        _assignments.put(name, assignment)
    tr.mark("assign")
    return checkpoint_id, algorithm, assignment, values


@gc_paused()
def _piece_sources(keys: list[str], local: _Local, staging: str, rank: int, world: int) -> tuple[list, list, Any]:
    """Step 3 of a sync save: what this rank writes, in layout order: lazy views of the tensors' own memory
    (device tensors staged in batches while writing, snapshot.lazy_views). Returns ``(arrays, [], None)``."""
    by_key = {r.key: r for r in local.records}
    try:
        return snapshot.lazy_views([by_key[key].tensor for key in keys]), [], None
    except BaseException as e:
        _mark_failed(staging, rank, e)  # the coordinator must not wait for this rank until the timeout
        if isinstance(e, Exception):
            leave_failed_save(staging, rank, world)
        if isinstance(e, Exception) and not isinstance(e, CheckpointError):
            raise SaveFailedError(f"save to {staging} failed: rank {rank} failed: {_cause(e)}") from e
        raise


@gc_paused()
def _snapshot(
    keys: list[str], local: _Local, staging: str, rank: int, world: int, deferred_keys, opts: CheckpointOptions
) -> Snapshot:
    """Step 3 of an async save: the Snapshot of what this rank writes (layout order): volatile tensors copied
    now, deferred ones (``deferred_keys``, default: trainable Parameters) registered for the background copy."""
    by_key = {r.key: r for r in local.records}
    if deferred_keys is None:
        is_deferred = default_deferred
    else:
        wanted = set(deferred_keys)

        def is_deferred(record) -> bool:
            return record.key in wanted

    try:
        return Snapshot([by_key[key] for key in keys], is_deferred, hugepages=opts.hugepages)
    except BaseException as e:
        _mark_failed(staging, rank, e)  # the coordinator must not wait for this rank until the timeout
        if isinstance(e, Exception):
            leave_failed_save(staging, rank, world)
        raise


def _start_in_background(job: _SaveJob) -> SaveHandle:
    """Step 4 of an async save: deferred copies, write + commit on the background worker; the handle is this
    process's pending save (the next save or load waits for it)."""
    global _pending
    handle = SaveHandle(job.path, job.checkpoint_id)
    with _pending_lock:
        _pending = handle
    try:
        _worker.submit(lambda: handle._run(job.run))
    except BaseException:
        with _pending_lock:
            if _pending is handle:
                _pending = None
        if job.snapshot is not None:
            job.snapshot.cancel()
        job._written()
        raise
    return handle
