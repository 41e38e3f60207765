"""Pausing Python's cyclic garbage collector during the bookkeeping of a save or a load.

Why: the bookkeeping of a checkpoint of many tensors (a mixture of experts has ~10^5 keys) allocates millions of
small objects (parsed JSON, piece records, read and write plans) and no reference cycles, yet the collector runs
every few hundred allocations and its oldest generation walks every object of the process. Measured here (2 ranks,
8000 keys of 256 bytes): parsing the 3.3 MB metadata.json took 395 ms with the collector and 207 ms without; the
save 1.42-1.50 s and 0.79-0.90 s; the load 1.34-1.39 s and 1.03-1.06 s. Reference counting still frees all acyclic
garbage at once while the collector is paused.

``gc_paused()`` is a context manager and a decorator. Pauses nest and may overlap across threads (an async save's
background thread and a load on the main thread): the collector is turned off by the first and back on by the
last, and only if it was on before the first (an application that turned it off keeps it off).
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0  # pauses in progress, all threads
_resume = False  # whether the last pause to end turns the collector back on


@contextmanager
def gc_paused() -> Iterator[None]:
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                gc.enable()
