"""Which run committed a checkpoint, and whether a committed checkpoint is complete.

Why: a root of numbered checkpoints (CheckpointManager's ``step_N``, the Trainer's ``checkpoint-N``) is shared with
leftovers: a directory of an earlier run or of another job (often with higher step numbers), a copy torn mid-way
that still carries its commit record. A commit record alone says "committed", not "usable" nor "ours". So every
save that knows its run writes ``lineage`` into the commit record (format/commit.py): the run's id, the checkpoint
id the run continued from (its ``parent``), and the coordinator's clock at the commit. Rotation and resume
(selection.py) then count only checkpoints that are complete (:func:`examine`: the commit record, the metadata it
names, and every data file the metadata lists with its size: a few stats, no data read) and of this run.

A run's id is new at a fresh start (also in a root an earlier run left with its ``latest``: root_runs.py); a run
that resumes carries on the lineage of the checkpoint it resumed from (:meth:`Lineage.continuing`), so rotation
after a restart still removes what the run saved before its crash.

The recorded commit times of one lineage never go back: a record's time is at least that of the checkpoint the
run continued from and of the run's previous record (plus a millisecond), whatever the clock says. Why: a run
restarted on a node whose clock is behind (or after the clock was stepped back) otherwise recorded its newer
checkpoints as older: rotation deleted them and kept the stale ones, and a resume picked the stale one.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from .directory import StorageUnreadableError, read_metadata
from .errors import CheckpointError, MetadataError
from .format.codecs import RAW, TABLE_ROW, table_name
from .format.metadata import COMMIT_FILE, check_file_name
from .format.schema import parse_commit, parse_lineage
from .format.strict_json import SMALL_FILE_BYTES, loads_strict
from .io.storage import Storage

MIN_TICK = 1e-3  # seconds a record's time is at least after its predecessor's (a clock that went back)


@dataclass(frozen=True)
class Lineage:
    """A run, as its saves record it: ``run`` (its id) and ``parent`` (the checkpoint id it continued from;
    None: a fresh start)."""

    run: str | None
    parent: str | None = None
    since: float = field(default=0.0, compare=False)  # the commit time of the checkpoint continued from
    _last: list[float] = field(default_factory=list, init=False, compare=False, repr=False)  # this run's last

    @classmethod
    def fresh(cls, parent: str | None = None, since: float | None = None) -> Lineage:
        return cls(uuid.uuid4().hex, parent, since or 0.0)

    @classmethod
    def continuing(cls, found: Found) -> Lineage:
        """The lineage of a run that resumed from ``found``: its run and origin when it has a lineage record; a new
        run whose parent is ``found`` when it has none (written before lineages were recorded)."""
        if found.run is not None:
            return cls(found.run, found.parent, found.time or 0.0)
        return cls.fresh(found.checkpoint_id, found.time)

    def record(self) -> dict | None:
        """The commit record's ``lineage`` (None for the lineage of unrecorded checkpoints)."""
        if self.run is None:
            return None
        floor = max([self.since, *self._last]) + MIN_TICK if self.since or self._last else 0.0
        now = max(time.time(), floor)
        self._last[:] = [now]
        return {"run": self.run, "parent": self.parent, "time": now}

    def owns(self, found: Found) -> bool:
        """``found`` belongs to this run: committed by it, or the checkpoint it continued from."""
        return found.run == self.run or (self.parent is not None and found.checkpoint_id == self.parent)


@dataclass(frozen=True)
class Found:
    """A committed numbered checkpoint of a root, examined: ``problem`` is None when it is complete."""

    location: str
    step: int
    checkpoint_id: str | None = None
    run: str | None = None  # None: no lineage record
    parent: str | None = None
    time: float | None = None
    problem: str | None = None

    @property
    def complete(self) -> bool:
        return self.problem is None

    @property
    def name(self) -> str:
        return self.location.rstrip("/").rpartition("/")[2]

    def order(self) -> tuple:
        """Newest last: checkpoints with a lineage record by commit time, after the unrecorded ones by step."""
        return (self.time is not None, self.time or 0.0, self.step)

    def lineage(self) -> Lineage:
        return Lineage(self.run, self.parent)

    def describe(self) -> str:
        if self.problem is not None:
            return f"incomplete: {self.problem}"
        if self.run is None:
            return "no lineage record (written before lineages were recorded, or by a one-process tool)"
        return f"of run {self.run[:12]}"


def examine(location: str, step: int, storage: Storage) -> Found:
    """``location`` as a :class:`Found`: its commit record and lineage, and whether it is complete (its metadata
    readable and matching the commit record, every data file it lists present with its recorded size).
    StorageUnreadableError when the storage refuses a read (EACCES, EIO): unreadable is never "not there"."""
    where = f"{location}/{COMMIT_FILE}"
    try:
        raw = storage.get(location, COMMIT_FILE, SMALL_FILE_BYTES)
    except OSError as e:  # EACCES, EIO: says nothing about the checkpoint; never taken for "not there"
        raise StorageUnreadableError(f"cannot read {where}: {e}") from e
    except MetadataError as e:  # larger than a commit record can be: a damaged or foreign file, never fatal
        return Found(location, step, problem=f"commit record unreadable: {e}")
    if raw is None:
        return Found(location, step, problem=f"no commit record {COMMIT_FILE}")
    try:
        record = loads_strict(raw, where)
        cid, _ = parse_commit(record, where)
        lineage = parse_lineage(record, where)
    except CheckpointError as e:
        return Found(location, step, problem=f"commit record unreadable: {e}")
    run, parent, when = lineage if lineage is not None else (None, None, None)
    found = Found(location, step, cid, run, parent, when)
    try:
        md = read_metadata(location, None, storage)
        for name, fm in md.files.items():
            if md.codecs.get(name, RAW) != RAW:  # a compressed file: its size is its chunk table's, not fm.size
                problem = _stored_file_problem(storage, location, name, fm.size)
                if problem is not None:
                    return _torn(found, problem)
                continue
            size = _size(storage, location, name)
            if size is None:
                return _torn(found, f"data file {name} is missing")
            if size != fm.size:
                return _torn(found, f"data file {name} has {size} bytes, expected {fm.size}")
    except CheckpointError as e:
        cause = e.__cause__
        if isinstance(cause, OSError) and not isinstance(cause, FileNotFoundError):
            raise StorageUnreadableError(f"cannot read checkpoint {location}: {cause}") from e
        return _torn(found, f"{type(e).__name__}: {e}")
    return found


def _size(storage: Storage, location: str, name: str) -> int | None:
    try:
        handle = storage.open_read(location, check_file_name(name))
    except FileNotFoundError:
        return None
    except OSError as e:
        raise StorageUnreadableError(f"cannot read {location}/{name}: {e}") from e
    try:
        return handle.size
    finally:
        handle.close()


def _stored_file_problem(storage: Storage, location: str, name: str, decoded_size: int) -> str | None:
    """Why the compressed data file ``name`` (format 4 "codecs") is not complete, or None: it and its chunk table
    ``<name>.chunks`` are there, the table is whole rows, and its last row ends where the stored file ends and
    within the decoded size. One stat each and one 40-byte read: the same few requests as a raw file's size check."""
    table = table_name(name)
    size = _size(storage, location, name)
    if size is None:
        return f"data file {name} is missing"
    try:
        handle = storage.open_read(location, check_file_name(table))
    except FileNotFoundError:
        return f"chunk table {table} is missing"
    except OSError as e:
        raise StorageUnreadableError(f"cannot read {location}/{table}: {e}") from e
    try:
        if handle.size == 0 or handle.size % TABLE_ROW.itemsize:
            return f"chunk table {table} has {handle.size} bytes, not whole rows"
        last = bytearray(TABLE_ROW.itemsize)
        if handle.read_into(handle.size - len(last), last) != len(last):
            return f"chunk table {table} is shorter than its size"
    except OSError as e:
        raise StorageUnreadableError(f"cannot read {location}/{table}: {e}") from e
    finally:
        handle.close()
    row = np.frombuffer(bytes(last), TABLE_ROW)[0]
    if int(row["soff"]) + int(row["slen"]) != size:
        return f"data file {name} has {size} bytes, its chunk table ends at {int(row['soff']) + int(row['slen'])}"
    if int(row["doff"]) + int(row["dlen"]) > decoded_size:
        return f"chunk table {table} runs past the decoded size {decoded_size}"
    return None


def _torn(found: Found, problem: str) -> Found:
    return Found(found.location, found.step, found.checkpoint_id, found.run, found.parent, found.time, problem)
