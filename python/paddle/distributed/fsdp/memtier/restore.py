"""Restart from the memory tier: scan, agree, bring peer copies over, read and verify in one pass, verdict.

Order, on every rank:

1. *scan* the rank's own copy and the copy it holds for its partner, headers only: prefix, "valid" flag, header
   checksum, job id, world size, rank and the model's records; the own copy's non-tensor state is decoded;
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
import time

from ..checkpoint.errors import rebuild_remote_error
from ..checkpoint.format.reserved import EXTRA_KEY
from ..checkpoint.io.storage import backend_for
from ..checkpoint.manager import committed_steps, step_dir_name
from . import agreement, peers
from .copies import read_copy
from .errors import InvalidMemoryCopyError, MemoryTierError, NoCommonStepError
from .readback import read_into
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
        self.apply_own = None  # the own copy's checked non-tensor state (decode_values), set by the scan
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
        self.apply_own = None

    # ------------------------------------------------------------------ 1. scan
    def _open(self, name: str, path: str, owner: int, layout) -> None:
        if name in self.excluded or not os.path.exists(path):
            return
        try:
            expect = dict(self.tier.expect(), rank=owner)  # a held copy may be sent: DLPack needs it writable
            own = name == "own"
            self.found[name] = read_copy(path, expect, layout, writable=not own, verify=False)
            if own:
                tier, header = self.tier, self.found[name][1]
                self.apply_own = decode_values(tier.fsdp, tier.optimizer, header["values"], f"memory copy {path}")
        except (InvalidMemoryCopyError, OSError) as e:
            copy = self.found.pop(name, None)
            if copy is not None:
                copy[0].close()
            logger.warning("memory tier: rank %d skips %s: %s", self.rank, "its own copy" if name == "own" else
                           "the peer copy it holds", e)  # fmt: skip

    def scan(self, layout) -> dict:
        copies = self.tier.copies
        error = None
        try:
            self._open("own", copies.own_path(), self.rank, layout)
            if self.tier.source is not None:
                self._open("held", copies.peer_path(), self.tier.source, None)
        except Exception as e:  # noqa: BLE001 - raised on every rank after the agreement's exchange
            error = (type(e).__name__, str(e))
        root = self.tier.durable_root
        held = self.found.get("held")
        own = self.found.get("own")
        return {
            "own": own[1]["step"] if own else None,
            "held": [self.tier.source, held[1]["step"]] if held else None,
            "held_size": held[0].size if held else 0,
            "storage": committed_steps(root),
            "error": error,
        }

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
        state = tensor_state(tier.fsdp, tier.optimizer)
        for _round in range(2 * tier.world + 2):  # every repeated round excludes at least one copy
            report = self.scan(state.layout)
            self.mark("scan")
            reports = tier.fsdp.comm.all_gather_object(report)
            self.mark("agree")
            for r, rep in enumerate(reports):
                if rep["error"] is not None:
                    raise rebuild_remote_error(*rep["error"], r)
            decision = agreement.decide(reports)
            if decision is None and self.written:  # every copy excluded after a failed read, storage empty
                raise NoCommonStepError("no intact memory copy is left after a failed restore, storage is empty")
            if decision is None or decision.sources[0] == agreement.STORAGE:
                self.close_found()
                return None if decision is None else self.from_storage(decision)
            self._log_stale(decision.step)
            result = self.from_memory(state, decision, reports)
            if result is not None:
                return result
        raise MemoryTierError("memory tier: restore did not converge")  # pragma: no cover - bounded above

    def _log_stale(self, step: int) -> None:
        for name, (_slot, header, _o, _n) in self.found.items():
            if header["step"] < step:
                logger.info("memory tier: rank %d does not use its %s copy of step %d (stale: agreed step %d)",
                            self.rank, name, header["step"], step)  # fmt: skip

    def from_storage(self, decision) -> RestoreResult:
        from ..state.resume import load_checkpoint

        root = self.tier.durable_root
        path = backend_for(root).child(root, step_dir_name(decision.step))
        result = load_checkpoint(self.tier.fsdp, path, optimizer=self.tier.optimizer)
        logger.info("memory tier: every rank restored step %d from storage %s", decision.step, path)
        out = RestoreResult(dict(result), decision.step, decision.sources)
        out.timings = self.timings()
        return out

    # ------------------------------------------------------------------ 3.-5. memory
    def _fetch(self, decision, reports) -> None:
        """Peer transfers of this decision (holder -> owner's own slot), then the owner reads the copy."""
        kind = decision.sources[self.rank]
        transfers = sorted((holder, r) for r, holder in decision.holders.items())
        if not transfers:
            return
        send = self.found["held"][0].buf if self.rank in decision.holders.values() else None
        recv_slot = None
        if kind == agreement.PEER:
            stale = self.found.pop("own", None)
            self.apply_own = None
            if stale is not None:
                stale[0].close()
            path = self.tier.copies.own_path()
            if os.path.exists(path):
                os.unlink(path)
            size = reports[decision.holders[self.rank]]["held_size"]
            recv_slot = Slot.allocate(path, 0, size - HEADER_OFF)
            self.mark("allocate")
        try:
            peers.transfer(self.tier.tier_group(), self.rank, transfers, send, recv_slot and recv_slot.buf)
        finally:
            if recv_slot is not None:
                recv_slot.close()
        self.mark("transfer")
        if kind == agreement.PEER:
            tier = self.tier
            layout = tensor_state(tier.fsdp, tier.optimizer).layout
            self.found["own"] = read_copy(tier.copies.own_path(), dict(tier.expect(), rank=self.rank), layout,
                                          verify=False)  # fmt: skip

    def _read(self, state, decision, reports):
        """(copy, apply) of this rank: the copy read into the tensors, every chunk verified on the way (raises
        InvalidMemoryCopyError for a corrupt copy, after writing part of the tensors)."""
        self._fetch(decision, reports)
        copy = self.found.get("own")
        if copy is None or copy[1]["step"] != decision.step:
            raise InvalidMemoryCopyError(f"rank {self.rank}: no copy of step {decision.step} after the transfers")
        slot, header, doff, dlen = copy
        apply = self.apply_own
        if apply is None:
            tier = self.tier
            apply = decode_values(tier.fsdp, tier.optimizer, header["values"], f"memory copy {slot.path}")
        self.written = True
        read_into(slot, header, doff, dlen, [rec.tensor for rec in state.records])
        return copy, apply

    def from_memory(self, state, decision, reports) -> RestoreResult | None:
        """Restore from memory; None when a copy turned out corrupt (excluded: the caller starts a new round)."""
        kind = decision.sources[self.rank]
        status, copy, apply = None, None, None
        try:
            copy, apply = self._read(state, decision, reports)
        except InvalidMemoryCopyError as e:
            logger.warning("memory tier: rank %d: %s", self.rank, e)
            status = ("corrupt", str(e))
        except Exception as e:  # noqa: BLE001 - every rank must reach the exchange
            status = (type(e).__name__, str(e))
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
                if r == self.rank:
                    self.excluded.add("own")
                if decision.sources[r] == agreement.PEER and decision.holders[r] == self.rank:
                    self.excluded.add("held")
            logger.warning("memory tier: rank %d: the copies of ranks %s failed their check; every rank tries "
                           "another source", self.rank, [r for r, _v in failed])  # fmt: skip
            return None
        header = copy[1]
        apply()
        self.mark("apply")
        self.tier.unmap_later(list(self.found.values()))  # unmapping is slow: at the next save, off this path
        self.found = {}
        extra = header["values"].get(EXTRA_KEY) or {}
        timings = self.timings()
        logger.info("memory tier: rank %d restored step %d from %s (%s)", self.rank, decision.step, kind,
                    ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in timings.items()))  # fmt: skip
        persisted = False
        if self.tier.persist_on_restore and decision.step not in reports[0]["storage"]:
            self.tier.persist(decision.step, extra, async_save=False)
            persisted = True
        result = RestoreResult(extra, decision.step, decision.sources, persisted)
        result.timings = timings
        return result
