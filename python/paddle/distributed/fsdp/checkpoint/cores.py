"""This process's share of the node's cores: what the checkpoint's helper threads (encode, quantize, the derived
weights' check) size themselves by when not told.

Why a share and not ``os.cpu_count()``: a GPU node runs one training process per device (8 on a 64-core host),
each with its own pools; sized by the whole node, eight pools of 63 threads would contend for 64 cores, and
``codec="auto"``, which multiplies one thread's encode rate by the thread count (codec_choice.py), would credit
each rank with the whole node's encoder and compress where the storage is faster than the rank's real share.
The share is the cores this process may run on (its CPU affinity, which container limits and ``taskset`` set)
divided by the ranks the launcher started on this node (``PADDLE_LOCAL_SIZE``).
"""

from __future__ import annotations

import os


def ranks_on_this_node() -> int:
    """The launcher's ``PADDLE_LOCAL_SIZE`` (paddle.distributed.launch sets it for every rank); 1 without it or
    when it is not a positive integer."""
    try:
        size = int(os.environ.get("PADDLE_LOCAL_SIZE", "").strip() or 0)
    except ValueError:
        return 1
    return size if size > 0 else 1


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity where the platform has one, else every core."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def core_share() -> int:
    """This rank's share of the node's cores (at least 1)."""
    return max(1, usable_cores() // ranks_on_this_node())


def helper_threads() -> int:
    """Helper threads when not chosen: the share but one core, left for the training process's own thread (at
    least 1)."""
    return max(1, core_share() - 1)
