"""Faults at a chosen stage of a save, injected by wrapping the Storage the engine resolves (tests only).

Why: crash safety can only be shown by really dying at each step of the save protocol (no ``finally``, no
``atexit``, no flush), on one rank, in a real multi-process job; prompt named failure on every rank by really
failing one rank's I/O at each step. The package has no hook for this: each stage is a call the engine makes on
its ``Storage``, seen by ``FaultStorage`` (layered over every storage with ``io.backends.add_storage_layer``), and
the hand-over, which goes through the TCP store, is the ``hand-over`` trace mark that follows it. The stage table
(protocol order, what is durable at each) is in docs/save-load.md, "Crash semantics". Set::

    PADDLE_FSDP_CKPT_FAULT=<stage>:<rank>[:<n>][:<ERRNO> | :FREEZE | :FREEZE<r>]

and the process whose save-group rank is ``<rank>`` sends itself SIGKILL the ``<n>``-th time (default 1) it
reaches ``<stage>``; with an errno name (``ENOSPC``, ``EIO``, ...) it raises that ``OSError`` there instead, as
the file system would. ``FREEZE`` stops it with SIGSTOP instead (a hung node, a paused container: alive, silent,
its sockets open), ``FREEZE<r>`` stops the process of rank ``<r>`` (its pid from ``note_pid``); either way the
frozen pid is written to ``$PADDLE_FSDP_CKPT_FAULT_DIR/frozen`` first, for the test to SIGCONT or kill it. ``PADDLE_FSDP_CKPT_FAULT_DELAY=<point>:<rank>:<seconds>`` makes that rank sleep at
``<point>`` every time it gets there (races made deterministic). A worker process calls ``install()`` once; an
in-process test uses ``installed()``. Where each stage is seen:

=================  ==========================================================================================
``before_data``    ``write_object`` of the rank's data object ``<rank>_0.safetensors`` (not yet opened)
``mid_data``       the same call: the first half of its bytes written and durable (POSIX: a half-size file
                   through the backend's own writer; an object store: the upload fed up to the piece that
                   crosses the half, left pending), then the fault
``after_data``     the ``hand-over`` trace mark of ``save rank <rank>`` (its hand-over is sent)
``before_metadata`` coordinator: ``put_all`` of the index objects with ``metadata.json`` into the staging
``before_commit``  coordinator: ``put`` of ``COMMIT`` into the staging it wrote ``metadata.json`` into
``before_rename``  coordinator: ``publish`` of that staging
``after_rename``   coordinator (CheckpointManager): ``put`` of ``latest`` (committed; the pointer not moved)
``before_prune``   coordinator (CheckpointManager, keep_last): reading ``latest`` back after writing it, the first
                   call of the pruning
=================  ==========================================================================================

Delay points: ``before_data`` (as the stage), ``markers`` (after the ``put`` of ``<r>.failed.json`` or
``ABORT``, the detail of a failure record, before the record named by its cause), ``handed_over`` (at the
``hand-over`` mark, before ``after_data``).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence

from paddle.distributed.fsdp.checkpoint import tracing
from paddle.distributed.fsdp.checkpoint.io.backends import add_storage_layer, remove_storage_layer
from paddle.distributed.fsdp.checkpoint.io.local import LocalStorage
from paddle.distributed.fsdp.checkpoint.io.storage import DigestFn, Piece, ReadHandle, Storage

ENV = "PADDLE_FSDP_CKPT_FAULT"
DIR_ENV = "PADDLE_FSDP_CKPT_FAULT_DIR"  # where FREEZE modes find the ranks' pids and record the frozen one
FREEZE_RE = re.compile(r"^FREEZE(\d*)$")
DELAY_ENV = "PADDLE_FSDP_CKPT_FAULT_DELAY"
DELAY_POINTS = ("before_data", "markers", "handed_over")
STAGES = (
    "before_data",
    "mid_data",
    "after_data",
    "before_metadata",
    "before_commit",
    "before_rename",
    "after_rename",
    "before_prune",
)
DATA_RE = re.compile(r"^(\d+)_\d+\.safetensors$")
FAILED_DETAIL_RE = re.compile(r"^(\d+)\.failed\.json$")
HAND_OVER_MARK = "hand-over"  # save/commit.py's trace mark right after a rank's hand-over

_counts: dict[str, int] = {}
_lock = threading.Lock()
_seen = {"rank": 0}  # this process's save-group rank: from the name of the data object it last wrote
_coordinating: set[str] = set()  # stagings this process wrote metadata.json into (it is their coordinator)
_pointer_moved: set[str] = set()  # roots whose `latest` this process just wrote (pruning comes next)


def _spec() -> tuple[str, int, int, int | str | None] | None:
    raw = os.environ.get(ENV)
    if not raw:
        return None
    parts = raw.strip().split(":")
    code: int | str | None = None
    if len(parts) >= 3 and FREEZE_RE.match(parts[-1]):
        code = parts[-1]
        parts = parts[:-1]
    elif len(parts) >= 3 and parts[-1].isalpha():
        code = getattr(errno, parts[-1], None)
        if not isinstance(code, int):
            raise ValueError(f"{ENV}={raw!r}: {parts[-1]!r} is not an errno name")
        parts = parts[:-1]
    if len(parts) not in (2, 3) or parts[0] not in STAGES:
        raise ValueError(f"{ENV}={raw!r}: expected <stage>:<rank>[:<n>][:<ERRNO>] with stage in {STAGES}")
    return parts[0], int(parts[1]), int(parts[2]) if len(parts) == 3 else 1, code


def hit(stage: str, rank: int) -> bool:
    """True exactly when this arrival at ``stage`` on ``rank`` is the armed one (arrivals are counted)."""
    spec = _spec()
    if spec is None or spec[0] != stage or spec[1] != rank:
        return False
    with _lock:
        _counts[stage] = _counts.get(stage, 0) + 1
        return _counts[stage] == spec[2]


def reset() -> None:
    """Forget the arrivals counted so far (several faulty saves in one process)."""
    with _lock:
        _counts.clear()
        _coordinating.clear()
        _pointer_moved.clear()


def fire(stage: str) -> None:
    """Die now, as ``kill -9`` would (a stderr line first, so the test log shows where); or, when the fault
    names an errno, raise that OSError as a failing file system would."""
    spec = _spec()
    if spec is not None and isinstance(spec[3], str):
        freeze(spec[3], stage)
        return
    if spec is not None and spec[3] is not None:
        code = spec[3]
        raise OSError(code, f"{os.strerror(code)} [injected by {ENV} at stage {stage}]")
    sys.stderr.write(f"[{ENV}] pid {os.getpid()}: SIGKILL at stage {stage}\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def note_pid(rank: int) -> None:
    """Worker side: record this process as rank ``rank`` (for ``FREEZE<rank>`` armed on another rank)."""
    with open(os.path.join(os.environ[DIR_ENV], f"pid.{rank}"), "w") as f:
        f.write(str(os.getpid()))


def frozen_pid() -> int | None:
    """The pid a FREEZE mode stopped (None: nothing frozen since the last ``clear_frozen``)."""
    try:
        with open(os.path.join(os.environ[DIR_ENV], "frozen")) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def clear_frozen() -> None:
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(os.environ[DIR_ENV], "frozen"))


def freeze(mode: str, stage: str) -> None:
    """SIGSTOP this process (``FREEZE``) or rank r's (``FREEZE<r>``), its pid recorded first."""
    target = FREEZE_RE.match(mode).group(1)
    where = os.environ[DIR_ENV]
    if target:
        with open(os.path.join(where, f"pid.{target}")) as f:
            pid = int(f.read())
    else:
        pid = os.getpid()
    tmp = os.path.join(where, f"frozen.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(str(pid))
    os.replace(tmp, os.path.join(where, "frozen"))
    sys.stderr.write(f"[{ENV}] pid {os.getpid()}: SIGSTOP of pid {pid} at stage {stage}\n")
    sys.stderr.flush()
    os.kill(pid, signal.SIGSTOP)


def point(stage: str, rank: int) -> None:
    """A stage boundary: dies (or fails) here when armed for it."""
    if hit(stage, rank):
        fire(stage)


def delay(where: str, rank: int) -> None:
    """Sleeps when ``PADDLE_FSDP_CKPT_FAULT_DELAY`` names this point and rank."""
    raw = os.environ.get(DELAY_ENV)
    if not raw:
        return
    parts = raw.strip().split(":")
    if len(parts) != 3 or parts[0] not in DELAY_POINTS:
        raise ValueError(f"{DELAY_ENV}={raw!r}: expected <point>:<rank>:<seconds> with point in {DELAY_POINTS}")
    if parts[0] == where and int(parts[1]) == rank:
        time.sleep(float(parts[2]))


def _halves(header: bytes, arrays: list[memoryview], half: int) -> tuple[bytes, list[memoryview]]:
    """The first ``half`` bytes of header + arrays, as a header and pieces."""
    if half <= len(header):
        return header[:half], []
    left, out = half - len(header), []
    for a in arrays:
        if left <= 0:
            break
        out.append(a[:left])
        left -= len(out[-1])
    return header, out


class FaultStorage(Storage):
    """Forwards every call to ``inner``; fails or dies at the armed stage (module docstring)."""

    def __init__(self, inner: Storage) -> None:
        self.inner = inner

    def __getattr__(self, name: str):  # what only the wrapped backend has (its options, its clients)
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    # names
    def child(self, parent: str, name: str) -> str:
        return self.inner.child(parent, name)

    def parent(self, location: str) -> str:
        return self.inner.parent(location)

    def children(self, parent: str) -> list[str]:
        return self.inner.children(parent)

    def list(self, location: str) -> list[str]:
        return self.inner.list(location)

    def exists(self, location: str) -> bool:
        return self.inner.exists(location)

    def stagings(self, final: str) -> list[str]:
        return self.inner.stagings(final)

    # writes
    def begin(self, final: str, checkpoint_id: str) -> str:
        _pointer_moved.clear()  # a new save: the previous one's pruning is over
        return self.inner.begin(final, checkpoint_id)

    def write_object(
        self,
        location: str,
        name: str,
        header: bytes,
        pieces: Sequence[Piece],
        chunk_bytes: int,
        digest: DigestFn | None,
        *,
        should_stop: Callable[[], None] | None = None,
    ) -> tuple[int, list[list[int]]]:
        m = DATA_RE.match(name)
        if m is not None:
            rank = _seen["rank"] = int(m.group(1))
            delay("before_data", rank)
            point("before_data", rank)
            if hit("mid_data", rank):
                return self._half_then_fail(location, name, header, pieces, chunk_bytes, digest, should_stop)
        return self.inner.write_object(location, name, header, pieces, chunk_bytes, digest, should_stop=should_stop)

    def _half_then_fail(self, location, name, header, pieces, chunk_bytes, digest, should_stop):
        """``mid_data``: half of the object's bytes durable, then the fault."""
        arrays, owners = [], []  # producers called now (their owners kept): the total size is needed first
        for p in pieces:
            if callable(p):
                p, owner = p()
                owners.append(owner)
            arrays.append(memoryview(p).cast("B"))
        half = (len(header) + sum(len(a) for a in arrays)) // 2
        if isinstance(self.inner, LocalStorage):  # a file: exactly `half` bytes, fsynced by the backend's writer
            head, first = _halves(bytes(header), arrays, half)
            self.inner.write_object(location, name, head, first, chunk_bytes, None, should_stop=should_stop)
            fire("mid_data")  # a kill or an error ends here; a freeze returns once resumed: the write goes on
            self.inner.delete(location, name)  # (the half object; the backend refuses to overwrite a file)
            return self.inner.write_object(location, name, header, arrays, chunk_bytes, digest, should_stop=should_stop)
        spec = _spec()
        if spec is not None and isinstance(spec[3], str):  # a freeze on an object store: before the upload
            fire("mid_data")
            return self.inner.write_object(location, name, header, arrays, chunk_bytes, digest, should_stop=should_stop)
        # an object store: feed the upload up to the piece that crosses the half, then fail while it is pending
        fed, size = [], len(header)
        for a in arrays:
            fed.append(a)
            size += len(a)
            if size >= half:
                break

        def fail_here():
            fire("mid_data")

        return self.inner.write_object(
            location, name, header, [*fed, fail_here], chunk_bytes, digest, should_stop=should_stop
        )

    def put(self, location: str, name: str, data: bytes, *, durable: bool = True) -> None:
        rank = _seen["rank"]
        if name == "metadata.json":
            self._before_metadata(location)
        elif name == "COMMIT" and location in _coordinating:
            point("before_commit", rank)
        elif name == "latest":
            point("after_rename", rank)
        self.inner.put(location, name, data, durable=durable)
        if name == "latest":
            _pointer_moved.add(location)
        m = FAILED_DETAIL_RE.match(name)
        if m is not None:
            delay("markers", int(m.group(1)))
        elif name == "ABORT":
            delay("markers", rank)

    def put_all(self, location: str, objects: Mapping[str, bytes]) -> None:
        if "metadata.json" in objects:
            self._before_metadata(location)
        self.inner.put_all(location, objects)

    def _before_metadata(self, location: str) -> None:
        if location not in _coordinating:
            _coordinating.add(location)
            point("before_metadata", _seen["rank"])

    def delete(self, location: str, name: str) -> None:
        self.inner.delete(location, name)

    def publish(self, staging: str, final: str) -> None:
        if staging in _coordinating:
            point("before_rename", _seen["rank"])
        self.inner.publish(staging, final)

    def remove(self, location: str, wait: bool = False) -> None:
        self.inner.remove(location, wait)

    def sync(self, location: str) -> None:
        self.inner.sync(location)

    # reads
    def get(self, location: str, name: str, limit: int | None = None) -> bytes | None:
        if name == "latest" and location in _pointer_moved:
            _pointer_moved.discard(location)
            point("before_prune", _seen["rank"])
        return self.inner.get(location, name, limit)

    def open_read(self, location: str, name: str) -> ReadHandle:
        return self.inner.open_read(location, name)


_real_mark = tracing.Tracer.mark


def _mark(self: tracing.Tracer, name: str) -> None:
    """Tracer.mark, plus ``after_data`` at the hand-over mark of a save (``what`` is ``save rank <r>``)."""
    _real_mark(self, name)
    if name == HAND_OVER_MARK and self.what.startswith("save rank "):
        rank = int(self.what.rpartition(" ")[2])
        delay("handed_over", rank)
        point("after_data", rank)


def install() -> Callable[[], None]:
    """Layer FaultStorage over every storage this process resolves and watch the hand-over mark (idempotent);
    returns the function that undoes it. Without the variables set nothing fails."""
    remove_storage_layer(FaultStorage)
    add_storage_layer(FaultStorage)
    tracing.Tracer.mark = _mark

    def uninstall() -> None:
        remove_storage_layer(FaultStorage)
        tracing.Tracer.mark = _real_mark
        reset()

    return uninstall


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """``install()`` for the duration of a block (in-process tests)."""
    reset()
    uninstall = install()
    try:
        yield
    finally:
        uninstall()
