"""Host mappings that paddle tensors view through DLPack, and the rule they keep: no mapping dies inside paddle's
DLPack deleter.

Why: paddle 3.3.1 runs a DLPack tensor's deleter (numpy's, which drops the array) while holding its
``PaddleDeleterManager`` mutex, and ``from_dlpack`` locks that mutex too, both with the GIL held. If anything in
the deleter lets the GIL go (CPython unmaps an ``mmap`` with the GIL released; Python code, e.g. a ``__del__`` or
a ``weakref.finalize`` callback, hands the GIL over every few milliseconds), a thread that takes it and makes or
frees a DLPack tensor waits for the mutex while the deleter waits for the GIL: both hang for good. Seen with gdb on
2026-12-05: the memory tier's persist thread viewing its copy as tensors while training freed a transient block.

So every mapping is held here, not by its views: a view's deleter only releases a buffer export (C code, GIL
held), and :func:`release_unviewed`, called where no deleter runs (before each new mapping, by the buffers'
release points and by the owners of the mappings), unmaps those nothing views any more and then runs their
``on_unmap`` callbacks.
"""

from __future__ import annotations

import mmap
import threading
from typing import Callable

import numpy as np

_lock = threading.Lock()
_held: list[tuple[mmap.mmap, Callable[[], None] | None]] = []


def anonymous_array(nbytes: int, on_unmap: Callable[[], None] | None = None) -> np.ndarray:
    """A uint8 array over ``nbytes`` of fresh anonymous memory (zero pages), returned to the OS by the first
    :func:`release_unviewed` after the last view of it is freed; ``on_unmap`` is called then."""
    release_unviewed()  # first: what is no longer viewed is returned before more is mapped
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    array = np.frombuffer(mm, np.uint8)
    with _lock:
        _held.append((mm, on_unmap))
    return array


def keep_until_unviewed(mm: mmap.mmap, on_unmap: Callable[[], None] | None = None) -> None:
    """Take over ``mm`` from an owner done with it: closed now if nothing views it, else by a later
    :func:`release_unviewed`."""
    with _lock:
        _held.append((mm, on_unmap))
    release_unviewed()


def release_unviewed() -> int:
    """Unmap the held mappings nothing views any more and call their ``on_unmap``; returns how many are still
    viewed. Never from a deleter (it releases the GIL)."""
    done = []
    with _lock:  # mmap.close() lets the GIL go; another thread blocks on this lock without holding the GIL
        keep = []
        for mm, on_unmap in _held:
            try:
                mm.close()
            except BufferError:  # still viewed
                keep.append((mm, on_unmap))
                continue
            done.append(on_unmap)
        _held[:] = keep
        left = len(keep)
    for on_unmap in done:
        if on_unmap is not None:
            on_unmap()
    return left
