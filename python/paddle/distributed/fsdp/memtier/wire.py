"""Peer copies over a direct TCP connection between partner ranks (a save's exchange, a restore's transfers).

Why not the process group: gloo's send/recv in paddle 3.3.1 is blocking (its isend/irecv time out), has no
deadline (a dead partner leaves it waiting), and needs both sides' memory as tensors. The sender sends the slot
from its mapping (a save: its own slot; a restore: the copy it holds), and the receiver reads straight into the
destination: the peer slot's mapping on a save, the model's tensors on a restore (one pass,
hashed on the way: readback.fill_tensors), so a restore from a peer copy allocates no slot.

Addresses: every rank listens on its node's address (the host of ``PADDLE_CURRENT_ENDPOINT``, else 127.0.0.1)
on a free port; the tier exchanges the addresses once over the training group (manager.py).

Failure: every socket operation has a deadline (``timeout_s``). A partner killed mid-transfer has its socket
closed by its kernel: a named PeerTransferError at once on the other side; one that vanished without a close
(a lost node): PeerTransferError when the deadline passes. Never a hang.

Framing: a hello (magic, sender rank, tag, byte count), the bytes, then one acknowledgement byte from the
receiver once every byte arrived (so a sender's success means the copy landed). The tag (a save's step, a
restore's round) lets a receiver drop a connection left over from an exchange that was abandoned.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import time

import numpy as np

from .errors import PeerTransferError

logger = logging.getLogger(__name__)

HELLO = struct.Struct("<8sqqq")  # magic, sender rank, tag, byte count
MAGIC = b"FSDPMTX1"
ACK = b"\x01"
SEND_PIECE = 64 << 20  # a sender's deadline applies per piece (sendall's timeout covers the whole call)


def node_host() -> str:
    """This node's address for partner connections: the launcher's endpoint host, else the loopback."""
    endpoint = os.environ.get("PADDLE_CURRENT_ENDPOINT", "")
    host = endpoint.rpartition(":")[0] if ":" in endpoint else ""
    return host or "127.0.0.1"


class PeerLink:
    """This rank's listening socket and every rank's address (``addrs``, set by the tier after an exchange)."""

    def __init__(self, rank: int, timeout_s: float):
        self.rank, self.timeout_s = rank, timeout_s
        host = node_host()
        self._server = socket.create_server((host, 0), backlog=16)
        self.address = (host, self._server.getsockname()[1])
        self.addrs: list[tuple[str, int]] = []

    def close(self) -> None:
        self._server.close()

    def send_buffer(self, dst: int, buf, tag: int) -> int:
        """Send ``buf`` (a slot's mapping) whole to rank ``dst`` (which calls ``accept(self.rank, tag)``); returns
        its size once ``dst`` acknowledged every byte. PeerTransferError on any failure or past the deadline (it
        applies to each piece of ``SEND_PIECE`` bytes). From the mapping rather than ``socket.sendfile`` of the
        file: 20-30% faster here for a tmpfs file (docs/reports/memtier-bench-2026-12-03-session3.md)."""
        mv = memoryview(buf).cast("B")

        def write(s: socket.socket) -> int:
            for i in range(0, len(mv), SEND_PIECE):
                s.sendall(mv[i : i + SEND_PIECE])
            return len(mv)

        return self._send(dst, tag, len(mv), write, "sending its copy")

    def _send(self, dst: int, tag: int, size: int, write, what: str) -> int:
        what = f"rank {self.rank}: {what} to rank {dst}"
        try:
            with socket.create_connection(self.addrs[dst], timeout=self.timeout_s) as s:
                s.settimeout(self.timeout_s)
                s.sendall(HELLO.pack(MAGIC, self.rank, tag, size))
                sent = write(s)
                if sent != size:
                    raise PeerTransferError(f"{what}: {sent} of {size} bytes sent")
                if s.recv(1) != ACK:
                    raise PeerTransferError(f"{what}: rank {dst} closed the connection before acknowledging")
                return size
        except TimeoutError:
            raise PeerTransferError(f"{what}: no progress within {self.timeout_s:g} s") from None
        except OSError as e:
            raise PeerTransferError(f"{what} failed (rank {dst} died?): {e}") from None

    def accept(self, src: int, tag: int) -> Incoming:
        """The connection of rank ``src`` sending with ``tag`` (others are dropped: left over from an abandoned
        exchange). PeerTransferError when it does not arrive within the deadline."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PeerTransferError(f"rank {self.rank}: rank {src} did not connect within {self.timeout_s:g} s")
            self._server.settimeout(left)
            try:
                conn, _addr = self._server.accept()
            except TimeoutError:
                continue
            conn.settimeout(self.timeout_s)
            incoming = Incoming(conn, src, self.rank)
            try:
                magic, who, got_tag, size = HELLO.unpack(incoming.read_exact(HELLO.size))
            except PeerTransferError as e:
                logger.warning("memory tier: rank %d drops a broken connection: %s", self.rank, e)
                incoming.close()
                continue
            if magic == MAGIC and who == src and got_tag == tag:
                incoming.size = size
                return incoming
            logger.warning("memory tier: rank %d drops a connection of rank %s with tag %s (expected rank %d, "
                           "tag %d)", self.rank, who, got_tag, src, tag)  # fmt: skip
            incoming.close()


class Incoming:
    """One arriving copy: ``read_into`` / ``skip`` consume it in order, ``finish`` drains and acknowledges it."""

    def __init__(self, conn: socket.socket, src: int, rank: int):
        self.conn, self.src, self.rank = conn, src, rank
        self.size, self.pos = 0, 0  # the payload's size (set after the hello), bytes of the payload consumed
        self._hello = True

    def _fail(self, msg: str) -> PeerTransferError:
        self.close()
        return PeerTransferError(f"rank {self.rank}: receiving from rank {self.src}: {msg}")

    def read_into(self, buf) -> None:
        """Fill ``buf`` (a writable buffer) with the next bytes."""
        mv = memoryview(buf).cast("B")
        n, got = len(mv), 0
        if not self._hello and self.pos + n > self.size:
            raise self._fail(f"{n} more bytes wanted at {self.pos}, the copy has {self.size}")
        while got < n:
            try:
                k = self.conn.recv_into(mv[got:], n - got)
            except TimeoutError:
                raise self._fail(f"no data within {self.conn.gettimeout():g} s ({self.pos + got} of {self.size} "
                                 "bytes)") from None  # fmt: skip
            except OSError as e:
                raise self._fail(
                    f"connection failed after {self.pos + got} bytes (rank {self.src} died?): {e}"
                ) from None
            if k == 0:
                raise self._fail(f"rank {self.src} closed the connection after {self.pos + got} of {self.size} "
                                 "bytes (killed?)")  # fmt: skip
            got += k
        if self._hello:
            self._hello = False
        else:
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
            self.conn.sendall(ACK)
        except OSError as e:
            raise self._fail(f"cannot acknowledge: {e}") from None
        self.close()

    def close(self) -> None:
        try:
            self.conn.close()
        except OSError:
            pass


def receive_into_slot(link: PeerLink, slot, src: int, tag: int) -> None:
    """A save's exchange, receiving side: the copy of rank ``src`` into ``slot`` (the peer slot, same size). The
    slot is marked "writing" once the partner's copy starts to arrive, and its prefix (with the "valid" flag) is
    written last, so a transfer cut short leaves the slot marked "writing", and a partner that died before sending
    (e.g. killed while copying its own state) leaves the previous copy it sent valid."""
    from .slot import HEADER_OFF

    incoming = link.accept(src, tag)
    if incoming.size != slot.size:
        incoming.close()
        raise PeerTransferError(f"rank {link.rank}: rank {src} sends {incoming.size} bytes, its slot has {slot.size}")
    slot.mark_writing()  # only now: a partner that died before sending leaves the previous copy valid
    prefix = np.empty(HEADER_OFF, np.uint8)
    incoming.read_into(prefix)
    incoming.read_into(slot.buf[HEADER_OFF:])
    incoming.finish()
    slot.buf[12:HEADER_OFF] = prefix[12:]  # all but magic and state, then the magic, then the state
    slot.buf[:8] = prefix[:8]
    slot.buf[8:12] = prefix[8:12]


def receive_header(incoming: Incoming, where: str) -> tuple[dict, int, int]:
    """A restore's transfer, receiving side: the copy's header (checked like a mapped one: slot.parse_header)
    from the stream; ``incoming`` is then at the data region's start."""
    from .errors import InvalidMemoryCopyError
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
