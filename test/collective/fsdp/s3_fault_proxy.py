"""A fault-injecting HTTP proxy in front of the real S3 server, for the S3 fault tests.

Why: SeaweedFS cannot fail on demand. This proxy (threads, 127.0.0.1, a free port) forwards each HTTP/1.1 request
to the server unchanged, except those that match a rule, which get: an S3 error reply (500 InternalError, 503
SlowDown), a connection reset (RST), a stall after part of the request body (the server stops reading an upload),
or a stall after part of the reply (a download stops mid-body). Clients do not pipeline, so a connection's reply
bytes belong to its last request and need no parsing. Every request is logged for the tests' assertions.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

ERROR_BODIES = {
    500: ("InternalError", "We encountered an internal error. Please try again."),
    503: ("SlowDown", "Please reduce your request rate."),
}
ACTIONS = ("500", "503", "reset", "stall_request", "stall_reply")


@dataclass
class Rule:
    """Apply ``action`` to up to ``times`` requests (None: all) for which ``match(method, target)`` is true."""

    match: Callable[[str, str], bool]
    action: str
    times: int | None = None
    after_bytes: int = 64 << 10  # for stalls: body bytes let through first
    hits: int = 0

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"unknown action {self.action!r}; one of {ACTIONS}")


@dataclass
class Seen:
    method: str
    target: str
    action: str  # "forward" or the injected action


@dataclass
class FaultProxy:
    upstream: tuple[str, int]
    rules: list[Rule] = field(default_factory=list)
    log: list[Seen] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept_loop, daemon=True, name="fault-proxy")
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._listener.getsockname()[1]}"

    def add(self, rule: Rule) -> Rule:
        with self._lock:
            self.rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._lock:
            self.rules.clear()
            self.log.clear()

    def seen(self, method: str, contains: str = "") -> list[Seen]:
        with self._lock:
            return [s for s in self.log if s.method == method and contains in s.target]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._listener.close()
        with self._lock:
            for c in self._conns:
                with contextlib.suppress(OSError):
                    c.close()

    # -- internals ---------------------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), daemon=True, name="fault-proxy-conn").start()

    def _pick(self, method: str, target: str) -> Rule | None:
        with self._lock:
            for rule in self.rules:
                if (rule.times is None or rule.hits < rule.times) and rule.match(method, target):
                    rule.hits += 1
                    self.log.append(Seen(method, target, rule.action))
                    return rule
            self.log.append(Seen(method, target, "forward"))
        return None

    def _serve(self, client: socket.socket) -> None:
        upstream = socket.create_connection(self.upstream, timeout=60)
        with self._lock:
            self._conns.append(upstream)
        stall_reply = _Cutoff()
        pump = threading.Thread(target=self._pump_replies, args=(upstream, client, stall_reply), daemon=True)
        pump.start()
        reader = client.makefile("rb")
        try:
            while not self._stop.is_set():
                head = _read_head(reader)
                if head is None:
                    return
                method, target, raw_head, length, expect = head
                rule = self._pick(method, target)
                if rule is None or rule.action == "stall_reply":
                    if rule is not None:
                        stall_reply.arm(rule.after_bytes)
                    upstream.sendall(raw_head)
                    _copy_body(reader, length, upstream.sendall)
                elif rule.action == "stall_request":
                    if expect:
                        client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                    _copy_body(reader, min(length, rule.after_bytes), lambda b: None)
                    self._stop.wait()  # stop reading: the client's send blocks until it gives up
                    return
                elif rule.action == "reset":
                    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    return
                elif expect:  # the client waits for 100 Continue: answer now, it will not send the body
                    client.sendall(_error_reply(int(rule.action), target, close=True))
                    return
                else:
                    _copy_body(reader, length, lambda b: None)
                    client.sendall(_error_reply(int(rule.action), target))
        except OSError:
            return
        finally:
            for s in (client, upstream):
                with contextlib.suppress(OSError):
                    s.close()

    def _pump_replies(self, upstream: socket.socket, client: socket.socket, cutoff: _Cutoff) -> None:
        with contextlib.suppress(OSError):
            while not self._stop.is_set():
                data = upstream.recv(1 << 16)
                if not data:
                    client.shutdown(socket.SHUT_WR)
                    return
                data, stalled = cutoff.take(data)
                client.sendall(data)
                if stalled:
                    self._stop.wait()  # the reply stops mid-body; the connection stays open
                    return


class _Cutoff:
    """Lets ``n`` reply bytes through after being armed, then reports a stall."""

    def __init__(self) -> None:
        self.left: int | None = None

    def arm(self, n: int) -> None:
        self.left = n

    def take(self, data: bytes) -> tuple[bytes, bool]:
        if self.left is None:
            return data, False
        if len(data) < self.left:
            self.left -= len(data)
            return data, False
        return data[: self.left], True


def _read_head(reader) -> tuple[str, str, bytes, int, bool] | None:
    """One request's line + headers: (method, target, raw bytes, Content-Length, Expect: 100-continue).
    None at end of stream."""
    lines = []
    while True:
        line = reader.readline(65536)
        if not line:
            return None
        lines.append(line)
        if line in (b"\r\n", b"\n"):
            break
    method, target, _ = lines[0].decode("latin-1").split(" ", 2)
    length, expect = 0, False
    for line in lines[1:]:
        name, _, value = line.decode("latin-1").partition(":")
        expect |= name.strip().lower() == "expect" and "100-continue" in value.lower()
        if name.strip().lower() == "content-length":
            length = int(value.strip())
        if name.strip().lower() == "transfer-encoding" and "chunked" in value.lower():
            raise OSError("fault proxy: chunked request bodies are not supported")
    return method, target, b"".join(lines), length, expect


def _copy_body(reader, length: int, sink: Callable[[bytes], object]) -> None:
    while length > 0:
        chunk = reader.read(min(length, 1 << 16))
        if not chunk:
            raise OSError("client closed mid-body")
        sink(chunk)
        length -= len(chunk)


def _error_reply(status: int, target: str, close: bool = False) -> bytes:
    code, message = ERROR_BODIES[status]
    body = (
        f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>{message}</Message>'
        f"<Resource>{target}</Resource><RequestId>fault-proxy</RequestId></Error>"
    ).encode()
    reason = {500: "Internal Server Error", 503: "Service Unavailable"}[status]
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/xml\r\nContent-Length: {len(body)}\r\n"
        f"Connection: {'close' if close else 'keep-alive'}\r\n\r\n"
    )
    return head.encode() + body
