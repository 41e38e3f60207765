"""Phase tracing of saves and loads: where the time of one save or load goes, per rank.

A ``Tracer`` collects ``(phase, seconds)`` marks; at ``done()`` it logs them at INFO on the logger
``paddle.distributed.fsdp.checkpoint.tracing`` (``CheckpointOptions.trace``, ``PADDLE_FSDP_CKPT_TRACE=1``; a
stderr handler is attached when nothing else handles that logger, since asking for a trace means wanting to
see it) and/or hands a ``TraceRecord`` to
``CheckpointOptions.trace_hook`` (the benchmark's public way in). Without either it records nothing.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from .errors import extension_name

logger = logging.getLogger(__name__)


def _ensure_visible() -> None:
    """Trace lines reach stderr even when the application configured no logging."""
    if not logger.hasHandlers():
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    if logger.getEffectiveLevel() > logging.INFO:
        logger.setLevel(logging.INFO)


@dataclass(frozen=True)
class TraceRecord:
    """Phase timings of one save or load on one rank, handed to ``CheckpointOptions.trace_hook``."""

    what: str  # e.g. "save (calling thread)", "save rank 0", "load"
    pid: int
    marks: tuple[tuple[str, float], ...]  # (phase name, seconds since the previous mark), in order
    total: float  # seconds from start to done

    def phases_ms(self) -> dict[str, float]:
        return {name: seconds * 1000 for name, seconds in self.marks}


TraceHook = Callable[[TraceRecord], None]


class TraceSettings(Protocol):
    """What a Tracer reads of its options: CheckpointOptions (options.py, which takes TraceHook from here)."""

    @property
    def trace(self) -> bool: ...

    @property
    def trace_hook(self) -> TraceHook | None: ...


class Tracer:
    """Phase timings of one save or load: logged with ``options.trace``, handed to
    ``options.trace_hook``; free when neither is set."""

    def __init__(self, what: str, options: TraceSettings):
        self.what = what
        self.print = options.trace
        self.hook = options.trace_hook
        self.on = self.print or self.hook is not None
        self.t0 = self.last = time.perf_counter()
        self.marks: list[tuple[str, float]] = []

    def mark(self, name: str) -> None:
        if self.on:
            now = time.perf_counter()
            self.marks.append((name, now - self.last))
            self.last = now

    def done(self) -> None:
        if not self.on:
            return
        record = TraceRecord(self.what, os.getpid(), tuple(self.marks), time.perf_counter() - self.t0)
        if self.print:
            parts = " ".join(f"{n}={d * 1000:.1f}ms" for n, d in record.marks)
            _ensure_visible()
            logger.info("[ckpt-trace pid %d] %s: %s total=%.1fms", record.pid, self.what, parts, record.total * 1000)
        if self.hook is not None:
            try:
                self.hook(record)
            except Exception as e:  # the save or load it reports on succeeded: a diagnostic must not undo that
                logger.warning(
                    "trace_hook %s raised %s: %s (the %s itself succeeded)",
                    extension_name(self.hook),
                    type(e).__name__,
                    e,
                    self.what,
                )
