"""Load path of the checkpoint engine: ``load_state_dict``, ``load_full_state_dict``, ``LoadReport``
(``read_metadata`` is directory.py's).

The layout of a checkpoint directory and the save protocol (staging directory, COMMIT written last, atomic
rename, what a crashed save leaves behind) are described in save.py.

Checksums (xxh3-64, or CRC-32 in older checkpoints, per ``chunk_bytes`` chunk of each piece; checksums.py): a load
that needs part of a piece reads the enclosing chunks, verifies them, then copies what it needs; so every byte
loaded is verified and at most two extra chunks per contiguous range are read. ``load_state_dict(...,
verify_checksums=False)`` skips the check (on by default); sizes, metadata hash and COMMIT are still checked.

Load (default, memory-bounded): every rank reads metadata.json (after checking COMMIT and its hash), matches every
requested key (kind, shape, dtype), intersects the flat runs of each requested record with the saved pieces
(coverage), opens every data file it needs and checks its size; one ``all_gather_object`` then tells every rank
whether any rank failed (the same named error everywhere) and that all read the same checkpoint. Up to here
nothing is written: everything that can be checked without the data is all-or-nothing. Then each rank reads its
byte ranges (plus chunk alignment) in file order straight into the targets' own memory (contiguous host tensors),
or through a staging window of rows (device or strided tensors, copied with ``Tensor.copy_``); small scattered
ranges (rows of boxes) go through bounded read windows, the partial chunks at both ends of a range through a
one-chunk bounce buffer. Large ranges of files not in the page cache are streamed (streamed.py: O_DIRECT reads into
a 16 MiB ring of bounce buffers on a reader thread, each 256 KiB hashed and then copied into the target while it
is in the CPU cache); files in the page cache are read into the targets 256 KiB at a time, each step hashed right
after it is read (reader.py). The extra
host memory is at most ``max_host_bytes`` (default ``max(64 MiB, 2%)`` of the rank's requested state,
``default_load_budget``), counted by the engine's own account (``host_memory.account``; ``LoadReport.
peak_host_bytes``): a load never needs a second copy of the rank's state. Data found corrupt (or unreadable) while
reading stops that rank's reads; a second exchange then raises ``PartiallyLoadedError`` on EVERY rank: the targets
were written in part and must not be used (no rank can continue unknowingly with mixed state).
``load_checkpoint(root)`` (state/resume.py) then falls back to the newest older committed checkpoint, which
rewrites every target. Measured choice: a verify-first pass would read everything twice (cold cache: twice the
I/O; warm: the page cache must hold the slice); an undo log is a copy of the slice in host memory.

``atomic=True``: all-or-nothing for everything, at the cost of a host copy of the rank's slice.
Contiguous host targets made of whole saved pieces (a load into the world size that saved, the usual resume) are
read straight into their own memory, their previous bytes copied into an undo buffer just ahead of each read on a
helper thread and put back if the load does not commit (inplace.py; ``CheckpointOptions(in_place=False)`` stages
them instead). Other contiguous host targets whose ranges are all large: the file ranges are merged into spans and read
in file order, 16 MiB at a time, into one host staging buffer, with O_DIRECT when the file is not in the page cache,
else buffered (reader.py; explicit ``POSIX_FADV_WILLNEED`` was measured slower). Other targets (small scattered
ranges such as rows of boxes, device or strided tensors) get a staging buffer of their own, large ranges read
straight into it, small ones through windows of at most 64 MiB. Checksums of the large ranges run on helper threads
while later ranges are read; the rank waits for all of them before the status exchange. Host staging (with the undo
buffer) is this rank's slice (plus chunk and page alignment); it is the async-save buffer when this process has one
(borrowed, no fresh memory), else fresh memory freed after the load. Only
when every key, shape, dtype, coverage and checksum on every rank is fine, and every rank read the same checkpoint
(checkpoint ids compared; one ``all_gather_object`` of the status) is the load committed: the staged bytes are
copied into the targets in place (and the undo copies of in-place reads dropped): a memcpy into the tensor's own
memory for contiguous host tensors, ``Tensor.copy_`` (host staging tensor, pinned, copied on the target's own place)
otherwise; views into fused buffers keep sharing memory either way. On any failure the targets are bit-identical to
before.

Both: JSON values are written back into the dict. ``strict=True`` (default) fails, before anything is written, on
a requested key that is missing or has another shape/dtype/kind, naming the key; ``strict=False`` loads the matching
subset and lists the rest in the returned LoadReport. Checkpoint keys no rank asked for are only reported
(``LoadReport.unexpected_keys``), so a model-only load of a model+optimizer checkpoint works.

Node-local disks: loading works when every rank sees every file it needs (shared FS, or files copied so that
each node has the pieces its ranks read). Saving needs one file system visible to all ranks (see save.py).
``process_group``: ranks, file names and ``coordinator_rank`` are group-local ranks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import checksums, host_memory, reader
from .background import wait_pending
from .coordination import Comm, aligned, gather_errors
from .directory import read_metadata, removed_or
from .errors import (
    CheckpointError,
    CheckpointRemovedError,
    CorruptCheckpointError,
    DtypeMismatchError,
    InvalidStateDictError,
    MissingKeyError,
    PartiallyLoadedError,
    ShapeMismatchError,
)
from .format.coverage import coverage_problems, flat_span
from .format.metadata import DTYPES, CheckpointMetadata, resolve_member
from .format.regions import clip_segments, read_deferred, read_region, region_segments
from .gc_pause import gc_paused
from .inplace import InPlaceReads
from .keywords import STOCK_LOAD_KEYWORDS, check_keywords, keyword_names
from .options import CheckpointOptions, resolve
from .paths import local_path
from .planner import Region, region_of_piece
from .records import to_record
from .tracing import Tracer

# ------------------------------------------------------------------------------------------------ reading


def _staging_tensor(shape, dtype: str, pin: bool):
    """Host memory to read into (pinned for device targets: ``CUDAPinnedPlace``, logged fallback)."""
    from .. import device

    return device.host_empty(list(shape), dtype, pinned=pin)


def named_read_error(path: str, e: BaseException | None) -> BaseException | None:
    """A read failure as a named error: an OSError (EIO, EACCES, ...) reading the checkpoint is
    CorruptCheckpointError naming the path; errors of the engine pass through."""
    if isinstance(e, OSError):
        err = CorruptCheckpointError(f"checkpoint {path}: cannot read it: {type(e).__name__}: {e}")
        err.__cause__ = e
        return err
    return e


def check_coverage(root: str, md: CheckpointMetadata, keys) -> None:
    """Every element of each of ``keys`` is saved exactly once (coverage.py; the check verify_checkpoint runs),
    before a byte of data is read; CorruptCheckpointError naming the key otherwise."""
    md.prefetch(keys)  # format 2: the pieces of these keys only, in few reads
    for key in sorted(keys):
        tm = md.tensors[key]
        problems = coverage_problems(
            key, tm.shape, [(i, region_of_piece(tm.shape, p)) for i, p in enumerate(tm.pieces)]
        )
        if problems:
            raise CorruptCheckpointError(f"checkpoint {root}: {problems[0]}")


def check_data_files(root: str, md: CheckpointMetadata, keys, regions: dict | None = None, options=None) -> None:
    """The data files holding ``keys`` (only the pieces that touch ``regions[key]``, when given) are regular
    files of the sizes the metadata gives (opened without blocking, one at a time), so what is planned and
    allocated afterwards is bounded by bytes really there."""
    names = set()
    for key in keys:
        tm = md.tensors[key]
        span = None
        if regions is not None and key in regions:
            r = regions[key]
            span = flat_span(r.shape, r.box_offset, r.box_shape, r.flat_range)
        for p in tm.pieces:
            if not p.nbytes:
                continue
            if span is not None:
                first, end = flat_span(tm.shape, p.box_offset, p.box_shape, p.flat_range)
                if first >= span[1] or end <= span[0]:
                    continue
            names.add(p.file)
    files = reader.FileSet.of(root, md, resolve_member, verify=False, options=options)
    try:
        for name in sorted(names):
            files.fd(name)
            files.close()
    finally:
        files.close()


def _in_place_regions(reads: list, enabled: bool = True) -> tuple[list, list]:
    """Split the fast-path reads ``(target, piece, a, b, dst)`` into regions read in place (inplace.py) and the
    rest. A target is read in place when each of its reads is a whole saved piece (no chunk widening: the piece's
    chunks are the target's bytes) and its memory overlaps no other such target. Regions come in file order.
    ``enabled=False`` (CheckpointOptions.in_place) reads nothing in place."""
    if not enabled:
        return [], reads
    by_target: dict[int, list] = {}
    for r in reads:
        by_target.setdefault(id(r[0]), []).append(r)
    whole = [rs for rs in by_target.values() if all(a == 0 and b == piece.nbytes for _t, piece, a, b, _d in rs)]
    spans = sorted(
        (rs[0][0].tensor.data_ptr(), host_memory.raw_view(rs[0][0].tensor, allow_copy=False)[0].nbytes, i)
        for i, rs in enumerate(whole)
    )
    aliased, end, widest = set(), -1, -1  # widest: the interval reaching furthest so far
    for ptr, n, i in spans:
        if ptr < end:
            aliased.update((i, widest))
        if ptr + n > end:
            end, widest = ptr + n, i
    chosen = {id(rs[0][0]) for i, rs in enumerate(whole) if i not in aliased}
    regions, rest = [], []
    for r in reads:
        tg, piece, a, b, d = r
        if id(tg) not in chosen:
            rest.append(r)
            continue
        dst, _ = host_memory.raw_view(tg.tensor, allow_copy=False)
        regions.append((tg.key, piece, dst[d : d + (b - a)]))
    regions.sort(key=lambda reg: (reg[1].file, reg[1].offset))
    return regions, rest


_SPAN_GAP = 4096  # file ranges closer than this are read as one span (staging stays the slice + alignment)


def _plan_spans(reads: list, chunk_bytes: int, verify: bool) -> list[list]:
    """Group the in-place reads ``(target, piece, a, b, dst)`` into aligned file spans.

    Returns ``[name, start, need, members]`` per span (``start`` aligned to DIRECT_ALIGN; ``need`` bytes from
    there cover every member; with ``verify`` every member's range is widened to whole chunks of its piece)."""
    C = chunk_bytes
    ranges = []
    for r in reads:
        _tg, piece, a, b, _d = r
        a0, b0 = ((a // C) * C, min(-(-b // C) * C, piece.nbytes)) if verify else (a, b)
        ranges.append((piece.file, piece.offset + a0, piece.offset + b0, r, a0, b0))
    ranges.sort(key=lambda x: (x[0], x[1]))
    spans: list[list] = []
    for name, fs, fe, r, a0, b0 in ranges:
        if spans and spans[-1][0] == name and fs <= spans[-1][2] + _SPAN_GAP:
            spans[-1][2] = max(spans[-1][2], fe)
            spans[-1][3].append((r, a0, b0))
        else:
            spans.append([name, fs, fe, [(r, a0, b0)]])
    A = reader.DIRECT_ALIGN
    out = []
    for name, fs, fe, members in spans:
        start = (fs // A) * A
        out.append([name, start, fe - start, members])
    return out


# ------------------------------------------------------------------------------------------------ load


@dataclass
class LoadReport:
    """What a load did on this rank."""

    loaded_keys: list[str] = field(default_factory=list)
    missing_keys: list[str] = field(default_factory=list)  # requested, absent from the checkpoint
    mismatched_keys: dict[str, str] = field(default_factory=dict)  # key -> reason (shape/dtype/kind)
    unexpected_keys: list[str] = field(default_factory=list)  # in the checkpoint, requested by no rank
    bytes_read: int = 0
    seconds: float = 0.0
    atomic: bool = False  # loaded with an undo copy / staging (atomic=True)
    host_budget: int = 0  # bound on the extra host memory of a memory-bounded load (bytes)
    peak_host_bytes: int = 0  # the engine's own account of the extra host memory this load held at its peak


LOAD_MIN_HOST_BYTES = 64 << 20  # memory-bounded loads: extra host memory at most max(this, ...
LOAD_HOST_FRACTION = 0.02  # ... this fraction of the rank's requested state)


def default_load_budget(state_bytes: int) -> int:
    """Extra host memory a memory-bounded load may hold: ``max(64 MiB, 2%)`` of the rank's state."""
    return max(LOAD_MIN_HOST_BYTES, int(LOAD_HOST_FRACTION * state_bytes))


@dataclass
class _Target:
    key: str
    tensor: Any
    region: Region
    dtype: str
    staging: Any = None
    raw: Any = None
    copies: Any = None  # in-place host target: [(dst byte offset, verified source bytes in the span buffer)]


@gc_paused()
def load_state_dict(
    state_dict: dict,
    path: str,
    process_group=None,
    coordinator_rank: int = 0,
    *,
    verify_checksums: bool = True,
    strict: bool = True,
    atomic: bool = False,
    max_host_bytes: int | None = None,
    precheck: Callable[[CheckpointMetadata], None] | None = None,
    options: CheckpointOptions | None = None,
    _metadata: CheckpointMetadata | None = None,
    **unused_stock_kwargs,
) -> LoadReport:
    """Load ``path`` into the tensors of ``state_dict`` in place (see the module docstring).

    Default: memory-bounded (at most ``max_host_bytes`` of extra host memory, default ``default_load_budget``),
    all-or-nothing for everything checked before the first byte is written, and PartiallyLoadedError on every
    rank when data turns out corrupt (or unreadable) once writing has begun. ``atomic=True``: all-or-nothing for
    everything, at the cost of a host copy of the rank's slice.

    ``precheck(metadata)`` (optional) runs on every rank right after the metadata is read, before the engine's
    own checks (keys, shapes, dtypes, exact coverage, data file kinds and sizes) and before any data is read:
    what it raises on any rank is exchanged, so every rank raises the same named error and nothing is written.
    Callers decode and validate the non-tensor state they will restore there (state/resume.py).

    ``options`` (CheckpointOptions; None: ``CheckpointOptions.from_env()``, read now): O_DIRECT, huge pages,
    in-place reads, read slab, checksum threads, tracing.

    ``_metadata``: the metadata of ``path`` as its caller read it a moment ago (load_checkpoint), so that it is
    not read and parsed twice; everything is still checked against it, and the ranks still compare checkpoint ids.

    Stock's keywords (``unique_id``, ``offload``, ``safetensors``, ...) are accepted and ignored (``aoa_config``
    refused); any other keyword is a TypeError naming the nearest valid one (keywords.py).

    Steps (``_LoadJob``, atomic): validate -> plan -> read -> exchange -> commit; nothing a target holds changes
    before the exchange has shown that every rank validated and read everything (in-place reads keep an undo
    copy). ``_BoundedLoadJob`` (default): validate -> prepare -> exchange -> read into the targets -> exchange.
    """
    check_keywords("load_state_dict", unused_stock_kwargs, keyword_names(load_state_dict) + STOCK_LOAD_KEYWORDS)
    if unused_stock_kwargs.get("aoa_config") is not None:
        raise InvalidStateDictError("aoa_config is not supported by the FSDP checkpoint engine")
    try:
        opts, opts_error = resolve(options), None
    except CheckpointError as e:  # a malformed PADDLE_FSDP_CKPT_* variable: reported by the exchange below
        opts, opts_error = CheckpointOptions(), e
    tr = Tracer("load", opts)
    wait_pending(raise_error=False)
    t0 = time.perf_counter()
    comm = Comm(process_group)
    if not atomic:
        job = _BoundedLoadJob(state_dict, local_path(path), opts, verify_checksums, tr)
        job.md = _metadata
        all_requested = job.run(comm, strict, max_host_bytes, opts_error, precheck)
        return job.finish(all_requested, time.perf_counter() - t0)
    job = _LoadJob(state_dict, local_path(path), opts, verify_checksums, tr)
    job.md = _metadata
    job.report.atomic = True
    base = host_memory.account.reset_peak()
    err: BaseException | None = None
    try:
        # 1. validate (no data read): metadata, caller's checks, keys, shapes, dtypes, exact coverage, files;
        # the verdict of every rank is exchanged before any byte of data is read or any target written
        try:
            if opts_error is not None:
                raise opts_error
            job.validate(strict, precheck)
        except Exception as e:  # noqa: BLE001 - every failure must reach the verdict exchange below
            err = named_read_error(job.path, e)
        all_requested = job.exchange(comm, err)
        # 2-3. plan, read and verify; 4. exchange; 5. commit
        try:
            job.plan()
            job.read()
        except Exception as e:  # noqa: BLE001 - every failure must reach the status exchange below
            err = named_read_error(job.path, e)
            if isinstance(err, CorruptCheckpointError):  # a file gone under the reader: removed, not corrupt
                err = removed_or(job.path, err, job.md.checkpoint_id)
        finally:
            job.stop_reading()
        job.exchange(comm, err)
        job.commit()
    finally:
        job.release()
        # staging and undo copies count, also when borrowed from the arena: a copy of the slice wherever it lives
        job.report.peak_host_bytes = max(host_memory.account.peak - base, job.staged_bytes)
    return job.finish(all_requested, time.perf_counter() - t0)


class _LoadJob:
    """The state of one ``load_state_dict`` call on this rank, and its steps in order."""

    def __init__(self, state_dict, path: str, opts: CheckpointOptions, verify_checksums: bool, tr: Tracer):
        self.state_dict = state_dict
        self.path = path
        self.opts = opts
        self.verify_checksums = verify_checksums
        self.tr = tr
        self.report = LoadReport()
        self.md: CheckpointMetadata | None = None
        self.targets: list[_Target] = []
        self.value_updates: dict[str, Any] = {}
        self.requested = sorted(k for k in state_dict) if isinstance(state_dict, dict) else []
        self.verifier = reader.ChunkVerifier(opts.checksum_threads)
        self.files: reader.FileSet | None = None
        self.arena_held = False
        self.in_place: InPlaceReads | None = None
        self.committed = False
        # filled by plan(), consumed by read()
        self.span_reads: list = []
        self.staged: list[_Target] = []
        self.staged_bytes = 0  # host staging + undo bytes (a copy of the slice)

    # ------------------------------------------------------------------------------------------ 1. validate

    def validate(self, strict: bool, precheck=None) -> None:
        """Read the committed metadata, run the caller's ``precheck`` on it, and match every requested key against
        it (kind, shape, dtype). With ``strict`` any mismatch raises the named error of the first one; else
        mismatches go to the report. Then exact coverage of every target's tensor and the kinds and sizes of the
        data files its pieces are in: everything that can be refused before a byte of data is read."""
        path, report = self.path, self.report
        md = self.md = self.md if self.md is not None else read_metadata(path, self.opts)
        self.tr.mark("metadata")
        if precheck is not None:  # the caller's checks first: "another optimizer" says more than its keys
            precheck(md)
        if not isinstance(self.state_dict, dict):
            raise InvalidStateDictError(f"state_dict must be a dict, got {type(self.state_dict).__name__}")
        problems: list[tuple[type, str]] = []

        def refuse(error: type, key: str, reason: str) -> None:
            """Record why ``key`` cannot load: in the report, and as the error strict mode raises."""
            if error is MissingKeyError:
                report.missing_keys.append(key)
            else:
                report.mismatched_keys[key] = reason
            problems.append((error, f"key {key!r}: {reason}"))

        def refuse_absent(key: str, wanted: str, saved_as: str) -> None:
            if saved_as:
                refuse(InvalidStateDictError, key, f"saved as a {saved_as}, requested as a {wanted}")
            else:
                refuse(MissingKeyError, key, f"missing from checkpoint {path}")

        for key, val in self.state_dict.items():
            rec = to_record(key, val)
            if rec is None:
                if key in md.values:
                    self.value_updates[key] = md.values[key]
                    report.loaded_keys.append(key)
                else:
                    refuse_absent(key, "plain value", "tensor" if key in md.tensors else "")
                continue
            tm = md.tensors.get(key)
            if tm is None:
                refuse_absent(key, "tensor", "plain value" if key in md.values else "")
                continue
            if tuple(tm.shape) != tuple(rec.region.shape):
                refuse(
                    ShapeMismatchError,
                    key,
                    f"shape {list(rec.region.shape)} requested, {list(tm.shape)} in the checkpoint",
                )
                continue
            if tm.dtype != rec.dtype:
                refuse(DtypeMismatchError, key, f"dtype {rec.dtype} requested, {tm.dtype} in the checkpoint")
                continue
            self.targets.append(_Target(key, rec.tensor, rec.region, rec.dtype))
        if strict and problems:
            cls, _ = problems[0]
            more = (
                f" (and {len(problems) - 1} more: " + "; ".join(m for _, m in problems[1:4]) + ")"
                if len(problems) > 1
                else ""
            )
            raise cls(problems[0][1] + more)
        check_coverage(path, md, {tg.key for tg in self.targets})
        check_data_files(
            path, md, {tg.key for tg in self.targets}, {tg.key: tg.region for tg in self.targets}, self.opts
        )
        self.tr.mark("validate")

    # ------------------------------------------------------------------------------------------ 2. plan

    @property
    def verify(self) -> bool:
        return self.verify_checksums and self.md.checksum != checksums.NONE

    def plan(self) -> None:
        """Decide where every byte goes, and carve all host staging out of one buffer.

        Host targets read in large ranges only (the usual case): their file ranges are read as aligned spans
        (O_DIRECT where supported) into the buffer and committed with a memcpy per range, or read in place
        (whole saved pieces, with an undo copy). Other targets (small scattered ranges, device or strided
        tensors) get a staging area of their own, committed with one memcpy (host) or Tensor.copy_ (device,
        strided). The buffer is the async-save arena when there is one, else fresh memory.
        """
        md, opts, verify = self.md, self.opts, self.verify
        direct: list = []  # (target, piece, a, b, dst offset)
        for tg in self.targets:
            if tg.region.numel == 0:
                continue
            segs = region_segments(self.path, md, tg.key, tg.region)
            host = host_memory.is_host_contiguous(tg.tensor)
            if opts.host_fast_path and host and all(bool(sg[4].all()) for sg in segs):
                tg.copies = []
                for piece, src_b, dst_b, len_b, _big in segs:
                    for a, d, n in zip(src_b.tolist(), dst_b.tolist(), len_b.tolist()):
                        direct.append((tg, piece, a, a + n, d))
            else:
                self.staged.append(tg)
        regions, direct = _in_place_regions(direct, opts.in_place)
        spans = _plan_spans(direct, md.chunk_bytes, verify)
        A = reader.DIRECT_ALIGN
        span_bytes = [-(-sp[2] // A) * A for sp in spans]
        host_staged = [tg for tg in self.staged if opts.host_fast_path and host_memory.is_host_contiguous(tg.tensor)]
        undo_bytes = sum(aligned(len(dst)) for _key, _piece, dst in regions)
        need = sum(span_bytes) + undo_bytes + sum(aligned(tg.region.numel * DTYPES[tg.dtype][0]) for tg in host_staged)
        self.staged_bytes = need
        stage = (
            host_memory.arena.acquire(need, grow=host_memory.arena.capacity > 0, hugepages=opts.hugepages)
            if need
            else None
        )
        self.arena_held = stage is not None
        if stage is None and need:
            stage = host_memory.alloc_host(need, for_direct_reads=bool(span_bytes), hugepages=opts.hugepages)
        pos = 0
        for (name, start, n_need, members), nb in zip(spans, span_bytes):
            buf = stage[pos : pos + nb]
            pos += nb
            checks, seen = [], set()
            for (tg, piece, a, b, d), a0, b0 in members:
                lo = piece.offset + a - start
                tg.copies.append((d, buf[lo : lo + (b - a)]))
                if verify and (id(piece), a0, b0) not in seen:
                    seen.add((id(piece), a0, b0))
                    checks.append((tg.key, piece, a0, b0))
            self.span_reads.append(reader.SpanRead(name, start, n_need, buf, checks))
        for tg in host_staged:
            n = tg.region.numel * DTYPES[tg.dtype][0]
            tg.raw = stage[pos : pos + n]
            pos += aligned(n)
        if regions:  # previous bytes copied to the undo buffer ahead of the reads, on a helper thread
            self.in_place = InPlaceReads(regions, stage[pos : pos + undo_bytes])

    # ------------------------------------------------------------------------------------------ 3. read

    def read(self) -> None:
        """Read and verify everything planned (targets read in place keep their undo copy until commit)."""
        md, verify, verifier = self.md, self.verify, self.verifier
        files = self.files = reader.FileSet.of(self.path, md, resolve_member, verify, self.opts)
        reader.read_spans(files, self.span_reads, md.chunk_bytes, verifier if verify else None)
        self.span_reads = []
        if self.in_place is not None:
            self.in_place.read(files, md.chunk_bytes, verify, verifier)
        reads: list = []  # large ranges of staged targets, read below in file order
        for tg in self.staged:
            if tg.raw is None:
                # device (or strided) target: host staging tensor (pinned for devices), committed with copy_
                pin = not host_memory.is_host_contiguous(tg.tensor)
                tg.staging = _staging_tensor(tg.tensor.shape, tg.dtype, pin)
                tg.raw, _ = host_memory.raw_view(tg.staging, allow_copy=False)
            read_region(files, md, tg.key, tg.region, tg.raw, self.verify_checksums, verifier, reads)
        read_deferred(files, md, reads, self.verify_checksums, verifier)
        self.tr.mark("read")
        verifier.wait()  # every queued checksum, before this rank reports its status
        self.report.bytes_read = files.bytes_read
        self.tr.mark("verify-wait")

    def stop_reading(self) -> None:
        """After read (or its failure): no helper thread reads the staging any more, files closed."""
        self.verifier.drain()
        if self.files is not None:
            self.files.close()

    # ------------------------------------------------------------------------------------------ 4. exchange

    def exchange(self, comm: Comm, err: BaseException | None) -> set[str]:
        """Every rank's status: raise the same named error on every rank if any failed, or if the ranks read
        different checkpoints. Returns the keys requested by any rank."""
        md = self.md
        statuses = gather_errors(comm, err, (self.requested, md.checkpoint_id if md else None))
        ids = sorted({s[1] for s in statuses})
        if len(ids) > 1:  # e.g. the path was replaced by a concurrent save between the ranks' reads
            raise CheckpointRemovedError(
                f"load of {self.path}: ranks read different checkpoints ({ids}); was it replaced during the "
                f"load? nothing was loaded"
            )
        self.tr.mark("exchange")
        all_requested: set[str] = set()
        for s in statuses:
            all_requested.update(s[0])
        return all_requested

    # ------------------------------------------------------------------------------------------ 5. commit

    def commit(self) -> None:
        """All ranks are fine: copy the staged bytes into the targets (in-place targets hold them already)."""
        for tg in self.targets:
            if tg.copies is not None:
                dst, _ = host_memory.raw_view(tg.tensor, allow_copy=False)
                for d, src in tg.copies:
                    np.copyto(dst[d : d + len(src)], src)
            elif tg.staging is not None:
                # Tensor.copy_ writes into the existing allocation (views into fused buffers keep aliasing) and
                # copies host->device on the target's own place
                tg.tensor.copy_(tg.staging, True)
            elif tg.raw is not None:
                dst, _ = host_memory.raw_view(tg.tensor, allow_copy=False)
                np.copyto(dst, tg.raw)
            tg.staging = tg.raw = tg.copies = None
            self.report.loaded_keys.append(tg.key)
        self.committed = True

    def release(self) -> None:
        """Always: drop staging views, finish (committed) or undo (not committed) in-place reads, give the
        arena back."""
        for tg in self.targets:
            tg.staging = tg.raw = tg.copies = None
        if self.in_place is not None:
            if self.committed:
                self.in_place.finish()
            else:
                self.verifier.drain()  # no checksum thread reads a target while it is restored
                self.in_place.restore()  # every tensor read in place gets its previous bytes back
            self.in_place = None
        if self.arena_held:
            host_memory.arena.release()

    def finish(self, all_requested: set[str], seconds: float) -> LoadReport:
        """After the commit: JSON values into the dict, the report completed."""
        for k, v in self.value_updates.items():
            self.state_dict[k] = v
        md, report = self.md, self.report
        report.unexpected_keys = sorted((set(md.tensors) | set(md.values)) - all_requested)
        report.seconds = seconds
        self.tr.mark("copy-into-targets")
        self.tr.done()
        return report


def _file_position(item) -> tuple:
    """Where the first byte a planned target reads lies: ``(file, offset)`` of its earliest segment."""
    _tg, segs = item
    return min(((p.file, p.offset + int(src[0])) for p, src, *_rest in segs if len(src)), default=("", 0))


class _BoundedLoadJob(_LoadJob):
    """A memory-bounded load (the default; module docstring): validate -> prepare -> exchange -> read straight
    into the targets -> exchange of the outcome."""

    def run(self, comm: Comm, strict: bool, max_host_bytes: int | None, opts_error, precheck=None) -> set[str]:
        err: BaseException | None = None
        plan: list = []
        try:
            try:
                if opts_error is not None:
                    raise opts_error
                self.validate(strict, precheck)
                plan = self.prepare(max_host_bytes)
            except Exception as e:  # noqa: BLE001 - every failure must reach the status exchange below
                err = named_read_error(self.path, e)
            all_requested = self.exchange(comm, err)  # raises on every rank if any failed: nothing was written
            self.tr.mark("exchange-checks")
            err = None
            try:
                self.write_targets(plan)
            except Exception as e:  # noqa: BLE001 - every failure must reach the outcome exchange below
                err = named_read_error(self.path, e)
                if isinstance(err, CorruptCheckpointError):  # a file gone under the reader: removed, not corrupt
                    err = removed_or(self.path, err, self.md.checkpoint_id)
            finally:
                self.verifier.drain()
            self.exchange_outcome(comm, err)
        finally:
            self.stop_reading()
        return all_requested

    def prepare(self, max_host_bytes: int | None) -> list:
        """Everything checkable without the data: coverage of every target, every data file opened and its size
        checked. Returns ``[(target, segments)]`` and sets the host-memory budget."""
        md = self.md
        state_bytes = sum(tg.region.numel * DTYPES[tg.dtype][0] for tg in self.targets)
        self.budget = default_load_budget(state_bytes) if max_host_bytes is None else int(max_host_bytes)
        self.report.host_budget = self.budget
        self.files = reader.FileSet.of(self.path, md, resolve_member, self.verify_checksums, self.opts)
        plan = []
        for tg in self.targets:
            if tg.region.numel == 0:
                continue
            segs = region_segments(self.path, md, tg.key, tg.region)
            for seg in segs:
                self.files.fd(seg[0].file)  # opened and size-checked before any byte is written
            plan.append((tg, segs))
        self.tr.mark("prepare")
        return plan

    def write_targets(self, plan: list) -> None:
        """Read every target's bytes into its own memory (host) or through a staging window (device, strided);
        the report gets the peak of the engine's host-memory account over this step."""
        md, files, verifier = self.md, self.files, self.verifier
        base = host_memory.account.reset_peak()
        C = md.chunk_bytes
        # live at once at most: a staging window, a read window (+2 chunks) and two bounce chunks
        window = max(C, (self.budget - 4 * C) // 2)
        try:
            reads: list = []  # the reads of host targets, done straight into them in file order
            for tg, segs in sorted(plan, key=_file_position):  # windowed targets in file order too
                if self.opts.host_fast_path and host_memory.is_host_contiguous(tg.tensor):
                    dst, _ = host_memory.raw_view(tg.tensor, allow_copy=False)
                    read_region(files, md, tg.key, tg.region, dst, self.verify_checksums, verifier, reads, window, segs)
                else:
                    self._fill_through_window(tg, segs, window)
            read_deferred(files, md, reads, self.verify_checksums, verifier, window)
            self.report.loaded_keys.extend(tg.key for tg, _segs in plan)
            self.tr.mark("read")
            verifier.wait()
            self.report.bytes_read = files.bytes_read
            self.tr.mark("verify-wait")
        finally:
            self.report.peak_host_bytes = max(0, host_memory.account.peak - base)

    def _fill_through_window(self, tg: _Target, segs: list, window: int) -> None:
        """Device (or strided) target: read into a host staging tensor (pinned for devices) of at most ``window``
        bytes, rows at a time, each window verified and then copied into the target with ``Tensor.copy_``."""
        md, files, verifier, verify = self.md, self.files, self.verifier, self.verify_checksums
        shape = list(tg.tensor.shape)
        nbytes = tg.region.numel * DTYPES[tg.dtype][0]
        pin = not host_memory.is_host_place(tg.tensor.place)
        rows = shape[0] if shape else 1
        row_bytes = nbytes // max(rows, 1)
        per_window = max(1, window // max(row_bytes, 1))
        if not shape or per_window >= rows or not tg.tensor.is_contiguous():
            # whole target at once (small, 0-d or strided: a strided target cannot be written row window-wise)
            staging = host_memory.account.track(_staging_tensor(shape, tg.dtype, pin), nbytes)
            raw, _ = host_memory.raw_view(staging, allow_copy=False)
            read_region(files, md, tg.key, tg.region, raw, verify, verifier, None, window, segs)
            verifier.wait()
            tg.tensor.copy_(staging, True)
            return
        staging = host_memory.account.track(
            _staging_tensor([per_window] + shape[1:], tg.dtype, pin), per_window * row_bytes
        )
        raw, _ = host_memory.raw_view(staging, allow_copy=False)
        for r0 in range(0, rows, per_window):
            r1 = min(rows, r0 + per_window)
            w0, w1 = r0 * row_bytes, r1 * row_bytes
            window_segs = clip_segments(segs, w0, w1, md.chunk_bytes)
            read_region(files, md, tg.key, tg.region, raw[: w1 - w0], verify, verifier, None, window, window_segs)
            verifier.wait()  # the window is reused next: its checks must be done
            src = staging if r1 - r0 == per_window else staging._slice(0, r1 - r0)
            tg.tensor._slice(r0, r1).copy_(src, True)

    def exchange_outcome(self, comm: Comm, err: BaseException | None) -> None:
        """After writing: a failure on any rank raises PartiallyLoadedError on every rank."""
        try:
            gather_errors(comm, err)
        except Exception as e:  # noqa: BLE001 - a failure on any rank: this rank's own, else the first other one
            cause = f"rank {comm.rank} failed: {type(e).__name__}: {e}" if e is err else f"{type(e).__name__}: {e}"
            raise PartiallyLoadedError(
                f"load of {self.path} failed after writing into the targets had begun ({cause}). The tensors "
                f"being loaded on every rank that read data now hold a mix of their previous and the loaded "
                f"values: do not continue with them. Load a checkpoint again (load_checkpoint(root) falls back to "
                f"the newest older checkpoint by itself), or load with atomic=True, which keeps an undo copy"
            ) from e
        self.tr.mark("exchange-outcome")


@gc_paused()
def load_full_state_dict(
    path: str, keys: Iterable[str] | None = None, *, options: CheckpointOptions | None = None
) -> dict:
    """Full tensors by key, read in this process only (no collectives), e.g. for ``model.set_state_dict``.

    With ``keys=None`` every tensor of the checkpoint is returned; a key naming a JSON value returns the value.
    ``options``: as for ``load_state_dict``.
    """
    opts = resolve(options)
    import paddle  # noqa: F401

    path = local_path(path)
    md = read_metadata(path, opts)
    wanted = list(md.tensors) if keys is None else list(keys)
    for key in wanted:
        if key not in md.tensors and key not in md.values:
            raise MissingKeyError(f"key {key!r} is missing from checkpoint {path}")
    tensor_keys = [k for k in wanted if k in md.tensors]
    try:
        # before allocating by a declared shape: exact coverage + real files of the declared sizes, so what is
        # allocated is the bytes of pieces that really are on disk (pieces never share bytes: schema.py)
        check_coverage(path, md, tensor_keys)
        check_data_files(path, md, tensor_keys, options=opts)
        return _read_full(path, md, wanted, opts)
    except OSError as e:
        raise removed_or(path, named_read_error(path, e), md.checkpoint_id) from e
    except CorruptCheckpointError as e:
        gone = removed_or(path, e, md.checkpoint_id)
        if gone is e:
            raise
        raise gone from e


def _read_full(path: str, md: CheckpointMetadata, wanted: list[str], opts: CheckpointOptions) -> dict:
    out: dict = {}
    files = reader.FileSet.of(path, md, resolve_member, True, opts)
    verifier = reader.ChunkVerifier(opts.checksum_threads)
    reads: list = []
    try:
        for key in wanted:
            if key in md.values and key not in md.tensors:
                out[key] = md.values[key]
                continue
            tm = md.tensors[key]
            t = _staging_tensor(tm.shape, tm.dtype, False)
            region = Region.full(tm.shape)
            if region.numel:
                raw, _ = host_memory.raw_view(t, allow_copy=False)
                read_region(files, md, key, region, raw, True, verifier, reads)
            out[key] = t
        read_deferred(files, md, reads, True, verifier)
        verifier.wait()  # nothing is returned before every checksum passed
    finally:
        verifier.drain()
        files.close()
    return out
