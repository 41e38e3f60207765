"""A client of paddle's TCP store whose every call has a deadline and whose every reply is checked.

Why not paddle's own client (``core.TCPStore``): once connected, its ``add``/``get``/``set`` block in ``recv``
without a timeout, so a store host that freezes (SIGSTOP, a paused container, a stalled node) holds a save
forever, and the heartbeat lease is never looked at (issue #50). Nor does it check what it reads: an endpoint
answering random bytes made ``is_committed()`` true at once. This client speaks the same wire protocol to the
same server (paddle 3.3.1, libuv or classic daemon), on a plain socket:

    request   int32 command (ADD 0, GET 1, SET 3), uint64 key length, key ("/" + key, as paddle's client)
              ADD: int64 delta             -> reply int64 new value
              SET: uint64 length, bytes    -> no reply
              GET:                         -> reply uint64 length, bytes (the key must exist: the channel only
                                              reads keys whose flag it saw)

and pipelines with every request an ``ADD`` to a counter of its own (a fresh random key and a random step per
connection): its reply must be exactly the number of calls so far times the step. Every call thus gets a reply (a ``set`` too, so a set is
acknowledged), and a reply read out of step, from something that is not the store, or garbage, fails that
check with ``StoreReplyError`` instead of passing as a value (random bytes match with probability 2**-64).
Every call ends within ``deadline`` seconds (``StoreTimeoutError``); after any failure the connection is closed
and never used again, since its stream may hold the rest of an unread reply.
"""

from __future__ import annotations

import os
import socket
import struct
import time

ADD, GET, SET = 0, 1, 3
KEY_PREFIX = "/"  # what paddle's client puts before every key: both clients see the same keys
MAX_VALUE = 64 << 20  # a longer GET reply is not the store's (the channel's values are a few hundred bytes)
_I32, _U64, _I64 = struct.Struct("<i"), struct.Struct("<Q"), struct.Struct("<q")


class StoreError(OSError):
    """The TCP store could not serve a call (base of the two below; an OSError like a reset connection)."""


class StoreTimeoutError(StoreError):
    """The TCP store did not answer a call within its deadline (its host frozen, stalled or lost)."""


class StoreReplyError(StoreError):
    """The endpoint's reply is not a valid answer of paddle's TCP store (another service, or garbage)."""


def _key(key: str) -> bytes:
    raw = (KEY_PREFIX + key).encode()
    return _U64.pack(len(raw)) + raw


class StoreClient:
    """One connection to the store at ``host:port``; not thread-safe (one per thread role)."""

    def __init__(self, host: str, port: int, connect_deadline: float, served_by: str = ""):
        self.where = f"{host}:{port}" + (f" (served by {served_by})" if served_by else "")
        try:
            self.sock = socket.create_connection((host, port), timeout=connect_deadline)
        except socket.timeout:
            raise StoreTimeoutError(
                f"the TCP store at {self.where} accepted no connection within {connect_deadline:g} s"
            ) from None
        except OSError as e:
            raise StoreError(e.errno, f"the TCP store at {self.where} cannot be reached: {e.strerror or e}") from None
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # one small request, one reply
        self.canary = _key(f"fsdp-ckpt-client/{os.urandom(12).hex()}")
        self.step = (1 << 32) + int.from_bytes(os.urandom(4), "little")  # an endpoint repeating a value fails
        self.calls = 0
        self.broken: BaseException | None = None

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    # ------------------------------------------------------------------------------------------- calls
    def add(self, key: str, delta: int, deadline: float) -> int:
        return self._call(_I32.pack(ADD) + _key(key) + _I64.pack(delta), deadline, self._read_i64)[0]

    def set(self, key: str, value: bytes, deadline: float) -> None:
        self._call(_I32.pack(SET) + _key(key) + _U64.pack(len(value)) + bytes(value), deadline, None)

    def get(self, key: str, deadline: float) -> bytes:
        return self._call(_I32.pack(GET) + _key(key), deadline, self._read_value)

    # ------------------------------------------------------------------------------------------- wire
    def _call(self, request: bytes, deadline: float, read_reply):
        if self.broken is not None:
            raise StoreError(f"the connection to the TCP store at {self.where} failed before: {self.broken}")
        end = time.monotonic() + deadline
        try:
            self.sock.settimeout(deadline)
            self.sock.sendall(request + _I32.pack(ADD) + self.canary + _I64.pack(self.step))
            reply = read_reply(end) if read_reply is not None else None
            self.calls += 1
            (seq,) = self._read_i64(end)
            if seq != self.calls * self.step:
                raise StoreReplyError(
                    f"the endpoint at {self.where} does not answer as paddle's TCP store does (the check of call "
                    f"{self.calls} read back {seq}, not {self.calls * self.step}): another service on that port, "
                    f"or a damaged stream?"
                )
            return reply
        except BaseException as e:
            self.broken = e
            self.close()
            if isinstance(e, socket.timeout):
                raise StoreTimeoutError(
                    f"the TCP store at {self.where} did not answer within {deadline:g} s (its host frozen or lost?)"
                ) from None
            raise

    def _recv(self, n: int, end: float) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            left = end - time.monotonic()
            if left <= 0:
                raise socket.timeout()
            self.sock.settimeout(left)
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise StoreError(f"the TCP store at {self.where} closed the connection")
            buf += chunk
        return bytes(buf)

    def _read_i64(self, end: float) -> tuple[int]:
        return _I64.unpack(self._recv(8, end))

    def _read_value(self, end: float) -> bytes:
        (n,) = _U64.unpack(self._recv(8, end))
        if n > MAX_VALUE:
            raise StoreReplyError(
                f"the endpoint at {self.where} announced a value of {n} bytes, not an answer of paddle's TCP store"
            )
        return self._recv(n, end)
