"""The first save of a set of records: the coordinator assigns the writes of the world, each rank learns its own.

Why: a save whose write assignment is not remembered (the first save of a job, a save after an elastic restart,
records that changed) used to send every rank's record descriptions to every rank and run the assignment of the
whole world on every rank: O(pieces of the world) bytes and work per rank (10 s a rank at 8192 ranks for
Qwen3-235B in the scale simulation). Here each rank sends its descriptions, as columns (assign.pack), to the
coordinator only; the coordinator assigns and checks (assign.assign_columns) and sends each rank either its part
(the positions of the records it writes among its own, the world size and the checksum chunk: O(its records))
or the error that refuses the save, the same named error on every rank, before anything is written.

Transport: five collectives of the save's process group on the calling thread, like the save's first exchange:
gather of the sizes, broadcast of the largest, gather of the padded columns, broadcast of the largest answer,
scatter of the padded answers. A non-coordinator rank sends its columns + 8 bytes and receives 16 bytes plus
the largest answer of any rank (its own size when ranks hold similar shares). Unequal shares pad every message
to the largest: the coordinator then receives world x the largest share.
"""

from __future__ import annotations

import pickle
import zlib
from collections.abc import Mapping

import numpy as np

from .assign import Assigned, Columns, assign_columns, keys_of, pack, wire_at
from .errors import ERROR_CLASSES, CheckpointError, SaveFailedError
from .planner import WriteAssignment, auto_chunk

_PICKLE = pickle.HIGHEST_PROTOCOL


def rank_columns(wires: list) -> bytes:
    """What a rank sends the coordinator: its descriptions (wire form) as pickled columns, compressed (keys repeat
    their module paths: ~15x smaller for Qwen3-235B at 8192 ranks, ~0.1 ms a rank), which also shrinks the
    padding of every rank's message to the largest one."""
    return zlib.compress(pickle.dumps(pack(wires), protocol=_PICKLE), 1)


def _answer(obj) -> bytes:
    return zlib.compress(pickle.dumps(obj, protocol=_PICKLE), 1)


def coordinate(blobs: list[bytes], values: dict) -> tuple[WriteAssignment | None, list[bytes]]:
    """The coordinator's part: every rank's columns -> ``(full assignment, answer per rank)``. A refused save
    gives ``(None, answers)`` whose every answer is the error; the caller raises it after sending them."""
    try:
        cols = [pickle.loads(zlib.decompress(b)) for b in blobs]
        got = assign_columns(cols, values)
    except CheckpointError as e:
        return None, [_answer(("error", type(e).__name__, str(e)))] * len(blobs)
    world = len(cols)
    chunk = auto_chunk(world, got.total_bytes, got.pieces)
    answers = [_answer(("ok", world, chunk, p)) for p in got.picks]
    return WriteAssignment(got.specs, _Writes(cols, got), world=world, chunk=chunk), answers


def own_assignment(rank: int, wires: list, answer: bytes) -> WriteAssignment:
    """A rank's part of the assignment from the coordinator's ``answer``: its own writes (its own wires, in
    the coordinator's order) and the specs of its own keys. Raises the save's error: the class and message the
    coordinator found, as every rank found it when each assigned the whole world itself."""
    status = pickle.loads(zlib.decompress(answer))
    if status[0] == "error":
        raise ERROR_CLASSES.get(status[1], CheckpointError)(status[2])
    _ok, world, chunk, picks = status
    mine = [(wires[i][0], wires[i]) for i in picks.tolist()]
    specs = [(key, w[1], tuple(w[2])) for key, w in mine]
    return WriteAssignment(specs, {rank: mine}, world=world, chunk=chunk)


class _Writes(Mapping):
    """``{rank: [(key, wire)]}`` of every rank, built per rank when first asked for (the coordinator's commit
    and stock index ask for every rank; the assignment itself never does)."""

    def __init__(self, cols: list[Columns], got: Assigned):
        self._cols, self._picks, self._built = cols, got.picks, {}

    def __getitem__(self, rank: int) -> list:
        out = self._built.get(rank)
        if out is None:
            c = self._cols[rank]
            keys = keys_of(c)
            out = self._built[rank] = [(keys[i], wire_at(c, i, keys)) for i in self._picks[rank].tolist()]
        return out

    def __len__(self) -> int:
        return len(self._cols)

    def __iter__(self):
        return iter(range(len(self._cols)))


def exchange_assignment(comm, coordinator: int, wires: list, values: dict) -> WriteAssignment:
    """A first save's assignment on every rank of ``comm`` (coordination.Comm): the full one on the
    coordinator, the rank's own part elsewhere; every rank raises the same named error when the save is refused.
    Collective: every rank calls it with the same ``coordinator``."""
    blob = rank_columns(wires)
    if comm.world == 1:
        assignment, answers = coordinate([blob], values)
        return _finish(assignment, 0, wires, answers[0])
    blobs = comm.gather_bytes(blob, coordinator)
    answers = None
    assignment = None
    if comm.rank == coordinator:
        try:
            assignment, answers = coordinate(blobs, values)
        except BaseException as e:  # a bug: every rank must still hear of it, or the others wait forever
            err = SaveFailedError(f"save failed: the coordinator (rank {coordinator}) failed: {e!r}")
            comm.scatter_bytes([_answer(("error", type(err).__name__, str(err)))] * comm.world, coordinator)
            raise
    answer = comm.scatter_bytes(answers, coordinator)
    return _finish(assignment, comm.rank, wires, answer)


def _finish(assignment, rank: int, wires: list, answer: bytes) -> WriteAssignment:
    return assignment if assignment is not None else own_assignment(rank, wires, answer)


def padded(data: bytes, size: int) -> np.ndarray:
    """``data`` as a uint8 array of ``size + 8`` bytes: its length, then the bytes, then zeros."""
    out = np.zeros(size + 8, np.uint8)
    out[:8] = np.frombuffer(len(data).to_bytes(8, "little"), np.uint8)
    out[8 : 8 + len(data)] = np.frombuffer(data, np.uint8)
    return out


def unpadded(block: np.ndarray) -> bytes:
    n = int.from_bytes(block[:8].tobytes(), "little")
    return block[8 : 8 + n].tobytes()
