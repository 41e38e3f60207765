"""Tests' reset of the checkpoint engine's process-wide state (checkpoint/process_state.py lists it).

Why here and not in the package: a training process has no reason to forget its save in flight or its remembered
write assignments; only tests that must not depend on their order do. It reaches into the modules' private
state on purpose, under the same locks the engine takes.
"""

from __future__ import annotations

import paddle.distributed.fsdp.checkpoint.background as background
import paddle.distributed.fsdp.checkpoint.checksums as checksums
import paddle.distributed.fsdp.checkpoint.root_runs as root_runs
import paddle.distributed.fsdp.checkpoint.selection as selection
import paddle.distributed.fsdp.checkpoint.snapshot_guard as snapshot_guard
from paddle.distributed.fsdp.checkpoint.save import channel, commit, save


def reset_process_state() -> None:
    """Wait for a save in flight (its error is dropped), then put every resettable process-wide state back to its
    state at import; RuntimeError while a snapshot copy still runs."""
    background.wait_pending(False)
    with background._pending_lock:
        background._pending = None
    with save._save_lock:
        save._assignments.clear()
    channel.reset_clients()
    checksums._warned_fallback = False
    root_runs.forget()
    selection._NAMED_LEFT.clear()
    commit._stock_warned.clear()
    if snapshot_guard.copies_in_flight():
        raise RuntimeError("reset_process_state: a snapshot copy is still running")
