"""Power loss at the block level (#54): a loop device over a one-file FUSE file system records every block write
and every flush of a real file system (ext4) in order; crash states are rebuilt from the log and mounted.

Why this works: the loop driver turns each flush and FUA of the block device into an fsync of its backing file,
and FUSE (no writeback cache) hands every write and fsync to this daemon as it happens. The daemon appends each
to a log (``<BQI`` kind, offset, length + data; kind 0 write, 1 flush) before it answers, so once a save's fsync
has returned, its blocks are in the log.

The block model: at a crash every write before the last completed flush is on the disk; of the writes after it
any subset, the last one possibly torn at a 512-byte boundary. The file system's own recovery (the journal
replay of mount) then runs on the image.

Run as ``python block_crash.py serve MOUNTPOINT SIZE LOG`` (the FUSE daemon; foreground).
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import stat
import struct
import subprocess
import sys
import time

_REC = struct.Struct("<BQI")
WRITE, FLUSH = 0, 1


def serve(mountpoint: str, size: int, log_path: str) -> None:
    from fuse import FUSE, FuseOSError, Operations

    class OneFile(Operations):
        """``/disk``: ``size`` bytes in memory; writes and fsyncs appended to the log."""

        def __init__(self):
            self.data = bytearray(size)
            self.log = open(log_path, "wb", buffering=0)  # noqa: SIM115 - open for the daemon's life

        def getattr(self, path, fh=None):
            now = time.time()
            if path == "/":
                return {"st_mode": stat.S_IFDIR | 0o755, "st_nlink": 2, "st_ctime": now, "st_mtime": now}
            if path == "/disk":
                return {"st_mode": stat.S_IFREG | 0o600, "st_nlink": 1, "st_size": size, "st_ctime": now,
                        "st_mtime": now}  # fmt: skip
            raise FuseOSError(errno.ENOENT)

        def readdir(self, path, fh):
            return [".", "..", "disk"]

        def open(self, path, flags):
            return 0

        def read(self, path, n, offset, fh):
            return bytes(self.data[offset : offset + n])

        def write(self, path, buf, offset, fh):
            self.data[offset : offset + len(buf)] = buf
            self.log.write(_REC.pack(WRITE, offset, len(buf)) + bytes(buf))
            return len(buf)

        def truncate(self, path, length, fh=None):
            return 0

        def fsync(self, path, datasync, fh):
            self.log.write(_REC.pack(FLUSH, 0, 0))
            return 0

    FUSE(OneFile(), mountpoint, foreground=True, nothreads=True, direct_io=True)


def read_log(path: str) -> list[tuple]:
    """[(kind, offset, data, end position in the log file)]"""
    out = []
    with open(path, "rb") as f:
        blob = f.read()
    pos = 0
    while pos + _REC.size <= len(blob):
        kind, off, n = _REC.unpack_from(blob, pos)
        data = blob[pos + _REC.size : pos + _REC.size + n]
        if len(data) < n:
            break
        pos += _REC.size + n
        out.append((kind, off, data, pos))
    return out


def run(cmd: list[str], **kw) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120, **kw).stdout.strip()


@contextlib.contextmanager
def recording_disk(work: str, size: int):
    """Yield (block device, log path) of a loop device over a FUSE file that logs every write and flush."""
    fmnt, log = os.path.join(work, "fuse"), os.path.join(work, "blocks.log")
    os.makedirs(fmnt)
    daemon = subprocess.Popen([sys.executable, __file__, "serve", fmnt, str(size), log], stderr=subprocess.PIPE)
    dev = None
    try:
        deadline = time.monotonic() + 30
        while not os.path.exists(os.path.join(fmnt, "disk")):
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"FUSE daemon did not start: {daemon.stderr.read().decode()[-500:]}")
            time.sleep(0.05)
        dev = run(["losetup", "-f", "--show", os.path.join(fmnt, "disk")])
        yield dev, log
    finally:
        if dev is not None:
            subprocess.run(["losetup", "-d", dev], capture_output=True)
        subprocess.run(["umount", fmnt], capture_output=True)
        try:
            daemon.wait(timeout=20)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()


def crash_images(log: list[tuple], start: int, size: int, budget: int, rng: random.Random):
    """Yield (log position of the crash, image bytes, what was lost) for ``budget`` sampled crash states whose
    crash point is at or after record ``start`` (everything before it is on disk), plus the state at every
    flush with nothing after it kept."""
    flushes = [i for i, r in enumerate(log) if r[0] == FLUSH and i >= start]
    plan = [(i + 1, 0.0) for i in flushes]
    plan += [(rng.randint(start, len(log)), rng.choice((0.0, 0.5, 1.0))) for _ in range(max(0, budget - len(plan)))]
    base = bytearray(size)
    applied = 0
    for k, keep in sorted(plan):
        last_flush = max((i for i in flushes if i < k), default=start - 1)
        durable_end = max(last_flush + 1, start)
        while applied < durable_end:  # the durable prefix grows with k: applied once
            kind, off, data, _ = log[applied]
            if kind == WRITE:
                base[off : off + len(data)] = data
            applied += 1
        image = bytearray(base)
        lost = 0
        tail = [r for r in log[durable_end:k] if r[0] == WRITE]
        for j, (_, off, data, _) in enumerate(tail):
            if rng.random() >= keep:
                lost += 1
                continue
            if j == len(tail) - 1 and len(data) > 512 and rng.random() < 0.5:
                data = data[: rng.randrange(1, len(data) // 512) * 512]
            image[off : off + len(data)] = data
        yield log[k - 1][3] if k else 0, bytes(image), lost


if __name__ == "__main__" and sys.argv[1] == "serve":
    serve(sys.argv[2], int(sys.argv[3]), sys.argv[4])
