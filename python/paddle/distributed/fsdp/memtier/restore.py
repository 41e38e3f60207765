"""Restart from the memory tier: scan, agree, bring peer copies over, read and verify in one pass, verdict.

Order, on every rank:

1. *scan* the rank's own copies (every own slot: copies.py) and the copy it holds for its partner, headers only:
   prefix, "valid" flag, header checksum, job id, world size, rank and the model's records; the own copies'
   non-tensor state is decoded;
2. *agree* (agreement.py) on the step and every rank's source from everyone's scan (any other failure of a scan
   is raised on every rank, the same named error);
3. only when some rank restores from a peer copy: *transfer* it (holder -> owner, into the owner's own slot);
4. *read* the copy into the tensors in one pass, every chunk checksum verified on the bytes that landed
   (readback.py), then exchange the verdicts. When any rank's copy failed its check, that copy is excluded and
   every rank starts a new round (another source: the peer copy, an older common step, storage), whose read or
   load overwrites every tensor the failed attempt wrote; when no source is left, every rank raises the same
   named error (the model's tensors are then not a checkpoint's: the error says so). Non-tensor state (optimizer
   and LR scheduler, RNG) is applied only after every rank's verdict was "intact".

Why this order: a restore from memory is bound by memory bandwidth; checking every chunk before the agreement
and copying after it read every byte from DRAM twice (and faulted the mapping in for the check); now each byte
is read once, hashed in the CPU cache, and the price of a corrupt copy (rare) is a second round.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

from ..checkpoint import root_runs
from ..checkpoint.errors import CheckpointError, rebuild_remote_error
from ..checkpoint.format.reserved import EXTRA_KEY
from ..checkpoint.io.backends import backend_for
from ..checkpoint.manager import committed_steps, step_dir_name
from . import agreement, wire
from .copies import check_header, read_copy
from .errors import InvalidMemoryCopyError, MemoryTierError, NoCommonStepError, PeerTransferError
from .header import written_at
from .readback import fill_tensors, populate, read_into
from .slot import HEADER_OFF, Slot
from .state import decode_values, tensor_state

logger = logging.getLogger(__name__)


class RestoreResult(dict):
    """The restored ``extra_state`` (this dict), with ``step``, ``sources`` (per rank: memory, peer, storage),
    ``persisted`` (the step was written to storage after the restore) and ``timings`` (seconds per phase)."""

    def __init__(self, extra: dict, step: int, sources: list[str], persisted: bool = False):
        super().__init__(extra)
        self.step, self.sources, self.persisted = step, sources, persisted
        self.timings: dict[str, float] = {}


class Restore:
    """One collective restore for ``tier`` (a MemoryTier)."""

    def __init__(self, tier):
        self.tier = tier
        self.rank = tier.rank
        self.marks = [("start", time.perf_counter())]
        self.excluded: set[str] = set()  # this rank's copies found corrupt in an earlier round
        self.found: dict = {}
        self.apply_own: dict = {}  # per own slot name, its checked non-tensor state (decode_values), set by the scan
        self.used: str | None = None  # the own slot read (its name: "own<i>")
        self.restored_slot: int | None = None  # its index, once the restore succeeded from it
        self._sender = None  # the thread sending held copies to their owners
        self.storage_steps: list[int] = []
        self.slot_sizes: tuple[int, int] | None = None  # (header capacity, data length) of a copy received
        self.written = False  # a read into the tensors was attempted (a later failure leaves them undefined)

    def mark(self, name: str) -> None:
        self.marks.append((name, time.perf_counter()))

    def timings(self) -> dict[str, float]:
        m = self.marks
        out: dict[str, float] = {}
        for i in range(1, len(m)):
            out[m[i][0]] = out.get(m[i][0], 0.0) + m[i][1] - m[i - 1][1]
        return out

    def close_found(self) -> None:
        for slot, *_rest in self.found.values():
            slot.close()
        self.found = {}
        self.apply_own = {}

    # ------------------------------------------------------------------ 1. scan
    def _open(self, name: str, path: str, owner: int, layout) -> None:
        if name in self.excluded or not os.path.lexists(path):
            return
        try:
            expect = dict(self.tier.expect(), rank=owner)
            self.found[name] = read_copy(path, expect, layout, verify=False)  # the header only
            if name.startswith("own"):
                tier, header = self.tier, self.found[name][1]
                self.apply_own[name] = decode_values(tier.resume_objects(), header["values"], f"memory copy {path}")
        except (CheckpointError, OSError, TypeError, ValueError, KeyError) as e:  # a copy this rank cannot use
            copy = self.found.pop(name, None)
            if copy is not None:
                copy[0].close()
            logger.warning("memory tier: rank %d skips %s: %s", self.rank, "its own copy" if name.startswith("own") else
                           "the peer copy it holds", e)  # fmt: skip

    def scan(self, layout) -> dict:
        copies = self.tier.copies
        error = None
        try:
            for path in copies.own_paths():
                self._open(f"own{copies.own_index(path)}", path, self.rank, layout)
            if self.tier.source is not None:
                self._open("held", copies.peer_path(), self.tier.source, None)
        except Exception as e:  # noqa: BLE001 - raised on every rank after the agreement's exchange
            error = (type(e).__name__, str(e))
        storage: list[int] = []
        try:  # a rank that cannot list storage reports it (every rank raises it): never "no checkpoint"
            storage = committed_steps(self.tier.durable_root)
        except Exception as e:  # noqa: BLE001 - raised on every rank after the agreement's exchange
            error = error or (type(e).__name__, str(e))
        held = self.found.get("held")
        own = sorted({copy[1]["step"] for name, copy in self.found.items() if name.startswith("own")})
        return {
            "own": own,
            "held": [self.tier.source, held[1]["step"]] if held else None,
            "storage": storage,
            "error": error,
            "where": f"{socket.gethostname()}:{copies.dir}",
            **self._intents(bool(own)),
        }

    def _intents(self, has_copy: bool) -> dict:
        """What this rank's interrupted slots say (slot.intent): ``seen``, the newest step they name as complete
        on every rank when they were written (-1: none), and ``never``: this rank has no copy and every own slot
        is a first save's interrupted copy (no common step named; none a refused or damaged copy)."""
        paths, seen, never = self.tier.copies.own_paths(), -1, not has_copy
        for path in paths:
            try:
                slot = Slot.open(path)
            except (CheckpointError, OSError):
                never = False
                continue
            try:
                intent = slot.intent()
                if intent is None and slot.size:  # a valid copy this rank refused, or an older layout's
                    never = False
            finally:
                slot.close()
            if intent is not None:
                seen = max(seen, intent[1])
        return {"seen": seen, "never": bool(paths) and never and seen < 0}

    # ------------------------------------------------------------------ driver
    def run(self) -> RestoreResult | None:
        try:
            return self._rounds()
        except Exception as e:
            self.close_found()
            if self.written:
                note = ("memory tier: a failed restore attempt had already written part of the model's tensors: "
                        "they hold no checkpoint's state; load one before training")  # fmt: skip
                logger.error("rank %d: %s (%s)", self.rank, note, e)
                e.add_note(note)
            raise

    def _rounds(self) -> RestoreResult | None:
        tier = self.tier
        state = tensor_state(tier.resume_objects())
        tier.peer_link()  # collective when first called: before any rank may need it
        self.mark("prepare")
        for _round in range(2 * tier.world + 2):  # every repeated round excludes at least one copy
            report = self.scan(state.layout)
            self.mark("scan")
            reports = tier.fsdp.comm.all_gather_object(report)
            self.mark("agree")
            self.storage_steps = reports[0]["storage"]
            for r, rep in enumerate(reports):
                if rep["error"] is not None:
                    raise rebuild_remote_error(*rep["error"], r)
            decision = agreement.decide(reports)
            if decision is None and self.written:  # every copy excluded after a failed read, storage empty
                raise NoCommonStepError("no intact memory copy is left after a failed restore, storage is empty")
            if decision is not None and decision.sources[0] == agreement.FRESH:
                self.close_found()
                logger.warning("memory tier: rank %d: a first save was interrupted before every rank completed it "
                               "(memory %s): every rank starts from the beginning", self.rank,
                               [rep["own"] for rep in reports])  # fmt: skip
                self.discard_newer(-1)
                return None
            if decision is None or decision.sources[0] == agreement.STORAGE:
                self.close_found()
                if decision is None:
                    return None
                result = self.from_storage(decision)
                self.discard_newer(decision.step)
                return result
            self._log_stale(decision.step)
            result = self.from_memory(state, decision, _round)
            if result is not None:
                self.discard_newer(decision.step)
                return result
        raise MemoryTierError("memory tier: restore did not converge")  # pragma: no cover - bounded above

    def discard_newer(self, step: int) -> None:
        """Mark "writing" every copy of this rank (own and held) of a step newer than the agreed ``step``: training
        goes on from ``step``, so such a copy belongs to a lineage that no longer exists; kept, it could pair at a
        later restart with a new copy of the same step number on another rank (not the same state)."""
        copies = self.tier.copies
        for path in [*copies.own_paths(), copies.peer_path()]:
            try:
                slot = Slot.open(path, writable=True)
            except (CheckpointError, OSError):
                continue
            try:
                header, _o, _n = slot.header()
                if header["step"] > step:
                    slot.mark_writing(header["step"], step)
                    logger.info("memory tier: rank %d discards its copy of step %d in %s (newer than the restored "
                                "step %d)", self.rank, header["step"], path, step)  # fmt: skip
            except CheckpointError:
                pass
            finally:
                slot.close()

    def _log_stale(self, step: int) -> None:
        for name, (_slot, header, _o, _n) in self.found.items():
            if header["step"] < step:
                logger.info("memory tier: rank %d does not use its %s copy of step %d (stale: agreed step %d)",
                            self.rank, name, header["step"], step)  # fmt: skip

    def from_storage(self, decision) -> RestoreResult:
        from ..state.resume import load_checkpoint

        root = self.tier.durable_root
        path = backend_for(root).child(root, step_dir_name(decision.step))
        result = load_checkpoint(self.tier.fsdp, path, **self.tier.resume_kwargs())
        logger.info("memory tier: every rank restored step %d from storage %s", decision.step, path)
        out = RestoreResult(dict(result), decision.step, decision.sources)
        out.timings = self.timings()
        return out

    # ------------------------------------------------------------------ 3.-5. memory
    def _send_held(self, decision, tag: int) -> list[BaseException]:
        """Holders: send the held copy to each owner restoring from it (a helper thread: this rank may be
        reading its own copy, or receiving, at the same time). Returns the list its error lands in."""
        errors: list[BaseException] = []
        owners = [r for r, holder in decision.holders.items() if holder == self.rank]
        if not owners:
            return errors
        link, held = self.tier.peer_link(), self.found.get("held")

        def send() -> None:
            try:
                if held is None:  # pragma: no cover - the agreement names only holders of a valid copy
                    raise InvalidMemoryCopyError(f"rank {self.rank} holds no copy to send")
                populate(held[0], 0, held[0].size)  # the mapping of the scan: sending from it beats sendfile
                for owner in owners:
                    link.send_buffer(owner, held[0].buf, tag)
            except BaseException as e:  # noqa: BLE001 - reported in the verdict
                errors.append(e)

        self._sender = threading.Thread(target=send, name="memtier-peer-restore", daemon=True)
        self._sender.start()
        return errors

    def _receive(self, state, decision, tag: int):
        """(header, apply) of the copy arriving from this rank's holder, read straight into the tensors (one pass,
        every chunk verified); the stream is drained and acknowledged unless the connection itself failed."""
        tier = self.tier
        holder = decision.holders[self.rank]
        incoming = tier.peer_link().accept(holder, tag)
        where = f"peer copy of rank {self.rank} from rank {holder}"
        try:
            header, doff, dlen = wire.receive_header(incoming, where)
            check_header(header, dict(tier.expect(), rank=self.rank, step=decision.step), state.layout, where)
            apply = decode_values(tier.resume_objects(), header["values"], where)
            self.mark("transfer")

            def fill(dst, off: int) -> None:
                incoming.skip(doff + off - incoming.pos)
                incoming.read_into(dst)

            self.written = True
            fill_tensors(header, dlen, [rec.tensor for rec in state.records], fill, where)
        except PeerTransferError:
            raise
        except BaseException:
            incoming.finish()  # the holder's send completes; the verdict reports this copy
            raise
        incoming.finish()
        self.slot_sizes = (doff - HEADER_OFF, dlen)  # the own slot to reserve again (manager.restore)
        return header, apply

    def _read(self, state, decision, tag: int):
        """(header, apply) of this rank's copy of the agreed step, read into the tensors in one pass (raises
        InvalidMemoryCopyError for a corrupt copy, after writing part of the tensors)."""
        if decision.sources[self.rank] == agreement.PEER:
            return self._receive(state, decision, tag)
        names = [n for n, c in self.found.items() if n.startswith("own") and c[1]["step"] == decision.step]
        names.sort(key=lambda n: written_at(self.found[n][1]), reverse=True)  # a step saved twice: the later copy
        if not names:
            raise InvalidMemoryCopyError(f"rank {self.rank}: no copy of step {decision.step}")
        self.used = names[0]
        slot, header, doff, dlen = self.found[self.used]
        self.written = True
        read_into(slot, header, doff, dlen, [rec.tensor for rec in state.records])
        return header, self.apply_own[self.used]

    def from_memory(self, state, decision, round_: int) -> RestoreResult | None:
        """Restore from memory; None when a copy turned out corrupt (excluded: the caller starts a new round)."""
        kind = decision.sources[self.rank]
        tag = -1 - round_  # a restore's transfers (a save's carry its step)
        status, header, apply = None, None, None
        send_errors = self._send_held(decision, tag)
        try:
            header, apply = self._read(state, decision, tag)
        except InvalidMemoryCopyError as e:
            logger.warning("memory tier: rank %d: %s", self.rank, e)
            status = ("corrupt", str(e))
        except Exception as e:  # noqa: BLE001 - every rank must reach the exchange
            status = (type(e).__name__, str(e))
        if self._sender is not None:
            self._sender.join()
            self._sender = None
        if status is None and send_errors:
            status = (type(send_errors[0]).__name__, str(send_errors[0]))
        self.mark("read")
        verdicts = self.tier.fsdp.comm.all_gather_object(status)
        self.mark("verdict")
        failed = [(r, v) for r, v in enumerate(verdicts) if v is not None]
        if failed:
            self.close_found()
            for r, (what, msg) in failed:
                if what != "corrupt":
                    raise rebuild_remote_error(what, msg, r)
            for r, _v in failed:  # a corrupt copy: its owner's own, or the holder's copy it came from
                if r == self.rank and decision.sources[r] == agreement.MEMORY and self.used is not None:
                    self.excluded.add(self.used)
                if decision.sources[r] == agreement.PEER and decision.holders[r] == self.rank:
                    self.excluded.add("held")
            logger.warning("memory tier: rank %d: the copies of ranks %s failed their check; every rank tries "
                           "another source", self.rank, [r for r, _v in failed])  # fmt: skip
            return None
        apply()
        self.mark("apply")
        if kind == agreement.MEMORY:
            self.restored_slot = int(self.used[3:])
        self.tier.unmap_later(list(self.found.values()))  # unmapping is slow: at the next save, off this path
        self.found = {}
        extra = header["values"].get(EXTRA_KEY) or {}
        timings = self.timings()
        logger.info("memory tier: rank %d restored step %d from %s (%s)", self.rank, decision.step, kind,
                    ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in timings.items()))  # fmt: skip
        # the copies continue the run their persists recorded (what `latest` names): this process's saves into the
        # durable root, this persist first, rotate that run's checkpoints (a restore from storage: by its load)
        root_runs.adopt_latest(self.tier.durable_root)
        persisted = False
        if self.tier.persist_on_restore and decision.step not in self.storage_steps:
            self.tier.persist(decision.step, extra, async_save=False)
            persisted = True
        result = RestoreResult(extra, decision.step, decision.sources, persisted)
        result.timings = timings
        return result
