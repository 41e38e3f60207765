"""The coordinator's side of the scale simulation's hand-overs: a real TCP store served in this process."""

from __future__ import annotations

import json
import time


class _Locked:
    """One store client shared by the channel's calls and its heartbeat thread (a client is not thread-safe;
    the engine gives each its own connection to the job's store, which a store served here cannot)."""

    def __init__(self, store):
        import threading

        self.store, self.lock = store, threading.Lock()

    def __getattr__(self, method: str):
        fn = getattr(self.store, method)

        def call(*args):
            with self.lock:
                return fn(*args)

        return call


class _Deadline:
    """A StoreClient called as the channel calls a store given to it (no deadline argument): 5 s a call."""

    def __init__(self, client):
        self.client = client

    def __getattr__(self, method: str):
        fn = getattr(self.client, method)
        return lambda *args: fn(*args, 5.0)


def store_handover(world: int, handovers: dict) -> float:
    """Seconds the coordinator's channel takes to read ``world`` hand-overs from a real TCP store (this
    process serves it; the ranks' ``done`` keys are set first, as the ranks would)."""
    import socket

    import paddle.base.core as core
    from paddle.distributed.fsdp.checkpoint.save import channel
    from paddle.distributed.fsdp.checkpoint.save.store_client import StoreClient

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    master = core.TCPStore("127.0.0.1", port, True, 1, 60)  # the server (and a client of paddle's, unused)
    writer = StoreClient("127.0.0.1", port, 2.0)  # the engine's own client, as every rank's channel uses
    ns = "fsdp-ckpt/sim/"
    for r, h in handovers.items():
        writer.set(f"{ns}done/{r}", json.dumps(h).encode(), 5.0)
        writer.add(f"{ns}fdone/{r}", 1, 5.0)
        writer.add(f"{ns}ndone", 1, 5.0)
    client = _Deadline(StoreClient("127.0.0.1", port, 2.0))
    ch = channel.SaveChannel("sim", 0, world, 0, 60.0, store=_Locked(client))
    try:
        t0 = time.perf_counter()
        got = None
        while got is None:
            assert not ch.failures()
            got = ch.all_done()
        return time.perf_counter() - t0
    finally:
        ch.close()
        del master
