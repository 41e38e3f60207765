"""Flush: the newest memory checkpoint in a node's memory root(s) written to durable storage from ONE process,
after a crash (``paddle-fsdp-ckpt flush-memory``; also before a restart, by the launcher or a job script).

Why a command: after a crash no training process is left to persist a step that reached memory but not
storage; the copies survive in ``/dev/shm`` (a tmpfs), and with the peer copies one node's root usually holds
every rank's state (its ranks' own copies and its partner node's). Give every root that is reachable.

Which step: the newest step for which EVERY rank of the job has a copy (its own, or the one its partner holds)
whose header, job, world size, durable root identity (identity.py: copies of another durable root are
skipped) and every chunk checksum check out; a copy that does not is skipped with a warning (any other copy
of that rank in any root, or an older step, is used). A step storage already has is not written again.

What is trusted: roots and files are opened as the tier opens them (roots.py: no symlink, FIFO or another
user's file; a root others may write to is refused); a job whose rank lock is held by a live process is
refused (MemoryRootInUseError), and the locks are held while flushing, so a restarting tier cannot rewrite a
copy under it; each record is copied into a private buffer and verified there before it is written, so the
checkpoint holds exactly the bytes that were verified.

What is written: the checkpoint the job's collective save would have written at that step (persist.py): the
engine's planner assigns and lays out every rank's file from the copies' record descriptions, each rank file
is written from its copy's mapped bytes (one piece at a time, checksummed on the way), then ``metadata.json``
and ``COMMIT`` last, in a staging directory published as ``<durable_root>/step_<N>``; then ``latest`` names it.
Any storage backend: a local directory, or a URL (``s3://``) whose staging directory is local and is uploaded
when complete (the engine's ``staged_output``, staged_output.py); ``latest`` and pruning go through the root's Storage.
Its bytes are what the tier's persist writes (flush_bytes.py: derived weights, the chunk codec of the tier's
options, ``auto`` resolved against the durable root's backend; the tier's ``quantize_moments``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..checkpoint import checksums, writer
from ..checkpoint.codec_choice import choose_codec
from ..checkpoint.directory import committed_steps, step_dir_name
from ..checkpoint.encoded_write import RAW, default_threads, write_encoded
from ..checkpoint.format.metadata import LATEST_FILE, FileMeta, itemsize
from ..checkpoint.format.reserved import QUANT_KEY
from ..checkpoint.io.backends import backend_for
from ..checkpoint.io.local import LocalStorage
from ..checkpoint.manager import root_lineage
from ..checkpoint.one_process import CheckpointWriter
from ..checkpoint.planner import assign_writes, lay_out_files, merged_values
from ..checkpoint.selection import prune
from ..checkpoint.staged_output import staged_output
from ..state.resume_state import PER_RANK_KEYS
from . import flush_bytes, identity
from .copies import OWN_NAME, read_copy
from .errors import InvalidMemoryCopyError, MemoryTierError, NoCommonStepError
from .header import written_at
from .persist import records_of
from .roots import JOB_ID_RE, check_job_id, hold_locks, open_dir
from .slot import Slot, check_record_bytes

logger = logging.getLogger(__name__)


@dataclass
class FlushResult:
    """What ``flush_memory`` did: ``path`` is the checkpoint written (None: nothing newer than storage)."""

    job: str
    world: int
    step: int
    path: str | None
    sources: dict[int, str] = field(default_factory=dict)  # rank -> the copy file used
    nbytes: int = 0


def _scan(roots: list[str], job: str | None, durable_id: str | None, locks: list) -> tuple[str, list]:
    """(job, [(path, header)]) of every copy of one job under ``roots`` with a valid header naming
    ``durable_id`` (no data read); the rank locks of every job directory read are taken into ``locks``."""
    by_job: dict[str, list] = {}
    other_root = []
    if job is not None:
        check_job_id(job)
    for root in roots:
        if not os.path.isdir(root):
            raise MemoryTierError(f"memory root {root} is not a directory")
        os.close(open_dir(root, create=False, private=False))
        for name in sorted(os.listdir(root)):
            jdir = os.path.join(root, name)
            if job is not None and name != job or not JOB_ID_RE.match(name) or not os.path.isdir(jdir):
                continue
            os.close(open_dir(jdir, create=False, private=False))
            names = sorted(os.listdir(jdir))
            locks.extend(hold_locks(jdir, [n for n in names if n.endswith(".lock")]))
            for fname in names:
                path = os.path.join(jdir, fname)
                if not (OWN_NAME.match(fname) or fname.endswith(".peer")):
                    continue
                try:
                    slot = Slot.open(path)
                except (InvalidMemoryCopyError, OSError) as e:
                    logger.warning("skipping %s: %s", path, e)
                    continue
                try:
                    header, _off, _len = slot.header()
                    if header["durable_id"] != durable_id:
                        other_root.append(path)
                        logger.warning("skipping %s: a copy of another durable root (its id %s, the durable root's "
                                       "%s)", path, header["durable_id"], durable_id)  # fmt: skip
                        continue
                    by_job.setdefault(name, []).append((path, header))
                except InvalidMemoryCopyError as e:
                    logger.warning("skipping %s: %s", path, e)
                finally:
                    slot.close()
    if not by_job:
        why = f"; {len(other_root)} copies name another durable root (id {durable_id} here)" if other_root else ""
        raise MemoryTierError(f"no valid memory copy{f' of job {job!r}' if job else ''} under {', '.join(roots)}{why}")
    if len(by_job) > 1:
        raise MemoryTierError(f"memory copies of several jobs under the roots: {sorted(by_job)}; choose one with --job")
    return next(iter(by_job.items()))


def _preference(copy: tuple[str, dict]) -> tuple[bool, int]:
    """The order a rank's copies of one step are tried in: its own before a peer's, the later written first (a step
    saved twice: one slot may still hold the first save, as restore.py reads). ``written`` is compared only among
    the own copies of one rank, which one node's boot clock wrote; a held copy is another node's."""
    path, header = copy
    return (path.endswith(".peer"), -written_at(header))


def _choose(job: str, found: list[tuple[str, dict]], step: int | None) -> tuple[int, int, list]:
    """(world, step, per rank its verified copy (slot, header, data_off, data_len)): the newest step (or
    ``step``) every rank has a verified copy of; NoCommonStepError otherwise."""
    candidates = sorted({(h["step"], h["world"]) for _p, h in found if step is None or h["step"] == step}, reverse=True)
    for st, world in candidates:
        chosen: dict[int, tuple] = {}
        for path, h in sorted(found, key=_preference):
            r = h.get("rank")
            if h["step"] != st or h["world"] != world or r in chosen or type(r) is not int or not 0 <= r < world:
                continue
            try:
                chosen[r] = read_copy(path, {"job": job, "world": world, "rank": r, "step": st}, None)
            except (InvalidMemoryCopyError, OSError) as e:
                logger.warning("skipping %s: %s", path, e)
        if len(chosen) == world:
            return world, st, [chosen[r] for r in range(world)]
        for copy in chosen.values():
            copy[0].close()
        logger.info("step %d: copies of ranks %s only (world %d)", st, sorted(chosen), world)
    have = sorted({(h["step"], h["rank"]) for _p, h in found})
    raise NoCommonStepError(
        f"job {job}: no step{'' if step is None else f' {step}'} has a valid memory copy of every rank in these "
        f"roots (copies found, (step, rank): {have}); give the memory roots of the other nodes too"
    )


def _write(
    staging: str, copies: list, on_bytes, on_total, lineage: dict | None = None, storage=None, durable_root: str = ""
) -> int:
    """Write every rank's file from its copy into ``staging``, then metadata.json and COMMIT (the engine's
    one-process writer, one_process.py, so its index is the one every tool writes), leaving out and compressing
    what the tier's persist would (flush_bytes.py; ``storage``: the durable root's backend, which ``auto``
    resolves against). Returns the stored bytes of the data files."""
    out = CheckpointWriter(staging)
    digest = checksums.digest_function(out.checksum) if out.checksum != checksums.NONE else None
    first = copies[0]
    choices = flush_bytes.persist_choices(first[1], f"memory copy {first[0].path}")
    # (a flush runs in a fresh process after a crash: ``auto`` has no measurement here, so the backend's prior)
    codec = choose_codec(choices["codec"], storage, durable_root, default_threads()) if storage is not None else RAW
    left_out = flush_bytes.derived_keys(copies, records_of) if choices["derive_weights"] else {}
    added, removed, quant = [{} for _c in copies], [set() for _c in copies], None
    if choices["quantize_moments"] is not None:
        added, removed, quant = flush_bytes.quantized_moments(copies, records_of, choices["quantize_moments"])
    wires, per_rank = [], []
    for r, (slot, header, _off, _len) in enumerate(copies):
        pairs = records_of(header, f"memory copy {slot.path}")
        gone = removed[r].union(left_out)
        wires.append([desc.to_wire() for _rec, desc in pairs if desc.key not in gone])
        wires[-1].extend(desc.to_wire() for desc, _bytes in added[r].values())
        per_rank.append({k: (None if k in PER_RANK_KEYS else v) for k, v in header["values"].items()})
        if quant is not None:
            per_rank[-1][QUANT_KEY] = quant
    try:
        values = merged_values(per_rank)
        plan = lay_out_files(assign_writes(wires, values), values, out.checkpoint_id)
    except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        raise InvalidMemoryCopyError(
            f"the copies' record descriptions and values do not make a checkpoint: {e}"
        ) from None
    present = [k for k in PER_RANK_KEYS if k in values]  # each rank's entry of a per-rank value, by rank
    for key in present:
        values[key] = [h["values"].get(key) for _s, h, _o, _n in copies]
    if on_total is not None:
        on_total(sum(layout.size - len(layout.header) for layout in plan.files.values()))
    for r, (slot, header, doff, dlen) in enumerate(copies):
        layout, data = plan.files[r], slot.data(doff, dlen)
        where = {rec[0]: rec for rec in header["records"]}
        pieces = []
        for key, piece in layout.pieces:
            if key in added[r]:  # quantized moments: codes and scales computed from verified bytes, in memory
                pieces.append(_in_memory(added[r][key][1], on_bytes))
                continue
            off, nbytes = where[key][3], where[key][4]
            if nbytes != piece.nbytes:
                raise InvalidMemoryCopyError(f"memory copy {slot.path}: record {key!r} has {nbytes} bytes, "
                                             f"the plan {piece.nbytes}")  # fmt: skip
            pieces.append(_producer(data[off : off + nbytes], header, where[key], on_bytes, f"memory copy {slot.path}"))
        if codec == RAW:
            size, sums = writer.write_rank_file(os.path.join(staging, layout.name), layout.header, pieces,
                                                out.chunk_bytes, digest)  # fmt: skip
        else:
            widths = [itemsize(plan.tensors[key].dtype) for key, _piece in layout.pieces]
            size, sums = write_encoded(LocalStorage(odirect=False), staging, layout.name, layout.header, pieces, widths,
                                       out.chunk_bytes, digest, codec)  # fmt: skip
        if size != layout.size:
            raise MemoryTierError(f"{layout.name}: wrote {size} bytes, expected {layout.size}")
        for (_key, piece), piece_sums in zip(layout.pieces, sums):
            piece.checksums = [int(c) for c in piece_sums]
        out.files[layout.name] = FileMeta(rank=r, size=size)
    out.tensors = dict(plan.tensors)
    # per-rank entries: own objects, as a save; stock readers read raw files only (as a save: no 0.metadata then)
    out.commit(values, codec == RAW, tuple(present), lineage, flush_bytes.derived_field(left_out), codec)
    return sum(os.path.getsize(os.path.join(staging, name)) for name in out.files)


def _in_memory(arr: np.ndarray, on_bytes):
    """The piece of a record computed by the flush itself (quantized moments: flush_bytes.py)."""

    def produce():
        if on_bytes is not None:
            on_bytes(len(arr))
        return arr, arr

    return produce


def _producer(src, header: dict, rec: list, on_bytes, where: str):
    """The piece of record ``rec``: copied out of the mapping ``src`` into a private buffer and verified THERE
    against the header's digests, so what is written is exactly what was verified (the mapping may change under
    a reader: a process still writing the copy). Memory: the record being written plus one write batch."""

    def produce():
        private = np.array(src, copy=True)
        try:
            check_record_bytes(header, rec, private, where)
        except InvalidMemoryCopyError as e:
            raise InvalidMemoryCopyError(f"{e} (the copy changed after it was verified: nothing committed)") from None
        if on_bytes is not None:
            on_bytes(len(private))
        return private, private

    return produce


def flush_memory(
    roots: list[str],
    durable_root: str,
    *,
    job: str | None = None,
    step: int | None = None,
    keep_last: int | None = None,
    on_bytes: Callable[[int], None] | None = None,
    on_total: Callable[[int], None] | None = None,
) -> FlushResult:
    """Write the newest memory checkpoint every rank has in ``roots`` (memory roots, e.g. /dev/shm/paddle-fsdp-
    memtier) to ``durable_root/step_<N>`` and point ``latest`` at it (see the module docstring). ``step``: that
    step instead of the newest; ``keep_last``: then prune like CheckpointManager. Named errors: MemoryTierError
    (no copies, several jobs, a bad root), NoCommonStepError (no step every rank has). Progress: ``on_total(n)``
    once the plan is made (tensor bytes to write), then ``on_bytes(k)`` per piece written."""
    if isinstance(roots, str) or not roots or not all(isinstance(r, str) and r for r in roots):
        raise MemoryTierError(f"roots must be a non-empty list of memory root paths, got {roots!r}")
    if not isinstance(durable_root, str) or not durable_root:
        raise MemoryTierError(f"durable_root must be a directory path or a storage URL, got {durable_root!r}")
    if step is not None and (type(step) is not int or step < 0):
        raise MemoryTierError(f"step must be a non-negative int, got {step!r}")
    if keep_last is not None and (type(keep_last) is not int or keep_last < 1):
        raise MemoryTierError(f"keep_last must be an int >= 1, got {keep_last!r}")
    durable_root = durable_root if "://" in durable_root else os.path.abspath(durable_root)
    storage = backend_for(durable_root)  # StorageError for a URL scheme no backend serves, before reading memory
    durable_id = identity.read_id(durable_root, storage)
    if durable_id is None:
        raise MemoryTierError(f"durable root {durable_root} has no memory-tier id ({identity.ID_OBJECT}): no memory "
                              "copy belongs to it (the root was removed, or no memory tier ever used it)")  # fmt: skip
    locks: list[int] = []
    try:
        job, found = _scan(list(roots), job, durable_id, locks)
        world, st, copies = _choose(job, found, step)
        return _flush(durable_root, storage, job, world, st, copies, keep_last, on_bytes, on_total)
    finally:
        for fd in locks:
            os.close(fd)


def _flush(durable_root, storage, job, world, st, copies, keep_last, on_bytes, on_total) -> FlushResult:
    logger.info("job %s: step %d, every rank's copy verified: %s", job, st, ", ".join(c[0].path for c in copies))
    result = FlushResult(job, world, st, None, {r: c[0].path for r, c in enumerate(copies)})
    try:
        stored = committed_steps(durable_root, storage)
        if stored and max(stored) >= st:
            logger.info("storage %s already has step %d (memory: step %d): nothing to flush", durable_root,
                        max(stored), st)  # fmt: skip
            return result
        name = step_dir_name(st)
        out = storage.child(durable_root, name)
        lineage = root_lineage(durable_root, storage).record()  # the job's run, as its persists recorded it
        with staged_output(out) as staging:
            nbytes = _write(staging, copies, on_bytes, on_total, lineage, storage, durable_root)
        storage.put(durable_root, LATEST_FILE, f"{name}\n".encode())
        if keep_last is not None:
            prune(durable_root, keep_last, protect=(name,), storage=storage)
        result.path, result.nbytes = out, nbytes
        logger.info("flushed job %s step %d (world %d) to %s", job, st, world, out)
        return result
    finally:
        for copy in copies:
            copy[0].close()
