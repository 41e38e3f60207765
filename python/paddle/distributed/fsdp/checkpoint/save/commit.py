"""Steps 2-3 of a save: write this rank's data object, then commit (coordinator) or wait for the commit.

Every byte goes through the storage interface (io/storage.py) and every message between ranks through the
save's channel (channel.py: the TCP store; a heartbeat per rank). Order, and who does what::

    each rank:    write_object(staging, "<rank>_0.safetensors")     durable (fsynced) on return
                  put(staging, "<rank>_0.safetensors.sums")          its chunk checksums (format/index.py)
                  put(staging, "<rank>.values")                      its per-rank values (format/rank_values.py)
                  channel.done(size, header length, checksum count, values object size + SHA-256): O(1)
    coordinator:  wait for every hand-over (a failure, a dead rank or ``timeout``: SaveFailedError, abort)
                  put index.keys, index.pieces, index.ranks, metadata.json, 0.metadata, then COMMIT last; sync;
                  publish
                  channel.committed(); publisher.publish() (``latest``); channel.published(); cleanup (keep_last)
    other ranks:  wait for committed (and published); a failure, an abort, a dead coordinator: SaveFailedError.
                  Where the coordinator's publish did not take this rank's object (node-local disks: each rank
                  sees its own staging), the rank publishes its own staging to its own ``path``.

A rank that fails before its hand-over tells everyone at once (channel.fail) and records why in the staging
(markers.py); one that fails after it follows the coordinator's decision, which is taken once more right before
the COMMIT record. Nothing here issues a collective: it runs on the background thread of async saves.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from .. import checksums
from ..codec_choice import MeteredStorage, Write, record_write, storage_root
from ..commit_record import commit_id
from ..encoded_write import RAW, write_data_object
from ..errors import SaveFailedError
from ..format import rank_values as per_rank
from ..format.commit import commit_record
from ..format.index import pack_sums, sums_name
from ..format.metadata import COMMIT_FILE, LATEST_FILE, METADATA_FILE, PARTS_DIR, CheckpointMetadata, FileMeta
from ..gc_pause import gc_paused
from ..io.storage import Storage
from ..options import CheckpointOptions
from ..planner import WriteAssignment, rank_plan
from ..save_index import assignment_columns, index_objects
from ..tracing import Tracer
from .abandon import leave_failed_save, leave_timeout
from .channel import LocalChannel, SaveChannel
from .markers import cause, mark_aborted, mark_failed

logger = logging.getLogger(__name__)


class Publisher:
    """What CheckpointManager plugs into a save (duck-typed; this class documents the protocol)."""

    def publish(self) -> None:
        """Coordinator, right after the commit: make the new checkpoint the one ``latest`` names (durably)."""

    def is_published(self) -> bool:
        """Other ranks, only when the coordinator was lost after its commit: read back whether ``publish``
        took effect (the channel says so otherwise)."""
        return False

    def cleanup(self) -> None:
        """Coordinator, after ``publish``: remove what is no longer kept (best effort, never raises)."""


class _PeerFailed(Exception):
    """Another rank reported a failure while this one was still writing."""


@dataclass
class SaveJob:
    path: str
    staging: str
    rank: int
    world: int
    coordinator: int
    checkpoint_id: str
    assignment: WriteAssignment
    values: dict  # the checkpoint's JSON values, but the per-rank ones
    per_rank_keys: tuple  # values every rank gives its own of (each rank's in its own object: rank_values.py)
    rank_values: dict  # this rank's values of per_rank_keys (written by this rank, never gathered)
    arrays: list  # uint8 arrays (or producers), one per piece this rank writes (in layout order)
    keepalive: list
    chunk_bytes: int
    checksum: str  # algorithm (checksums.py), the same on every rank
    timeout: float
    write_stock: bool
    storage: Storage
    channel: SaveChannel | LocalChannel
    options: CheckpointOptions = field(default_factory=CheckpointOptions)
    publisher: Publisher | None = None
    lineage: Any = None  # coordinator: () -> the commit record's lineage (lineage.py), or None
    created: float = field(default_factory=time.time)
    release: Any = None  # async save: gives the snapshot arena back (called once the data object is written)
    snapshot: Any = None  # async save: the Snapshot whose deferred copies run first in the background thread
    plan: Any = None  # the SavePlan; laid out by run() (an async save's caller does not wait for it)
    derived: dict = field(default_factory=dict)  # format 4's "derived" field (save/derive.py); {}: none
    codec: str = "raw"  # chunk codec of the data files (codec_choice.choose_codec), the same on every rank

    def _written(self) -> None:
        self.arrays = self.keepalive = []  # release snapshot memory early
        release, self.release = self.release, None
        if release is not None:
            release()

    def fail(self, e: BaseException) -> None:
        """This rank failed before its hand-over: tell every rank, record why in the staging."""
        self.channel.fail(cause(e))
        mark_failed(self.storage, self.staging, self.rank, e)

    def run(self) -> None:
        """Write, then commit (coordinator) or wait for the commit; every failure is a SaveFailedError naming
        the rank that failed and its cause, on every rank, as soon as it is known; a failed save's staging is
        removed once every rank has left it (abandon.py)."""
        try:
            try:
                try:
                    if self.snapshot is not None:  # async: copy the deferred tensors first (snapshot.py)
                        self.snapshot.copy_deferred()
                    if self.plan is None:  # (a sync save laid it out on the calling thread, the same way)
                        self.plan = rank_plan(
                            self.assignment,
                            self.values,
                            self.checkpoint_id,
                            self.rank,
                            self.coordinator,
                            self.write_stock,
                        )
                except BaseException as e:
                    self.fail(e)
                    raise
                self._run()
            except SaveFailedError:
                raise
            except Exception as e:
                raise SaveFailedError(
                    f"save to {self.path} failed: rank {self.rank} failed: {cause(e)}; the previous checkpoint is "
                    f"untouched"
                ) from e
            finally:
                self._written()
        except Exception:
            leave_failed_save(
                self.storage,
                self.staging,
                self.channel,
                self.world,
                leave_timeout(self.timeout, self.options.heartbeat_lease),
            )
            raise
        finally:
            self.channel.close()

    def _run(self) -> None:
        tr = Tracer(f"save rank {self.rank}", self.options)
        name = self.plan.files[self.rank].name
        handed_over = False  # this rank's hand-over is sent: its data object belongs to the coordinator's commit
        try:
            self._write(name, tr)
            handed_over = True
            tr.mark("hand-over")
        except _PeerFailed as e:  # another rank failed first: stop writing, free the space, say who failed
            self._drop(name)
            err = SaveFailedError(f"save to {self.path} aborted: {e}; the previous checkpoint is untouched")
            if self.rank == self.coordinator:  # the decision: a rank that failed after its hand-over waits for it
                self._abort(err)
            raise err from None
        except BaseException as e:
            if not handed_over:
                self.fail(e)
            else:
                self.channel.fail(cause(e))
                mark_failed(self.storage, self.staging, self.rank, e)
            if handed_over and self.rank != self.coordinator and isinstance(e, Exception):
                # the coordinator may be committing with this rank's (complete, durable) object already: deleting
                # it could leave a committed checkpoint without it, and raising alone would make the ranks
                # disagree. The coordinator decides (it checks for failures once more right before COMMIT)
                self._follow_decision(name, e, tr)
                return
            if isinstance(e, Exception):  # (an interrupt leaves the staging as a kill would)
                self._drop(name)
            raise
        if self.rank == self.coordinator:
            self._commit_and_publish(name, tr)
        else:
            self._wait_commit(name)
            tr.mark("wait-commit")
        tr.done()

    def _write(self, name: str, tr: Tracer) -> None:
        layout = self.plan.files[self.rank]
        try:
            digest = None if self.checksum == checksums.NONE else checksums.digest_function(self.checksum)
            metered = MeteredStorage(self.storage)  # the backend's own time: what codec "auto" compares
            size, sums = write_data_object(self, name, layout, digest, metered)  # raw, or stored through the codec
        finally:
            self._written()
        measured = Write(self.codec, size, metered.bytes, metered.seconds, metered.wall)
        record_write(storage_root(self.storage, self.path), measured)
        tr.mark("write+fsync")
        if digest is not None:  # format 2: this rank's checksums beside its data object, never gathered
            self.storage.put(self.staging, sums_name(name), pack_sums(sums))
        n_sums = sum(len(s) for s in sums) if digest is not None else 0
        handover = {"size": size, "header": len(layout.header), "sums": n_sums}
        if self.per_rank_keys:  # format 3: this rank's values in its own object; the coordinator gets a receipt
            mine = {k: self.rank_values[k] for k in self.per_rank_keys if k in self.rank_values}
            blob = per_rank.encode_entry(self.checkpoint_id, self.rank, mine)
            self.storage.put(self.staging, per_rank.object_name(self.rank), blob)
            handover["values"] = per_rank.entry_receipt(blob)
        self.channel.done(handover)

    def _drop(self, name: str) -> None:
        try:
            self.storage.delete(self.staging, name)
        except OSError:
            pass

    def _abort(self, e: BaseException) -> None:
        self.channel.abort(cause(e))
        mark_aborted(self.storage, self.staging, self.rank, e)

    def _peer_failure(self) -> None:
        """Raise _PeerFailed when another rank reported a failure (checked between slabs of a long write)."""
        failed = self.channel.peer_failures()
        failed.pop(self.rank, None)
        if failed:
            r, why = sorted(failed.items())[0]
            raise _PeerFailed(f"rank {r} failed: {why}")

    # --------------------------------------------------------------------------------------------- coordinator
    def _commit_and_publish(self, name: str, tr: Tracer) -> None:
        try:
            self._commit(tr)
        except BaseException as e:
            self._abort(e)  # tells the waiting ranks at once
            if isinstance(e, Exception):  # (an interrupt leaves the staging as a kill would)
                self._drop(name)
            if isinstance(e, SaveFailedError) or not isinstance(e, Exception):
                raise
            raise SaveFailedError(
                f"save to {self.path} failed: rank {self.rank} (the coordinator) failed to commit: {cause(e)}; "
                f"the previous checkpoint is untouched"
            ) from e
        self.channel.committed()
        if self.publisher is None:
            return
        try:
            self.publisher.publish()
        except Exception as e:
            # committed, but `latest` could not be moved: the waiting ranks must not wait for it
            self.channel.abort(cause(e))
            raise SaveFailedError(
                f"save to {self.path}: the checkpoint was committed, but rank {self.rank} could not move "
                f"the '{LATEST_FILE}' pointer: {cause(e)}"
            ) from e
        self.channel.published()
        tr.mark("publish")
        self.publisher.cleanup()

    def _commit(self, tr: Tracer) -> None:
        """Wait for every rank's data, write metadata.json, the stock index and COMMIT (last) into the staging,
        then publish it at ``path`` atomically."""
        status = self._wait_for_ranks()
        tr.mark("wait-ranks")
        with gc_paused():  # the index of every piece: many small objects (gc_pause.py)
            objects = self._index(status)
            data = objects[METADATA_FILE]
            # inside the (invisible) staging each object is durable on its own; order: data objects and their
            # checksums (durable from their ranks), index objects, metadata, stock index, the commit record,
            # then the publish
            objects = dict(objects)
            if self.write_stock:
                from ..stock_compat import STOCK_METADATA_FILE, stock_metadata_bytes

                _warn_stock_at_scale(self.world)
                objects[STOCK_METADATA_FILE] = stock_metadata_bytes(self._stock_view())
            self.storage.put_all(self.staging, objects)  # on S3: one round trip for all of them
        tr.mark("metadata")
        # the last point at which the save can still be aborted: a rank that failed after its hand-over waits
        # for this decision (_follow_decision)
        late = self.channel.failures()
        if late:
            r, why = sorted(late.items())[0]
            raise SaveFailedError(
                f"save to {self.path} aborted: rank {r} failed: {why}; the previous checkpoint is untouched"
            )
        self.storage.remove(self.storage.child(self.staging, PARTS_DIR))
        lineage = self.lineage() if self.lineage is not None else None
        self.storage.put(self.staging, COMMIT_FILE, commit_record(self.checkpoint_id, data, lineage))
        self.storage.sync(self.staging)
        tr.mark("commit-record")
        self.storage.publish(self.staging, self.path)
        tr.mark("rename")

    def _wait_for_ranks(self) -> dict:
        """Every rank's hand-over (rank -> sizes + checksums + values); SaveFailedError on the first failure, a
        rank found dead, or a rank silent for ``timeout``."""
        ch = self.channel

        def all_parts():
            failed = ch.failures()
            if failed:
                return {"failed": failed}
            return ch.all_done()

        def pending():
            have = set(ch.handed_over())
            return [r for r in range(self.world) if r not in have]

        try:
            status = ch.wait(all_parts, self.timeout, f"all {self.world} ranks to finish writing", _Lazy(pending))
        except TimeoutError:
            raise SaveFailedError(
                f"save to {self.path} aborted: ranks {pending()} did not finish writing within {self.timeout:g} s "
                f"(did they die?); the previous checkpoint is untouched"
            ) from None
        except SaveFailedError as e:
            raise SaveFailedError(f"save to {self.path} aborted: {e}; the previous checkpoint is untouched") from None
        if "failed" in status:
            r, why = sorted(status["failed"].items())[0]
            raise SaveFailedError(
                f"save to {self.path} aborted: rank {r} failed: {why}; the previous checkpoint is untouched"
            )
        return status

    def _index(self, status: dict) -> dict[str, bytes]:
        """The format-3 index objects (save_index.py): the plan, checked against the sizes and checksum counts
        the ranks reported; the table of the ranks' per-rank values objects from their receipts."""
        values = {k: v for k, v in self.plan.values.items() if k not in self.per_rank_keys}
        header = {
            "checkpoint_id": self.checkpoint_id,
            "created_unix": self.created,
            "world_size": self.world,
            "chunk_bytes": self.chunk_bytes,
            "checksum": self.checksum,
            "values": values,
            "derived": self.derived,
        }
        if self.per_rank_keys:
            try:
                table = per_rank.encode_table([status[r].get("values") for r in range(self.world)])
            except ValueError as e:
                raise SaveFailedError(
                    f"save to {self.path} aborted: {e} (per_rank_values must name the same keys on every rank)"
                ) from None
            header["rank_values"] = (list(self.per_rank_keys), table)
        cols = assignment_columns(self.assignment, self.chunk_bytes)
        if self.codec != RAW:  # every data file is stored through the codec (format 4)
            header["codecs"] = {name: self.codec for name, _len, _n in cols["files"]}
        return index_objects(cols, header, status, self.checksum != checksums.NONE)

    def _stock_view(self) -> CheckpointMetadata:
        return stock_view(self.plan, self.checkpoint_id, self.world)

    # --------------------------------------------------------------------------------------------- other ranks
    def _follow_decision(self, name: str, error: Exception, tr: Tracer) -> None:
        """This rank failed after its hand-over: the coordinator's decision is the outcome on every rank.
        Aborted: raise this rank's own error (named by run()). Committed (the failure came after the decision;
        the checkpoint is complete, this rank's object included): return like every other rank, logged."""
        try:
            self._wait_commit(name, ignore_own_failure=True)
        except SaveFailedError:
            self._drop(name)
            raise error from None
        logger.error(
            "save to %s: rank %d failed after its data was complete (%s); the coordinator had committed already, "
            "so the checkpoint is complete and this rank returns like the others",
            self.path,
            self.rank,
            cause(error),
        )
        tr.done()

    def _wait_commit(self, name: str, ignore_own_failure: bool = False) -> None:
        """Wait until the coordinator committed (and, for a CheckpointManager save, moved ``latest``); then
        publish this rank's own staging where the coordinator's publish did not take it (node-local disks)."""
        ch = self.channel
        seen_commit = False

        def state():
            nonlocal seen_commit
            if not seen_commit and ch.is_committed():
                seen_commit = True
            reason = ch.aborted()
            if reason is not None:
                return ("aborted", reason)
            if seen_commit:
                return ("committed", None) if self.publisher is None or ch.is_published() else None
            failed = ch.failures()
            if ignore_own_failure:
                failed.pop(self.rank, None)
            return ("failed", sorted(failed.items())[0]) if failed else None

        try:
            st, info = ch.wait(state, self.timeout, f"rank {self.coordinator} to commit", [self.coordinator])
        except (TimeoutError, SaveFailedError) as e:
            # the coordinator is gone (and the store with it, when it hosted it): the commit record in storage
            # is the truth about the commit; `latest` can no longer be confirmed
            seen_commit = seen_commit or self._committed_in_storage()
            if seen_commit and (self.publisher is None or self.publisher.is_published()):
                st, info = "committed", None
            else:
                self._raise_lost(e, seen_commit)
        if st == "failed":
            r, why = info
            self._drop(name)
            raise SaveFailedError(
                f"save to {self.path} aborted: rank {r} failed: {why}; the previous checkpoint is untouched"
            )
        if st == "aborted":
            self._drop(name)
            if seen_commit:
                raise SaveFailedError(f"save to {self.path}: committed, but the coordinator failed after: {info}")
            raise SaveFailedError(
                f"save to {self.path} aborted by rank {self.coordinator} (the coordinator): {info}; the previous "
                f"checkpoint is untouched"
            )
        self._publish_own(name)

    def _committed_in_storage(self) -> bool:
        return commit_id(self.path, self.storage) == self.checkpoint_id

    def _raise_lost(self, e: BaseException, seen_commit: bool) -> None:
        """The wait for the coordinator ended without its word: timeout, or the coordinator found dead."""
        if isinstance(e, TimeoutError):
            if seen_commit:
                raise SaveFailedError(
                    f"save to {self.path}: rank {self.coordinator} committed the checkpoint but did not move the "
                    f"'{LATEST_FILE}' pointer within {self.timeout:g} s (did it die?)"
                ) from None
            raise SaveFailedError(
                f"save to {self.path} did not commit: rank {self.coordinator} (the coordinator) did not commit "
                f"within {self.timeout:g} s (did it die?); the previous checkpoint is untouched"
            ) from None
        # this rank's object stays (its staging is removed by the next save): the coordinator was not heard, but
        # may be alive (frozen, then resumed) and commit with it, which must not give a checkpoint without it
        if seen_commit:
            raise SaveFailedError(
                f"save to {self.path} committed, but did not move the '{LATEST_FILE}' pointer: {e}"
            ) from None
        raise SaveFailedError(
            f"save to {self.path} did not commit: {e} (a coordinator that was frozen, not dead, may still commit "
            f"it, complete, when it resumes)"
        ) from None

    def _publish_own(self, name: str) -> None:
        """Node-local storage: the coordinator's publish did not take this rank's object (``path`` shows no
        commit record of this checkpoint, and this rank's staging, never holding one, still has the object):
        publish it at this rank's own ``path``. On shared storage the staging is gone (or, after an exchanging
        rename, holds the previous checkpoint, which has a commit record), so nothing happens."""
        if commit_id(self.path, self.storage) == self.checkpoint_id:
            return
        own = self.storage.list(self.staging)
        if name in own and COMMIT_FILE not in own:
            self.storage.remove(self.storage.child(self.staging, PARTS_DIR))
            self.storage.publish(self.staging, self.path)


STOCK_WARN_WORLD = 256  # from this world the coordinator's work for 0.metadata dominates a commit (docs/performance.md)
_stock_warned: list = []


def _warn_stock_at_scale(world: int) -> None:
    """Once per process: write_stock_metadata at a large world (every rank's file laid out and every piece
    pickled on the coordinator, at every save); `paddle-fsdp-ckpt stock-index` writes it later when needed."""
    if world >= STOCK_WARN_WORLD and not _stock_warned:
        _stock_warned.append(world)
        logger.warning(
            "save at %d ranks with write_stock_metadata=True: the coordinator lays out every rank's file and "
            "pickles every piece for stock paddle's 0.metadata at each save; pass write_stock_metadata=False and "
            "run `paddle-fsdp-ckpt stock-index CKPT` for a checkpoint a stock reader needs",
            world,
        )


def stock_view(plan, checkpoint_id: str, world: int) -> CheckpointMetadata:
    """A save plan laid out for every rank (planner.SavePlan) as format-1 metadata without checksums: what stock
    paddle's ``0.metadata`` is built from (the coordinator's extra work of ``write_stock_metadata``)."""
    md = CheckpointMetadata(checkpoint_id=checkpoint_id, world_size=world)
    md.files = {plan.files[r].name: FileMeta(r, plan.files[r].size) for r in range(world)}
    md.tensors = plan.tensors
    return md


class _Lazy:
    """An iterable recomputed at each iteration (the ranks still to hand over, for the dead-rank check)."""

    def __init__(self, fn):
        self.fn = fn

    def __iter__(self):
        return iter(self.fn())


def open_channel(checkpoint_id: str, rank: int, world: int, coordinator: int, lease: float):
    """The channel of one save: the TCP store's for a group, nothing for one rank."""
    if world == 1:
        return LocalChannel(rank)
    return SaveChannel(checkpoint_id, rank, world, coordinator, lease)
