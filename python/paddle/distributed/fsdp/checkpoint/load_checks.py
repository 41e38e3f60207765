"""The checks of a load that read no data (exact coverage, data objects of the declared sizes), the host staging
of a target, and the named error of a failed read: shared by every kind of load (load/atomic.py,
load/bounded.py, load/load.py) and the tools."""

from __future__ import annotations

from .commit_record import removed_or
from .errors import CorruptCheckpointError
from .format.coverage import coverage_problems, flat_span
from .format.metadata import CheckpointMetadata
from .geometry import region_of_piece
from .io.storage import Storage
from .reader import FileSet


def staging_tensor(shape, dtype: str, pin: bool):
    """Host memory to read into (pinned for device targets: ``CUDAPinnedPlace``, logged fallback)."""
    from ..devices import device

    return device.host_empty(list(shape), dtype, pinned=pin)


def named_read_error(path: str, e: BaseException | None) -> BaseException | None:
    """A read failure as a named error: an OSError (EIO, EACCES, ...) reading the checkpoint is
    CorruptCheckpointError naming the path; errors of the engine pass through."""
    if isinstance(e, OSError):
        err = CorruptCheckpointError(f"checkpoint {path}: cannot read it: {type(e).__name__}: {e}")
        err.__cause__ = e
        return err
    return e


def read_failure(path: str, e: BaseException | None, md: CheckpointMetadata | None, storage: Storage):
    """The error a load reports for ``e``: ``named_read_error``, and CheckpointRemovedError instead of
    corruption when the checkpoint went away (or was replaced) under the reader (keep_last rotation)."""
    err = named_read_error(path, e)
    if isinstance(err, CorruptCheckpointError):
        err = removed_or(path, err, md.checkpoint_id if md is not None else None, storage)
    return err


def check_coverage(root: str, md: CheckpointMetadata, keys, regions: dict | None = None) -> None:
    """Every element of each of ``keys`` is saved exactly once (coverage.py; the check verify_checkpoint runs),
    before a byte of data is read; CorruptCheckpointError naming the key otherwise. With ``regions[key]`` (the
    Region this rank loads), format 3 reads only the rows of a key split over many ranks that its row directory
    selects for the region's flat span, and checks that they cover the span exactly once (format/row_directory)."""
    spans, keys = {}, set(keys)
    for key, r in (regions or {}).items():
        if key in keys:
            spans[key] = flat_span(r.shape, r.box_offset, r.box_shape, r.flat_range)
    md.prefetch(keys, spans)  # format 2: the pieces of these keys only, in few reads (format 3: their windows)
    for key in sorted(keys):
        tm = md.tensors[key]
        pieces, whole = tm.window(*spans[key]) if key in spans else (tm.pieces, True)
        if not whole:
            continue  # a window: checked over its span as it was read
        problems = coverage_problems(key, tm.shape, [(i, region_of_piece(tm.shape, p)) for i, p in enumerate(pieces)])
        if problems:
            raise CorruptCheckpointError(f"checkpoint {root}: {problems[0]}")


def check_data_files(
    root: str,
    md: CheckpointMetadata,
    keys,
    regions: dict | None = None,
    options=None,
    storage: Storage | None = None,
) -> None:
    """The data objects holding ``keys`` (only the pieces that touch ``regions[key]``, when given) exist in
    ``storage`` with the sizes the metadata gives (local: regular files opened without blocking, one at a time),
    so what is planned and allocated afterwards is bounded by bytes really there."""
    names = set()
    for key in keys:
        tm = md.tensors[key]
        span = None
        if regions is not None and key in regions:
            r = regions[key]
            span = flat_span(r.shape, r.box_offset, r.box_shape, r.flat_range)
        for p in tm.window(*span)[0] if span is not None else tm.pieces:
            if not p.nbytes:
                continue
            if span is not None:
                first, end = flat_span(tm.shape, p.box_offset, p.box_shape, p.flat_range)
                if first >= span[1] or end <= span[0]:
                    continue
            names.add(p.file)
    files = FileSet.of(root, md, verify=False, options=options, storage=storage)
    try:
        for name in sorted(names):
            files.handle(name)
            files.close()
    finally:
        files.close()
