"""The memory copies a rank keeps (its own states in N slots used in turn, and one peer's) and writing a save.

Bounded memory: ``slots`` own slot files per rank (2 by default) and one peer slot, allocated once (``setup``) and
reused by every later save. Why several own slots: a save writes a slot other than the one holding the newest
step complete on every rank (slots.py chooses), so a crash while it copies still leaves that step; and a
persist reads the slot of its step while the next saves write another. One slot (``slots=1``) is the older
layout: a save overwrites the only copy in place (marked "writing" until complete). Setup is collective: every
rank learns every rank's slot size, and if any rank lacks the space, every rank disables the tier together (the
saves then go to storage).

Files: ``rankNNNNN.own`` (slot 0: the single-slot layout's name, so a root it wrote restores), ``rankNNNNN.own1``
... and ``rankNNNNN.peer``.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import threading

import numpy as np

from ..checkpoint import checksums, host_memory, snapshot, snapshot_guard
from ..devices import device
from . import roots
from .errors import InvalidMemoryCopyError, MemoryTierFullError
from .slot import Slot, aligned

logger = logging.getLogger(__name__)

CHUNK_BYTES = 64 << 20


def header_capacity(values_json_len: int, n_records: int) -> int:
    """Room for the header: the records' entries and the JSON values, with slack for growing values."""
    return aligned(4 * values_json_len + 512 * n_records + (64 << 10), 4096)


def offsets_of(layout: list[list]) -> tuple[list[int], int]:
    offsets, pos = [], 0
    for item in layout:
        offsets.append(pos)
        pos += aligned(item[3])
    return offsets, pos


OWN_NAME = re.compile(r"^rank(\d{5})\.own(\d*)$")  # slot 0 is ".own", slot i ".own<i>"
MAX_SLOTS = 8


def own_name(rank: int, index: int) -> str:
    return f"rank{rank:05d}.own{index or ''}"


class Copies:
    """This rank's ``slots`` own slots and its peer slot (None without a peer copy) under ``<root>/<job>``
    (roots.py: a checked job id, private directories, the rank's lock held while the tier lives)."""

    def __init__(self, root: str, job: str, rank: int, slots: int = 2):
        self.root = root
        self.dir = os.path.join(root, roots.check_job_id(job))
        self.rank = rank
        self.n_slots = slots
        self.lock: roots.RankLock | None = None
        self.own: list[Slot] = []
        self.peer: Slot | None = None
        self.sizes: list[tuple[int, int]] = []  # (header capacity, data length) by rank

    def own_path(self, rank: int | None = None, index: int = 0) -> str:
        return os.path.join(self.dir, own_name(self.rank if rank is None else rank, index))

    @staticmethod
    def own_index(path: str) -> int:
        m = OWN_NAME.match(os.path.basename(path))
        return int(m.group(2) or 0) if m else 0

    def own_paths(self) -> list[str]:
        """Every own slot file of this rank present in the job's directory (any count: a root written with
        another ``slots``), slot 0 first."""
        try:
            names = os.listdir(self.dir)
        except OSError:
            return []
        found = []
        for name in names:
            m = OWN_NAME.match(name)
            if m and int(m.group(1)) == self.rank and (m.group(2) == "" or 0 < int(m.group(2)) < MAX_SLOTS):
                found.append((int(m.group(2) or 0), os.path.join(self.dir, name)))
        return [path for _i, path in sorted(found)]

    def peer_path(self) -> str:
        return os.path.join(self.dir, f"rank{self.rank:05d}.peer")

    def claim(self) -> None:
        """Check the memory root and the job's directory (roots.open_dir) and take this rank's lock (once):
        MemoryRootError / MemoryRootInUseError by name."""
        if self.lock is None:
            os.close(roots.open_dir(self.root, create=True, private=False))
            self.lock = roots.RankLock(self.dir, self.rank)

    def unclaim(self, remove: bool) -> None:
        """Release the lock (the end of the tier); ``remove``: delete the lock file and the job's directory too."""
        if self.lock is None:
            return
        if remove:
            try:
                os.unlink(self.lock.path)
            except FileNotFoundError:
                pass
        self.lock.close()
        self.lock = None
        if remove:
            try:
                os.rmdir(self.dir)
            except OSError:
                pass

    def allocate(self, sizes: list[tuple[int, int]], source: int | None, quota: int | None) -> None:
        """Allocate every slot (MemoryTierFullError when the root or the quota is too small for all). Own slot
        files beyond ``n_slots`` (a root written with more) are removed: their steps are older than the kept ones
        or were refused by the restore."""
        self.claim()
        self.release()
        self.sizes = sizes
        cap, dlen = sizes[self.rank]
        peer_size = (sizes[source][0] + sizes[source][1]) if source is not None else 0
        own_size = self.n_slots * (cap + dlen)
        if quota is not None and own_size + peer_size > quota:
            raise MemoryTierFullError(
                f"rank {self.rank}: {self.n_slots} own copies ({own_size} bytes) and peer copy ({peer_size} bytes) "
                f"exceed the memory tier quota of {quota} bytes"
            )
        keep = {self.own_path(index=i) for i in range(self.n_slots)}
        for path in self.own_paths():
            if path not in keep and os.path.isfile(path) and not os.path.islink(path):
                os.unlink(path)  # anything else under such a name is left alone (never a copy: roots.open_file)
        try:
            for i in range(self.n_slots):  # one at a time: a failure closes (remove) the ones already mapped
                self.own.append(Slot.allocate(self.own_path(index=i), cap, dlen))
            if source is not None:
                self.peer = Slot.allocate(self.peer_path(), *sizes[source])
        except MemoryTierFullError:
            self.remove()
            raise

    def release(self) -> None:
        for slot in [*self.own, self.peer]:
            if slot is not None:
                slot.close()
        self.own, self.peer = [], None

    def remove(self) -> None:
        """Delete every slot file (a clean end of the job, or a tier that could not be set up)."""
        self.release()
        for path in [*self.own_paths(), self.peer_path()]:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        try:
            os.rmdir(self.dir)
        except OSError:
            pass


class SaveIntoSlot:
    """One save into the own slot: volatile host records copied at construction (the caller's clock), device
    records' copies issued there (snapshot.StagedInto), deferred ones registered with the snapshot guard and
    completed by ``finish`` (background), which then checksums and writes the header that makes the copy valid."""

    def __init__(self, slot: Slot, state, header: dict, algo: str, common: int = -1):
        self.slot, self.state, self.header, self.algo = slot, state, header, algo
        self.offsets, self.data_len = offsets_of(state.layout)
        self.data_off = slot.size - self.data_len
        data = slot.data(self.data_off, self.data_len)
        slot.mark_writing(int(header["step"]), common)
        self._jobs, volatile, deferred = [], [], []
        for rec, off, item in zip(state.records, self.offsets, state.layout):
            dst = data[off : off + item[3]]
            if not item[3]:
                continue
            on_host = device.is_host(rec.tensor)
            if on_host and (rec.key not in state.deferred or not rec.tensor.is_contiguous()):
                # strided: at the call, on this thread (paddle's contiguous() moves the tensor's own memory)
                np.copyto(dst, host_memory.raw_view(rec.tensor)[0])
            elif rec.key in state.deferred:
                (self._jobs if on_host else deferred).append((dst, rec.tensor))
            else:
                volatile.append((dst, rec.tensor))
        # device copies are issued here, on the training thread, as the engine's Snapshot does
        self._staged = snapshot.StagedInto(volatile, deferred) if volatile or deferred else None
        self._guard = None
        if self._jobs or deferred:
            # the ranges after staging: paddle's contiguous() moves a strided tensor's own memory
            ranges = [snapshot_guard.span_of(t) or (0, 0) for _dst, t in self._jobs + deferred]
            self._guard = snapshot_guard.SnapshotInFlight(ranges)
            snapshot_guard.register(self._guard)

    def finish(self) -> None:
        """Copy the deferred host records and wait for the device copies, release the guard (training's writes
        may go on), move the staged bytes into the slot, checksum, write the header (valid from then on)."""
        staged, self._staged = self._staged, None
        try:
            try:
                for dst, t in self._jobs:
                    np.copyto(dst, host_memory.raw_view(t, allow_copy=False)[0])
                if staged is not None:
                    staged.wait()
            finally:
                self.release_guard()
            if staged is not None:
                staged.finish()
        finally:
            if staged is not None:
                staged.release()
        data = self.slot.data(self.data_off, self.data_len)
        fn = checksums.digest_function(self.algo) if self.algo != checksums.NONE else None
        records = []
        for (key, dtype, shape, nbytes), off in zip(self.state.layout, self.offsets):
            sums = checksums.chunk_digests(data[off : off + nbytes], CHUNK_BYTES, fn) if fn else []
            records.append([key, dtype, shape, off, nbytes, sums])
        self.header.update(algo=self.algo, chunk=CHUNK_BYTES, records=records)
        self.slot.write_header(self.header, self.data_off, self.data_len)

    def release_guard(self) -> None:
        """End the guard's wait (also on error); a save never finished gives its staging back too."""
        guard, self._guard = self._guard, None
        self._jobs = []
        staged, self._staged = self._staged, None
        if staged is not None:
            staged.release()
        if guard is not None:
            guard.done.set()
            snapshot_guard.unregister(guard)


def check_header(header: dict, expect: dict, layout: list[list] | None, where: str) -> None:
    """InvalidMemoryCopyError unless the header is of ``expect`` (job, world, rank, ...) and ``layout``."""
    for field, want in expect.items():
        if header.get(field) != want:
            if field == "durable_id":
                raise InvalidMemoryCopyError(f"{where}: a copy of another durable root (its id {header.get(field)}, "
                                             f"the durable root's {want}): ignored")  # fmt: skip
            raise InvalidMemoryCopyError(f"{where}: {field} {header.get(field)!r}, expected {want!r}")
    if layout is not None:
        try:
            have = [[k, d, s, n] for k, d, s, _off, n, _sums in header["records"]]
        except (KeyError, TypeError, ValueError):
            raise InvalidMemoryCopyError(f"{where}: unreadable records") from None
        if have != layout:
            raise InvalidMemoryCopyError(f"{where}: its records differ from this model's state")


def read_copy(
    path: str, expect: dict, layout: list[list] | None, writable: bool = False, verify: bool = True
) -> tuple[Slot, dict, int, int]:
    """Open, validate and (``verify``) checksum the copy at ``path``: InvalidMemoryCopyError (with the reason)
    unless it is of job/world/rank ``expect`` and (when given) matches ``layout``. Returns (slot, header,
    data_off, data_len); the caller closes the slot."""
    slot = Slot.open(path, writable, populate=verify)
    try:
        header, doff, dlen = slot.header()
        check_header(header, expect, layout, f"memory copy {path}")
        if verify:
            slot.verify(header, doff, dlen)
    except BaseException:
        slot.close()
        raise
    return slot, header, doff, dlen


class Background:
    """One background job at a time (the save's copy, checksum and peer transfer) on one long-lived thread;
    ``wait`` returns the last job's error. Why a long-lived thread: starting a thread per save costs the caller
    a GIL hand-over (~5-10 ms measured here), more than the rest of a save's call."""

    def __init__(self, name: str = "memtier-save"):
        self.name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._idle = threading.Event()
        self._idle.set()
        self._error: BaseException | None = None

    def start(self, fn) -> None:
        self.wait()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()
        self._idle.clear()
        self._jobs.put(fn)

    def _loop(self) -> None:
        while True:
            fn = self._jobs.get()
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - reported by wait()
                logger.error("memory tier: background job of %s failed: %s", self.name, e)
                self._error = e
            finally:
                self._idle.set()

    def idle(self) -> bool:
        return self._idle.is_set()

    def wait(self) -> BaseException | None:
        self._idle.wait()
        err, self._error = self._error, None
        return err
