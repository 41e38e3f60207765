"""Peer copies over a direct TCP connection between partner ranks (a save's exchange, a restore's transfers).

Why not the process group: gloo's send/recv in paddle 3.3.1 is blocking (its isend/irecv time out), has no
deadline (a dead partner leaves it waiting), and needs both sides' memory as tensors. The sender sends the slot
from its mapping (a save: its own slot; a restore: the copy it holds), and the receiver reads straight into the
destination: the peer slot's mapping on a save, the model's tensors on a restore (one pass,
hashed on the way: readback.fill_tensors), so a restore from a peer copy allocates no slot.

Addresses: every rank listens on its node's address (the host of ``PADDLE_CURRENT_ENDPOINT``, else 127.0.0.1)
on a free port; the tier exchanges the addresses once over the training group (manager.py).

Who is admitted: only the job's ranks. Every connection is challenged: the receiver sends a fresh nonce, the
sender answers with its hello (magic, sender rank, tag, byte count, its own nonce) and an HMAC-SHA256 of the
hello and both nonces under the job's key (32 random bytes rank 0 draws per start and hands to every rank over
the training group: manager.peer_link). The receiver takes the payload only after that MAC checks out, and
acknowledges it with its own MAC, so a sender also knows its copy reached a rank of the job. A connection that
fails any of this (a stranger, a garbled or replayed hello, a left-over of an abandoned exchange: another tag)
is dropped with a warning; hellos are read from every pending connection at once (a selector), so a stranger
that connects and stays silent, or trickles, never delays the partner's connection. The payload itself is not
MAC'd: it travels on the authenticated connection, and its header is then checked field by field
(header.py) and its data chunk by chunk (the header's digests). An attacker on the network path between two
nodes is out of scope (gloo's own traffic is neither authenticated nor encrypted either).

Deadlines: every read and write is bound by a total deadline, not a per-call timeout: the hello within
``timeout_s`` of the accept, the payload (and the acknowledgement) within ``timeout_s + size / MIN_RATE``
of the hello. A partner killed mid-transfer has its socket closed by its kernel: a named PeerTransferError at
once on the other side; one that vanished without a close (a lost node), or a trickling peer:
PeerTransferError when the deadline passes. Never a hang.

Framing: challenge (receiver), hello + MAC (sender), the bytes, the acknowledgement MAC (receiver) once every
byte arrived (so a sender's success means the copy landed). The tag (a save's step, a restore's round) lets a
receiver drop a connection left over from an exchange that was abandoned.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import selectors
import socket
import struct
import time

import numpy as np

from .errors import InvalidMemoryCopyError, PeerAuthError, PeerTransferError

logger = logging.getLogger(__name__)

MAGIC = b"FSDPMTX2"  # 2: challenge-response with the job's key
CHALLENGE = struct.Struct("<8s16s")  # magic, receiver's nonce
HELLO = struct.Struct("<8sqqq16s")  # magic, sender rank, tag, byte count, sender's nonce
MAC_BYTES = 32
SEND_PIECE = 64 << 20  # one sendall per piece, each bound by what is left of the deadline
MIN_RATE = 16 << 20  # bytes/s a copy must at least move at on average (the deadline: timeout_s + size / MIN_RATE)
MAX_PENDING = 64  # connections whose hello is awaited at once; the oldest is dropped beyond


def node_host() -> str:
    """This node's address for partner connections: the launcher's endpoint host, else the loopback."""
    endpoint = os.environ.get("PADDLE_CURRENT_ENDPOINT", "")
    host = endpoint.rpartition(":")[0] if ":" in endpoint else ""
    return host or "127.0.0.1"


def _mac(key: bytes, label: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, label + b"".join(parts), hashlib.sha256).digest()


def _left(deadline: float) -> float:
    return deadline - time.monotonic()


class PeerLink:
    """This rank's listening socket, every rank's address (``addrs``) and the job's key (``key``), both set by the
    tier after an exchange over the training group."""

    def __init__(self, rank: int, timeout_s: float, key: bytes):
        if not isinstance(key, bytes) or len(key) < 16:
            raise PeerTransferError("the peer link needs a key of at least 16 bytes")
        self.rank, self.timeout_s, self.key = rank, timeout_s, key
        host = node_host()
        self._server = socket.create_server((host, 0), backlog=MAX_PENDING)
        self._server.setblocking(False)  # accepted only when the selector says so (a reset connection: no wait)
        self.address = (host, self._server.getsockname()[1])
        self.addrs: list[tuple[str, int]] = []

    def close(self) -> None:
        self._server.close()

    def deadline_for(self, size: int) -> float:
        return time.monotonic() + self.timeout_s + size / MIN_RATE

    def send_buffer(self, dst: int, buf, tag: int) -> int:
        """Send ``buf`` (a slot's mapping) whole to rank ``dst`` (which calls ``accept(self.rank, tag)``); returns
        its size once ``dst`` acknowledged every byte with the job's key. PeerTransferError on any failure or past
        the deadline. From the mapping rather than ``socket.sendfile`` of the file: 20-30% faster here for a
        tmpfs file (docs/reports/memtier-bench-2026-12-03-session3.md)."""
        mv = memoryview(buf).cast("B")
        size = len(mv)
        what = f"rank {self.rank}: sending its copy to rank {dst}"
        try:
            with socket.create_connection(self.addrs[dst], timeout=self.timeout_s) as s:
                s.settimeout(self.timeout_s)
                magic, their_nonce = CHALLENGE.unpack(_recv_exact(s, CHALLENGE.size, time.monotonic() + self.timeout_s))
                if magic != MAGIC:
                    raise PeerAuthError(f"{what}: the process at {self.addrs[dst]} is not a memory-tier peer link")
                nonce = secrets.token_bytes(16)
                hello = HELLO.pack(MAGIC, self.rank, tag, size, nonce)
                s.sendall(hello + _mac(self.key, b"hello", their_nonce, hello, dst.to_bytes(8, "little")))
                deadline = self.deadline_for(size)
                for i in range(0, size, SEND_PIECE):
                    s.settimeout(max(_left(deadline), 1e-3))
                    s.sendall(mv[i : i + SEND_PIECE])
                ack = _recv_exact(s, MAC_BYTES, deadline)
                if not hmac.compare_digest(ack, _mac(self.key, b"ack", their_nonce, nonce)):
                    raise PeerAuthError(f"{what}: the acknowledgement does not carry the job's key (not rank {dst})")
                return size
        except _Closed as e:
            raise PeerTransferError(f"{what}: rank {dst} closed the connection ({e})") from None
        except TimeoutError:
            raise PeerTransferError(f"{what}: not done within the deadline ({self.timeout_s:g} s + "
                                    f"{size / MIN_RATE:.1f} s for {size} bytes)") from None  # fmt: skip
        except OSError as e:
            raise PeerTransferError(f"{what} failed (rank {dst} died?): {e}") from None

    def accept(self, src: int, tag: int) -> Incoming:
        """The authenticated connection of rank ``src`` sending with ``tag``; every other connection is dropped
        (see the module docstring). PeerTransferError when it does not arrive within ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        pending: dict[socket.socket, _Pending] = {}
        sel = selectors.DefaultSelector()
        sel.register(self._server, selectors.EVENT_READ)
        try:
            while True:
                left = _left(deadline)
                if left <= 0:
                    raise PeerTransferError(f"rank {self.rank}: rank {src} did not connect within {self.timeout_s:g} s")
                for key, _ev in sel.select(left):
                    if key.fileobj is self._server:
                        self._admit(sel, pending)
                        continue
                    conn = key.fileobj
                    if conn not in pending:  # dropped by a flood earlier in this round of events
                        continue
                    done = pending[conn].feed(conn)
                    if done is None:
                        continue
                    sel.unregister(conn)
                    p = pending.pop(conn)
                    if done is not True:
                        logger.warning("memory tier: rank %d drops a connection from %s: %s", self.rank, p.peer, done)
                        conn.close()
                        continue
                    _m, who, got_tag, size, nonce = HELLO.unpack(p.buf[: HELLO.size])
                    if who != src or got_tag != tag:
                        logger.warning("memory tier: rank %d drops a connection of rank %d with tag %d (expected "
                                       "rank %d, tag %d)", self.rank, who, got_tag, src, tag)  # fmt: skip
                        conn.close()
                        continue
                    conn.settimeout(self.timeout_s)
                    ack = _mac(self.key, b"ack", p.nonce, nonce)
                    return Incoming(conn, src, self.rank, size, self.deadline_for(size), ack)
        finally:
            sel.close()
            for conn in pending:
                conn.close()

    def _admit(self, sel, pending: dict) -> None:
        try:
            conn, addr = self._server.accept()
        except (BlockingIOError, InterruptedError, ConnectionError):
            return
        conn.setblocking(False)
        p = _Pending(self, addr)
        try:
            conn.send(CHALLENGE.pack(MAGIC, p.nonce))  # 24 bytes into an empty socket buffer: never blocks
        except OSError:
            conn.close()
            return
        if len(pending) >= MAX_PENDING:  # a flood: the oldest pending connection goes
            oldest = next(iter(pending))
            sel.unregister(oldest)
            oldest.close()
            del pending[oldest]
        pending[conn] = p
        sel.register(conn, selectors.EVENT_READ)


class _Closed(Exception):
    pass


def _recv_exact(s: socket.socket, n: int, deadline: float) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        left = _left(deadline)
        if left <= 0:
            raise TimeoutError
        s.settimeout(left)
        got = s.recv(n - len(buf))
        if not got:
            raise _Closed(f"after {len(buf)} of {n} bytes")
        buf += got
    return bytes(buf)


class _Pending:
    """A connection whose hello (and MAC) is being read, without blocking the accept loop."""

    def __init__(self, link: PeerLink, peer):
        self.link, self.peer = link, peer
        self.nonce = secrets.token_bytes(16)
        self.buf = b""

    def feed(self, conn: socket.socket):
        """None: more bytes needed; True: an authenticated hello; a str: why the connection is dropped."""
        want = HELLO.size + MAC_BYTES - len(self.buf)
        try:
            got = conn.recv(want)
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as e:
            return f"connection failed: {e}"
        if not got:
            return "closed before its hello"
        self.buf += got
        if len(self.buf) < HELLO.size + MAC_BYTES:
            return None
        hello, mac = self.buf[: HELLO.size], self.buf[HELLO.size :]
        if hello[:8] != MAGIC:
            return "not a memory-tier peer"
        want_mac = _mac(self.link.key, b"hello", self.nonce, hello, self.link.rank.to_bytes(8, "little"))
        if not hmac.compare_digest(mac, want_mac):
            return "its hello does not carry the job's key (a stranger or another job)"
        return True


class Incoming:
    """One arriving, authenticated copy: ``read_into`` / ``skip`` consume it in order, ``finish`` drains and
    acknowledges it. Every read is bound by the transfer's deadline."""

    def __init__(self, conn: socket.socket, src: int, rank: int, size: int, deadline: float, ack: bytes):
        self.conn, self.src, self.rank = conn, src, rank
        self.size, self.pos = size, 0  # the payload's size, bytes of the payload consumed
        self.deadline, self._ack = deadline, ack
        self._timeout = max(min(conn.gettimeout() or 1e9, _left(deadline)), 1e-3)
        conn.settimeout(self._timeout)  # a recv never outlasts the deadline (lowered as it nears)

    def _fail(self, msg: str) -> PeerTransferError:
        self.close()
        return PeerTransferError(f"rank {self.rank}: receiving from rank {self.src}: {msg}")

    def read_into(self, buf) -> None:
        """Fill ``buf`` (a writable buffer) with the next bytes."""
        mv = memoryview(buf).cast("B")
        n, got = len(mv), 0
        if self.pos + n > self.size:
            raise self._fail(f"{n} more bytes wanted at {self.pos}, the copy has {self.size}")
        while got < n:
            left = _left(self.deadline)
            try:
                if left <= 0:
                    raise TimeoutError
                if left < self._timeout:  # only near the deadline: settimeout costs two fcntl calls
                    self._timeout = left
                    self.conn.settimeout(left)
                k = self.conn.recv_into(mv[got:], n - got)
            except TimeoutError:
                raise self._fail(f"not complete within the deadline ({self.pos + got} of {self.size} bytes)") from None
            except OSError as e:
                raise self._fail(
                    f"connection failed after {self.pos + got} bytes (rank {self.src} died?): {e}"
                ) from None
            if k == 0:
                raise self._fail(f"rank {self.src} closed the connection after {self.pos + got} of {self.size} "
                                 "bytes (killed?)")  # fmt: skip
            got += k
        self.pos += n

    def read_exact(self, n: int) -> bytes:
        buf = bytearray(n)
        self.read_into(buf)
        return bytes(buf)

    def skip(self, n: int) -> None:
        scratch = np.empty(min(n, 1 << 20), np.uint8)
        while n > 0:
            k = min(n, len(scratch))
            self.read_into(scratch[:k])
            n -= k

    def finish(self) -> None:
        """Consume what is left, acknowledge, close (the sender's call returns)."""
        self.skip(self.size - self.pos)
        try:
            self.conn.settimeout(max(_left(self.deadline), 1e-3))
            self.conn.sendall(self._ack)
        except OSError as e:
            raise self._fail(f"cannot acknowledge: {e}") from None
        self.close()

    def close(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass


def receive_into_slot(link: PeerLink, slot, src: int, tag: int, expect: dict | None = None) -> None:
    """A save's exchange, receiving side: the copy of rank ``src`` into ``slot`` (the peer slot, same size). The
    slot is marked "writing" once the partner's copy starts to arrive, and its prefix (with the "valid" flag) is
    written last, only after the header checked out (header.py, and ``expect``: job, world, rank, durable root),
    so a transfer cut short or a copy that is not what it claims leaves the slot marked "writing", and a partner
    that died before sending (e.g. killed while copying its own state) leaves the previous copy it sent valid.
    A partner's copy marked "writing" (its own save failed) is taken as it is: never used."""
    from .copies import check_header
    from .slot import _PREFIX, HEADER_OFF, VALID, parse_header

    incoming = link.accept(src, tag)
    if incoming.size != slot.size:
        incoming.close()
        raise PeerTransferError(f"rank {link.rank}: rank {src} sends {incoming.size} bytes, its slot has {slot.size}")
    slot.mark_writing()  # only now: a partner that died before sending leaves the previous copy valid
    prefix = np.empty(HEADER_OFF, np.uint8)
    incoming.read_into(prefix)
    incoming.read_into(slot.buf[HEADER_OFF:])
    incoming.finish()
    if _PREFIX.unpack_from(prefix, 0)[1] == VALID:
        where = f"peer copy of rank {src} received by rank {link.rank}"
        hlen = min(int(_PREFIX.unpack_from(prefix, 0)[2]), slot.size - HEADER_OFF)
        header, _doff, _dlen = parse_header(np.concatenate([prefix, slot.buf[HEADER_OFF : HEADER_OFF + hlen]]),
                                            slot.size, where)  # fmt: skip
        if expect is not None:
            check_header(header, dict(expect, rank=src), None, where)
    slot.buf[12:HEADER_OFF] = prefix[12:]  # all but magic and state, then the magic, then the state
    slot.buf[:8] = prefix[:8]
    slot.buf[8:12] = prefix[8:12]


def receive_header(incoming: Incoming, where: str) -> tuple[dict, int, int]:
    """A restore's transfer, receiving side: the copy's header (checked like a mapped one: slot.parse_header)
    from the stream; ``incoming`` is then at the data region's start."""
    from .slot import _PREFIX, HEADER_OFF, parse_header

    buf = np.empty(HEADER_OFF, np.uint8)
    if incoming.size < HEADER_OFF:
        raise InvalidMemoryCopyError(f"memory copy {where} is truncated ({incoming.size} bytes)")
    incoming.read_into(buf)
    doff = _PREFIX.unpack_from(buf, 0)[4]
    if not HEADER_OFF <= doff <= min(incoming.size, 1 << 30):
        raise InvalidMemoryCopyError(f"memory copy {where} is malformed (data offset {doff})")
    rest = np.empty(doff - HEADER_OFF, np.uint8)
    incoming.read_into(rest)
    return parse_header(np.concatenate([buf, rest]), incoming.size, where)
