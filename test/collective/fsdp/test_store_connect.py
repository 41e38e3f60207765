"""A save's connection to the job's TCP store is bounded in time (save/channel.py, save/store_client.py).

Why: the store's process can die or freeze between two saves (a kill -9 or a SIGSTOP of rank 0, which hosts the
store: the kernel still completes handshakes on its listening socket). paddle's own client retried a dead
address for its whole 60 s timeout, and a survivor stuck there missed its named SaveFailedError before the
launcher's teardown (CI, test_crash_safety after_data-rank0, 2026-12-06). The engine's client connects within
``CONNECT_DEADLINE`` or raises a named StoreError, which the channel treats as a lost store.
"""

from __future__ import annotations

import socket
import time

import paddle.base.core as core
import pytest
from paddle.distributed.fsdp.checkpoint.save import channel
from paddle.distributed.fsdp.checkpoint.save.store_client import StoreError


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


def test_a_store_that_is_gone_is_a_named_error_at_once(endpoint):
    t0 = time.monotonic()
    with pytest.raises(StoreError, match=r"TCP store at 127\.0\.0\.1:\d+ \(served by rank 0\) cannot be reached"):
        channel._client("main")
    assert time.monotonic() - t0 < channel.CONNECT_DEADLINE + 1
    assert "main" not in channel._clients


def test_a_full_listen_backlog_is_a_named_timeout(endpoint):
    """A listening socket nobody accepts from (a frozen store host) stops completing handshakes once its
    backlog is full: the connect gives up after CONNECT_DEADLINE."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", endpoint))
        srv.listen(0)
        held = []
        try:
            for _ in range(8):  # fill the backlog (the kernel allows a few more than asked)
                c = socket.socket()
                c.setblocking(False)
                c.connect_ex(("127.0.0.1", endpoint))
                held.append(c)
            t0 = time.monotonic()
            with pytest.raises(StoreError, match="accepted no connection within|did not answer"):
                channel._client("main").add("k", 0, 1.0)
            assert time.monotonic() - t0 < channel.CONNECT_DEADLINE + 2
        finally:
            for c in held:
                c.close()


def test_a_live_store_connects_and_answers(endpoint):
    master = core.TCPStore("127.0.0.1", endpoint, True, 1, 60)
    master.set("probe", b"here")
    master.add("fence", 1)  # paddle's set is not acknowledged: an add after it orders the two
    client = channel._client("main")
    assert client.add("fence", 0, 2.0) == 1
    assert client.get("probe", 2.0) == b"here"
    client.set("back", b"\x00\xffbytes", 2.0)  # acknowledged: paddle's client sees it at once
    assert bytes(master.get("back")) == b"\x00\xffbytes"
    assert client.add("n", 5, 2.0) == 5 and client.add("n", 2, 2.0) == 7 and master.add("n", 0) == 7
    assert channel._client("main") is client  # one client per role, kept
