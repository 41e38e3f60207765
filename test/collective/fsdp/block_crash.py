"""Power loss at the block level (#54): a loop device over a one-file FUSE file system records every block write
and every flush of a real file system (ext4, xfs) in order; crash states are rebuilt from the log and mounted.

Why this works: the loop driver turns each flush and FUA of the block device into an fsync of its backing file,
and FUSE (no writeback cache) hands every write and fsync to this daemon as it happens. The daemon appends each
to a log (``<BQI`` kind, offset, length + data; kind 0 write, 1 flush, 2 a write of zeros, logged without its
bytes: mkfs.xfs zeroes a 64 MiB log) before it answers, so once a save's fsync has returned, its blocks are in
the log. The disk is held sparsely (chunks that were ever written non-zero), so a 300 MiB xfs costs what its
metadata and files take.

The block model: at a crash every write before the last completed flush is on the disk; of the writes after it
any subset, the last one possibly torn at a 512-byte boundary. The file system's own recovery (the journal or log
replay of mount) then runs on the image.

Run as ``python block_crash.py serve MOUNTPOINT SIZE LOG`` (the FUSE daemon; foreground).
"""

from __future__ import annotations

import contextlib
import errno
import os
import random
import shutil
import stat
import struct
import subprocess
import sys
import time
from dataclasses import dataclass

_REC = struct.Struct("<BQI")
WRITE, FLUSH, ZERO = 0, 1, 2
CHUNK = 1 << 16
_ZEROS = memoryview(bytes(CHUNK))


def _zero(buf) -> bool:
    mv = memoryview(buf).cast("B")
    return all(mv[i : i + CHUNK] == _ZEROS[: len(mv[i : i + CHUNK])] for i in range(0, len(mv), CHUNK))  # memcmp


class SparseDisk:
    """``size`` bytes, zero where never written: chunks of CHUNK bytes made on the first non-zero write."""

    def __init__(self, size: int):
        self.size = size
        self.chunks: dict[int, bytearray] = {}

    def write(self, off: int, data) -> None:
        mv, pos = memoryview(data), 0
        while pos < len(mv):
            idx, inner = divmod(off + pos, CHUNK)
            n = min(CHUNK - inner, len(mv) - pos)
            piece = mv[pos : pos + n]
            chunk = self.chunks.get(idx)
            if chunk is None and not _zero(piece):  # zeros over a hole change nothing
                chunk = self.chunks[idx] = bytearray(CHUNK)
            if chunk is not None:
                chunk[inner : inner + n] = piece
            pos += n

    def read(self, off: int, n: int) -> bytes:
        out = bytearray(n)
        pos = 0
        while pos < n:
            idx, inner = divmod(off + pos, CHUNK)
            k = min(CHUNK - inner, n - pos)
            chunk = self.chunks.get(idx)
            if chunk is not None:
                out[pos : pos + k] = chunk[inner : inner + k]
            pos += k
        return bytes(out)

    def save(self, path: str) -> None:
        """Write the disk as a sparse file (holes where nothing was written)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, self.size)
            for idx, chunk in self.chunks.items():
                os.pwrite(fd, chunk, idx * CHUNK)
        finally:
            os.close(fd)


def serve(mountpoint: str, size: int, log_path: str) -> None:
    from fuse import FUSE, FuseOSError, Operations

    class OneFile(Operations):
        """``/disk``: ``size`` bytes held sparsely in memory; writes and fsyncs appended to the log."""

        def __init__(self):
            self.disk = SparseDisk(size)
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
            return self.disk.read(offset, n)

        def write(self, path, buf, offset, fh):
            self.disk.write(offset, buf)
            if not _zero(buf):
                self.log.write(_REC.pack(WRITE, offset, len(buf)) + bytes(buf))
            else:
                self.log.write(_REC.pack(ZERO, offset, len(buf)))
            return len(buf)

        def truncate(self, path, length, fh=None):
            return 0

        def fsync(self, path, datasync, fh):
            self.log.write(_REC.pack(FLUSH, 0, 0))
            return 0

    FUSE(OneFile(), mountpoint, foreground=True, nothreads=True, direct_io=True)


def read_log(path: str, with_data: bool = True) -> list[tuple]:
    """[(kind, offset, data, end position in the log file)]; a write of zeros comes back as a WRITE of zeros
    (``with_data`` False: data None)."""
    out = []
    with open(path, "rb") as f:
        blob = f.read()
    pos = 0
    while pos + _REC.size <= len(blob):
        kind, off, n = _REC.unpack_from(blob, pos)
        if kind == ZERO:
            pos += _REC.size
            out.append((WRITE, off, bytes(n) if with_data else None, pos))
            continue
        if pos + _REC.size + n > len(blob):
            break
        data = blob[pos + _REC.size : pos + _REC.size + n] if with_data else None
        pos += _REC.size + n
        out.append((kind, off, data, pos))
    return out


def log_length(path: str) -> int:
    """Records in the log so far (the index the next one will have)."""
    return len(read_log(path, with_data=False))


def run(cmd: list[str], **kw) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120, **kw).stdout.strip()


def mount_image(img: str, mnt: str, options: tuple = ()) -> tuple[subprocess.CompletedProcess, str]:
    """Mount crash image ``img`` on a loop device of its own: (mount's outcome, device; detached again when the
    mount failed). Not ``mount -o loop``: it reuses a loop device still attached to the same file (the previous
    state's, being detached after its umount) with that device's cached blocks, so a state was sometimes read with
    blocks of the state before it (false findings, and it could hide real ones)."""
    dev = run(["losetup", "-f", "--show", img])
    run(["blockdev", "--flushbufs", dev])  # no cached block of an earlier state
    r = subprocess.run(["mount", *options, dev, mnt], capture_output=True, text=True, timeout=120)
    if r.returncode:
        detach(dev)
    return r, dev


def detach(dev: str) -> None:
    subprocess.run(["losetup", "-d", dev], check=True, capture_output=True, timeout=60)


def unmount_image(mnt: str, dev: str) -> None:
    subprocess.run(["umount", mnt], check=True, capture_output=True, timeout=120)
    detach(dev)


@dataclass(frozen=True)
class FileSystem:
    """A file system under test: how it is made, and its own repair for an image mount refuses."""

    name: str
    size: int
    mkfs: tuple[str, ...]
    repair: tuple[str, ...]  # run on the image file when mount fails (e2fsck for a torn superblock)
    fsck_first: bool = False  # no journal: the boot-time fsck is the recovery (run before the mount)
    # the unit a write is never torn inside: 512 B (a sector); xfs as on a 4 KiB-atomic disk, since its log
    # recovery reads in-place metadata blocks and fails on a 4 KiB directory block torn at 512 B (reproduced)
    atomic: int = 512

    def missing(self) -> str | None:
        for tool in (self.mkfs[0], self.repair[0]):
            if shutil.which(tool) is None:
                pkg = "xfsprogs" if "xfs" in tool else "e2fsprogs"
                return f"{tool} is not installed (apt-get install {pkg})"
        return None


EXT4 = FileSystem("ext4", 32 << 20, ("mkfs.ext4", "-q", "-F", "-E", "nodiscard"), ("e2fsck", "-fy"))
EXT4_NO_JOURNAL = FileSystem(
    "ext4_no_journal", 32 << 20, ("mkfs.ext4", "-q", "-F", "-E", "nodiscard", "-O", "^has_journal"),
    ("e2fsck", "-fy"), fsck_first=True,
)  # fmt: skip
XFS = FileSystem(
    "xfs", 300 << 20, ("mkfs.xfs", "-q", "-f", "-K"), ("xfs_repair",), atomic=4096
)  # 300 MiB: mkfs.xfs's minimum
FILE_SYSTEMS = {fs.name: fs for fs in (EXT4, EXT4_NO_JOURNAL, XFS)}


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


@contextlib.contextmanager
def recorded_fs(work: str, fs: FileSystem, mountpoint: str):
    """A fresh ``fs`` on a recording disk, mounted at ``mountpoint``; yields the log path (unmounted on exit)."""
    with recording_disk(work, fs.size) as (dev, log):
        run([*fs.mkfs, dev])
        run(["mount", dev, mountpoint])
        try:
            yield log
        finally:
            subprocess.run(["umount", mountpoint], capture_output=True, timeout=120)


def _plan(log: list[tuple], start: int, budget: int, rng: random.Random) -> tuple[list[int], list]:
    """``budget`` crash points (record index, share of the writes after the last flush kept): every flush boundary
    with nothing after it kept first (a seeded sample of them when they outnumber the budget), then random ones."""
    flushes = [i for i, r in enumerate(log) if r[0] == FLUSH and i >= start]
    bounds = flushes if len(flushes) <= budget else rng.sample(flushes, budget)
    plan = [(i + 1, 0.0) for i in bounds]
    plan += [(rng.randint(start, len(log)), rng.choice((0.0, 0.5, 1.0))) for _ in range(max(0, budget - len(plan)))]
    return flushes, sorted(plan)


def crash_states(log: list[tuple], start: int, size: int, budget: int, rng: random.Random, image: str, tear=512):
    """Write each crash state to the sparse file ``image`` in turn and yield (log position of the crash, writes
    lost): ``budget`` crash points at or after record ``start`` (everything before it is on disk), see ``_plan``;
    the flush boundaries first (a broken protocol usually fails at one: found early), then the random ones. The last
    kept write may be torn at a multiple of ``tear`` bytes."""
    flushes, plan = _plan(log, start, budget, rng)
    at_flush = {i + 1 for i in flushes}
    first, rest = [], []
    for p in plan:
        (first if p[1] == 0.0 and p[0] in at_flush else rest).append(p)
    for part in (first, rest):
        yield from _replay(log, start, flushes, part, size, rng, image, tear)


def _replay(log, start, flushes, plan, size, rng, image, tear):
    base = SparseDisk(size)
    applied = 0
    for k, keep in plan:
        last_flush = max((i for i in flushes if i < k), default=start - 1)
        durable_end = max(last_flush + 1, start)
        while applied < durable_end:  # the durable prefix grows with k: applied once
            kind, off, data, _ = log[applied]
            if kind == WRITE:
                base.write(off, data)
            applied += 1
        base.save(image)
        lost = 0
        tail = [r for r in log[durable_end:k] if r[0] == WRITE]
        fd = os.open(image, os.O_WRONLY)
        try:
            for j, (_, off, data, _) in enumerate(tail):
                if rng.random() >= keep:
                    lost += 1
                    continue
                if j == len(tail) - 1 and len(data) > tear and rng.random() < 0.5:
                    data = data[: rng.randrange(1, -(-len(data) // tear)) * tear]
                os.pwrite(fd, data, off)
        finally:
            os.close(fd)
        yield log[k - 1][3] if k else 0, lost


def crash_images(log: list[tuple], start: int, size: int, budget: int, rng: random.Random):
    """Like ``crash_states``, yielding (log position, image bytes, writes lost): for small disks only."""
    path = f"/dev/shm/crash-image-{os.getpid()}-{id(log)}.img"
    try:
        for pos, lost in crash_states(log, start, size, budget, rng, path):
            with open(path, "rb") as f:
                yield pos, f.read(), lost
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


if __name__ == "__main__" and sys.argv[1] == "serve":
    serve(sys.argv[2], int(sys.argv[3]), sys.argv[4])
