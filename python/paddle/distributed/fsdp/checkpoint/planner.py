"""Planning: records -> pieces to write; requested records -> byte ranges to read.

Regions and their flat runs are geometry.py's; the planner intersects the runs of a requested region with those
of each saved piece (``plan_reads``) and lays out the files of a save from a checked write assignment
(assign.py).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from .assign import assign_columns, pack
from .format.coverage import coverage_problems, flat_span  # noqa: F401 (coverage_problems: tools import it from here)
from .format.metadata import DEFAULT_CHUNK_BYTES, DTYPES, FORMAT_NAME, PieceMeta, TensorMeta, numel, rank_file_name
from .format.safetensors import build_header
from .gc_pause import gc_paused
from .geometry import Region, Segments, intersect, region_of_piece

# ----------------------------------------------------------------------------------------------- save planning


@dataclass
class RecordDesc:
    """What a rank announces about one tensor record before anything is written (small, picklable)."""

    key: str
    dtype: str
    region: Region
    replicated: bool  # plain tensor: every rank holds the whole tensor

    def to_wire(self):
        r = self.region
        return (self.key, self.dtype, r.shape, r.box_offset, r.box_shape, r.flat_range, self.replicated)

    @staticmethod
    def from_wire(w) -> RecordDesc:
        key, dtype, shape, off, box, fr, rep = w
        return RecordDesc(
            key, dtype, Region(tuple(shape), tuple(off), tuple(box), None if fr is None else tuple(fr)), rep
        )


@dataclass
class FileLayout:
    name: str
    rank: int
    header: bytes
    # (key, piece) in write order; piece.offset is absolute in the file
    pieces: list[tuple[str, PieceMeta]] = field(default_factory=list)
    size: int = 0


@dataclass
class SavePlan:
    tensors: dict[str, TensorMeta]
    values: dict[str, object]
    files: dict[int, FileLayout]  # rank -> layout


@dataclass(frozen=True)
class WriteAssignment:
    """Who writes which record (assign.py): ``specs`` ``[(key, dtype, global shape)]`` and ``writes``
    ``{rank: [(key, desc wire)]}`` in each rank's write order. Shared by saves (memoized): read only.

    The coordinator of a save holds every rank's writes; another rank of a first save only its own (and the
    specs of its own keys): ``world`` and ``chunk`` (the automatic checksum chunk, see chunk_for) then come from
    the coordinator."""

    specs: list
    writes: Mapping
    cache: dict = field(default_factory=dict, compare=False, repr=False)  # what follows from it (save_index.py)
    world: int | None = None  # None: len(writes)
    chunk: int | None = None  # None: chunk_for computes it from specs and writes

    @property
    def world_size(self) -> int:
        return len(self.writes) if self.world is None else self.world

    def keys_of(self, rank: int) -> list[str]:
        """The records ``rank`` writes, in file order (what an async save snapshots at the call)."""
        return [key for key, _w in self.writes[rank]]


@gc_paused()
def assign_writes(wires: list, values: dict) -> WriteAssignment:
    """The checked assignment of every rank's records (``wires``: per rank, its descs in wire form), the part
    of the plan that can refuse a state dict; raises InvalidStateDictError. Rules and checks: assign.py."""
    got = assign_columns([pack(w) for w in wires], values)
    writes = {r: [(wires[r][i][0], wires[r][i]) for i in got.picks[r].tolist()] for r in range(len(wires))}
    return WriteAssignment(got.specs, writes, chunk=auto_chunk(len(wires), got.total_bytes, got.pieces))


def descs_digest(wires: list) -> bytes:
    """16-byte digest of one rank's record descriptions (wire form): equal digests, equal descriptions."""
    return hashlib.blake2b(pickle.dumps(wires, protocol=pickle.HIGHEST_PROTOCOL), digest_size=16).digest()


def assignment_name(digests: list[bytes], values: dict, coordinator: int | None = None) -> bytes:
    """What a write assignment depends on: every rank's descriptions (by digest, in rank order), the keys of
    the JSON values and (saves) the coordinator, the one rank that holds every rank's writes."""
    h = hashlib.blake2b(digest_size=16)
    for d in digests:
        h.update(d)
    for key in sorted(values):
        h.update(b"\0" + key.encode("utf-8", "surrogatepass"))
    if coordinator is not None:
        h.update(b"\1" + str(int(coordinator)).encode())
    return h.digest()


class AssignmentMemo:
    """The last few write assignments of this process, by :func:`assignment_name`.

    A training job saves the same records every time. When every rank holds the assignment of the current
    descriptions, a save exchanges their 16-byte digests instead of the descriptions and skips the assignment:
    both grow with the number of records and an async save's caller waits for them. Holding the names only
    (not the descriptions) keeps the memo's memory at the assignments themselves."""

    def __init__(self, size: int = 4):
        self.size = size
        self._entries: dict[bytes, WriteAssignment] = {}  # insertion order = age

    def names(self) -> tuple[bytes, ...]:
        return tuple(self._entries)

    def get(self, name: bytes) -> WriteAssignment | None:
        return self._entries.get(name)

    def put(self, name: bytes, assignment: WriteAssignment) -> None:
        self._entries.pop(name, None)
        while len(self._entries) >= self.size:
            self._entries.pop(next(iter(self._entries)))
        self._entries[name] = assignment

    def clear(self) -> None:
        self._entries.clear()


MIN_AUTO_CHUNK = 16 << 10
AUTO_CHUNK_WORLD = 256


def chunk_for(assignment: WriteAssignment) -> int:
    """Checksum chunk of a save of ``assignment`` (the same on every rank). A verified load reads whole chunks,
    so each contiguous range it reads from a piece costs up to two chunks more than its share: with the pieces of
    hundreds of ranks (~1 MiB each for Qwen3-235B at 8192 ranks) 256 KiB chunks would read up to ~30% more in a
    resharded load. From AUTO_CHUNK_WORLD ranks on, the chunk is the power of two at most 1/16 of the mean piece
    (within [16 KiB, 256 KiB]); below, DEFAULT_CHUNK_BYTES (what the 2-rank speed figures were measured with)."""
    if assignment.chunk is not None:
        return assignment.chunk
    total = sum(numel(shape) * DTYPES[dtype][0] for _key, dtype, shape in assignment.specs)
    return auto_chunk(len(assignment.writes), total, sum(len(w) for w in assignment.writes.values()))


def auto_chunk(world: int, total_bytes: int, pieces: int) -> int:
    """chunk_for from the world size, the bytes of every tensor and the number of pieces written."""
    if world < AUTO_CHUNK_WORLD:
        return DEFAULT_CHUNK_BYTES
    want = max(1, total_bytes // max(1, pieces) // 16)
    return max(MIN_AUTO_CHUNK, min(DEFAULT_CHUNK_BYTES, 1 << (want.bit_length() - 1)))


@gc_paused()
def lay_out_files(
    assignment: WriteAssignment, values: dict, checkpoint_id: str, only_rank: int | None = None
) -> SavePlan:
    """The plan from a checked assignment: every rank file's header and pieces. Never refuses anything, so an
    async save runs it on its background thread (~3 ms per 1000 records, off the caller's clock). With
    ``only_rank`` just that rank's file (and ``tensors`` holds only its pieces): what a rank that does not
    commit needs, at the cost of its own records instead of the world's."""
    tensors = {key: TensorMeta(dtype=dtype, shape=shape, pieces=[]) for key, dtype, shape in assignment.specs}
    files: dict[int, FileLayout] = {}
    for rank in range(assignment.world_size) if only_rank is None else (only_rank,):
        name = rank_file_name(rank)
        entries = []
        pos = 0
        items = []
        for key, w in assignment.writes[rank]:
            reg = RecordDesc.from_wire(w).region
            nbytes = reg.numel * DTYPES[w[1]][0]
            st_shape = (reg.numel,) if reg.flat_range is not None else reg.box_shape
            entries.append((key, w[1], st_shape, pos, pos + nbytes))
            items.append((key, reg, pos, nbytes))
            pos += nbytes
        header = build_header(entries, {"format": FORMAT_NAME, "checkpoint_id": checkpoint_id, "rank": str(rank)})
        layout = FileLayout(name=name, rank=rank, header=header, size=len(header) + pos)
        for key, reg, p, nbytes in items:
            piece = PieceMeta(
                file=name,
                name=key,
                offset=len(header) + p,
                nbytes=nbytes,
                box_offset=reg.box_offset,
                box_shape=reg.box_shape,
                flat_range=reg.flat_range,
                checksums=[],
            )
            layout.pieces.append((key, piece))
            tensors[key].pieces.append(piece)
        files[rank] = layout
    return SavePlan(tensors=tensors, values=dict(values), files=files)


def rank_plan(
    assignment: WriteAssignment, values: dict, checkpoint_id: str, rank: int, coordinator: int, write_stock: bool
) -> SavePlan:
    """The plan ``rank`` writes by, the one place a save lays out its files (a sync save on the calling thread,
    an async one on its background thread: save/commit.py): every rank's file for the coordinator when it writes stock
    paddle's index (``0.metadata`` lists every piece), else only the rank's own."""
    only = None if rank == coordinator and write_stock else rank
    return lay_out_files(assignment, values, checkpoint_id, only)


def merged_values(per_rank_values: list[dict]) -> dict:
    """JSON values of a save: each key's value from the lowest rank that has it."""
    values: dict[str, object] = {}
    for vals in per_rank_values:
        for k, v in vals.items():
            values.setdefault(k, v)
    return values


# ----------------------------------------------------------------------------------------------- load planning


@dataclass
class ReadItem:
    """Copy elements of one saved piece into the host staging buffer of one requested record."""

    key: str
    piece: PieceMeta
    segments: Segments


def plan_reads(key: str, tm: TensorMeta, target: Region) -> tuple[list[ReadItem], int]:
    """Read items for one requested region, and how many of its elements they cover."""
    items = []
    covered = 0
    one = target.single_run()  # FSDP's flat records and whole tensors: interval arithmetic, no numpy
    if one is not None:
        if one[1] == 0:
            return items, 0
        dst_runs = None
        lo, hi = one[0], one[0] + one[1]
    else:
        dst_runs = target.runs()
        if len(dst_runs[0]) == 0:
            return items, 0
        lo, hi = int(dst_runs[0][0]), int(dst_runs[0][-1] + dst_runs[1][-1])
    for p in tm.window(lo, hi)[0]:  # (format 3: only the rows the row directory says may overlap)
        first, end = flat_span(tm.shape, p.box_offset, p.box_shape, p.flat_range)
        if first >= hi or end <= lo:  # from the bounds: no runs listed for pieces this region does not touch
            continue
        piece_region = region_of_piece(tm.shape, p)
        piece_one = piece_region.single_run() if one is not None else None
        if piece_one is not None:
            a, b = max(lo, piece_one[0]), min(hi, piece_one[0] + piece_one[1])
            if b > a:
                seg = Segments(
                    np.array([a - piece_one[0]], np.int64), np.array([a - lo], np.int64), np.array([b - a], np.int64)
                )
                items.append(ReadItem(key, p, seg))
                covered += b - a
            continue
        if dst_runs is None:
            dst_runs = target.runs()
        src_runs = piece_region.runs()
        if len(src_runs[0]) == 0:
            continue
        if src_runs[0][0] >= hi or src_runs[0][-1] + src_runs[1][-1] <= lo:
            continue
        seg = intersect(dst_runs, src_runs)
        if len(seg.length):
            items.append(ReadItem(key, p, seg))
            covered += seg.total
    return items, covered
