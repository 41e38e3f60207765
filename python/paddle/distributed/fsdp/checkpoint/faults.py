"""TEST-ONLY fault injection: kill this process with SIGKILL, or fail with an I/O error, at a chosen stage of a save.

Why: crash safety can only be shown by really dying at each step of the save protocol (no ``finally``, no
``atexit``, no flush), on one rank, in a real multi-process job; prompt named failure on every rank by really
failing one rank's I/O at each step. Set::

    PADDLE_FSDP_CKPT_FAULT=<stage>:<rank>[:<n>][:<ERRNO>]

and the process whose save-group rank is ``<rank>`` sends itself SIGKILL the ``<n>``-th time (default 1) it
reaches ``<stage>``; with an errno name (``ENOSPC``, ``EIO``, ``EROFS``, ``EACCES``, ...) it raises that
``OSError`` there instead, as the file system would (``mid_data``: after half of the data file was written).
Unset (the normal case) it costs one environment lookup per stage. Never set it in production. Stages, in
protocol order:

=================  ==========================================================================================
``before_data``    the staging directory exists; this rank has not opened its data file
``mid_data``       this rank's data file is half written (that half fsynced); no ``done`` marker
``after_data``     this rank's data file is complete and fsynced, its ``done`` marker is visible
``before_metadata`` coordinator: every rank's data is done; ``metadata.json`` not written yet
``before_commit``  coordinator: ``metadata.json`` and ``0.metadata`` written; the ``COMMIT`` record not
``before_rename``  coordinator: ``COMMIT`` written in the staging directory; not yet renamed into place
``after_rename``   coordinator: the checkpoint is committed at its path; a ``latest`` pointer not yet moved
``before_prune``   coordinator (CheckpointManager): ``latest`` moved; older checkpoints not yet removed
=================  ==========================================================================================

Timing (races made deterministic): ``PADDLE_FSDP_CKPT_FAULT_DELAY=<point>:<rank>:<seconds>`` makes the process
whose save-group rank is ``<rank>`` sleep at ``<point>`` every time it gets there. Points:

=================  ==========================================================================================
``before_data``    as the fault stage: this rank has not opened its data file yet
``markers``        a failing rank (or aborting coordinator) wrote the detail of its failure marker; the
                   marker named by its cause (what an empty-file-only full disk still takes) not yet
``handed_over``    this rank's ``done`` marker is visible (the coordinator may commit with its file now);
                   ``after_data`` not reached yet
=================  ==========================================================================================
"""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
import time

ENV = "PADDLE_FSDP_CKPT_FAULT"
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

_counts: dict[str, int] = {}
_lock = threading.Lock()


def _spec() -> tuple[str, int, int, int | None] | None:
    raw = os.environ.get(ENV)
    if not raw:
        return None
    parts = raw.strip().split(":")
    code = None
    if len(parts) >= 3 and parts[-1].isalpha():
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
    """Forget the arrivals counted so far (a test running several faulty saves in one process)."""
    with _lock:
        _counts.clear()


def kill(stage: str) -> None:
    """Die now, as ``kill -9`` would (stderr line first, so the test log shows where); or, when the fault names
    an errno, raise that OSError as a failing file system would."""
    spec = _spec()
    if spec is not None and spec[3] is not None:
        code = spec[3]
        raise OSError(code, f"{os.strerror(code)} [injected by {ENV} at stage {stage}]")
    sys.stderr.write(f"[{ENV}] pid {os.getpid()}: SIGKILL at stage {stage}\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def point(stage: str, rank: int) -> None:
    """A stage boundary of the save protocol: dies (or fails) here when armed for it."""
    if hit(stage, rank):
        kill(stage)


def delay(point: str, rank: int) -> None:
    """A point where a race can be widened on purpose: sleeps when ``PADDLE_FSDP_CKPT_FAULT_DELAY`` names it."""
    raw = os.environ.get(DELAY_ENV)
    if not raw:
        return
    parts = raw.strip().split(":")
    if len(parts) != 3 or parts[0] not in DELAY_POINTS:
        raise ValueError(f"{DELAY_ENV}={raw!r}: expected <point>:<rank>:<seconds> with point in {DELAY_POINTS}")
    if parts[0] == point and int(parts[1]) == rank:
        time.sleep(float(parts[2]))
