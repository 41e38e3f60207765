"""The atomic load (``load_state_dict(..., atomic=True)``): validate -> plan -> read -> exchange -> commit; nothing
a target holds changes before every rank validated and read everything (load.py's docstring has the details).
"""

from __future__ import annotations

import numpy as np

from .. import host_memory
from ..coordination import Comm, aligned
from ..format.metadata import DTYPES
from ..load_checks import staging_tensor
from ..ranges import SpanRead, read_spans
from ..read_ops import SpanPlan, TargetRead
from ..reader import DIRECT_ALIGN, FileSet
from ..regions import read_deferred, read_region, region_segments
from .inplace import InPlaceReads
from .job import LoadJob, Target


def _in_place_regions(reads: list[TargetRead], enabled: bool = True) -> tuple[list, list[TargetRead]]:
    """Split the fast-path reads into regions read in place (inplace.py: ``(key, piece, target bytes)``) and the
    rest. A target is read in place when each of its reads is a whole saved piece (no chunk widening: the piece's
    chunks are the target's bytes) and its memory overlaps no other such target. Regions come in file order.
    ``enabled=False`` (CheckpointOptions.in_place) reads nothing in place."""
    if not enabled:
        return [], reads
    by_target: dict[int, list[TargetRead]] = {}
    for r in reads:
        by_target.setdefault(id(r.target), []).append(r)
    whole = [rs for rs in by_target.values() if all(r.whole_piece for r in rs)]
    spans = sorted(
        (rs[0].target.tensor.data_ptr(), host_memory.raw_view(rs[0].target.tensor, allow_copy=False)[0].nbytes, i)
        for i, rs in enumerate(whole)
    )
    aliased, end, widest = set(), -1, -1  # widest: the interval reaching furthest so far
    for ptr, n, i in spans:
        if ptr < end:
            aliased.update((i, widest))
        if ptr + n > end:
            end, widest = ptr + n, i
    chosen = {id(rs[0].target) for i, rs in enumerate(whole) if i not in aliased}
    regions, rest = [], []
    for r in reads:
        if id(r.target) not in chosen:
            rest.append(r)
            continue
        dst, _ = host_memory.raw_view(r.target.tensor, allow_copy=False)
        regions.append((r.target.key, r.piece, dst[r.dst : r.dst + (r.b - r.a)]))
    regions.sort(key=lambda reg: (reg[1].file, reg[1].offset))
    return regions, rest


_SPAN_GAP = 4096  # file ranges closer than this are read as one span (staging stays the slice + alignment)


def _plan_spans(reads: list[TargetRead], chunk_bytes: int, verify: bool) -> list[SpanPlan]:
    """Group the reads into file spans (``start`` aligned to DIRECT_ALIGN; with ``verify`` every member's range is
    widened to whole chunks of its piece, and the span covers the widened ranges)."""
    C = chunk_bytes

    def widened(r: TargetRead) -> tuple[int, int]:
        return ((r.a // C) * C, min(-(-r.b // C) * C, r.piece.nbytes)) if verify else (r.a, r.b)

    spans: list[SpanPlan] = []
    for r in sorted(reads, key=lambda r: (r.piece.file, r.piece.offset + widened(r)[0])):
        a0, b0 = widened(r)
        fs, fe = r.piece.offset + a0, r.piece.offset + b0
        last = spans[-1] if spans else None
        if last is not None and last.name == r.piece.file and fs <= last.end + _SPAN_GAP:
            last.end = max(last.end, fe)
            last.members.append((r, a0, b0))
        else:
            spans.append(SpanPlan(r.piece.file, fs, fe, [(r, a0, b0)]))
    for sp in spans:
        sp.start = (sp.start // DIRECT_ALIGN) * DIRECT_ALIGN
    return spans


class AtomicLoadJob(LoadJob):
    """An all-or-nothing load: staged (or read in place with an undo copy), committed after the exchange."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.report.atomic = True
        self.arena_held = False
        self.in_place: InPlaceReads | None = None
        self.committed = False
        # filled by plan(), consumed by read()
        self.span_reads: list = []
        self.staged: list[Target] = []
        self.staged_bytes = 0  # host staging + undo bytes (a copy of the slice)

    def run(self, comm: Comm, strict: bool, earlier: BaseException | None) -> set[str]:
        """Every step in order; returns the keys requested by any rank."""
        base = host_memory.account.reset_peak()
        err: BaseException | None = None
        try:
            # 1. validate (no data read): metadata, keys, shapes, dtypes, exact coverage, files;
            # the verdict of every rank is exchanged before any byte of data is read or any target written
            try:
                self.check_earlier(earlier)
                self.validate(strict)
            except Exception as e:  # noqa: BLE001 - every failure must reach the verdict exchange below
                err = self.failure(e, comm.rank)
            all_requested = self.exchange(comm, err)
            # 2-3. plan, read and verify; 4. exchange; 5. commit
            try:
                self.plan()
                self.read()
            except Exception as e:  # noqa: BLE001 - every failure must reach the status exchange below
                err = self.failure(e, comm.rank)  # (a file gone: removed, not corrupt)
            finally:
                self.stop_reading()
            self.exchange(comm, err)
            self.commit()
        finally:
            self.release()
            # staging and undo copies count, also when borrowed from the arena: a copy of the slice wherever it lives
            self.report.peak_host_bytes = max(host_memory.account.peak - base, self.staged_bytes)
        return all_requested

    def plan(self) -> None:
        """Decide where every byte goes, and carve all host staging out of one buffer.

        Host targets read in large ranges only (the usual case): their file ranges are read as aligned spans
        (O_DIRECT where supported) into the buffer and committed with a memcpy per range, or read in place
        (whole saved pieces, with an undo copy). Other targets (small scattered ranges, device or strided
        tensors) get a staging area of their own, committed with one memcpy (host) or Tensor.copy_ (device,
        strided). The buffer is the async-save arena when there is one, else fresh memory.
        """
        md, opts, verify = self.md, self.opts, self.verify
        direct: list[TargetRead] = []
        for tg in self.targets:
            if tg.region.numel == 0:
                continue
            segs = region_segments(self.path, md, tg.key, tg.region)
            host = host_memory.is_host_contiguous(tg.tensor)
            if host and all(sg.all_big for sg in segs):
                tg.copies = []
                for sg in segs:
                    for a, d, n in zip(sg.src.tolist(), sg.dst.tolist(), sg.length.tolist()):
                        direct.append(TargetRead(tg, sg.piece, a, a + n, d))
            else:
                self.staged.append(tg)
        regions, direct = _in_place_regions(direct, opts.in_place)
        spans = _plan_spans(direct, md.chunk_bytes, verify)
        A = DIRECT_ALIGN
        span_bytes = [-(-(sp.end - sp.start) // A) * A for sp in spans]
        host_staged = [tg for tg in self.staged if host_memory.is_host_contiguous(tg.tensor)]
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
        for sp, nb in zip(spans, span_bytes):
            buf = stage[pos : pos + nb]
            pos += nb
            checks, seen = [], set()
            for r, a0, b0 in sp.members:
                lo = r.piece.offset + r.a - sp.start
                r.target.copies.append((r.dst, buf[lo : lo + (r.b - r.a)]))
                if verify and (id(r.piece), a0, b0) not in seen:
                    seen.add((id(r.piece), a0, b0))
                    checks.append((r.target.key, r.piece, a0, b0))
            self.span_reads.append(SpanRead(sp.name, sp.start, sp.end - sp.start, buf, checks))
        for tg in host_staged:
            n = tg.region.numel * DTYPES[tg.dtype][0]
            tg.raw = stage[pos : pos + n]
            pos += aligned(n)
        if regions:  # previous bytes copied to the undo buffer ahead of the reads, on a helper thread
            self.in_place = InPlaceReads(regions, stage[pos : pos + undo_bytes])

    def read(self) -> None:
        """Read and verify everything planned (targets read in place keep their undo copy until commit)."""
        md, verify, verifier = self.md, self.verify, self.verifier
        files = self.files = FileSet.of(self.path, md, verify, self.opts, self.storage)
        read_spans(files, self.span_reads, md.chunk_bytes, verifier if verify else None)
        self.span_reads = []
        if self.in_place is not None:
            self.in_place.read(files, md.chunk_bytes, verify, verifier)
        reads: list = []  # large ranges of staged targets, read below in file order
        for tg in self.staged:
            if tg.raw is None:
                # device (or strided) target: host staging tensor (pinned for devices), committed with copy_
                pin = not host_memory.is_host_contiguous(tg.tensor)
                tg.staging = staging_tensor(tg.tensor.shape, tg.dtype, pin)
                tg.raw, _ = host_memory.raw_view(tg.staging, allow_copy=False)
            read_region(files, md, tg.key, tg.region, tg.raw, self.verify_checksums, verifier, reads)
        read_deferred(files, md, reads, self.verify_checksums, verifier)
        self.tr.mark("read")
        verifier.wait()  # every queued checksum, before this rank reports its status
        self.report.bytes_read = files.bytes_read
        self.tr.mark("verify-wait")

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
