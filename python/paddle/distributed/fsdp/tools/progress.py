"""A small progress bar on stderr, drawn only when stderr is a terminal (no dependency).

``Progress(total, desc)`` is a context manager; ``update(n)`` advances by ``n`` units (bytes here).
When the stream is not a TTY (pipes, logs, CI) nothing is written at all, so tool output stays clean.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

_UNITS = ("B", "KB", "MB", "GB", "TB", "PB")


def human_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KB'`` (decimal units, as Hugging Face shard sizes)."""
    n = float(n)
    for unit in _UNITS:
        if abs(n) < 1000 or unit == _UNITS[-1]:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} {_UNITS[-1]}"  # pragma: no cover - loop always returns


class Progress:
    """Byte progress bar; a no-op unless ``stream`` (default stderr) is a TTY or ``enabled=True``."""

    def __init__(
        self,
        total: int,
        desc: str = "",
        stream: TextIO | None = None,
        enabled: bool | None = None,
        width: int = 30,
        min_interval: float = 0.1,
    ) -> None:
        self.total = max(int(total), 0)
        self.desc = desc
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            try:
                enabled = bool(isatty and isatty())
            except (ValueError, OSError):  # closed stream
                enabled = False
        self.enabled = enabled
        self.width = width
        self.min_interval = min_interval
        self.done = 0
        self.t0 = time.monotonic()
        self._last_draw = 0.0
        self._drawn = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: int, note: str = "") -> None:
        self.done += int(n)
        if not self.enabled:
            return
        now = time.monotonic()
        if now - self._last_draw >= self.min_interval or self.done >= self.total:
            self._draw(now, note)

    def _draw(self, now: float, note: str = "") -> None:
        self._last_draw = now
        frac = min(self.done / self.total, 1.0) if self.total else 1.0
        filled = int(round(frac * self.width))
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = max(now - self.t0, 1e-9)
        rate = human_bytes(self.done / elapsed)
        line = f"\r{self.desc} [{bar}] {frac * 100:5.1f}% {human_bytes(self.done)}/{human_bytes(self.total)} {rate}/s"
        if note:
            line += f" {note[:40]}"
        try:
            self.stream.write(line + "\033[K")
            self.stream.flush()
            self._drawn = True
        except (ValueError, OSError):
            self.enabled = False

    def close(self) -> None:
        if self.enabled and self._drawn:
            self._draw(time.monotonic())
            try:
                self.stream.write("\n")
                self.stream.flush()
            except (ValueError, OSError):
                pass
        self.enabled = False
