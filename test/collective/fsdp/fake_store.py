"""Endpoints that are not a working TCP store, served on a thread (tests only): one that accepts and never
answers (a frozen store host whose kernel still takes connections), and ones that answer garbage."""

from __future__ import annotations

import contextlib
import random
import socket
import struct
import threading
from collections.abc import Callable, Iterator

# what an endpoint sends back for each chunk it receives (None: nothing)
Reply = Callable[[bytes], bytes | None]


def silent(_data: bytes) -> None:
    return None


def random_bytes(seed: int) -> Reply:
    rng = random.Random(seed)
    return lambda data: rng.randbytes(rng.choice([1, 8, 16, 24, len(data), 4096]))


def constant(value: int) -> Reply:
    """Answers every chunk with the same int64 (a store stuck on one value; 1 is "committed")."""
    return lambda data: struct.pack("<q", value) * 4


def echo(data: bytes) -> bytes:
    return data


def http(_data: bytes) -> bytes:
    return b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n"


def huge_value(_data: bytes) -> bytes:
    """A length prefix announcing an enormous value, then an int64 (what a GET would read first)."""
    return struct.pack("<Q", 1 << 62) + struct.pack("<q", 1)


KINDS: dict[str, Reply] = {
    "random-0": random_bytes(0),
    "random-1": random_bytes(1),
    "random-2": random_bytes(2),
    "constant-1": constant(1),
    "constant-0": constant(0),
    "echo": echo,
    "http": http,
    "huge-value": huge_value,
}


@contextlib.contextmanager
def serving(reply: Reply) -> Iterator[int]:
    """Serve ``reply`` on a free localhost port (yielded) until the block ends."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    srv.settimeout(0.2)
    stop = threading.Event()
    conns: list[socket.socket] = []

    def handle(c: socket.socket) -> None:
        c.settimeout(0.2)
        while not stop.is_set():
            try:
                data = c.recv(65536)
            except socket.timeout:
                continue
            except OSError:
                return
            if not data:
                return
            out = reply(data)
            if out:
                try:
                    c.sendall(out)
                except OSError:
                    return

    def accept() -> None:
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            conns.append(c)
            threading.Thread(target=handle, args=(c,), daemon=True).start()

    th = threading.Thread(target=accept, daemon=True)
    th.start()
    try:
        yield srv.getsockname()[1]
    finally:
        stop.set()
        th.join()
        srv.close()
        for c in conns:
            c.close()
