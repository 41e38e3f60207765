"""What every load of a rank shares: its report, its targets, the validation of the request against the committed
metadata (read through the storage interface), the status exchange between ranks, and the finish.

Why its own module: the atomic load (atomic.py) and the memory-bounded load (bounded.py) differ only in
how they read; both validate, exchange and finish the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .. import checksums, lossy
from ..chunks import ChunkVerifier
from ..coordination import Comm, gather_errors, stage_error
from ..directory import read_metadata
from ..errors import (
    CheckpointRemovedError,
    DtypeMismatchError,
    InvalidStateDictError,
    LoadFailedError,
    MissingKeyError,
    ShapeMismatchError,
)
from ..format.metadata import CheckpointMetadata
from ..geometry import Region
from ..io.storage import Storage
from ..load_checks import check_coverage, check_data_files, named_read_error, read_failure
from ..options import CheckpointOptions
from ..reader import FileSet
from ..records import to_record
from ..tracing import Tracer


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
    # saved state the caller did not ask for (filled by the resume door, state/resume.py: "optimizer",
    # "grad_scaler", "ema", "stateful", "stateful['name']"); the engine itself leaves it empty
    left_unrequested: list[str] = field(default_factory=list)


LOAD_MIN_HOST_BYTES = 64 << 20  # memory-bounded loads: extra host memory at most max(this, ...
LOAD_HOST_FRACTION = 0.02  # ... this fraction of the rank's requested state)


def default_load_budget(state_bytes: int) -> int:
    """Extra host memory a memory-bounded load may hold: ``max(64 MiB, 2%)`` of the rank's state."""
    return max(LOAD_MIN_HOST_BYTES, int(LOAD_HOST_FRACTION * state_bytes))


@dataclass
class Target:
    """A tensor of the state dict being loaded: its key, region, and where its bytes are staged."""

    key: str
    tensor: Any
    region: Region
    dtype: str
    staging: Any = None
    raw: Any = None
    copies: Any = None  # in-place host target: [(dst byte offset, verified source bytes in the span buffer)]
    derive: Any = None  # a derived weight read from its master by windows (load/derive.py's Cast; bounded.py)


class LoadJob:
    """The state of one ``load_state_dict`` call on this rank and the steps every kind of load shares (validate,
    exchange, finish); atomic.py and bounded.py add their own reads."""

    def __init__(self, state_dict, path: str, opts: CheckpointOptions, verify_checksums: bool, tr: Tracer):
        self.state_dict = state_dict
        self.values_dict = state_dict  # the caller's dict: JSON values go back into it
        self.dequant = None  # quantized moments requested: their targets, written after the commit (lossy.py)
        self.path = path
        self.opts = opts
        self.verify_checksums = verify_checksums
        self.tr = tr
        self.report = LoadReport()
        self.md: CheckpointMetadata | None = None
        self.targets: list[Target] = []
        self.derived: list = []  # derived weights whose master the load reads by windows (load/derive.py)
        self.value_updates: dict[str, Any] = {}
        self.requested = sorted(k for k in state_dict) if isinstance(state_dict, dict) else []
        self.verifier = ChunkVerifier(opts.checksum_threads)
        self.files: FileSet | None = None
        self.storage_error: BaseException | None = None
        try:
            self.storage: Storage | None = opts.storage_for(path)
        except Exception as e:  # noqa: BLE001 - an added storage layer failing on this rank: the first exchange
            self.storage, self.storage_error = None, e

    def failure(self, e: BaseException, rank: int) -> BaseException:
        """The named error this rank reports for ``e`` (``read_failure``: an OSError is CorruptCheckpointError, a
        checkpoint gone under the reader CheckpointRemovedError; anything else not the engine's own is
        LoadFailedError naming the rank and the cause)."""
        if self.storage is None:
            err = named_read_error(self.path, e)
        else:
            err = read_failure(self.path, e, self.md, self.storage)
        return stage_error(err, f"load of {self.path} failed", rank, LoadFailedError)

    def check_earlier(self, earlier: BaseException | None) -> None:
        """Raise what failed on this rank before the load's own steps (a malformed variable, what the calling
        door's own stage raised, the storage backend), so that the first exchange reports it."""
        for e in (earlier, self.storage_error):
            if e is not None:
                raise e

    def validate(self, strict: bool) -> None:
        """Read the committed metadata (unless the caller opened the checkpoint: ``md`` set) and match every
        requested key against it (kind, shape, dtype). With ``strict`` any mismatch raises the named error of the
        first one; else mismatches go to the report. Then exact coverage of every target's tensor and the kinds and sizes of the
        data files its pieces are in: everything that can be refused before a byte of data is read."""
        path, report = self.path, self.report
        md = self.md = self.md if self.md is not None else read_metadata(path, self.opts, self.storage)
        self.tr.mark("metadata")
        if not isinstance(self.state_dict, dict):
            raise InvalidStateDictError(f"state_dict must be a dict, got {type(self.state_dict).__name__}")
        if md.quant and any(k in md.quant for k in self.state_dict):  # read their codes and scales instead
            self.state_dict = dict(self.state_dict)
            self.dequant = lossy.swap_targets(self.state_dict, md.quant)
            self.requested = sorted(self.state_dict)
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
            self.targets.append(Target(key, rec.tensor, rec.region, rec.dtype))
        for c in self.derived:  # (their dtype and shape checked by derive.prepare; the alias reads the master)
            self.targets.append(Target(c.alias, None, c.region, "float32", derive=c))
        self.requested = sorted({*self.requested, *(c.alias for c in self.derived)})
        if strict and problems:
            cls, _ = problems[0]
            more = (
                f" (and {len(problems) - 1} more: " + "; ".join(m for _, m in problems[1:4]) + ")"
                if len(problems) > 1
                else ""
            )
            raise cls(problems[0][1] + more)
        check_coverage(path, md, {tg.key for tg in self.targets}, {tg.key: tg.region for tg in self.targets})
        check_data_files(
            path,
            md,
            {tg.key for tg in self.targets},
            {tg.key: tg.region for tg in self.targets},
            self.opts,
            self.storage,
        )
        self.tr.mark("validate")

    @property
    def verify(self) -> bool:
        return self.verify_checksums and self.md.checksum != checksums.NONE

    def stop_reading(self) -> None:
        """After read (or its failure): no helper thread reads the staging any more, files closed."""
        self.verifier.drain()
        if self.files is not None:
            self.files.close()

    def exchange(self, comm: Comm, err: BaseException | None) -> set[str]:
        """Every rank's status: raise the same named error on every rank if any failed, or if the ranks read
        different checkpoints. Returns the keys requested by any rank."""
        md = self.md
        statuses = gather_errors(comm, err, (self.requested, md.checkpoint_id if md else None), agree=True)
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

    def finish(self, all_requested: set[str], seconds: float) -> LoadReport:
        """After the commit: JSON values into the dict, the report completed."""
        for k, v in self.value_updates.items():
            self.values_dict[k] = v
        md, report = self.md, self.report
        report.unexpected_keys = sorted((set(md.tensors) | set(md.values)) - all_requested)
        if self.dequant:  # the moments from the codes and scales just loaded; not bit-exact: warned
            self.dequant.finish(report.loaded_keys, self.opts.codec_threads)
            lossy.warn_lossy(self.path, md.quant, exact=False)
        report.seconds = seconds
        self.tr.mark("copy-into-targets")
        self.tr.done()
        return report
