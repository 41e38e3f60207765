"""Public functions of the checkpoint engine.

Layout of a committed checkpoint directory ``path``::

    path/
      0_0.safetensors  1_0.safetensors ...   one data file per saving rank (safetensors layout; may be empty)
      metadata.json                          the index (schema in metadata.py), JSON only
      0.metadata                             stock-paddle index (pickle) so stock ``dist.load_state_dict`` can
                                             read the checkpoint; written for stock, NEVER read by this engine
      COMMIT                                 commit record, written last: {"checkpoint_id", "metadata_sha256"}

Save protocol (all ranks call ``save_state_dict`` collectively):

1. every rank validates its records; one ``all_gather_object`` exchanges the small record descriptions (and any
   validation error, so all ranks fail together); every rank then computes the same plan: replicas are written
   by the lowest rank that holds them, coverage (each element exactly once) is checked, and the layout of every
   rank's file (offsets included) is fixed before any byte is written.
2. every rank writes its own file into the staging directory ``<path>.tmp-<checkpoint_id>`` straight from tensor
   memory, computing per-chunk CRC-32 on the way, fsyncs it once, then drops a small ``done`` marker (sizes +
   checksums; made visible atomically by rename) into ``<staging>/.parts/``. A rank that fails drops a
   ``failed`` marker instead.
3. the coordinator waits for all markers (file system polling, no collective), writes and fsyncs
   ``metadata.json``, ``0.metadata`` and ``COMMIT`` (last), fsyncs the directory and swaps it into ``path``
   atomically (``renameat2(RENAME_EXCHANGE)``; two renames where unsupported). The other ranks wait until they
   see ``path/COMMIT`` with this checkpoint's id (or an ``ABORT`` marker); for a CheckpointManager save also
   until ``latest`` names it. Every rank returns only after commit. Steps 2-3 use no collectives, which is what
   makes them safe to run in a background thread.

Saving twice to one path: saving to a path that holds a committed checkpoint replaces it atomically: readers see
either the old or the new checkpoint, never a mix; the old one is deleted only after the new one is in place (by
a non-daemon background thread, so the deletion does not delay the save). A path that exists and is neither
empty nor a checkpoint of this engine is refused.

Two saves in flight: the saves of one process never overlap, whatever thread they come from: a save (sync or
async) first waits for this process's previous save to commit (a load waits too), so they commit in call order
and, to one path, the later one wins. Two jobs saving to one path concurrently each commit atomically and the
last commit wins (a commit that finds the path just created by the other job replaces it); the non-coordinator
ranks of the job whose checkpoint was replaced before they saw it may time out (SaveFailedError) although it
committed. The staging directory is a sibling of ``path``, so all ranks must see the same file system (shared
FS); with node-local disks the commit would only happen on the coordinator's node.

Crashes (kill -9 of any rank at any stage; stages in ``faults.py``, which also holds the test-only
``PADDLE_FSDP_CKPT_FAULT`` hook that proves this): before the rename, ``path`` keeps the previous checkpoint
untouched (or stays absent) and the partial save is only ``<path>.tmp-<id>`` (never loadable at ``path``; safe
to delete; CheckpointManager removes it at its next save). Loading or verifying ``path`` when it is absent
but such a staging directory exists raises / reports IncompleteCheckpointError ("never committed", saying
whether the save failed with an error or was interrupted); the staging directory itself reports
IncompleteCheckpointError too until its COMMIT is written. The survivors of a killed rank do not hang: the
coordinator waits for the other ranks' data, and the other ranks wait for the commit, at most
``commit_timeout`` (default ``PADDLE_FSDP_CKPT_COMMIT_TIMEOUT``, 1800 s), then raise SaveFailedError; a rank
whose save fails with an error tells the others at once (``failed`` / ``ABORT`` markers).

Numbered checkpoints with a ``latest`` pointer and keep-last-K: ``manager.py`` (CheckpointManager).

``async_save=True``: the caller is blocked for the descriptor exchange and a host copy (snapshot) of the pieces
this rank writes; writing, fsync and commit run in a background (non-daemon) thread. The snapshot of host tensors
goes into one per-process host buffer (``storage.arena``) that is reused by every async save (grown when the
state grows) and STAYS RESIDENT between saves: an async-saving process holds about one extra copy of the bytes
it writes, all the time (filling fresh memory costs page faults, which made the snapshot several times slower
than a copy into resident memory). ``release_host_buffers()`` frees it; the next async save allocates it again.
Device (and strided) tensors are snapshotted with their own host copy instead. The returned SaveHandle's
``wait()`` returns after the commit (on every rank) or raises the background error; an error not collected by
``wait()`` is raised by the next ``save_state_dict``. gloo collectives are never issued from the background
thread (they would race with the training loop's collectives), hence the file-based completion protocol.

Checksums: CRC-32 per 1 MiB chunk of each piece (``chunk_bytes`` in metadata.json), computed on the tensor
memory during the single write pass (4 MiB slabs, on helper threads while the calling thread goes on writing). A load
that needs part of a piece reads the enclosing chunks, verifies them, then copies what it needs; so every byte
loaded is verified and at most two extra chunks per contiguous range are read. ``load_state_dict(...,
verify_checksums=False)`` skips the check (on by default); sizes, metadata hash and COMMIT are still checked.

Load: every rank reads metadata.json (after checking COMMIT and its hash), intersects the flat runs of each of its
requested records with the saved pieces and pread()s only those byte ranges (plus chunk alignment) of the files.
Contiguous host targets whose ranges are all large (the usual FSDP case): the file ranges are merged into spans
and read in file order, 16 MiB at a time, into one host staging buffer (the kernel's sequential readahead;
explicit ``POSIX_FADV_WILLNEED`` was measured slower; ``PADDLE_FSDP_CKPT_ODIRECT=1`` reads them with O_DIRECT
instead, bypassing the page cache, which was faster here on an uncached disk and slower on a host-cached one). Other targets (small
scattered ranges such as rows of boxes, device or strided tensors) get a staging buffer of their own, large
ranges read straight into it, small ones through windows of at most 64 MiB. Checksums of the large ranges run on
helper threads while later ranges are read; the rank waits for all of them before the status exchange. Host
staging is this rank's slice (plus chunk and page alignment); it is the async-save buffer when this process has
one (borrowed, no fresh memory), else fresh memory freed after the load; nothing else grows with the checkpoint.
Only when every key, shape, dtype, coverage and checksum on every rank is fine, and every rank read the same
checkpoint (checkpoint ids compared; one ``all_gather_object`` of the status) are the staged bytes copied into
the targets in place: a memcpy into the tensor's own memory for contiguous host tensors, ``Tensor.copy_`` (host
staging tensor, pinned, copied on the target's own place) otherwise; views into fused buffers keep sharing
memory either way. On any failure the targets are bit-identical to before. JSON values are written back into
the dict. ``strict=True`` (default) fails, before anything is written, on a requested key that is missing or
has another shape/dtype/kind, naming the key; ``strict=False`` loads the matching subset and lists the rest in
the returned LoadReport. Checkpoint keys no rank asked for are only reported (``LoadReport.unexpected_keys``),
so a model-only load of a model+optimizer checkpoint works.

Node-local disks: loading works when every rank sees every file it needs (shared FS, or files copied so that
each node has the pieces its ranks read). Saving needs one file system visible to all ranks (see above).
``process_group``: ranks, file names and ``coordinator_rank`` are group-local ranks.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable

import numpy as np

from . import faults, storage
from .errors import (
    CheckpointError,
    CorruptCheckpointError,
    DtypeMismatchError,
    IncompleteCheckpointError,
    InvalidStateDictError,
    MetadataError,
    MissingKeyError,
    NotACheckpointError,
    SaveFailedError,
    ShapeMismatchError,
    rebuild_remote_error,
)
from .metadata import (
    COMMIT_FILE,
    DEFAULT_CHUNK_BYTES,
    DTYPES,
    FORMAT_NAME,
    LATEST_FILE,
    METADATA_FILE,
    CheckpointMetadata,
    FileMeta,
    TensorMeta,
    resolve_member,
)
from .planner import (
    RecordDesc,
    Region,
    build_save_plan,
    coverage_problems,
    plan_reads,
    region_of_piece,
)
from .records import collect, to_record

PARTS_DIR = ".parts"
# Load commit for contiguous host targets: memcpy into the target's memory (faster than paddle staging
# tensors on CPU). False forces the generic path used for device targets (host staging tensor + copy_).
_HOST_FAST_PATH = True
_TRACE = os.environ.get("PADDLE_FSDP_CKPT_TRACE") == "1"


class _Tracer:
    """Phase timings printed to stderr when PADDLE_FSDP_CKPT_TRACE=1 (for finding where time goes)."""

    def __init__(self, what: str):
        self.what = what
        self.t0 = self.last = time.perf_counter()
        self.marks: list[tuple[str, float]] = []

    def mark(self, name: str) -> None:
        if _TRACE:
            now = time.perf_counter()
            self.marks.append((name, now - self.last))
            self.last = now

    def done(self) -> None:
        if _TRACE:
            import sys

            parts = " ".join(f"{n}={d * 1000:.1f}ms" for n, d in self.marks)
            print(f"[ckpt-trace pid {os.getpid()}] {self.what}: {parts} total="
                  f"{(time.perf_counter() - self.t0) * 1000:.1f}ms", file=sys.stderr, flush=True)
DEFAULT_COMMIT_TIMEOUT = float(os.environ.get("PADDLE_FSDP_CKPT_COMMIT_TIMEOUT", "1800"))

__all__ = [
    "save_state_dict",
    "load_state_dict",
    "load_full_state_dict",
    "read_metadata",
    "verify_checkpoint",
    "release_host_buffers",
    "SaveHandle",
    "LoadReport",
]


# ------------------------------------------------------------------------------------------------ groups


class _Comm:
    def __init__(self, process_group):
        import paddle.distributed as dist

        self.group = process_group
        if process_group is not None:
            self.world = int(process_group.nranks)
            self.rank = int(process_group.rank)
            if self.rank < 0:
                raise InvalidStateDictError("this process is not a member of the given process_group")
        elif dist.is_initialized() and dist.get_world_size() > 1:
            self.world = dist.get_world_size()
            self.rank = dist.get_rank()
        else:
            self.world, self.rank = 1, 0

    def all_gather_object(self, obj) -> list:
        if self.world == 1:
            return [obj]
        import paddle.distributed as dist

        out: list = []
        dist.all_gather_object(out, obj, group=self.group)
        return out


def _error_payload(e: BaseException):
    if e is None:
        return None
    return (type(e).__name__, str(e))


def _raise_gathered(statuses: list, own: BaseException | None) -> None:
    """Raise on every rank if any rank failed: the own error where there is one, else the first remote one."""
    if own is not None:
        raise own
    for r, st in enumerate(statuses):
        if st is not None:
            raise rebuild_remote_error(st[0], st[1], r)


# ------------------------------------------------------------------------------------------------ async state


class SaveHandle:
    """Handle of an async save. ``wait()`` blocks until the checkpoint is committed or raises its error."""

    def __init__(self, path: str, checkpoint_id: str):
        self.path = path
        self.checkpoint_id = checkpoint_id
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._reported = False
        self._done = threading.Event()

    def _run(self, fn) -> None:
        try:
            fn()
        except BaseException as e:  # surfaced by wait() or the next save
            self._error = e
        finally:
            self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> None:
        if not self._done.wait(timeout):
            raise TimeoutError(f"async save to {self.path} still running after {timeout} s")
        if self._thread is not None:
            self._thread.join()
        if self._error is not None and not self._reported:
            self._reported = True
            raise self._error


_pending: SaveHandle | None = None
_pending_lock = threading.Lock()
_save_lock = threading.Lock()


class _Publisher:
    """What CheckpointManager plugs into a save (duck-typed; this class documents the protocol)."""

    def publish(self) -> None:
        """Coordinator, right after the commit: make the new checkpoint the one ``latest`` names (durably)."""

    def is_published(self) -> bool:
        """Other ranks, after they saw the commit: True once ``publish`` has taken effect."""
        return True

    def cleanup(self) -> None:
        """Coordinator, after ``publish``: remove what is no longer kept (best effort, never raises)."""


def _wait_pending(raise_error: bool) -> None:
    """Wait for this process's previous async save. Its uncollected error is raised here when
    ``raise_error`` (the next save), else kept for the next save (a load does not consume it)."""
    global _pending
    with _pending_lock:
        h = _pending
    if h is None:
        return
    h._done.wait()
    if h._thread is not None:
        h._thread.join()
    failed = h._error is not None and not h._reported
    with _pending_lock:
        if _pending is h and (raise_error or not failed):
            _pending = None
    if raise_error and failed:
        h._reported = True
        raise SaveFailedError(f"previous async save to {h.path} failed: {h._error}") from h._error


# ------------------------------------------------------------------------------------------------ save


def _check_target_path(path: str) -> None:
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path):
        raise InvalidStateDictError(f"cannot save to {path}: it exists and is not a directory")
    names = os.listdir(path)
    if not names:
        return
    if COMMIT_FILE in names or METADATA_FILE in names:
        return  # a (possibly incomplete) checkpoint of ours: replaced atomically
    raise InvalidStateDictError(
        f"cannot save to {path}: the directory is not empty and holds no {FORMAT_NAME} checkpoint "
        f"(refusing to replace {len(names)} foreign entries)"
    )


def _poll(cond, timeout: float, what: str):
    t0 = time.monotonic()
    delay = 0.001
    while True:
        r = cond()
        if r:
            return r
        if time.monotonic() - t0 > timeout:
            raise SaveFailedError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.005)


def _read_json(path: str):
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except (OSError, ValueError):
        return None


@dataclass
class _SaveJob:
    path: str
    staging: str
    rank: int
    world: int
    coordinator: int
    checkpoint_id: str
    plan: Any
    arrays: list  # uint8 arrays, one per piece this rank writes (in layout order)
    keepalive: list
    chunk_bytes: int
    timeout: float
    write_stock: bool
    publisher: Any = None  # CheckpointManager hook: publish()/is_published()/cleanup(), see _Publisher
    created: float = field(default_factory=time.time)
    release: Any = None  # async save: gives the snapshot arena back (called once the data file is written)

    def _written(self) -> None:
        self.arrays = self.keepalive = []  # release snapshot memory early
        release, self.release = self.release, None
        if release is not None:
            release()

    def run(self) -> None:
        try:
            self._run()
        finally:
            self._written()

    def _run(self) -> None:
        tr = _Tracer(f"save rank {self.rank}")
        parts = os.path.join(self.staging, PARTS_DIR)
        os.makedirs(parts, exist_ok=True)
        layout = self.plan.files[self.rank]
        faults.point("before_data", self.rank)
        kill_at = layout.size // 2 if faults.hit("mid_data", self.rank) else None
        try:
            try:
                size, crcs = storage.write_rank_file(
                    os.path.join(self.staging, layout.name), layout.header, self.arrays, self.chunk_bytes,
                    kill_at=kill_at,
                )
            finally:
                self._written()
            tr.mark("write+fsync")
            # markers need atomic visibility, not durability: the data file itself is already fsynced
            storage.write_file(
                os.path.join(parts, f"{self.rank}.done.json"),
                json.dumps({"size": size, "crc32": crcs}).encode(),
                fsync=False,
                atomic=True,
            )
        except BaseException as e:
            _mark_failed(self.staging, self.rank, e)
            raise
        faults.point("after_data", self.rank)
        if self.rank == self.coordinator:
            try:
                self._commit(parts, tr)
            except BaseException as e:
                try:  # tells the waiting ranks at once (.parts is gone once the commit record is being written)
                    os.makedirs(parts, exist_ok=True)
                    storage.write_file(os.path.join(parts, "ABORT"), f"{type(e).__name__}: {e}".encode(),
                                       fsync=False, atomic=True)
                except OSError:
                    pass
                raise
            faults.point("after_rename", self.rank)
            if self.publisher is not None:
                self.publisher.publish()
                tr.mark("publish")
                faults.point("before_prune", self.rank)
                self.publisher.cleanup()
        else:
            self._wait_commit(parts)
            tr.mark("wait-commit")
        tr.done()

    def _commit(self, parts: str, tr: "_Tracer") -> None:
        def all_parts():
            status = {}
            for r in range(self.world):
                d = _read_json(os.path.join(parts, f"{r}.done.json"))
                if d is not None:
                    status[r] = ("done", d)
                    continue
                f = _read_json(os.path.join(parts, f"{r}.failed.json"))
                if f is not None:
                    status[r] = ("failed", f)
            if any(s[0] == "failed" for s in status.values()):
                return status
            return status if len(status) == self.world else None

        try:
            status = _poll(all_parts, self.timeout, f"all {self.world} ranks to finish writing {self.staging}")
        except SaveFailedError:
            have = [r for r in range(self.world) if os.path.exists(os.path.join(parts, f"{r}.done.json"))]
            missing = sorted(set(range(self.world)) - set(have))
            raise SaveFailedError(
                f"save to {self.path} aborted: ranks {missing} did not finish writing within {self.timeout:g} s "
                f"(did they die?); the previous checkpoint is untouched"
            ) from None
        tr.mark("wait-ranks")
        failed = {r: s[1] for r, s in status.items() if s[0] == "failed"}
        if failed:
            r, info = sorted(failed.items())[0]
            raise SaveFailedError(f"save to {self.path} aborted: rank {r} failed: {info.get('error')}")
        faults.point("before_metadata", self.rank)

        md = CheckpointMetadata(
            checkpoint_id=self.checkpoint_id,
            world_size=self.world,
            chunk_bytes=self.chunk_bytes,
            checksum="crc32",
            created_unix=self.created,
            values=self.plan.values,
        )
        for r in range(self.world):
            layout = self.plan.files[r]
            done = status[r][1]
            if int(done["size"]) != layout.size or len(done["crc32"]) != len(layout.pieces):
                raise SaveFailedError(f"rank {r} reported a file that does not match the plan")
            md.files[layout.name] = FileMeta(rank=r, size=layout.size)
            for (key, piece), crcs in zip(layout.pieces, done["crc32"]):
                piece.crc32 = [int(c) for c in crcs]
        md.tensors = self.plan.tensors
        data = md.dumps()
        # inside the (invisible) staging directory plain write+fsync is enough; order: data files (fsynced by
        # their ranks), metadata, stock index, then the commit record, then the directory, then the rename
        storage.write_file(os.path.join(self.staging, METADATA_FILE), data, fsync=True, atomic=False)
        if self.write_stock:
            from .stock_compat import write_stock_metadata

            write_stock_metadata(self.staging, md)
        tr.mark("metadata")
        faults.point("before_commit", self.rank)
        commit = {
            "format": FORMAT_NAME,
            "checkpoint_id": self.checkpoint_id,
            "metadata_sha256": hashlib.sha256(data).hexdigest(),
        }
        import shutil

        shutil.rmtree(parts, ignore_errors=True)
        storage.write_file(os.path.join(self.staging, COMMIT_FILE), json.dumps(commit).encode(), fsync=True,
                           atomic=False)
        storage.fsync_dir(self.staging)
        tr.mark("commit-record")
        faults.point("before_rename", self.rank)
        storage.replace_dir(self.staging, self.path, f"{self.path}.old-{self.checkpoint_id}")
        tr.mark("rename")

    def _wait_commit(self, parts: str) -> None:
        """Wait until the coordinator committed (and, for a CheckpointManager save, moved ``latest``)."""
        commit_path = os.path.join(self.path, COMMIT_FILE)
        abort_path = os.path.join(parts, "ABORT")
        seen_commit = False

        def state():
            nonlocal seen_commit
            c = _read_json(commit_path)
            if c is not None and c.get("checkpoint_id") == self.checkpoint_id:
                seen_commit = True
                if self.publisher is None or self.publisher.is_published():
                    return "committed"
                return None
            if os.path.exists(abort_path):
                return "aborted"
            return None

        try:
            st = _poll(state, self.timeout, f"rank {self.coordinator} to commit {self.path}")
        except SaveFailedError:
            if seen_commit:
                raise SaveFailedError(
                    f"save to {self.path}: rank {self.coordinator} committed the checkpoint but did not move the "
                    f"'{LATEST_FILE}' pointer within {self.timeout:g} s (did it die?)"
                ) from None
            raise SaveFailedError(
                f"save to {self.path} did not commit: rank {self.coordinator} (the coordinator) did not commit "
                f"within {self.timeout:g} s (did it die?); the previous checkpoint is untouched"
            ) from None
        if st == "aborted":
            try:
                with open(abort_path) as f:
                    reason = f.read()
            except OSError:
                reason = "unknown"
            raise SaveFailedError(f"save to {self.path} aborted by the coordinator: {reason}")


_ALIGN = 64  # byte alignment of the pieces carved out of one host buffer


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _snapshot(tensors: list) -> tuple[list, list, Any]:
    """Host copy of the pieces this rank writes, for an async save: (arrays, owners to keep alive, release).

    Host tensors are copied into the per-process snapshot arena (``storage.arena``, grown when too small and
    kept resident for the next async save; fresh memory when another user holds it); ``release`` gives the arena
    back. A device (or strided) tensor's host copy made by ``raw_view`` is its snapshot already.
    """
    views = [storage.raw_view(t) for t in tensors]
    need = sum(_aligned(len(arr)) for (arr, k), t in zip(views, tensors) if k is t)
    buf = storage.arena.acquire(need, grow=True) if need else None
    release = storage.arena.release if buf is not None else None
    try:
        if buf is None and need:
            buf = storage.alloc_host(need)
        arrays, keep, pos = [], [], 0
        for (arr, k), t in zip(views, tensors):
            if k is t:
                dst = buf[pos : pos + len(arr)]
                np.copyto(dst, arr)
                arrays.append(dst)
                pos += _aligned(len(arr))
            else:  # already a private host copy (device or strided tensor): keep its owner alive
                arrays.append(arr)
                keep.append(k)
    except BaseException:
        if release is not None:
            release()
        raise
    return arrays, keep, release


def release_host_buffers() -> bool:
    """Free the host buffer that async saves keep resident for their snapshots (and loads borrow as staging).

    Returns False (and frees nothing) while a save or load of this process is using it. The next async save
    allocates it again.
    """
    return storage.arena.free()


def _lazy_view(t):
    """Piece provider for write_rank_file: the tensor's bytes (and their owner), produced when written."""
    return lambda: storage.raw_view(t)


def _mark_failed(staging: str, rank: int, e: BaseException) -> None:
    try:
        parts = os.path.join(staging, PARTS_DIR)
        os.makedirs(parts, exist_ok=True)
        storage.write_file(
            os.path.join(parts, f"{rank}.failed.json"),
            json.dumps({"error": f"{type(e).__name__}: {e}"}).encode(),
            fsync=False,
            atomic=True,
        )
    except OSError:
        pass


def save_state_dict(
    state_dict: dict,
    path: str,
    process_group=None,
    coordinator_rank: int = 0,
    *,
    async_save: bool = False,
    commit_timeout: float | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    write_stock_metadata: bool = True,
    _publisher: _Publisher | None = None,
    **unused_stock_kwargs,
) -> SaveHandle | None:
    """Save ``state_dict`` collectively into the checkpoint directory ``path`` (see the module docstring).

    ``_publisher`` is CheckpointManager's hook (moves ``latest`` after the commit); not for direct use.
    """
    with _save_lock:  # saves of one process never overlap, whatever thread they come from
        return _save_locked(state_dict, path, process_group, coordinator_rank, async_save, commit_timeout,
                            chunk_bytes, write_stock_metadata, _publisher)


def _save_locked(
    state_dict: dict,
    path: str,
    process_group,
    coordinator_rank: int,
    async_save: bool,
    commit_timeout: float | None,
    chunk_bytes: int,
    write_stock_metadata: bool,
    publisher: _Publisher | None,
) -> SaveHandle | None:
    tr = _Tracer("save (calling thread)")
    _wait_pending(raise_error=True)
    tr.mark("wait-previous")
    path = os.path.abspath(os.fspath(path))
    comm = _Comm(process_group)
    if not 0 <= coordinator_rank < comm.world:
        raise InvalidStateDictError(f"coordinator_rank {coordinator_rank} is outside the group of {comm.world}")
    timeout = DEFAULT_COMMIT_TIMEOUT if commit_timeout is None else float(commit_timeout)

    err, records, values, descs = None, [], {}, []
    my_id = uuid.uuid4().hex
    try:
        records, values = collect(state_dict)
        descs = [r.desc().to_wire() for r in records]
        if comm.rank == coordinator_rank:
            _check_target_path(path)
    except CheckpointError as e:
        err = e
    gathered = comm.all_gather_object((_error_payload(err), descs, values if err is None else {}, my_id))
    _raise_gathered([g[0] for g in gathered], err)
    tr.mark("exchange")

    checkpoint_id = gathered[coordinator_rank][3]
    plan = build_save_plan(
        [([RecordDesc.from_wire(w) for w in g[1]], g[2]) for g in gathered], checkpoint_id, chunk_bytes
    )
    by_key = {r.key: r for r in records}
    staging = f"{path}.tmp-{checkpoint_id}"
    tr.mark("plan")
    arrays: list = []
    keep: list = []
    release = None
    try:
        tensors = [by_key[key].tensor for key, _piece in plan.files[comm.rank].pieces]
        if async_save:
            # snapshot now: host copy of this rank's pieces into the reusable snapshot arena (device tensors:
            # the .cpu() copy is the snapshot)
            arrays, keep, release = _snapshot(tensors)
        else:
            # sync: write straight from tensor memory; device tensors are copied to host one piece at a
            # time while writing (never the whole state at once)
            arrays = [_lazy_view(t) for t in tensors]
    except BaseException as e:
        _mark_failed(staging, comm.rank, e)  # the coordinator must not wait for this rank until the timeout
        raise
    tr.mark("snapshot" if async_save else "views")
    job = _SaveJob(
        path=path,
        staging=staging,
        rank=comm.rank,
        world=comm.world,
        coordinator=coordinator_rank,
        checkpoint_id=checkpoint_id,
        plan=plan,
        arrays=arrays,
        keepalive=keep,
        chunk_bytes=chunk_bytes,
        timeout=timeout,
        write_stock=write_stock_metadata,
        publisher=publisher,
        release=release,
    )
    if not async_save:
        job.run()
        tr.mark("write+commit")
        tr.done()
        return None
    handle = SaveHandle(path, checkpoint_id)
    th = threading.Thread(target=handle._run, args=(job.run,), name=f"ckpt-save-{checkpoint_id[:8]}")
    handle._thread = th
    global _pending
    with _pending_lock:
        _pending = handle
    try:
        th.start()
    except BaseException:
        with _pending_lock:
            if _pending is handle:
                _pending = None
        job._written()
        raise
    tr.mark("start-thread")
    tr.done()
    return handle


# ------------------------------------------------------------------------------------------------ reading


def _describe_dir(path: str) -> str:
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return "unreadable"
    if len(names) > 8:
        names = names[:8] + ["..."]
    return ", ".join(names) or "empty"


def read_metadata(path: str) -> CheckpointMetadata:
    """Metadata of a committed checkpoint; raises NotACheckpointError / IncompleteCheckpointError / MetadataError."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        parent = os.path.dirname(path)
        base = os.path.basename(path)
        try:
            near = sorted(n for n in os.listdir(parent) if n.startswith((base + ".old-", base + ".tmp-")))
        except OSError:
            near = []
        staging = [n for n in near if n.startswith(base + ".tmp-")]
        old = [n for n in near if n.startswith(base + ".old-")]
        old_hint = (f"; {old[0]} holds the checkpoint that was being replaced (rename it back to "
                    f"{base})") if old else ""
        if staging:
            raise IncompleteCheckpointError(
                f"checkpoint {path} is incomplete: it was never committed; "
                f"{_describe_staging(_newest(parent, staging))} left {staging[:3]} next to it{old_hint}"
            )
        raise NotACheckpointError(f"{path} is not a checkpoint: no such directory{old_hint}")
    mpath = os.path.join(path, METADATA_FILE)
    cpath = os.path.join(path, COMMIT_FILE)
    has_m, has_c = os.path.isfile(mpath), os.path.isfile(cpath)
    if not has_c:
        names = os.listdir(path)
        looks_partial = has_m or PARTS_DIR in names or any(n.endswith("_0.safetensors") for n in names)
        if looks_partial:
            missing = "the commit record COMMIT" + ("" if has_m else " and metadata.json")
            raise IncompleteCheckpointError(
                f"checkpoint {path} is incomplete: {missing} is missing (the save did not finish)"
            )
        if LATEST_FILE in names:
            raise NotACheckpointError(
                f"{path} is a checkpoint root ({LATEST_FILE} -> {_peek_latest(path)}), not a checkpoint: pass one "
                f"of its checkpoint directories, or pass the root to load_checkpoint / CheckpointManager"
            )
        stock = any(n.endswith(".metadata") for n in names)
        raise NotACheckpointError(
            f"{path} is not a {FORMAT_NAME} checkpoint: no {METADATA_FILE} and no {COMMIT_FILE} "
            f"({'looks like a stock paddle checkpoint; ' if stock else ''}contents: {_describe_dir(path)})"
        )
    try:
        with open(cpath, "rb") as f:
            commit = json.loads(f.read())
        want_sha = commit["metadata_sha256"]
        cid = commit["checkpoint_id"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise MetadataError(f"checkpoint {path}: commit record {COMMIT_FILE} is damaged: {e}") from None
    if not has_m:
        raise CorruptCheckpointError(f"checkpoint {path}: {METADATA_FILE} is missing although it was committed")
    with open(mpath, "rb") as f:
        data = f.read()
    if hashlib.sha256(data).hexdigest() != want_sha:
        raise MetadataError(
            f"checkpoint {path}: {METADATA_FILE} does not match the checksum in the commit record (damaged)"
        )
    md = CheckpointMetadata.loads(data, where=f"{path}/{METADATA_FILE}")
    if md.checkpoint_id != cid:
        raise MetadataError(f"checkpoint {path}: commit record and metadata name different checkpoints")
    return md


def _newest(parent: str, names: list[str]) -> str:
    def mtime(n: str) -> float:
        try:
            return os.path.getmtime(os.path.join(parent, n))
        except OSError:
            return 0.0

    return os.path.join(parent, max(names, key=mtime))


def _describe_staging(staging: str) -> str:
    """Why a staging directory is there: a save that failed with an error, or one that was killed (or runs)."""
    parts = os.path.join(staging, PARTS_DIR)
    try:
        names = sorted(os.listdir(parts))
    except OSError:
        names = []
    errors = [n for n in names if n.endswith(".failed.json") or n == "ABORT"]
    if errors:
        try:
            with open(os.path.join(parts, errors[0]), "rb") as f:
                raw = f.read(500)
            why = json.loads(raw).get("error") if errors[0] != "ABORT" else raw.decode(errors="replace")
        except (OSError, ValueError, AttributeError):
            why = "unknown error"
        return f"a save that failed ({why})"
    return "a save that was interrupted (or is still running)"


def _peek_latest(root: str) -> str:
    try:
        with open(os.path.join(root, LATEST_FILE), "rb") as f:
            return f.read(256).decode(errors="replace").strip() or "empty"
    except OSError:
        return "unreadable"


def _staging_tensor(shape, dtype: str, pin: bool):
    import paddle

    try:
        return paddle.empty(list(shape), dtype=dtype, device=paddle.CPUPlace(), pin_memory=pin)
    except Exception:
        if not pin:
            raise
        return paddle.empty(list(shape), dtype=dtype, device=paddle.CPUPlace())


def _segments(root: str, md: CheckpointMetadata, key: str, tm: TensorMeta, region: Region) -> list:
    """Where the bytes of ``region`` of ``key`` are: per saved piece ``(piece, src, dst, length, big)``, byte
    offsets (piece-relative source, region-relative destination) sorted by source; ``big`` marks the segments of
    at least two checksum chunks (read straight, without a window buffer)."""
    items, covered = plan_reads(key, tm, region)
    if covered != region.numel:
        raise CorruptCheckpointError(
            f"checkpoint {root}: key {key!r}: saved pieces cover {covered} of the {region.numel} "
            f"requested elements"
        )
    isz = DTYPES[tm.dtype][0]
    out = []
    for it in items:
        seg = it.segments
        order = np.argsort(seg.src, kind="stable")
        len_b = seg.length[order] * isz
        out.append((it.piece, seg.src[order] * isz, seg.dst[order] * isz, len_b, len_b >= 2 * md.chunk_bytes))
    return out


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
    A = storage.DIRECT_ALIGN
    out = []
    for name, fs, fe, members in spans:
        start = (fs // A) * A
        out.append([name, start, fe - start, members])
    return out


def _fill(files: storage.FileSet, md: CheckpointMetadata, key: str, tm: TensorMeta, region: Region,
          out: np.ndarray, verify: bool, verifier: storage.ChunkVerifier | None = None,
          deferred: list | None = None) -> None:
    """Read every element of ``region`` of ``key`` into ``out`` (uint8, region storage order).

    With ``verifier``, checks of large ranges are queued on it: ``out`` is verified only after its ``wait()``.
    With ``deferred``, large ranges are not read here but appended to it as ``(key, piece, a, b, out view)``
    for ``_read_deferred`` (which reads them in file order); small ones are read at once.
    """
    verify = verify and md.checksum == "crc32"
    for piece, src_b, dst_b, len_b, big in _segments(files.root, md, key, tm, region):
        # large segments: read straight into the staging buffer (verified in place)
        for a, d, l in zip(src_b[big].tolist(), dst_b[big].tolist(), len_b[big].tolist()):
            if deferred is not None:
                deferred.append((key, piece, a, a + l, out[d : d + l]))
                continue
            storage.read_range_direct(files, key, piece, a, a + l, out[d : d + l], md.chunk_bytes, verify,
                                      verifier=verifier)
        if big.all():
            continue
        src_b, dst_b, len_b = src_b[~big], dst_b[~big], len_b[~big]
        # small segments (e.g. rows of a box): read enclosing windows once, verify, scatter
        merged: list[tuple[int, int]] = []
        for a, b in zip(src_b.tolist(), (src_b + len_b).tolist()):
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        si = 0
        n = len(src_b)
        for wpos, buf in storage.read_piece_windows(files, key, piece, merged, md.chunk_bytes, verify):
            wend = wpos + len(buf)
            # segments are sorted by source offset and disjoint, so finished ones form a prefix
            j = si
            while j < n and src_b[j] < wend:
                a = int(src_b[j])
                b = a + int(len_b[j])
                lo, hi = max(a, wpos), min(b, wend)
                if hi > lo:
                    d = int(dst_b[j]) + (lo - a)
                    out[d : d + (hi - lo)] = buf[lo - wpos : hi - wpos]
                if b <= wend and j == si:
                    si += 1
                j += 1


def _read_deferred(files: storage.FileSet, md: CheckpointMetadata, reads: list, verify: bool,
                   verifier: storage.ChunkVerifier) -> None:
    """Read the large ranges collected by ``_fill(deferred=...)`` in file order (sequential for the kernel's
    readahead; requesting readahead explicitly with POSIX_FADV_WILLNEED was measured slower)."""
    verify = verify and md.checksum == "crc32"
    reads.sort(key=lambda r: (r[1].file, r[1].offset + r[2]))
    for key, piece, a, b, out in reads:
        storage.read_range_direct(files, key, piece, a, b, out, md.chunk_bytes, verify, verifier=verifier)


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


@dataclass
class _Target:
    key: str
    tensor: Any
    region: Region
    dtype: str
    staging: Any = None
    raw: Any = None
    copies: Any = None  # in-place host target: [(dst byte offset, verified source bytes in the span buffer)]


def load_state_dict(
    state_dict: dict,
    path: str,
    process_group=None,
    coordinator_rank: int = 0,
    *,
    verify_checksums: bool = True,
    strict: bool = True,
    **unused_stock_kwargs,
) -> LoadReport:
    """Load ``path`` into the tensors of ``state_dict`` in place, all-or-nothing (see the module docstring)."""
    if unused_stock_kwargs.get("aoa_config") is not None:
        raise InvalidStateDictError("aoa_config is not supported by the FSDP checkpoint engine")
    tr = _Tracer("load")
    _wait_pending(raise_error=False)
    t0 = time.perf_counter()
    path = os.path.abspath(os.fspath(path))
    comm = _Comm(process_group)
    report = LoadReport()
    err: BaseException | None = None
    targets: list[_Target] = []
    value_updates: dict[str, Any] = {}
    md = None
    files = None
    verifier = storage.ChunkVerifier()
    arena_held = False
    requested = sorted(k for k in state_dict) if isinstance(state_dict, dict) else []
    try:
        try:
            md = read_metadata(path)
            tr.mark("metadata")
            if not isinstance(state_dict, dict):
                raise InvalidStateDictError(f"state_dict must be a dict, got {type(state_dict).__name__}")
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
                    refuse(ShapeMismatchError, key,
                           f"shape {list(rec.region.shape)} requested, {list(tm.shape)} in the checkpoint")
                    continue
                if tm.dtype != rec.dtype:
                    refuse(DtypeMismatchError, key, f"dtype {rec.dtype} requested, {tm.dtype} in the checkpoint")
                    continue
                targets.append(_Target(key, rec.tensor, rec.region, rec.dtype))
            if strict and problems:
                cls, _ = problems[0]
                more = f" (and {len(problems) - 1} more: " + "; ".join(m for _, m in problems[1:4]) + ")" \
                    if len(problems) > 1 else ""
                raise cls(problems[0][1] + more)
            tr.mark("validate")
            # read + verify everything into host staging (this rank's slice); targets untouched until commit.
            # Host targets read in large ranges only (the usual case): their file ranges are read as aligned
            # spans (O_DIRECT where supported) into one host buffer, committed with a memcpy per range into the
            # target's own memory. Other targets (small scattered ranges, device or strided tensors) get a
            # staging buffer of their own, committed with one memcpy (host) or Tensor.copy_ (device, strided).
            # All host staging is carved out of one buffer: the async-save arena when there is one, else fresh.
            verify = verify_checksums and md.checksum == "crc32"
            direct: list = []  # (target, piece, a, b, dst offset)
            staged: list[_Target] = []
            for tg in targets:
                if tg.region.numel == 0:
                    continue
                segs = _segments(path, md, tg.key, md.tensors[tg.key], tg.region)
                host = storage._is_host(tg.tensor.place) and tg.tensor.is_contiguous()
                if _HOST_FAST_PATH and host and all(bool(sg[4].all()) for sg in segs):
                    tg.copies = []
                    for piece, src_b, dst_b, len_b, _big in segs:
                        for a, d, n in zip(src_b.tolist(), dst_b.tolist(), len_b.tolist()):
                            direct.append((tg, piece, a, a + n, d))
                else:
                    staged.append(tg)
            spans = _plan_spans(direct, md.chunk_bytes, verify)
            A = storage.DIRECT_ALIGN
            span_bytes = [-(-sp[2] // A) * A for sp in spans]
            host_staged = [tg for tg in staged if _HOST_FAST_PATH and storage._is_host(tg.tensor.place)
                           and tg.tensor.is_contiguous()]
            need = sum(span_bytes) + sum(_aligned(tg.region.numel * DTYPES[tg.dtype][0]) for tg in host_staged)
            stage = storage.arena.acquire(need, grow=storage.arena.capacity > 0) if need else None
            arena_held = stage is not None
            if stage is None and need:
                stage = storage.alloc_host(need)
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
                span_reads.append(storage.SpanRead(name, start, n_need, buf, checks))
            for tg in host_staged:
                n = tg.region.numel * DTYPES[tg.dtype][0]
                tg.raw = stage[pos : pos + n]
                pos += _aligned(n)
            stage = None
            files = storage.FileSet(path, {n: f.size for n, f in md.files.items()}, resolve_member)
            storage.read_spans(files, span_reads, md.chunk_bytes, verifier if verify else None)
            span_reads = None
            reads: list = []  # large ranges of staged targets, read below in file order
            for tg in staged:
                if tg.raw is None:
                    # device (or strided) target: host staging tensor (pinned for devices), committed with copy_
                    pin = not storage._is_host(tg.tensor.place)
                    tg.staging = _staging_tensor(tg.tensor.shape, tg.dtype, pin)
                    tg.raw, _ = storage.raw_view(tg.staging, allow_copy=False)
                _fill(files, md, tg.key, md.tensors[tg.key], tg.region, tg.raw, verify_checksums, verifier, reads)
            _read_deferred(files, md, reads, verify_checksums, verifier)
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
        statuses = comm.all_gather_object((_error_payload(err), requested, md.checkpoint_id if md else None))
        _raise_gathered([s[0] for s in statuses], err)
        ids = sorted({s[2] for s in statuses})
        if len(ids) > 1:  # e.g. the path was replaced by a concurrent save between the ranks' reads
            raise CheckpointError(
                f"load of {path}: ranks read different checkpoints ({ids}); was it replaced during the load? "
                f"nothing was loaded"
            )
        tr.mark("exchange")

        # all ranks are fine: commit into the targets
        for tg in targets:
            if tg.copies is not None:
                dst, _ = storage.raw_view(tg.tensor, allow_copy=False)
                for d, src in tg.copies:
                    np.copyto(dst[d : d + len(src)], src)
            elif tg.staging is not None:
                # Tensor.copy_ writes into the existing allocation (views into fused buffers keep aliasing) and
                # copies host->device on the target's own place
                tg.tensor.copy_(tg.staging, True)
            elif tg.raw is not None:
                dst, _ = storage.raw_view(tg.tensor, allow_copy=False)
                np.copyto(dst, tg.raw)
            tg.staging = tg.raw = tg.copies = None
            report.loaded_keys.append(tg.key)
    finally:
        for tg in targets:
            tg.staging = tg.raw = tg.copies = None
        if arena_held:
            storage.arena.release()
    for k, v in value_updates.items():
        state_dict[k] = v
    all_requested = set()
    for s in statuses:
        all_requested.update(s[1])
    report.unexpected_keys = sorted((set(md.tensors) | set(md.values)) - all_requested)
    report.seconds = time.perf_counter() - t0
    tr.mark("copy-into-targets")
    tr.done()
    return report


def load_full_state_dict(path: str, keys: Iterable[str] | None = None) -> dict:
    """Full tensors by key, read in this process only (no collectives), e.g. for ``model.set_state_dict``.

    With ``keys=None`` every tensor of the checkpoint is returned; a key naming a JSON value returns the value.
    """
    import paddle  # noqa: F401

    path = os.path.abspath(os.fspath(path))
    md = read_metadata(path)
    wanted = list(md.tensors) if keys is None else list(keys)
    out: dict = {}
    files = storage.FileSet(path, {n: f.size for n, f in md.files.items()}, resolve_member)
    verifier = storage.ChunkVerifier()
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
                raw, _ = storage.raw_view(t, allow_copy=False)
                _fill(files, md, key, tm, region, raw, True, verifier, reads)
            out[key] = t
        _read_deferred(files, md, reads, True, verifier)
        verifier.wait()  # nothing is returned before every checksum passed
    finally:
        verifier.drain()
        files.close()
    return out


# ------------------------------------------------------------------------------------------------ verify


def verify_checkpoint(path: str) -> list[str]:
    """Problems found in the checkpoint at ``path`` (empty list == sound).

    Checks the commit record, metadata, that every element of every tensor is covered exactly once, that every
    data file exists with the expected size and a safetensors header that matches the metadata, that pieces do
    not overlap inside a file, and every checksum (reads all data once).
    """
    path = os.path.abspath(os.fspath(path))
    try:
        md = read_metadata(path)
    except CheckpointError as e:
        return [f"{type(e).__name__}: {e}"]
    problems: list[str] = []
    for key, tm in md.tensors.items():
        problems += coverage_problems(
            key, tm.shape, [(md.files[p.file].rank, region_of_piece(tm.shape, p)) for p in tm.pieces]
        )
    by_file: dict[str, list] = {n: [] for n in md.files}
    for key, tm in md.tensors.items():
        for p in tm.pieces:
            by_file[p.file].append((p.offset, p.offset + p.nbytes, key, p))
    usable = set()
    for name, fm in md.files.items():
        try:
            fpath = resolve_member(path, name)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        if not os.path.isfile(fpath):
            problems.append(f"data file {name} is missing")
            continue
        size = os.path.getsize(fpath)
        if size != fm.size:
            problems.append(f"data file {name} has {size} bytes, expected {fm.size}")
            continue
        usable.add(name)
        spans = sorted(by_file[name], key=lambda x: x[0])
        for (a0, a1, k0, _), (b0, b1, k1, _) in zip(spans, spans[1:]):
            if b0 < a1:
                problems.append(f"data file {name}: pieces of {k0!r} and {k1!r} overlap")
        problems += _check_header(fpath, name, by_file[name])
    if md.checksum == "crc32":
        files = storage.FileSet(path, {n: f.size for n, f in md.files.items()}, resolve_member)
        try:
            for key, tm in md.tensors.items():
                for p in tm.pieces:
                    if p.file not in usable or p.nbytes == 0:
                        continue
                    try:
                        for _ in storage.read_piece_windows(
                            files, key, p, [(0, p.nbytes)], md.chunk_bytes, True
                        ):
                            pass
                    except CorruptCheckpointError as e:
                        problems.append(str(e))
        finally:
            files.close()
    return problems


def _check_header(fpath: str, name: str, pieces) -> list[str]:
    try:
        with open(fpath, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if n > 100 << 20:
                return [f"data file {name}: implausible safetensors header length {n}"]
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        return [f"data file {name}: unreadable safetensors header: {e}"]
    out = []
    base = 8 + n
    for a, b, key, p in pieces:
        ent = header.get(p.name)
        if not isinstance(ent, dict) or ent.get("data_offsets") != [a - base, b - base]:
            out.append(f"data file {name}: safetensors header entry for {key!r} does not match the metadata")
    return out
