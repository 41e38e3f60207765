"""The checkpoint engine's helper thread pools: one per (purpose, size), made at first use, kept for the process.

Why one registry: checksums, decodes, readahead fetches, quantization and the derived weights' check each want a
pool that outlives a call (threads start once, not every save or load). In one place, every one of them is
forgotten in a forked child, which inherits the pool objects but not their threads (work queued there would wait
forever), and process_state.py lists them once.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

_pools: dict[tuple[str, int], ThreadPoolExecutor] = {}
_lock = threading.Lock()


def shared_pool(purpose: str, threads: int) -> ThreadPoolExecutor:
    """The process's pool of ``threads`` threads (>= 1) for ``purpose`` (its threads' name prefix)."""
    with _lock:
        pool = _pools.get((purpose, threads))
        if pool is None:
            pool = _pools[purpose, threads] = ThreadPoolExecutor(threads, thread_name_prefix=f"ckpt-{purpose}")
        return pool


def _forget_pools_in_child() -> None:
    global _lock
    _pools.clear()
    _lock = threading.Lock()  # (held by another thread of the parent at the fork, it would stay held here)


os.register_at_fork(after_in_child=_forget_pools_in_child)
