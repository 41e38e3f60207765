"""The memory-bounded load (the default of ``load_state_dict``): validate -> prepare -> exchange -> read straight
into the targets -> exchange of the outcome (load.py's docstring has the details)."""

from __future__ import annotations

import numpy as np

from .. import host_memory
from ..coordination import Comm, gather_errors
from ..errors import PartiallyLoadedError
from ..format import derived
from ..format.metadata import DTYPES
from ..load_checks import read_failure, staging_tensor
from ..reader import FileSet
from ..regions import clip_segments, read_deferred, read_region, region_segments
from .job import LoadJob, Target, default_load_budget


def _file_position(item) -> tuple:
    """Where the first byte a planned target reads lies: ``(file, offset)`` of its earliest segment."""
    _tg, segs = item
    return min(((sg.piece.file, sg.first_byte) for sg in segs if len(sg.src)), default=("", 0))


class BoundedLoadJob(LoadJob):
    """A memory-bounded load (the default; module docstring): validate -> prepare -> exchange -> read straight
    into the targets -> exchange of the outcome."""

    def run(self, comm: Comm, strict: bool, max_host_bytes: int | None, earlier: BaseException | None) -> set[str]:
        err: BaseException | None = None
        plan: list = []
        try:
            try:
                self.check_earlier(earlier)
                self.validate(strict)
                plan = self.prepare(max_host_bytes)
            except Exception as e:  # noqa: BLE001 - every failure must reach the status exchange below
                err = self.failure(e, comm.rank)
            all_requested = self.exchange(comm, err)  # raises on every rank if any failed: nothing was written
            self.tr.mark("exchange-checks")
            err = None
            try:
                self.write_targets(plan)
            except Exception as e:  # noqa: BLE001 - every failure must reach the outcome exchange below
                err = read_failure(self.path, e, self.md, self.storage)  # (a file gone: removed, not corrupt)
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
        self.files = FileSet.of(self.path, md, self.verify_checksums, self.opts, self.storage)
        plan = []
        for tg in self.targets:
            if tg.region.numel == 0:
                continue
            segs = region_segments(self.path, md, tg.key, tg.region)
            for seg in segs:
                self.files.handle(seg.piece.file)  # opened and size-checked before any byte is written
                if self.verify_checksums and len(seg.piece.checksums):
                    seg.piece.checksums[0]  # noqa: B018 - its checksums read now (format 2/3: the sidecar), too
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
                if tg.derive is not None:
                    self._derive_through_window(tg, segs, window)
                elif host_memory.is_host_contiguous(tg.tensor):
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

    def _fill_through_window(self, tg: Target, segs: list, window: int) -> None:
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
            staging = host_memory.account.track(staging_tensor(shape, tg.dtype, pin), nbytes)
            raw, _ = host_memory.raw_view(staging, allow_copy=False)
            read_region(files, md, tg.key, tg.region, raw, verify, verifier, None, window, segs)
            verifier.wait()
            tg.tensor.copy_(staging, True)
            return
        staging = host_memory.account.track(
            staging_tensor([per_window] + shape[1:], tg.dtype, pin), per_window * row_bytes
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

    def _derive_through_window(self, tg: Target, segs: list, window: int) -> None:
        """A derived weight asked for without its master (a model-only load, load/derive.py): the master's float32
        bytes read into a window of the budget, verified, and cast into the weight, a window at a time, so the
        float32 source never exists whole. A device (or strided) weight goes through a staging window of its own
        dtype and ``Tensor.copy_``, rows at a time; the two windows share ``window``."""
        md, files, verifier, verify = self.md, self.files, self.verifier, self.verify_checksums
        cast, numel = tg.derive, tg.region.numel
        target = cast.target
        host = host_memory.is_host_contiguous(target)
        shape = list(target.shape)
        whole = not host and (not shape or not target.is_contiguous())  # 0-d or strided: one window
        if host:
            rows = numel  # (elements: any window boundary will do)
        else:
            rows = 1 if whole else shape[0]
        row = numel // max(rows, 1)  # elements a row
        per_window = min(rows, max(1, window // (max(row, 1) * (4 if host else 6))))
        source = host_memory.host_empty(per_window * row * 4)
        if host:
            out, _keep = host_memory.raw_view(target, allow_copy=False)
        else:
            pin = not host_memory.is_host_place(target.place)
            staging_shape = shape if whole else [per_window] + shape[1:]
            staging = host_memory.account.track(staging_tensor(staging_shape, cast.dtype, pin), per_window * row * 2)
            out, _keep = host_memory.raw_view(staging, allow_copy=False)
        out = out.view(np.uint16)
        for r0 in range(0, rows, per_window):
            r1 = min(rows, r0 + per_window)
            e0, e1 = r0 * row, r1 * row
            part = source[: (e1 - e0) * 4]
            window_segs = clip_segments(segs, e0 * 4, e1 * 4, md.chunk_bytes)
            read_region(files, md, tg.key, tg.region, part, verify, verifier, None, window, window_segs)
            verifier.wait()  # the window is reused next, and only verified bytes are cast
            if host:
                derived.cast_into(part.view(np.float32), cast.dtype, out[e0:e1])
                continue
            derived.cast_into(part.view(np.float32), cast.dtype, out[: e1 - e0])
            if whole:
                target.copy_(staging, True)
            else:
                src = staging if r1 - r0 == per_window else staging._slice(0, r1 - r0)
                target._slice(r0, r1).copy_(src, True)

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
