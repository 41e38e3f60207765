"""Shared pieces of the checkpoint benchmark: constants, logging, peak-RSS measurement, page-cache control and
small helpers (see ``tools/bench_ckpt.py`` for what is measured)."""

from __future__ import annotations

import ctypes
import gc
import glob
import logging
import mmap
import os
import socket
import statistics
import sys
import threading

# the entry point, which child jobs (load in another world, torch DCP) run again
ENTRY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench_ckpt.py")

LOG = logging.getLogger("bench_ckpt")


GB = 1e9


WRITE_SLAB = 64 << 20


READ_SLAB = 16 << 20
DIRECT_SLAB = 4 << 20  # O_DIRECT raw read: reads of this size into one reused page-aligned buffer
# raw-read variants of the load limit (the fastest one is the limit): buffered into memory of the share's size,
# buffered into one reused buffer, O_DIRECT into one reused buffer (where the file system allows it)
RAW_READ_VARIANTS = ("resident", "ring", "direct")


FLOAT_BYTES = 4


STATE_COPIES = 3  # fp32 parameter + AdamW moment1 + moment2


def launch_cmd(world: int, log_dir: str, script_args: list[str]) -> list[str]:
    """``python -m paddle.distributed.launch`` of the entry point on ``world`` ranks."""
    return [
        sys.executable,
        "-m",
        "paddle.distributed.launch",
        "--nproc_per_node",
        str(world),
        "--log_dir",
        log_dir,
        ENTRY,
        *script_args,
    ]


def state_args(args, repeats: int | None = None) -> list[str]:
    """The arguments that make a child job build the same state as this one (``repeats``: its own count)."""
    return [
        "--size-gib",
        str(args.size_gib),
        "--dim",
        str(args.dim),
        "--repeats",
        str(args.repeats if repeats is None else repeats),
        "--seed",
        str(args.seed),
    ]


def model_shape(args) -> tuple[int, int]:
    """(dim, number of Linear blocks) whose params + moments come closest to --size-gib."""
    per_block = (args.dim * args.dim + args.dim) * FLOAT_BYTES * STATE_COPIES
    n = max(1, round(args.size_gib * (1 << 30) / per_block))
    return args.dim, n


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _malloc_trim() -> None:
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakRSS:
    """Extra peak RSS of this process during a ``with`` block, over its RSS at entry."""

    _clear_refs_ok: bool | None = None

    def __init__(self):
        self.base = 0
        self.peak = 0
        self._stop = threading.Event()
        self._thread = None

    @classmethod
    def _reset_hwm(cls) -> bool:
        if cls._clear_refs_ok is False:
            return False
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            cls._clear_refs_ok = True
        except OSError:
            cls._clear_refs_ok = False
        return bool(cls._clear_refs_ok)

    def _sample(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _status_bytes("VmRSS"))

    def __enter__(self):
        gc.collect()
        _malloc_trim()  # return freed heap pages to the OS, so reused heap memory counts as extra
        self.base = _status_bytes("VmRSS")
        self.peak = self.base
        if not self._reset_hwm():
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, _status_bytes("VmRSS"))
        else:
            self.peak = _status_bytes("VmHWM")
        return False

    @property
    def extra(self) -> int:
        return max(0, self.peak - self.base)

    @property
    def method(self) -> str:
        return "VmHWM (clear_refs)" if self._clear_refs_ok else "VmRSS sampling (2 ms)"


def cached_fraction(paths) -> float | None:
    """Fraction of the files' pages resident in the page cache (the engine's mincore query), None if unknown."""
    from paddle.distributed.fsdp.checkpoint.libc import page_cache_fraction

    total = hit = 0.0
    page = mmap.PAGESIZE
    for path in paths:
        size = os.path.getsize(path)
        if size == 0:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            frac = page_cache_fraction(fd, size)
        finally:
            os.close(fd)
        if frac is None:
            return None
        n = (size + page - 1) // page
        total += n
        hit += frac * n
    return hit / total if total else 0.0


_DROP_METHOD: str | None = None


def drop_method() -> str | None:
    """How the last ``drop_cache`` evicted the files (None before the first)."""
    return _DROP_METHOD


def drop_cache(paths) -> str:
    """Evict the files from the page cache: drop_caches when writable, else fadvise(DONTNEED) per file."""
    global _DROP_METHOD
    if _DROP_METHOD in (None, "drop_caches"):
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3")
            _DROP_METHOD = "drop_caches"
            return _DROP_METHOD
        except OSError:
            _DROP_METHOD = "posix_fadvise(DONTNEED)"
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return _DROP_METHOD


def files_under(d: str) -> list[str]:
    out = []
    for root, _dirs, names in os.walk(d):
        out += [os.path.join(root, n) for n in names]
    return sorted(out)


def data_files(ckpt: str) -> list[str]:
    """The tensor data files of a checkpoint (ours: *.safetensors; torch DCP: *.distcp; else all files)."""
    fs = sorted(glob.glob(os.path.join(ckpt, "*.safetensors"))) or sorted(glob.glob(os.path.join(ckpt, "*.distcp")))
    return fs or [f for f in files_under(ckpt)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def median(xs):
    return statistics.median(xs) if xs else None


def clean_env() -> dict:
    """Environment for a child job: without the variables of the paddle launch we run under (the engine's own
    ``PADDLE_FSDP_CKPT_*`` settings are kept, so every phase runs with the same ones)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k.startswith("PADDLE_FSDP_CKPT_") or not (k.startswith("PADDLE_") or k.startswith("POD_"))
    }
    env["PYTHONWARNINGS"] = "ignore::UserWarning"
    # run from compiled bytecode, as an installed package does (pip compiles it at install): under
    # PYTHONDONTWRITEBYTECODE every fresh process would compile the modules a first save or load imports lazily
    # inside the timed call (6-11 ms of a 0.25 s warm load here); torch and stock paddle have theirs anyway
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def setup_logging(rank: int, tag: str = "") -> None:
    """Progress on stderr from rank 0 (own handler: paddle configures the root logger on import)."""
    LOG.handlers.clear()
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter(f"%(asctime)s bench{tag}[r{rank}] %(message)s", datefmt="%H:%M:%S"))
    LOG.addHandler(h)
    LOG.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    LOG.propagate = False
