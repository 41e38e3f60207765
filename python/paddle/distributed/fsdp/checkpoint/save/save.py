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
   descriptions, the values and any validation error (so all ranks fail together). Unless every rank already
   holds the write assignment of these digests (a training job saves the same records every time;
   ``planner.AssignmentMemo``), the descriptions go to the coordinator only, which assigns the writes (replicas
   written once, coverage of each element exactly once checked: assign.py) and sends each rank its own part or
   the error that refuses the save, on every rank alike (first_save.py). The layout of each rank's file
   (offsets included) follows from its part and is fixed before any byte is written.
2. every rank writes its own data object into the staging location (``<path>.tmp-<checkpoint_id>`` for the
   local backend) through the storage interface (io/storage.py) straight from tensor memory, computing per-chunk
   checksums on the way, durably, then hands it over (sizes + checksums) through the save's channel (the TCP
   store, channel.py). A rank that fails says so through the channel at once.
3. the coordinator waits for every hand-over, writes ``metadata.json``, ``0.metadata`` and ``COMMIT`` (last) and
   publishes the staging at ``path`` atomically (commit.py). The other ranks wait for the channel's "committed"
   (for a CheckpointManager save also "published": ``latest`` moved). Every rank returns only after commit.
   Steps 2-3 use no collectives, which is what makes them safe to run in a background thread; every rank beats
   a heartbeat through the store, so a rank killed with -9 is named by the others within
   ``CheckpointOptions.heartbeat_lease`` seconds.

Saving twice to one path: saving to a path that holds a committed checkpoint replaces it atomically: readers see
either the old or the new checkpoint, never a mix; the old one is deleted only after the new one is in place (by
a non-daemon background thread, so the deletion does not delay the save). A path that exists and is neither
empty nor a checkpoint of this engine is refused.

Two saves in flight: the saves of one process never overlap, whatever thread they come from: a save (sync or
async) first waits for this process's previous save to commit (a load waits too), so they commit in call order
and, to one path, the later one wins. Two jobs saving to one path concurrently each commit atomically and the
last commit wins (a commit that finds the path just created by the other job replaces it); the non-coordinator
ranks of the job whose checkpoint was replaced before they saw it may time out (SaveFailedError) although it
committed. Node-local storage (every rank sees only its own ``path``): the coordinator's ``path`` holds the
metadata and its data file, every other rank publishes its own data file at its own ``path``; gathered into one
directory again (copied, re-mounted) the checkpoint loads at any world size.

Crashes (kill -9 of any rank at any stage; the stages, and what is durable at each, in docs/save-load.md; the
tests kill at each one through a wrapped Storage): before the rename, ``path`` keeps the previous checkpoint
untouched (or stays absent) and the partial save is only ``<path>.tmp-<id>`` (never loadable at ``path``; safe
to delete; CheckpointManager removes it at its next save). Loading or verifying ``path`` when it is absent
but such a staging directory exists raises / reports IncompleteCheckpointError ("never committed", saying
whether the save failed with an error or was interrupted); the staging directory itself reports
IncompleteCheckpointError too until its COMMIT is written. The survivors of a killed rank do not hang: they see
its heartbeat stop (``heartbeat_lease``) and raise SaveFailedError naming it; in any case the coordinator waits
for the other ranks' data, and the other ranks wait for the commit, at most ``CheckpointOptions.commit_timeout``
(default 1800 s); a rank whose save fails with an error tells the others at once
(channel) and records why in the staging (markers.py); one that fails after its hand-over follows the
coordinator's decision, taken once more right before ``COMMIT``.

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
loop's collectives), hence the store-based completion protocol.

Checksums: xxh3-64 (checksums.py) per 256 KiB chunk of each piece (``chunk_bytes`` in metadata.json; ``CheckpointOptions.checksum``), computed on
the tensor memory during the single write pass, piece by piece just before it is written. The coordinator's
choice of algorithm is used by every rank. Loads verify them (load/load.py).

Node-local disks: see "Saving twice" above; loading: see load/load.py.
``process_group``: ranks, file names and ``coordinator_rank`` are group-local ranks.

Cross-rank helpers shared with the load path (process group, error exchange): coordination.py. This module is
the calling thread's part; request.py one call's inputs, options and storage backend, resolved once at the
door and handed to every step; background.py the one save in flight; commit.py steps 2-3; markers.py the records.
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

from ...keywords import STOCK_SAVE_KEYWORDS, check_keywords, keyword_names
from .. import host_memory, snapshot
from ..background import SaveHandle, start_in_background, wait_pending
from ..codec_choice import choose_codec
from ..coordination import Comm, check_target_path, gather_errors, stage_error
from ..encoded_write import RAW, default_threads
from ..errors import CheckpointError, DirectoryMismatchError, InvalidStateDictError, SaveFailedError
from ..first_save import exchange_assignment
from ..gc_pause import gc_paused
from ..options import CheckpointOptions
from ..planner import (
    AssignmentMemo,
    assignment_name,
    chunk_for,
    descs_digest,
    merged_values,
    rank_plan,
)
from ..records import collect
from ..snapshot import Snapshot, default_deferred
from ..tracing import Tracer
from .abandon import leave_failed_save, leave_timeout
from .commit import Publisher, SaveJob, open_channel
from .derive import plan_derived
from .markers import cause, mark_failed, remove_failed_stagings
from .request import SaveRequest, save_request

logger = logging.getLogger(__name__)

_save_lock = __import__("threading").Lock()
_PUBLISH_MANAGED = ("state_dict", "path", "process_group", "coordinator_rank")  # save_and_publish's own arguments

__all__ = ["SaveHandle", "Publisher", "release_host_buffers", "save_and_publish", "save_state_dict", "wait_pending"]


def release_host_buffers() -> bool:
    """Free the host buffer that async saves keep resident for their snapshots (and loads borrow as staging).

    Returns False (and frees nothing) while a save or load of this process is using it. The next async save
    allocates it again.
    """
    freed = host_memory.arena.free()
    return snapshot.snapshot_staging.free() and freed


def save_state_dict(
    state_dict: dict,
    path: str,
    process_group=None,
    coordinator_rank: int = 0,
    *,
    async_save: bool = False,
    chunk_bytes: int | None = None,
    write_stock_metadata: bool = True,
    deferred_keys: Collection[str] | None = None,
    per_rank_values: Collection[str] = (),
    options: CheckpointOptions | None = None,
    derive_weights: bool | None = None,
    **unused_stock_kwargs,
) -> SaveHandle | None:
    """Save ``state_dict`` collectively into the checkpoint at ``path`` (see the module docstring).

    ``deferred_keys`` (async saves): keys whose tensors change only through an optimizer step or a direct write
    the engine intercepts (snapshot_guard.py); their host copy runs after the call returns (snapshot.py).
    Default: the keys whose tensor is a trainable paddle Parameter. Every other tensor is copied at the call.
    ``per_rank_values``: JSON-value keys every rank gives its own value for (e.g. its RNG state); saved as the
    list of all ranks' values by rank (None for a rank without one), sent to the coordinator with the rank's
    data (no collective of their own).
    ``chunk_bytes``: bytes per checksummed chunk; None: ``planner.chunk_for`` (256 KiB, smaller for the small
    pieces of saves by hundreds of ranks, so that a resharded load reads little beyond its share).
    ``derive_weights``: leave out each bf16/fp16 weight ``<k>`` that is exactly ``<k>.master_weight`` cast
    (save/derive.py; loads derive it); None: ``options.derive_weights`` (default True,
    ``PADDLE_FSDP_CKPT_DERIVE_WEIGHTS``).
    ``options`` (CheckpointOptions; None: ``CheckpointOptions.from_env()``, read now) sets the checksum
    algorithm, commit timeout, storage backend and tracing: every "how" of a save is there, not a keyword.
    Stock's keywords ``unique_id``, ``safetensors``, ``save_replicas`` are accepted and ignored (one version per
    directory, safetensors); any other keyword is a TypeError naming the nearest valid one (keywords.py).
    """
    check_keywords("save_state_dict", unused_stock_kwargs, keyword_names(save_state_dict) + STOCK_SAVE_KEYWORDS)
    return run_save(
        save_request(
            state_dict,
            path,
            process_group,
            coordinator_rank,
            None,
            async_save=async_save,
            chunk_bytes=chunk_bytes,
            write_stock_metadata=write_stock_metadata,
            deferred_keys=deferred_keys,
            per_rank_values=per_rank_values,
            options=options,
            derive_weights=derive_weights,
        )
    )


def save_and_publish(
    state_dict: dict, path: str, publisher: Publisher, process_group=None, coordinator_rank: int = 0, **kwargs
) -> SaveHandle | None:
    """``save_state_dict`` whose coordinator calls ``publisher`` after the commit, and whose other ranks return
    only once it has published (CheckpointManager: moves ``latest``, then prunes). ``kwargs``: those of
    ``save_state_dict``."""
    check_keywords("save_and_publish", kwargs, keyword_names(save_state_dict, _PUBLISH_MANAGED))
    return run_save(save_request(state_dict, path, process_group, coordinator_rank, publisher, **kwargs))


def run_save(req: SaveRequest) -> SaveHandle | None:
    """Carry out one save request (request.py): the save behind every door (``save_state_dict``,
    ``save_and_publish``, CheckpointManager.save, ``save_checkpoint``, the stock hook), each of which checked its
    own keywords, so an unknown keyword is reported once, naming the door called."""
    publisher = req.publisher
    if publisher is not None and not all(
        callable(getattr(publisher, m, None)) for m in ("publish", "is_published", "cleanup")
    ):
        raise InvalidStateDictError(
            f"publisher must have publish(), is_published() and cleanup(), got {type(publisher).__name__}"
        )
    with _save_lock:  # saves of one process never overlap, whatever thread they come from
        return _save_locked(req)


@dataclass
class _Local:
    """What this rank brings to the exchange of a save (step 1); ``error`` is reported to every rank."""

    records: list = field(default_factory=list)
    values: dict = field(default_factory=dict)
    descs: list = field(default_factory=list)
    algorithm: str | None = None
    codec: str | None = None  # this rank's choice before the exchange; the coordinator's after it
    error: BaseException | None = None
    all_values: list = field(default_factory=list)  # every rank's values, by rank (filled by the exchange)
    all_paths: list = field(default_factory=list)  # every rank's target path, by rank (filled by the exchange)


def _save_locked(req: SaveRequest) -> SaveHandle | None:
    """The save protocol, in steps: validate -> exchange + assignment -> piece sources -> file layout (an async
    save: on the background thread) -> write + commit."""
    opts, path, coordinator_rank, async_save = req.options, req.path, req.coordinator_rank, req.async_save
    tr = Tracer("save (calling thread)", opts)
    previous_error = None
    try:
        wait_pending(raise_error=True)
    except SaveFailedError as e:  # this rank's previous async save: every rank hears of it in the exchange
        previous_error = e
    tr.mark("wait-previous")
    if req.path_error is not None and not isinstance(req.path_error, CheckpointError):
        raise req.path_error  # not a path at all (TypeError): the caller's bug, the same on every rank
    comm = Comm(req.process_group)
    if not 0 <= coordinator_rank < comm.world:
        raise InvalidStateDictError(f"coordinator_rank {coordinator_rank} is outside the group of {comm.world}")

    req, derived_field = plan_derived(req, comm)  # (collective when on: the weights left out, on every rank)
    tr.mark("derive")
    local = _validate(req, comm.rank, previous_error)
    tr.mark("validate")
    # per-rank values reach the coordinator in the ranks' done markers, not through the exchange: only it needs
    # them (an RNG state is ~13 KB a rank, which would take every save's exchange to a second round)
    rank_values = {key: local.values[key] for key in req.per_rank_values if key in local.values}
    local.values.update(dict.fromkeys(rank_values))  # the key still goes with the exchange (its checks)
    checkpoint_id, algorithm, assignment, values = _exchange_and_assign(comm, local, coordinator_rank, tr, path)
    _check_names(local.all_paths, coordinator_rank)  # decided alike on every rank, from the exchange
    storage, channel, staging = _open(req, checkpoint_id, comm)
    my_keys = assignment.keys_of(comm.rank)
    codec = local.codec  # the coordinator's choice (codec_choice.py), taken by every rank
    write_stock = req.write_stock_metadata and codec == RAW  # stock readers read raw safetensors files only
    snap, plan, arrays, keep, release = _sources(
        my_keys,
        local,
        req,
        (assignment, values, checkpoint_id, comm.rank, coordinator_rank, write_stock),
        (channel, storage, staging),
    )
    tr.mark("snapshot (volatile part)" if async_save else "views")
    job = SaveJob(
        path=path,
        staging=staging,
        rank=comm.rank,
        world=comm.world,
        coordinator=coordinator_rank,
        checkpoint_id=checkpoint_id,
        assignment=assignment,
        values=values,
        per_rank_keys=tuple(req.per_rank_values),
        rank_values=rank_values,
        derived=derived_field,
        plan=plan,
        arrays=arrays,
        keepalive=keep,
        chunk_bytes=chunk_for(assignment) if req.chunk_bytes is None else req.chunk_bytes,
        checksum=algorithm,
        timeout=opts.commit_timeout,
        write_stock=write_stock,
        codec=codec,
        options=opts,
        publisher=req.publisher,
        lineage=req.lineage,
        storage=storage,
        channel=channel,
        release=release,
        snapshot=snap,
    )
    if not async_save:
        job.run()
        tr.mark("write+commit")
        tr.done()
        return None
    handle = _start_in_background(job, path, checkpoint_id)
    tr.mark("hand-over")
    tr.done()
    return handle


@gc_paused()
def _validate(req: SaveRequest, rank: int, previous_error: BaseException | None = None) -> _Local:
    """Step 1: this rank's records, their small descriptions and the checksum algorithm; its storage backend
    resolved (an added storage layer runs here, on every rank); the target path check (coordinator). Never raises:
    the error goes to the exchange, so no rank is left waiting. What failed before (this rank's previous async
    save, the calling door's own stage: ``req.caller_error``, the path, the options) is reported the same way."""
    local = _Local()
    opts, path = req.options, req.path
    try:
        for earlier in (previous_error, req.caller_error, req.path_error, req.opts_error):
            if earlier is not None:
                raise earlier
        local.algorithm = opts.checksum_algorithm()
        local.records, local.values = collect(req.state_dict)
        local.descs = [r.desc().to_wire() for r in local.records]
        storage = req.backend()
        local.codec = choose_codec(opts.codec, storage, path, opts.codec_threads or default_threads())
        if rank == req.coordinator_rank:
            remove_failed_stagings(storage, path)  # what earlier failed saves left (their space is needed now)
            if opts.storage is None and "://" not in path:
                check_target_path(path)
    except Exception as e:  # noqa: BLE001 - reported to every rank by the exchange; an I/O error or a bug named
        local.error = stage_error(e, f"save to {path} failed", rank, SaveFailedError)
    return local


_assignments = AssignmentMemo()  # used under _save_lock only


@gc_paused()
def _exchange_and_assign(comm: Comm, local: _Local, coordinator_rank: int, tr: Tracer, path: str):
    """Step 2: one exchange of every rank's description digest, values and target path (and errors: all ranks
    fail together), then the checked write assignment: remembered when every rank holds it for these digests and
    this coordinator, else from the coordinator (first_save.py; decided alike on every rank, from the first
    exchange). The coordinator holds every rank's writes, another rank its own. Returns ``(checkpoint_id,
    algorithm, assignment, values)``: the coordinator's id and algorithm (its codec: ``local.codec``), the values
    of the lowest rank that has each key."""
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
            local.codec,
        ),
    )
    local.all_paths = [g[5] for g in gathered]
    checkpoint_id, algorithm = gathered[coordinator_rank][3], gathered[coordinator_rank][4]
    local.codec = gathered[coordinator_rank][6]  # measured choices may differ by rank: one codec a save
    local.all_values = [g[2] for g in gathered]
    values = merged_values(local.all_values)
    name = assignment_name([g[0] for g in gathered], values, coordinator_rank)
    tr.mark("exchange")
    if all(name in g[1] for g in gathered):
        assignment = _assignments.get(name)
    else:
        assignment = exchange_assignment(comm, coordinator_rank, local.descs, values)
        _assignments.put(name, assignment)
    tr.mark("assign")
    return checkpoint_id, algorithm, assignment, values


def _open(req: SaveRequest, checkpoint_id: str, comm: Comm):
    """The save's storage backend (the request's), its channel (heartbeat starts) and its staging location."""
    path = req.path
    storage = req.backend()
    channel = open_channel(checkpoint_id, comm.rank, comm.world, req.coordinator_rank, req.options.heartbeat_lease)
    try:
        return storage, channel, storage.begin(path, checkpoint_id)
    except BaseException as e:
        channel.fail(cause(e))
        if isinstance(e, Exception):
            channel.leave()  # nothing of this rank's in storage; the others need not wait for it
        channel.close()
        raise SaveFailedError(f"save to {path} failed: rank {comm.rank} failed: {cause(e)}") from e


def _sources(keys, local: _Local, req: SaveRequest, layout_of, where):
    """Step 3: ``(snapshot, plan, arrays, keepalive, release)``; a failure is told to every rank at once."""
    channel, storage, staging = where
    opts = req.options
    snap = plan = None
    try:
        if req.async_save:
            snap = _snapshot(keys, local, req.deferred_keys, opts)
            return snap, plan, snap.arrays, snap.keep, snap.written
        plan = rank_plan(*layout_of)  # (an async save's job lays it out on its thread, the same way)
        return (snap, plan, *_piece_sources(keys, local))
    except BaseException as e:  # the coordinator must not wait for this rank until the timeout
        channel.fail(cause(e))
        mark_failed(storage, staging, channel.rank, e)
        if isinstance(e, Exception):
            leave_failed_save(
                storage, staging, channel, channel.world, leave_timeout(opts.commit_timeout, opts.heartbeat_lease)
            )
        channel.close()
        if isinstance(e, Exception) and not isinstance(e, CheckpointError):
            raise SaveFailedError(f"save to {staging} failed: rank {channel.rank} failed: {cause(e)}") from e
        raise


@gc_paused()
def _piece_sources(keys: list[str], local: _Local) -> tuple[list, list, Any]:
    """Step 3 of a sync save: what this rank writes, in layout order: lazy views of the tensors' own memory
    (device tensors staged in batches while writing, snapshot.lazy_views). Returns ``(arrays, [], None)``."""
    by_key = {r.key: r for r in local.records}
    return snapshot.lazy_views([by_key[key].tensor for key in keys]), [], None


@gc_paused()
def _snapshot(keys: list[str], local: _Local, deferred_keys, opts: CheckpointOptions) -> Snapshot:
    """Step 3 of an async save: the Snapshot of what this rank writes (layout order): volatile tensors copied
    now, deferred ones (``deferred_keys``, default: trainable Parameters) registered for the background copy."""
    by_key = {r.key: r for r in local.records}
    if deferred_keys is None:
        is_deferred = default_deferred
    else:
        wanted = set(deferred_keys)

        def is_deferred(record) -> bool:
            return record.key in wanted

    return Snapshot([by_key[key] for key in keys], is_deferred, hugepages=opts.hugepages)


def _check_names(all_paths: list[str], coordinator: int) -> None:
    """Every rank saves the same checkpoint name (its own ``path`` may differ: node-local disks), decided alike
    on every rank from the exchange."""
    names = {os.path.basename(p.rstrip("/")) for p in all_paths}
    if len(names) > 1:
        differ = {r: p for r, p in enumerate(all_paths) if p != all_paths[coordinator]}
        raise DirectoryMismatchError(
            f"save to {all_paths[coordinator]}: ranks were given different directories {differ} (coordinator rank "
            f"{coordinator}: {all_paths[coordinator]}); every rank must save the same checkpoint name (the same path, "
            f"or its own node-local directory of that name)"
        )


def _start_in_background(job: SaveJob, path: str, checkpoint_id: str) -> SaveHandle:
    """Step 4 of an async save: deferred copies, write + commit on the background worker; the handle is this
    process's pending save (the next save or load waits for it)."""

    def cancel() -> None:
        if job.snapshot is not None:
            job.snapshot.cancel()
        job._written()
        job.channel.close()

    return start_in_background(SaveHandle(path, checkpoint_id), job.run, cancel)
