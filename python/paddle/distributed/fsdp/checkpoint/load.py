"""Load path of the checkpoint engine: ``load_state_dict``, ``load_full_state_dict``, ``LoadReport``
(``read_metadata`` is format/commit.py's).

The layout of a checkpoint directory and the save protocol (staging directory, COMMIT written last, atomic
rename, what a crashed save leaves behind) are described in save.py.

Checksums (xxh3-64, or CRC-32 in older checkpoints, per ``chunk_bytes`` chunk of each piece; checksums.py): a load
that needs part of a piece reads the enclosing chunks, verifies them, then copies what it needs; so every byte
loaded is verified and at most two extra chunks per contiguous range are read. ``load_state_dict(...,
verify_checksums=False)`` skips the check (on by default); sizes, metadata hash and COMMIT are still checked.

Load: every rank reads metadata.json (after checking COMMIT and its hash), intersects the flat runs of each of its
requested records with the saved pieces and pread()s only those byte ranges (plus chunk alignment) of the files.
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
(borrowed, no fresh memory), else fresh memory freed after the load; nothing else grows with the checkpoint. Only
when every key, shape, dtype, coverage and checksum on every rank is fine, and every rank read the same checkpoint
(checkpoint ids compared; one ``all_gather_object`` of the status) is the load committed: the staged bytes are
copied into the targets in place (and the undo copies of in-place reads dropped): a memcpy into the tensor's own
memory for contiguous host tensors, ``Tensor.copy_`` (host staging tensor, pinned, copied on the target's own place)
otherwise; views into fused buffers keep sharing memory either way. On any failure the targets are bit-identical to
before. JSON values are written back into the dict. ``strict=True`` (default) fails, before anything is written, on
a requested key that is missing or has another shape/dtype/kind, naming the key; ``strict=False`` loads the matching
subset and lists the rest in the returned LoadReport. Checkpoint keys no rank asked for are only reported
(``LoadReport.unexpected_keys``), so a model-only load of a model+optimizer checkpoint works.

Node-local disks: loading works when every rank sees every file it needs (shared FS, or files copied so that
each node has the pieces its ranks read). Saving needs one file system visible to all ranks (see save.py).
``process_group``: ranks, file names and ``coordinator_rank`` are group-local ranks.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import checksums, host_memory, reader
from .coordination import Comm, aligned, gather_errors
from .errors import (
    CheckpointError,
    DtypeMismatchError,
    InvalidStateDictError,
    MissingKeyError,
    PartiallyLoadedError,
    ShapeMismatchError,
)
from .format.commit import read_metadata
from .format.metadata import DTYPES, CheckpointMetadata, resolve_member
from .format.regions import clip_segments, read_deferred, read_region, region_segments
from .inplace import InPlaceReads
from .options import CheckpointOptions, resolve
from .planner import Region
from .records import to_record
from .save import wait_pending
from .tracing import Tracer

# ------------------------------------------------------------------------------------------------ reading


def _staging_tensor(shape, dtype: str, pin: bool):
    import paddle

    try:
        return paddle.empty(list(shape), dtype=dtype, device=paddle.CPUPlace(), pin_memory=pin)
    except Exception:
        if not pin:
            raise
        return paddle.empty(list(shape), dtype=dtype, device=paddle.CPUPlace())


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


@dataclass
class _Target:
    key: str
    tensor: Any
    region: Region
    dtype: str
    staging: Any = None
    raw: Any = None
    copies: Any = None  # in-place host target: [(dst byte offset, verified source bytes in the span buffer)]


LOAD_MIN_HOST_BYTES = 64 << 20  # memory-bounded loads: extra host memory at most max(this, ...
LOAD_HOST_FRACTION = 0.02  # ... this fraction of the rank's requested state)


def default_load_budget(state_bytes: int) -> int:
    """Extra host memory a memory-bounded load may hold: ``max(64 MiB, 2%)`` of the rank's state."""
    return max(LOAD_MIN_HOST_BYTES, int(LOAD_HOST_FRACTION * state_bytes))


def _check_requests(state_dict, md: CheckpointMetadata, path: str, strict: bool, report: LoadReport):
    """Match the requested entries with the checkpoint: the tensor targets and the JSON values to load.

    Fills the report's missing/mismatched keys; with ``strict`` the first problem is raised (naming the key)."""
    if not isinstance(state_dict, dict):
        raise InvalidStateDictError(f"state_dict must be a dict, got {type(state_dict).__name__}")
    targets: list[_Target] = []
    value_updates: dict[str, Any] = {}
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

    for key, val in state_dict.items():
        rec = to_record(key, val)
        if rec is None:
            if key in md.values:
                value_updates[key] = md.values[key]
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
        targets.append(_Target(key, rec.tensor, rec.region, rec.dtype))
    if strict and problems:
        cls, _ = problems[0]
        more = (
            f" (and {len(problems) - 1} more: " + "; ".join(m for _, m in problems[1:4]) + ")"
            if len(problems) > 1
            else ""
        )
        raise cls(problems[0][1] + more)
    return targets, value_updates


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
    options: CheckpointOptions | None = None,
    **unused_stock_kwargs,
) -> LoadReport:
    """Load ``path`` into the tensors of ``state_dict`` in place (see the module docstring).

    Default: memory-bounded (at most ``max_host_bytes`` of extra host memory, default
    ``default_load_budget``), all-or-nothing for everything checked before the first byte is written, and
    PartiallyLoadedError on every rank when data turns out corrupt (or unreadable) once writing has begun.
    ``atomic=True``: all-or-nothing for everything, at the cost of a host copy of the rank's slice.
    ``options`` (CheckpointOptions; None: ``CheckpointOptions.from_env()``, read now): O_DIRECT, huge pages,
    in-place reads, read slab, checksum threads, tracing.
    """
    if unused_stock_kwargs.get("aoa_config") is not None:
        raise InvalidStateDictError("aoa_config is not supported by the FSDP checkpoint engine")
    try:
        opts, opts_error = resolve(options), None
    except CheckpointError as e:  # a malformed PADDLE_FSDP_CKPT_* variable: reported by the exchange below
        opts, opts_error = CheckpointOptions(), e
    tr = Tracer("load", opts)
    wait_pending(raise_error=False)
    t0 = time.perf_counter()
    path = os.path.abspath(os.fspath(path))
    comm = Comm(process_group)
    report = LoadReport(atomic=bool(atomic))
    requested = sorted(k for k in state_dict) if isinstance(state_dict, dict) else []
    load = _load_atomic if atomic else _load_bounded
    md, value_updates, statuses = load(
        state_dict, path, comm, report, requested, verify_checksums, strict, max_host_bytes, tr, opts, opts_error
    )
    for k, v in value_updates.items():
        state_dict[k] = v
    all_requested = set()
    for s in statuses:
        all_requested.update(s[0])
    report.unexpected_keys = sorted((set(md.tensors) | set(md.values)) - all_requested)
    report.seconds = time.perf_counter() - t0
    tr.done()
    return report


def _check_same_checkpoint(path: str, statuses: list) -> None:
    ids = sorted({s[1] for s in statuses})
    if len(ids) > 1:  # e.g. the path was replaced by a concurrent save between the ranks' reads
        raise CheckpointError(
            f"load of {path}: ranks read different checkpoints ({ids}); was it replaced during the load? "
            f"nothing was loaded"
        )


def _load_bounded(
    state_dict, path, comm, report, requested, verify_checksums, strict, max_host_bytes, tr, opts, opts_error
):
    """Memory-bounded load: checks, status exchange, then reads straight into the targets (windows for the rest).

    Everything that can be checked without the data is checked on every rank before any byte is written:
    commit record, metadata, keys, shapes, dtypes, coverage, the size of every data file this rank reads (files
    stay open from then on), the checkpoint id of every rank. Then each rank reads its ranges in file order
    straight into the targets' memory (contiguous host tensors), or through a staging window of at most the
    budget for device / strided ones, verifying every chunk; small scattered ranges go through read windows.
    A checksum mismatch or read error found then stops the rank's reads; after the second status exchange every
    rank raises PartiallyLoadedError naming the failing rank: targets were partly written.
    """
    err: BaseException | None = None
    md = None
    files = None
    plan: list = []
    value_updates: dict = {}
    verifier = reader.ChunkVerifier(opts.checksum_threads)
    try:
        try:
            if opts_error is not None:
                raise opts_error
            md = read_metadata(path)
            tr.mark("metadata")
            targets, value_updates = _check_requests(state_dict, md, path, strict, report)
            state_bytes = sum(tg.region.numel * DTYPES[tg.dtype][0] for tg in targets)
            budget = default_load_budget(state_bytes) if max_host_bytes is None else int(max_host_bytes)
            report.host_budget = budget
            files = reader.FileSet.of(path, md, resolve_member, verify_checksums, opts)
            for tg in targets:
                if tg.region.numel == 0:
                    continue
                segs = region_segments(path, md, tg.key, tg.region)
                for seg in segs:
                    files.fd(seg[0].file)  # opened and size-checked before any byte is written
                plan.append((tg, segs))
            tr.mark("validate")
        except Exception as e:  # noqa: BLE001 - every failure must reach the status exchange below
            err = e
        statuses = gather_errors(comm, err, (requested, md.checkpoint_id if md else None))
        _check_same_checkpoint(path, statuses)
        tr.mark("exchange-checks")

        # from here on the targets are written
        base = host_memory.account.reset_peak()
        C = md.chunk_bytes
        # live buffers at once: a staging window, a read window (+2 chunks) and two bounce chunks
        window = max(C, (budget - 4 * C) // 2)
        err = None
        try:
            reads: list = []  # large ranges of host targets, read straight into them in file order
            for tg, segs in plan:
                if opts.host_fast_path and host_memory.is_host_contiguous(tg.tensor):
                    dst, _ = host_memory.raw_view(tg.tensor, allow_copy=False)
                    read_region(files, md, tg.key, tg.region, dst, verify_checksums, verifier, reads, window, segs)
                else:
                    _fill_through_window(files, md, tg, segs, verify_checksums, verifier, window)
                report.loaded_keys.append(tg.key)
            read_deferred(files, md, reads, verify_checksums, verifier)
            tr.mark("read")
            verifier.wait()
            report.bytes_read = files.bytes_read
            tr.mark("verify-wait")
        except Exception as e:  # noqa: BLE001 - every failure must reach the status exchange below
            err = e
        finally:
            verifier.drain()
            report.peak_host_bytes = max(0, host_memory.account.peak - base)
        try:
            gather_errors(comm, err)
        except Exception as e:  # noqa: BLE001 - a failure on any rank: this rank's own, else the first other one
            cause = f"rank {comm.rank} failed: {type(e).__name__}: {e}" if e is err else f"{type(e).__name__}: {e}"
            raise PartiallyLoadedError(
                f"load of {path} failed after writing into the targets had begun ({cause}). The "
                f"tensors being loaded on every rank that read data now hold a mix of their previous and the loaded "
                f"values: do not continue with them. Load a checkpoint again (load_checkpoint(root) falls back to "
                f"the newest older checkpoint by itself), or load with atomic=True, which keeps an undo copy"
            ) from e
        tr.mark("exchange-status")
    finally:
        verifier.drain()
        if files is not None:
            files.close()
    return md, value_updates, statuses


def _fill_through_window(files, md, tg: _Target, segs: list, verify: bool, verifier, window: int) -> None:
    """Device (or strided) target: read into a host staging tensor (pinned for devices) of at most ``window``
    bytes, rows at a time, each window verified and then copied into the target with ``Tensor.copy_``."""
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


def _load_atomic(
    state_dict, path, comm, report, requested, verify_checksums, strict, max_host_bytes, tr, opts, opts_error
):
    """All-or-nothing load (``atomic=True``): reads into host staging and undo copies (inplace.py) first,
    commits into the targets only once every rank read and verified everything."""
    err: BaseException | None = None
    targets: list[_Target] = []
    value_updates: dict[str, Any] = {}
    md = None
    files = None
    verifier = reader.ChunkVerifier(opts.checksum_threads)
    arena_held = False
    in_place: InPlaceReads | None = None
    committed = False
    base = host_memory.account.reset_peak()
    try:
        try:
            if opts_error is not None:
                raise opts_error
            md = read_metadata(path)
            tr.mark("metadata")
            targets, value_updates = _check_requests(state_dict, md, path, strict, report)
            tr.mark("validate")
            # read + verify everything into host staging (this rank's slice); targets untouched until commit.
            # Host targets read in large ranges only (the usual case): their file ranges are read as aligned
            # spans (O_DIRECT where supported) into one host buffer, committed with a memcpy per range into the
            # target's own memory. Other targets (small scattered ranges, device or strided tensors) get a
            # staging buffer of their own, committed with one memcpy (host) or Tensor.copy_ (device, strided).
            # All host staging is carved out of one buffer: the async-save arena when there is one, else fresh.
            verify = verify_checksums and md.checksum != checksums.NONE
            direct: list = []  # (target, piece, a, b, dst offset)
            staged: list[_Target] = []
            for tg in targets:
                if tg.region.numel == 0:
                    continue
                segs = region_segments(path, md, tg.key, tg.region)
                host = host_memory.is_host_contiguous(tg.tensor)
                if opts.host_fast_path and host and all(bool(sg[4].all()) for sg in segs):
                    tg.copies = []
                    for piece, src_b, dst_b, len_b, _big in segs:
                        for a, d, n in zip(src_b.tolist(), dst_b.tolist(), len_b.tolist()):
                            direct.append((tg, piece, a, a + n, d))
                else:
                    staged.append(tg)
            regions, direct = _in_place_regions(direct, opts.in_place)
            spans = _plan_spans(direct, md.chunk_bytes, verify)
            A = reader.DIRECT_ALIGN
            span_bytes = [-(-sp[2] // A) * A for sp in spans]
            host_staged = [tg for tg in staged if opts.host_fast_path and host_memory.is_host_contiguous(tg.tensor)]
            undo_bytes = sum(aligned(len(dst)) for _key, _piece, dst in regions)
            need = (
                sum(span_bytes) + undo_bytes + sum(aligned(tg.region.numel * DTYPES[tg.dtype][0]) for tg in host_staged)
            )
            stage = (
                host_memory.arena.acquire(need, grow=host_memory.arena.capacity > 0, hugepages=opts.hugepages)
                if need
                else None
            )
            arena_held = stage is not None
            report.peak_host_bytes = need
            if stage is None and need:
                stage = host_memory.alloc_host(need, for_direct_reads=bool(span_bytes), hugepages=opts.hugepages)
            pos = 0
            span_reads = []
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
                span_reads.append(reader.SpanRead(name, start, n_need, buf, checks))
            for tg in host_staged:
                n = tg.region.numel * DTYPES[tg.dtype][0]
                tg.raw = stage[pos : pos + n]
                pos += aligned(n)
            if regions:  # previous bytes copied to the undo buffer ahead of the reads, on a helper thread
                in_place = InPlaceReads(regions, stage[pos : pos + undo_bytes])
            stage = None
            files = reader.FileSet.of(path, md, resolve_member, verify, opts)
            reader.read_spans(files, span_reads, md.chunk_bytes, verifier if verify else None)
            span_reads = None
            if in_place is not None:
                in_place.read(files, md.chunk_bytes, verify, verifier)
            reads: list = []  # large ranges of staged targets, read below in file order
            for tg in staged:
                if tg.raw is None:
                    # device (or strided) target: host staging tensor (pinned for devices), committed with copy_
                    pin = not host_memory.is_host_place(tg.tensor.place)
                    tg.staging = _staging_tensor(tg.tensor.shape, tg.dtype, pin)
                    tg.raw, _ = host_memory.raw_view(tg.staging, allow_copy=False)
                read_region(files, md, tg.key, tg.region, tg.raw, verify_checksums, verifier, reads)
            read_deferred(files, md, reads, verify_checksums, verifier)
            tr.mark("read")
            verifier.wait()  # every queued checksum, before this rank reports its status
            report.bytes_read = files.bytes_read
            tr.mark("verify-wait")
        except Exception as e:  # noqa: BLE001 - every failure must reach the status exchange below
            err = e
        finally:
            verifier.drain()  # no helper thread reads the staging any more
            if files is not None:
                files.close()
        statuses = gather_errors(comm, err, (requested, md.checkpoint_id if md else None))
        _check_same_checkpoint(path, statuses)
        tr.mark("exchange")

        # all ranks are fine: commit into the targets
        for tg in targets:
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
            report.loaded_keys.append(tg.key)
        committed = True
    finally:
        for tg in targets:
            tg.staging = tg.raw = tg.copies = None
        if in_place is not None:
            if committed:
                in_place.finish()
            else:
                verifier.drain()  # no checksum thread reads a target while it is restored
                in_place.restore()  # every tensor read in place gets its previous bytes back
            in_place = None
        if arena_held:
            host_memory.arena.release()
        # borrowed arena bytes count too: the staging is a copy of the slice wherever it lives
        report.peak_host_bytes = max(host_memory.account.peak - base, report.peak_host_bytes)
    tr.mark("copy-into-targets")
    return md, value_updates, statuses


def load_full_state_dict(
    path: str, keys: Iterable[str] | None = None, *, options: CheckpointOptions | None = None
) -> dict:
    """Full tensors by key, read in this process only (no collectives), e.g. for ``model.set_state_dict``.

    With ``keys=None`` every tensor of the checkpoint is returned; a key naming a JSON value returns the value.
    ``options``: as for ``load_state_dict``.
    """
    opts = resolve(options)
    import paddle  # noqa: F401

    path = os.path.abspath(os.fspath(path))
    md = read_metadata(path)
    wanted = list(md.tensors) if keys is None else list(keys)
    out: dict = {}
    files = reader.FileSet.of(path, md, resolve_member, True, opts)
    verifier = reader.ChunkVerifier(opts.checksum_threads)
    reads: list = []
    try:
        for key in wanted:
            if key in md.values and key not in md.tensors:
                out[key] = md.values[key]
                continue
            tm = md.tensors.get(key)
            if tm is None:
                raise MissingKeyError(f"key {key!r} is missing from checkpoint {path}")
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
