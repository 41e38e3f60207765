"""Every piece of process-wide state of the checkpoint engine, listed in one place.

Why: module singletons make tests depend on their order; listing them shows what a process carries from one save
or load to the next (test_checkpoint_layers.py checks the list against the code; the tests' own reset,
test/collective/fsdp/process_reset.py, puts every resettable one back to its state at import). The table "What the fork patches in paddle, and what a process keeps" in docs/internals.md lists them.
"""

from __future__ import annotations

# (module, attribute, what it holds, how it is reset)
PROCESS_STATE = (
    ("background", "_pending", "this process's save in flight (the next save or load waits for it)", "waited for"),
    (
        "background",
        "_worker",
        "the one background save thread (started at the first async save)",
        "kept; a forked child's (and its _pending): dropped",
    ),
    ("save.save", "_assignments", "write assignments remembered between saves of the same records", "cleared"),
    ("save.channel", "_clients", "TCP store clients (save thread, heartbeat thread)", "dropped"),
    ("host_memory", "arena", "the resident snapshot buffer of async saves", "release_host_buffers()"),
    (
        "snapshot",
        "snapshot_staging",
        "pinned host staging of async device snapshots (reused)",
        "release_host_buffers()",
    ),
    ("snapshot", "sync_pool", "pinned host staging of sync saves' device batches (a small pool)", "kept"),
    ("snapshot_guard", "_inflight / _installed", "snapshots being copied; the in-place write guard", "checked"),
    (
        "thread_pools",
        "_pools",
        "helper thread pools (checksum, decode, fetch, quantize, derived check), one per purpose and size",
        "kept; a forked child's: dropped",
    ),
    (
        "root_runs",
        "_runs",
        "the run this process's saves continue in each root it saved to or resumed from",
        "forget()",
    ),
    ("selection", "_NAMED_LEFT", "leftovers a rotation named already (each once a process)", "cleared"),
    ("gc_pause", "_depth", "pauses of Python's cyclic GC in progress", "must be 0"),
    ("checksums", "_warned_fallback", "the crc32 fallback warning was logged", "cleared"),
    ("save.commit", "_stock_warned", "the 0.metadata-at-scale warning was logged", "cleared"),
    ("io.backends", "_schemes", "registered storage backends by URL scheme", "kept"),
    ("io.backends", "_layers", "storage layers added by the application (add_storage_layer)", "kept"),
    ("s3.storage", "_default", "the shared S3Storage of s3:// locations (its clients; made at first use)", "kept"),
)
