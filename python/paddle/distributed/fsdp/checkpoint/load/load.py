"""Load path of the checkpoint engine: ``load_state_dict``, ``load_full_state_dict``, ``LoadReport``
(``read_metadata`` is directory.py's).

The layout of a checkpoint directory and the save protocol (staging directory, COMMIT written last, atomic
rename, what a crashed save leaves behind) are described in save/save.py.

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
each node has the pieces its ranks read). Saving needs one file system visible to all ranks (see save/save.py).
``process_group``: ranks, file names and ``coordinator_rank`` are group-local ranks.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from ...keywords import STOCK_LOAD_KEYWORDS, check_keywords, keyword_names
from .. import host_memory, lossy, root_runs
from ..background import wait_pending
from ..chunks import ChunkVerifier
from ..coordination import Comm
from ..directory import CommittedCheckpoint, open_checkpoint, read_metadata
from ..errors import CheckpointError, CorruptCheckpointError, InvalidStateDictError, MissingKeyError
from ..format.metadata import CheckpointMetadata
from ..gc_pause import gc_paused
from ..geometry import Region
from ..load_checks import check_coverage, check_data_files, read_failure, staging_tensor
from ..options import CheckpointOptions, resolve
from ..paths import local_path
from ..reader import FileSet
from ..regions import read_deferred, read_region
from ..tracing import Tracer
from . import derive
from .atomic import AtomicLoadJob
from .bounded import BoundedLoadJob
from .job import LoadReport, default_load_budget

__all__ = ["LoadReport", "default_load_budget", "load_full_state_dict", "load_state_dict", "run_load"]


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

    Default: memory-bounded (at most ``max_host_bytes`` of extra host memory, default ``default_load_budget``),
    all-or-nothing for everything checked before the first byte is written, and PartiallyLoadedError on every
    rank when data turns out corrupt (or unreadable) once writing has begun. ``atomic=True``: all-or-nothing for
    everything, at the cost of a host copy of the rank's slice.

    ``options`` (CheckpointOptions; None: ``CheckpointOptions.from_env()``, read now): O_DIRECT, huge pages,
    in-place reads, read slab, checksum threads, tracing.

    Stock's keywords (``unique_id``, ``offload``, ``safetensors``, ...) are accepted and ignored (``aoa_config``
    refused); any other keyword is a TypeError naming the nearest valid one (keywords.py).

    Steps (``AtomicLoadJob``, atomic): validate -> plan -> read -> exchange -> commit; nothing a target holds changes
    before the exchange has shown that every rank validated and read everything (in-place reads keep an undo
    copy). ``BoundedLoadJob`` (default): validate -> prepare -> exchange -> read into the targets -> exchange.
    """
    check_keywords("load_state_dict", unused_stock_kwargs, keyword_names(load_state_dict) + STOCK_LOAD_KEYWORDS)
    if unused_stock_kwargs.get("aoa_config") is not None:
        raise InvalidStateDictError("aoa_config is not supported by the FSDP checkpoint engine")
    return run_load(
        state_dict,
        path,
        process_group,
        coordinator_rank,
        verify_checksums=verify_checksums,
        strict=strict,
        atomic=atomic,
        max_host_bytes=max_host_bytes,
        options=options,
    )


@gc_paused()
def run_load(
    state_dict: dict,
    source: str | CommittedCheckpoint,
    process_group=None,
    coordinator_rank: int = 0,
    *,
    verify_checksums: bool = True,
    strict: bool = True,
    atomic: bool = False,
    max_host_bytes: int | None = None,
    options: CheckpointOptions | None = None,
    caller_error: BaseException | None = None,
) -> LoadReport:
    """The load behind every door, whose keywords its door checked (``load_state_dict``, CheckpointManager,
    the stock hook, ``load_checkpoint``): so an unknown keyword is reported once, naming the door called.

    ``source``: a path, or a checkpoint its caller opened and checked already (directory.open_checkpoint:
    load_checkpoint runs its own checks of the non-tensor state on that metadata first); the load is checked
    against that same metadata, read once, and the ranks still compare the checkpoint ids they read.
    ``caller_error``: what the calling door's own stage raised on this rank (load_checkpoint's collection of
    the targets): reported by the first exchange, so every rank raises it and nothing is read.
    """
    try:
        opts, earlier = resolve(options), caller_error
    except CheckpointError as e:  # a malformed PADDLE_FSDP_CKPT_* variable: reported by the exchange below
        opts, earlier = CheckpointOptions(), caller_error or e
    tr = Tracer("load", opts)
    wait_pending(raise_error=False)
    t0 = time.perf_counter()
    comm = Comm(process_group)
    opened = source if isinstance(source, CommittedCheckpoint) else None
    path = opened.path if opened is not None else source
    try:
        path = local_path(path, opts.storage)
    except CheckpointError as e:  # a URL no backend serves on this rank: the exchange tells every rank
        earlier = earlier or e
    caller_dict, casts = state_dict, []
    if earlier is None:
        try:
            opened = _opened(path, opened, opts)
            state_dict, opened, casts = derive.prepare(state_dict, opened, windowed=not atomic)
        except Exception as e:  # noqa: BLE001 - reported by the first exchange, on every rank
            earlier = e
    if atomic:
        job = AtomicLoadJob(state_dict, path, opts, verify_checksums, tr)
        job.md = opened.metadata if opened is not None else None
        all_requested = job.run(comm, strict, earlier)
    else:
        job = BoundedLoadJob(state_dict, path, opts, verify_checksums, tr)
        job.md = opened.metadata if opened is not None else None
        job.derived = [c for c in casts if c.region is not None]
        all_requested = job.run(comm, strict, max_host_bytes, earlier)
    report = job.finish(all_requested, time.perf_counter() - t0)
    root_runs.resumed_from(path)  # this process's saves into that root continue the loaded run (root_runs.py)
    if state_dict is not caller_dict:  # derived weights (format 4): cast now that the load committed
        derive.apply(casts, report, caller_dict, job.value_updates)
    return report


def _opened(path: str, opened: CommittedCheckpoint | None, opts: CheckpointOptions) -> CommittedCheckpoint | None:
    """The checkpoint, its metadata read once here (so a load of derived weights knows them before it starts);
    None when that fails: the load reads it again and reports the error on every rank."""
    if opened is not None:
        return opened
    try:
        return open_checkpoint(path, opts, opts.storage_for(path))
    except Exception:  # noqa: BLE001 - the job's own read names it, through the exchange
        return None


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

    path = local_path(path, opts.storage)
    storage = opts.storage_for(path)
    md = read_metadata(path, opts, storage)
    if keys is None:
        logical = [*(lossy.logical_keys(md) if md.quant else md.tensors), *md.derived]
    else:
        logical = list(keys)
    wanted = lossy.stored_keys(md, logical)  # a quantized moment: its codes and scales (format/quant.py)
    for key in wanted:
        if key in md.derived:
            derive.source_of(md, key)  # DerivedKeyError when its master is not there
        elif key not in md.tensors and key not in md.values:
            raise MissingKeyError(f"key {key!r} is missing from checkpoint {path}")
    tensor_keys = list(
        dict.fromkeys(md.derived[k].source if k in md.derived else k for k in wanted if k not in md.values)
    )
    try:
        # before allocating by a declared shape: exact coverage + real files of the declared sizes, so what is
        # allocated is the bytes of pieces that really are on disk (pieces never share bytes: schema.py, and
        # format/index.py among the rows a load reads)
        check_coverage(path, md, tensor_keys)
        check_data_files(path, md, tensor_keys, options=opts, storage=storage)
        out = _read_full(path, md, wanted, opts, storage)
        lossy.dequantize_full(md, out, logical)
        return out
    except (OSError, CorruptCheckpointError) as e:
        err = read_failure(path, e, md, storage)
        if err is e:
            raise
        raise err from e


def _read_full(path: str, md: CheckpointMetadata, wanted: list[str], opts: CheckpointOptions, storage) -> dict:
    out: dict = {}
    files = FileSet.of(path, md, True, opts, storage)
    verifier = ChunkVerifier(opts.checksum_threads)
    reads: list = []
    try:
        for key in wanted:
            if key in md.values and key not in md.tensors:
                out[key] = md.values[key]
                continue
            d = md.derived.get(key)
            tm = md.tensors[d.source if d else key]
            t = staging_tensor(tm.shape, tm.dtype, False)
            region = Region.full(tm.shape)
            if region.numel:
                raw, _ = host_memory.raw_view(t, allow_copy=False)
                read_region(files, md, d.source if d else key, region, raw, True, verifier, reads)
            out[key] = t
        read_deferred(files, md, reads, True, verifier)
        verifier.wait()  # nothing is returned before every checksum passed
        for key, d in md.derived.items():  # derived weights: their master read above, cast (format 4)
            if key in out:
                src, _ = host_memory.raw_view(out[key], allow_copy=False)
                t = staging_tensor(out[key].shape, d.dtype, False)
                derive.write_cast(t, src.view("float32"), d.dtype)
                out[key] = t
    finally:
        verifier.drain()
        files.close()
    return out
