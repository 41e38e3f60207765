"""A hang is a test failure, not a stuck CI job: ``with alarm(30, "what"): ...`` turns one into an AssertionError."""

from __future__ import annotations

import contextlib
import signal


@contextlib.contextmanager
def alarm(seconds: int, what: str):
    def hang(_sig, _frame):
        raise AssertionError(f"hang: {what} did not return within {seconds} s")

    old = signal.signal(signal.SIGALRM, hang)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
