"""A save's connection to the job's TCP store is bounded in time (save/channel.py ``_connect``).

Why: the reachability probe can succeed while the store's process dies (a kill -9 of the coordinator, which hosts
the store: the kernel still completes handshakes on its listening socket), and paddle's client then retries the
dead address for its whole 60 s timeout. A survivor stuck there missed its named SaveFailedError before the
launcher's teardown (CI, test_crash_safety after_data-rank0, 2026-12-06). Here the probe is made to lie about a
port nobody listens on: the connect must give up with a named ConnectionRefusedError, which the channel treats
as a lost store; paddle's own loop would raise its own error only after 60 s.
"""

from __future__ import annotations

import socket

import paddle.base.core as core
import pytest
from paddle.distributed.fsdp.checkpoint.save import channel


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def endpoint(monkeypatch):
    port = _free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    channel.reset_clients()
    yield port
    channel.reset_clients()


def test_a_store_that_died_after_the_probe_is_a_named_refusal(endpoint, monkeypatch):
    monkeypatch.setattr(channel, "_reachable", lambda host, port: True)  # the probe raced the store's death
    with pytest.raises(ConnectionRefusedError, match="accepted no client within"):
        channel._client("main")
    assert "main" not in channel._clients


def test_a_live_store_connects_and_answers(endpoint):
    master = core.TCPStore("127.0.0.1", endpoint, True, 1, 60)
    master.set("probe", b"here")
    client = channel._client("main")
    assert bytes(client.get("probe")) == b"here"
    assert channel._client("main") is client  # one client per role, kept
