"""One end of a memory-tier peer transfer (memtier/wire.py) in its own process, to be killed with SIGKILL.

Usage:
  memtier_wire.py send HOST PORT FILE   connect as rank 0 to rank 1 at HOST:PORT and send FILE's bytes (tag 7)
  memtier_wire.py recv                  listen as rank 1, print "PORT <port>", accept rank 0's copy (tag 7),
                                        read 1 MiB of it, print "GOT", then wait (never acknowledges)
"""

from __future__ import annotations

import sys
import time

import numpy as np
from paddle.distributed.fsdp.memtier import wire


def main() -> None:
    mode = sys.argv[1]
    if mode == "send":
        link = wire.PeerLink(0, 60.0, b"k" * 32)
        link.addrs = [link.address, (sys.argv[2], int(sys.argv[3]))]
        link.send_buffer(1, np.fromfile(sys.argv[4], np.uint8), 7)
        print("SENT", flush=True)
    else:
        link = wire.PeerLink(1, 60.0, b"k" * 32)
        print("PORT", link.address[1], flush=True)
        incoming = link.accept(0, 7)
        incoming.read_into(np.empty(1 << 20, np.uint8))
        print("GOT", flush=True)
        time.sleep(600)


if __name__ == "__main__":
    main()
