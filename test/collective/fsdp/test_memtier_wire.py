"""Peer copies over the direct TCP link (memtier/wire.py) with real processes killed by SIGKILL mid-transfer.

* the sender killed after the receiver got part of the copy: the receiver raises PeerTransferError naming the
  partner and the bytes received (at once: the kernel closes the dead process's socket), never a hang;
* the receiver killed mid-transfer: the sender raises PeerTransferError;
* a partner that never connects: PeerTransferError when the deadline passes; a connection with another tag (an
  abandoned exchange) is dropped and the expected one taken; a whole copy sent from memory (a save's
  ``send_buffer``) arrives byte for byte into a slot.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from paddle.distributed.fsdp.memtier import PeerTransferError, wire
from paddle.distributed.fsdp.memtier.slot import Slot

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "memtier_wire.py")
KEY = b"k" * 32  # the job's key (the tier draws one per start: manager.peer_link)
SIZE = 256 << 20  # far more than the socket buffers hold: the transfer is in flight when the kill comes


def _file(tmp_path, size=SIZE) -> str:
    path = str(tmp_path / "copy.own")
    with open(path, "wb") as f:
        f.write(np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes())
    return path


def _spawn(*args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, WORKER, *args], stdout=subprocess.PIPE, text=True)


def test_sender_killed_mid_transfer_is_a_named_error(tmp_path):
    link = wire.PeerLink(1, 60.0, KEY)
    proc = _spawn("send", link.address[0], str(link.address[1]), _file(tmp_path))
    try:
        incoming = link.accept(0, 7)
        buf = np.empty(SIZE, np.uint8)
        incoming.read_into(buf[: 1 << 20])
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        with pytest.raises(PeerTransferError, match=r"rank 0 (closed the connection|died).* of 268435456"):
            incoming.read_into(buf[1 << 20 :])
    finally:
        proc.kill()
        link.close()


def test_receiver_killed_mid_transfer_is_a_named_error(tmp_path):
    proc = _spawn("recv")
    link = wire.PeerLink(0, 60.0, KEY)
    errors: list[BaseException] = []
    try:
        port = int(proc.stdout.readline().split()[1])
        link.addrs = [link.address, ("127.0.0.1", port)]
        data = np.fromfile(_file(tmp_path), np.uint8)
        sender = threading.Thread(target=lambda: _catch(errors, link.send_buffer, 1, data, 7))
        sender.start()
        assert proc.stdout.readline().strip() == "GOT"
        proc.send_signal(signal.SIGKILL)
        sender.join(60)
        assert not sender.is_alive(), "the sender hangs after its receiver was killed"
        assert len(errors) == 1 and isinstance(errors[0], PeerTransferError), errors
        assert "sending" in str(errors[0]) and "rank 1" in str(errors[0]), errors[0]
    finally:
        proc.kill()
        link.close()


def _catch(errors, fn, *args) -> None:
    try:
        fn(*args)
    except BaseException as e:  # noqa: BLE001 - checked by the test
        errors.append(e)


def test_deadline_stale_tags_and_a_whole_copy(tmp_path):
    short = wire.PeerLink(1, 0.5, KEY)
    with pytest.raises(PeerTransferError, match="rank 0 did not connect within 0.5 s"):
        short.accept(0, 3)
    short.close()
    a, b = wire.PeerLink(0, 5.0, KEY), wire.PeerLink(1, 30.0, KEY)
    a.addrs = b.addrs = [a.address, b.address]
    try:
        slot = Slot.allocate(str(tmp_path / "rank00001.peer"), 4096, 1 << 20)
        pristine = np.random.default_rng(1).integers(0, 256, slot.size, dtype=np.uint8)
        stale_errors: list[BaseException] = []
        stale = threading.Thread(target=lambda: _catch(stale_errors, a.send_buffer, 1, pristine, 4))  # old tag
        stale.start()
        time.sleep(0.3)  # its connection is queued first
        errors: list[BaseException] = []
        sender = threading.Thread(target=lambda: _catch(errors, a.send_buffer, 1, pristine, 5))  # a save's send
        sender.start()
        wire.receive_into_slot(b, slot, 0, 5)
        sender.join(30)
        stale.join(30)
        assert errors == [] and bytes(slot.buf) == pristine.tobytes()
        assert len(stale_errors) == 1 and isinstance(stale_errors[0], PeerTransferError), stale_errors
        slot.close()
    finally:
        a.close()
        b.close()
