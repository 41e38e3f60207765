"""MemoryTier: checkpoints into host shared memory with a peer copy on another node, persisted every K-th save.

A training script needs three lines (see docs/memory-tier.md)::

    tier = fsdp.memory_tier(opt, durable_root="ckpt", persist_every=10)   # restores: tier.start_step
    for step in range(tier.start_step, total_steps):
        tier.save(step + 1, extra_state={...})   # after optimizer.step(); tier.close() at a clean end

A copy holds what ``save_checkpoint`` saves (state/resume_state.py): give ``grad_scaler=``, ``stateful=`` and
``ema=`` to the tier (or to ``save``) as to ``save_checkpoint``; ``restore`` applies them to the objects given.

``save`` blocks like an async save: tensors the optimizer step changes are copied into the rank's shared-memory
slot after it returned (the next ``optimizer.step()`` waits for that copy: snapshot_guard.py); the checksums and
the transfer to the peer run in the background. Every ``persist_every``-th memory checkpoint is also written to
``durable_root`` from the memory copy itself (persist.py: the same step's bytes, today's committed format) by a
second background thread, on the tier's own process group, with the tier's ``options`` and ``quantize_moments``
(what ``save_checkpoint`` with them writes: derived weights, the chunk codec, lossy moments when asked; the copy's
header records these choices, so a flush after a crash writes the same: flush.py). Each rank keeps ``memory_slots`` own copies (2 by
default) used in turn (slots.py chooses): a save never writes the slot of the newest step complete on every rank,
nor the slot a persist still reads, so a crash mid-copy keeps a complete step and no save is skipped for a
persist (one small exchange per save tells every rank that every rank completed the previous save and whether a
persist still runs). With one slot (the older layout) a save called during a persist is skipped (``skipped``).

``restore`` agrees collectively on the step (agreement.py), reads every rank's copy into its tensors in one
pass, verified on the way (readback.py; a peer copy straight from the holder's socket: wire.py), and applies the
non-tensor state only once every rank's copy checked out (else every rank falls back together); a step restored
from memory that storage lacks is persisted there before training resumes (persist on failure).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import threading
import time

from .. import env_switches
from ..checkpoint import checksums, lossy
from ..checkpoint.errors import CheckpointError, rebuild_remote_error
from ..checkpoint.options import CheckpointOptions
from ..devices import host_mappings
from ..state import frozen_base
from ..state.resume_state import ResumeObjects
from . import identity, peers, roots, wire
from .copies import MAX_SLOTS, Background, Copies, SaveIntoSlot, header_capacity, offsets_of
from .errors import MemoryRootError, MemoryTierEnvError, MemoryTierError, MemoryTierFullError
from .header import written_now
from .persist import persist_copy
from .restore import Restore, RestoreResult
from .slot import Slot
from .slots import SlotChooser
from .state import capture

logger = logging.getLogger(__name__)

ROOT_ENV = "PADDLE_FSDP_MEMTIER_ROOT"
JOB_ENV = "PADDLE_FSDP_JOB_ID"
QUOTA_ENV = "PADDLE_FSDP_MEMTIER_QUOTA"
DEFAULT_ROOT = env_switches.SWITCHES[ROOT_ENV].default  # /dev/shm/paddle-fsdp-memtier


class MemoryTier:
    """Memory checkpoints of one FullyShardFusion model (+ optimizer) with peer copies and background persistence
    (see the module docstring). Every method that takes part in collectives is called by every rank alike."""

    def __init__(
        self,
        fsdp,
        optimizer=None,
        *,
        durable_root: str,
        memory_root: str | None = None,
        persist_every: int = 10,
        keep_last: int | None = 2,
        job_id: str | None = None,
        partners: dict[int, int] | None = None,
        quota_bytes: int | None = None,
        checksum: str = "xxh3-64",
        persist_on_restore: bool = True,
        peer_timeout_s: float = 60.0,
        memory_slots: int = 2,
        grad_scaler=None,
        stateful: dict | None = None,
        ema=None,
        options: CheckpointOptions | None = None,
        quantize_moments: str | None = None,
    ):
        if not isinstance(durable_root, str) or not durable_root:
            raise MemoryTierError(f"durable_root must be a non-empty path, got {durable_root!r}")
        if type(persist_every) is not int or persist_every < 1:
            raise MemoryTierError(f"persist_every must be an int >= 1, got {persist_every!r}")
        if memory_root is not None and (not isinstance(memory_root, str) or not memory_root):
            raise MemoryTierError(f"memory_root must be a non-empty path, got {memory_root!r}")
        if job_id is not None:
            roots.check_job_id(job_id)
        if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
            raise MemoryTierError(f"keep_last must be an int >= 1 or None, got {keep_last!r}")
        if type(peer_timeout_s) not in (int, float) or not peer_timeout_s > 0:
            raise MemoryTierError(f"peer_timeout_s must be a positive number of seconds, got {peer_timeout_s!r}")
        if type(memory_slots) is not int or not 1 <= memory_slots < MAX_SLOTS:
            raise MemoryTierError(f"memory_slots must be an int in [1, {MAX_SLOTS - 1}], got {memory_slots!r}")
        checksums.default_algorithm(checksum)  # CheckpointError for an unknown algorithm
        # what persists (and flushes: the header carries it) write, as save_checkpoint with these arguments would
        self.options = options if options is not None else CheckpointOptions.from_env()
        mode = self.options.quantize_moments if quantize_moments is None else quantize_moments
        try:
            self.quantize_moments = lossy.check_mode(None if mode == "none" else mode)
        except ValueError as e:
            raise MemoryTierError(str(e)) from None
        if quota_bytes is None:
            quota_bytes = env_switches.read(QUOTA_ENV, error=MemoryTierEnvError)
        if quota_bytes is not None and (type(quota_bytes) is not int or quota_bytes < 0):
            raise MemoryTierError(f"quota_bytes must be a non-negative int or None, got {quota_bytes!r}")
        self.fsdp, self.optimizer = fsdp, optimizer
        # what else a save holds and a restore applies (state/resume_state.py), as save_checkpoint takes them
        self.grad_scaler, self.stateful, self.ema = grad_scaler, stateful, ema
        self.resume_objects()  # TypeError for a wrong object, before anything is set up
        self.durable_root = durable_root if "://" in durable_root else os.path.abspath(durable_root)
        self.memory_root = memory_root or env_switches.read(ROOT_ENV)
        self.persist_every, self.keep_last, self.quota = persist_every, keep_last, quota_bytes
        self.checksum, self.persist_on_restore, self.peer_timeout_s = checksum, persist_on_restore, peer_timeout_s
        self.rank, self.world = fsdp.rank, fsdp.world_size
        digest = hashlib.sha256(self.durable_root.encode()).hexdigest()[:12]
        self.job_id = roots.check_job_id(job_id or env_switches.read(JOB_ENV) or f"job-{digest}")
        self.durable_id: str | None = None  # the durable root's identity (identity.py), set by _prepare
        if partners is None:
            partners = peers.default_partners(self.world, peers.local_size(self.world))
        self.partners = peers.check_partners(partners, self.world)
        self.source = peers.source_of(self.partners, self.rank)
        self.copies = Copies(self.memory_root, self.job_id, self.rank, memory_slots)
        self.slots = SlotChooser(memory_slots)
        self._group = None
        self._link: wire.PeerLink | None = None
        self._layout: list | None = None
        self._bg = Background()
        self._persister = Background("memtier-persist")
        self._persisting = False  # a persist was started and every rank has not yet seen it finish
        self.save_timings: dict[str, float] = {}  # seconds of the last save's background phases (benchmark)
        self.skipped: list[int] = []  # memory saves skipped because a persist was still writing (one slot only)
        self.persists_skipped: list[int] = []  # persists not started: the previous one was still writing
        self.persist_errors: list[str] = []
        self._unmap_later: list = []
        self.disabled_reason: MemoryTierError | None = None
        self.durable_saves: list[int] = []
        self._persist_handle = None
        self.restored: RestoreResult | None = None  # what the last restore() returned
        self.start_step = 0  # its step (0: nothing was stored, a fresh start)

    # ------------------------------------------------------------------ plumbing
    def tier_group(self):
        """The tier's own process group for persists (persist.py: they run on a background thread, never on the
        training's group). Collective when first called; None in a single process."""
        if self._group is None and self.world > 1:
            from ..comm.topology import new_group  # with the barrier gloo needs after it

            self._group = new_group(list(range(self.world)))
        return self._group

    def peer_link(self) -> wire.PeerLink | None:
        """This rank's end of the direct connections to its partners (wire.py); None without peer copies.
        Collective when first called: every rank's address, and rank 0's fresh key for the link (the per-job
        secret that admits the job's ranks only), travel over the training group, never through the
        environment, a file or the launcher's store."""
        if self._link is None and self.partners:
            key = secrets.token_bytes(32) if self.rank == 0 else None
            link = wire.PeerLink(self.rank, self.peer_timeout_s, b"\0" * 32)
            gathered = self.fsdp.comm.all_gather_object((link.address, key))
            link.key = gathered[0][1]
            link.addrs = [tuple(a) for a, _k in gathered]
            self._link = link
        return self._link

    def _prepare(self) -> None:
        """Once, before the tier touches its memory root (collective): check the root and take this rank's lock
        (roots.py), and agree on the durable root's identity (identity.py). Any rank's failure is raised on
        every rank as the same named error."""
        if self.durable_id is not None:
            return
        status = None
        try:
            self.copies.claim()
        except (CheckpointError, OSError) as e:
            status = (type(e).__name__ if isinstance(e, CheckpointError) else "MemoryRootError", f"{e}")
        for r, st in enumerate(self.fsdp.comm.all_gather_object(status)):
            if st is not None:
                self.copies.unclaim(remove=False)
                raise rebuild_remote_error(*st, r)
        self.durable_id = identity.agree(self.durable_root, self.rank, self.fsdp.comm.all_gather_object)

    def expect(self) -> dict:
        return {"job": self.job_id, "world": self.world, "durable_id": self.durable_id}

    def _setup(self, state, values_len: int) -> None:
        """Allocate the two slots on every rank for this layout; disable the tier on every rank when any rank
        lacks the space (collective)."""
        self._bg.wait()
        self._unmap()
        self._prepare()
        cap = header_capacity(values_len, len(state.layout))
        _offsets, data_len = offsets_of(state.layout)
        sizes = [tuple(s) for s in self.fsdp.comm.all_gather_object((cap, data_len))]
        err = None
        try:
            self.copies.allocate(sizes, self.source, self.quota)
        except (MemoryTierFullError, MemoryRootError, OSError) as e:  # OSError: an unusable root (permissions)
            err = e
        status = (type(err).__name__, str(err)) if err else None
        failed = [(r, st) for r, st in enumerate(self.fsdp.comm.all_gather_object(status)) if st]
        for r, (kind, msg) in failed:
            if kind in ("MemoryRootError", "MemoryRootInUseError"):  # an unsafe root: refused, never worked around
                self.copies.release()
                raise rebuild_remote_error(kind, msg, r)
        if failed:
            self.copies.remove()
            r, (kind, msg) = failed[0]
            cls = MemoryTierFullError if kind == "MemoryTierFullError" else MemoryTierError
            self.disabled_reason = cls(f"memory tier disabled (rank {r}): {msg}")
            logger.error("%s; saves go to durable storage %s instead", self.disabled_reason, self.durable_root)
            return
        self.tier_group()
        self.peer_link()
        self._layout = state.layout

    def resume_objects(self, extra_state: dict | None = None) -> ResumeObjects:
        """What this tier saves and restores, for the owner of the resume state (state/resume_state.py)."""
        return ResumeObjects(self.fsdp, self.optimizer, self.grad_scaler, self.stateful, self.ema, extra_state)

    def resume_kwargs(self) -> dict:
        """The same objects as keywords of ``save_checkpoint`` / ``load_checkpoint`` (storage, through the tier)."""
        return dict(optimizer=self.optimizer, grad_scaler=self.grad_scaler, stateful=self.stateful, ema=self.ema)

    # ------------------------------------------------------------------ save
    def save(
        self, step: int, extra_state: dict | None = None, *, grad_scaler=None, stateful: dict | None = None, ema=None
    ) -> None:
        """Checkpoint ``step`` into memory (and to storage every ``persist_every``-th step). Collective.

        ``grad_scaler`` / ``stateful`` / ``ema``: as ``save_checkpoint`` takes them; given here they replace the
        tier's (given at construction, which a restore applies) for this and later saves."""
        if type(step) is not int or step < 0:
            raise MemoryTierError(f"step must be a non-negative int, got {step!r}")
        newest = max(self.slots.common_step, self.slots.pending[1] if self.slots.pending else -1)
        if step < newest:  # the same on every rank (SPMD): refused before any collective
            raise MemoryTierError(
                f"step {step} is lower than step {newest}, which this tier saved or restored: a restart would resume "
                f"from step {newest} (its copy stays in another slot). Steps must not go back; to roll back, start "
                "the tier with another job_id (PADDLE_FSDP_JOB_ID)"
            )
        if grad_scaler is not None or stateful is not None or ema is not None:
            ResumeObjects(self.fsdp, self.optimizer, grad_scaler, stateful, ema)  # TypeError, before anything
            self.grad_scaler = grad_scaler if grad_scaler is not None else self.grad_scaler
            self.stateful = stateful if stateful is not None else self.stateful
            self.ema = ema if ema is not None else self.ema
        err = self._bg.wait()
        if err is not None:
            logger.warning("memory tier: the previous memory save (background) failed: %s", err)
        host_mappings.release_unviewed()  # copies closed while tensors viewed them (slot.py)
        busy = self._save_status(err is None)
        index = self.slots.choose(busy) if self.disabled_reason is None else 0
        if index is None:  # one slot, read by a persist still writing
            self.skipped.append(step)
            logger.info("memory tier: memory save of step %d skipped: the persist of the copy is still writing", step)
            return
        self._release_persist_buffers()
        state, values = capture(self.resume_objects(extra_state))
        if self.disabled_reason is None and state.layout != self._layout:
            self._setup(state, len(json.dumps(values)))  # collective, on every rank alike
        if self.disabled_reason is not None:
            self.persist(step, extra_state)
            return
        header = dict(self.expect(), rank=self.rank, step=step, values=values, descs=state.descs)
        header["persist"] = self.persist_choices()
        header["written"] = written_now()  # two own copies of one step: the restore takes the later
        job = SaveIntoSlot(self.copies.own[index], state, header, self.checksum, self.slots.common_step)
        self.slots.started(index, step)
        persist = step % self.persist_every == 0
        if persist and busy:
            persist = False
            self.persists_skipped.append(step)
            logger.info("memory tier: step %d is saved to memory but not persisted: the persist of step %d is "
                        "still writing", step, self.slots.persist_step)  # fmt: skip
        self._bg.start(lambda: self._finish_save(job, persist))
        if persist:
            self._persisting = True
            self.slots.persist_started(index, step)
            self.durable_saves.append(step)

    def _finish_save(self, job: SaveIntoSlot, persist: bool) -> None:
        """Background: finish the copy, then the peer exchange, which runs even when this rank's copy failed (it
        then sends a copy still marked "writing", never used): the partner is waiting for it. Then hand the persist
        of the copy to the persist thread; it too is started on every rank (a rank without a valid copy fails the
        collective save on every rank, by the engine's error exchange)."""
        error = None
        t0 = time.perf_counter()
        try:
            job.finish()
        except BaseException as e:  # noqa: BLE001 - re-raised after the exchange
            error = e
        finally:
            job.release_guard()
        t1 = time.perf_counter()
        try:
            self._exchange(job.slot, int(job.header["step"]))
            self.save_timings = {"copy_checksums": t1 - t0, "exchange": time.perf_counter() - t1}
        finally:
            if persist:
                ok = error is None
                self._persister.start(lambda: self._persist_own(job, ok))
        if error is not None:
            raise error

    def persist_choices(self) -> dict:
        """What a persist of a copy writes (the header's ``persist`` field, read again by flush.py)."""
        opts = self.options
        return {"derive_weights": opts.derive_weights, "codec": opts.codec, "quantize_moments": self.quantize_moments}

    def _persist_own(self, job: SaveIntoSlot, ok: bool) -> None:
        """Persist thread: the own copy of ``job``'s step to durable storage (collective on the persist group)."""
        group = self.tier_group()
        slot = job.slot
        if not ok:  # this rank's copy is incomplete: a state the engine refuses, on every rank together
            from ..checkpoint import save_state_dict

            save_state_dict(None, self.durable_root, process_group=group, options=self.options)
            return
        persist_copy(slot, job.header, job.data_off, job.data_len, self.durable_root, self.keep_last, group,
                     self.options, self.quantize_moments)  # fmt: skip

    def _save_status(self, ok: bool) -> bool:
        """Whether a started persist is still writing on any rank; and whether every rank completed its previous
        memory save (``ok``: this rank's), which makes that save's step the one the next saves keep. Collective
        (one small exchange per save, the same on every rank). Collects a finished persist's error (logged, kept
        in ``persist_errors``)."""
        busy = self._persisting and not self._persister.idle()
        if self.world > 1 and self.disabled_reason is None:
            gathered = self.fsdp.comm.all_gather_object((ok, busy))
            ok, busy = all(o for o, _b in gathered), any(b for _o, b in gathered)
        self.slots.previous_done(ok)
        if busy or not self._persisting:
            return busy
        self._persisting = False
        self.slots.persist_done()
        err = self._persister.wait()
        if err is not None:
            self.persist_errors.append(f"{type(err).__name__}: {err}")
            logger.error("memory tier: persisting the memory copy failed: %s", err)
        return False

    def wait_persisted(self) -> None:
        """Wait until the last started persist has written its step (MemoryTierError when it failed). Not
        collective; the next ``save`` still exchanges whether every rank's persist finished."""
        self._bg.wait()
        err = self._persister.wait()
        if err is not None:
            self.persist_errors.append(f"{type(err).__name__}: {err}")
            raise MemoryTierError(f"persisting the memory copy failed: {err}") from err

    def _exchange(self, slot: Slot, step: int) -> None:
        """Send the own slot to its holder while receiving the copy this rank holds (wire.py; both directions at
        once). PeerTransferError when the partner died or stalled past ``peer_timeout_s``."""
        link = self.peer_link()
        if link is None:
            return
        holder = self.partners.get(self.rank)
        errors: list[BaseException] = []

        def send() -> None:
            try:
                link.send_buffer(holder, slot.buf, step)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)

        sender = threading.Thread(target=send, name="memtier-peer-send", daemon=True) if holder is not None else None
        if sender is not None:
            sender.start()
        try:
            if self.source is not None and self.copies.peer is not None:
                wire.receive_into_slot(link, self.copies.peer, self.source, step, self.expect())
        finally:
            if sender is not None:
                sender.join()
        if errors:
            raise errors[0]

    def persist(self, step: int, extra_state: dict | None, async_save: bool = True) -> None:
        """A direct save of the live state (the tier disabled; a restored step storage lacks)."""
        from ..state.resume import save_checkpoint

        self._persist_handle = save_checkpoint(
            self.fsdp,
            self.durable_root,
            extra_state=extra_state,
            **self.resume_kwargs(),
            step=step,
            keep_last=self.keep_last,
            async_save=async_save,
            options=self.options,
            quantize_moments=self.quantize_moments,
        )
        self.durable_saves.append(step)

    def _release_persist_buffers(self) -> None:
        """Once a persist has finished, free the engine's async-save snapshot buffer (1x the state, resident
        otherwise): between persists the tier's host memory stays at its two copies."""
        handle = self._persist_handle
        if handle is not None and handle.done() and self.disabled_reason is None:
            from ..checkpoint.save import release_host_buffers

            release_host_buffers()
            self._persist_handle = None

    def wait(self) -> None:
        """Wait for the background part of the last memory save (copy, checksums, peer transfer)."""
        err = self._bg.wait()
        if err is not None:
            raise MemoryTierError(f"the last memory save failed: {err}") from err

    def close(self, remove: bool = True) -> None:
        """End of the job: wait for the last save; remove this rank's memory copies (a clean end) when ``remove``."""
        self._bg.wait()
        self._persister.wait()
        self._unmap()
        from ..checkpoint.save import wait_pending

        wait_pending(raise_error=False)
        if remove:
            self.copies.remove()
        else:
            self.copies.release()
        self.copies.unclaim(remove)
        self.durable_id = None
        if self._link is not None:
            self._link.close()
            self._link = None

    # ------------------------------------------------------------------ restore
    def restore(self) -> RestoreResult | None:
        """Restore the newest step every rank has (collective; restore.py). None when nothing is stored anywhere
        (a fresh start); NoCommonStepError on every rank when state exists but no step is common to all. Also sets
        ``restored`` and ``start_step``."""
        self._bg.wait()
        self._persister.wait()
        self._persisting = False
        self.slots.persist_done()
        self._unmap()  # a previous restore's mappings: an unlinked copy would keep its memory while mapped
        if self.optimizer is not None:
            self.fsdp.init_optimizer_state(self.optimizer)
        self.copies.release()
        self._layout = None
        self._prepare()
        if not frozen_base.writes_base_by_default(self.fsdp):  # copies reference the base: checked against this
            frozen_base.fingerprint(self.fsdp)  # collective, once per run
        restore = Restore(self)
        self.restored = restore.run()
        self.start_step = self.restored.step if self.restored is not None else 0
        kept = (
            restore.restored_slot
            if restore.restored_slot is not None and restore.restored_slot < self.slots.n
            else None
        )
        self.slots.restored(kept, self.restored.step if self.restored is not None else -1)
        if restore.slot_sizes is not None:  # restored from the peer copy: the own slot is likely gone (lost node)
            self._bg.start(lambda: self._reserve_own(*restore.slot_sizes))
        return self.restored

    def _reserve_own(self, header_cap: int, data_len: int) -> None:
        """Background, after a restore from the peer copy: reserve the own slot (its size as the received copy's)
        so that the first save does not pay the allocation (150-350 ms for 0.5 GB here); MemoryTierFullError is
        reported by that save, whose setup then disables the tier on every rank."""
        Slot.allocate(self.copies.own_path(), header_cap, data_len, self.quota).close()

    def unmap(self) -> None:
        """Drop this process's mappings of the copies (the files stay): what a restarted process starts from.
        Unmapping costs time (page tables of the whole copy), which is why a restore defers its own."""
        self._bg.wait()
        self._persister.wait()
        self.copies.release()
        self._layout = None
        self._unmap()

    def unmap_later(self, found: list) -> None:
        self._unmap_later.extend(found)

    def _unmap(self) -> None:
        for slot, *_rest in self._unmap_later:
            slot.close()
        self._unmap_later = []
