"""A stranger on a memory-tier peer-link port (memtier/wire.py): a real process that does not hold the job's key.

Usage:
  memtier_stranger.py MODE HOST PORT [FILE]
    idle      connect and stay silent
    trickle   connect and send one byte every 0.2 s
    garbage   connect and send 64 KiB of random bytes, then stay
    forged    answer the challenge with a well-formed hello as rank 0, tag 5, claiming FILE's size, under a wrong
              key, then send FILE (a crafted copy)
    flood     open 100 connections at once (non-blocking connects) and stay silent on each
    old       speak the previous, unauthenticated protocol (FSDPMTX1 hello) and send FILE
  memtier_stranger.py listen
    listen on a free port (print "PORT <port>"), challenge whoever connects, read everything it sends and
    acknowledge it with 32 random bytes (a stranger that took a partner's address)
Prints "CONNECTED" once connected (or "PORT"), then runs until killed.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct
import sys
import time


class wire:  # noqa: N801 - the protocol as a stranger learns it from wire.py's docstring (no paddle import: fast)
    MAGIC = b"FSDPMTX2"
    CHALLENGE = struct.Struct("<8s16s")
    HELLO = struct.Struct("<8sqqq16s")
    MAC_BYTES = 32


def main() -> None:
    mode = sys.argv[1]
    if mode == "listen":
        server = socket.create_server(("127.0.0.1", 0))
        print("PORT", server.getsockname()[1], flush=True)
        conn, _ = server.accept()
        conn.sendall(wire.CHALLENGE.pack(wire.MAGIC, os.urandom(16)))
        hello = conn.recv(wire.HELLO.size + wire.MAC_BYTES, socket.MSG_WAITALL)
        size = wire.HELLO.unpack(hello[: wire.HELLO.size])[3]
        while size > 0:
            size -= len(conn.recv(min(size, 1 << 20)))
        conn.sendall(os.urandom(wire.MAC_BYTES))
        time.sleep(600)
        return
    host, port = sys.argv[2], int(sys.argv[3])
    if mode == "flood":
        held = []
        for _ in range(100):
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex((host, port))
            held.append(c)
        print("CONNECTED", flush=True)
        time.sleep(600)
        return
    s = socket.create_connection((host, port))
    print("CONNECTED", flush=True)
    if mode == "trickle":
        for _ in range(3000):
            s.send(b"\x00")
            time.sleep(0.2)
    elif mode == "garbage":
        s.sendall(os.urandom(64 << 10))
    elif mode in ("forged", "old"):
        payload = open(sys.argv[4], "rb").read()
        if mode == "forged":
            _magic, nonce = wire.CHALLENGE.unpack(s.recv(wire.CHALLENGE.size, socket.MSG_WAITALL))
            hello = wire.HELLO.pack(wire.MAGIC, 0, 5, len(payload), os.urandom(16))
            mac = hmac.new(b"not the job's key".ljust(32), b"hello" + nonce + hello + (1).to_bytes(8, "little"),
                           hashlib.sha256).digest()  # fmt: skip
            s.sendall(hello + mac)
        else:
            s.sendall(struct.pack("<8sqqq", b"FSDPMTX1", 0, 5, len(payload)))
        try:
            s.sendall(payload)
        except OSError:
            pass
    time.sleep(600)


if __name__ == "__main__":
    main()
