#!/usr/bin/env python3
"""Checkpoint benchmark: the FSDP engine against raw I/O, the all-gather way and PyTorch DCP (issue 6).

Usage (one invocation measures everything on the same state)::

    python -m paddle.distributed.launch --nproc_per_node 2 tools/bench_ckpt.py --json bench.json
    python tools/bench_ckpt.py --world 2 --size-gib 1 --json bench.json     # launches itself

The state is a model of ``Linear(dim, dim)`` blocks sized so that parameters + AdamW moments come to
``--size-gib`` in all (fp32: 12 bytes per parameter), wrapped in ``FullyShardFusion`` (one FSDP unit per
block); the AdamW state is created with ``fsdp.init_optimizer_state`` and filled with random values. Every
phase is repeated ``--repeats`` times (round robin, fresh directories); the table shows medians.

Phases, each timed from a barrier to the slowest rank's end (GB = 1e9 bytes of state):

(a) ``raw write+fsync``: every rank writes its own state bytes from tensor memory to one file, 64 MiB
    writes, one fsync (the limit for saves);
(b) ``save sync`` / ``save async``: ``fsdp.save_checkpoint``; async reports the time the caller is blocked
    and the total until ``wait()``; blocked time is compared with a host memcpy of the rank's state (into
    a preallocated buffer, measured right before each async save; a copy into fresh memory is reported as well); ``async overlap`` runs a matmul
    loop while the save persists in the background and reports its speed relative to an idle run;
(c) ``all_gather + paddle.save``: parameters gathered with ``fsdp.full_parameters()``, AdamW moments with
    one padded ``all_gather`` per parameter, rank 0 writes one ``paddle.save`` file and fsyncs it;
(d) ``load``: ``fsdp.load_checkpoint`` into zeroed targets, same world (each round right after an async save,
    so the load borrows the engine's resident async-save buffer as its staging); ``load, fresh staging``: the
    same after ``release_host_buffers()`` (staging in fresh memory, as for the first load of a job; run after
    the rounds); ``load changed world``: the same
    checkpoint loaded by ``--load-world`` ranks (a child ``paddle.distributed.launch`` of this script in
    ``--mode load-only``); both verify an order-independent checksum of the loaded state;
(e) ``raw read``: the checkpoint's data files read by the same ranks (equal contiguous shares, 16 MiB
    preads), in each world, into resident memory of the share's size (what a load fills) and into one
    reused 16 MiB buffer (the I/O alone); the faster of the two is the limit for loads;
(f) ``torch DCP``: if torch is importable, FSDP2 (``fully_shard`` per Linear) with the same sizes on gloo,
    ``torch.distributed.checkpoint.save`` (fsync on), ``load`` + ``set_state_dict``, same and changed
    world, in separate process groups spawned by this script.

Page cache: ``/proc/sys/vm/drop_caches`` is used when writable, else ``posix_fadvise(DONTNEED)`` on every
file before each read phase; the resident fraction is checked with ``mincore`` and reported. The virtual
disk of a VM may still be cached by the host, so cold-read figures are noisy.

Memory: each rank's extra peak RSS over its RSS before the phase (``VmHWM`` after resetting it via
``/proc/self/clear_refs``; a sampling thread where that is not allowed; freed heap memory is returned with
``malloc_trim`` first, so reused heap pages count), during sync save, async save and load, compared with
its state bytes. The engine's per-phase timings (its public ``CheckpointOptions.trace_hook``) are recorded in-process
(``--no-trace`` turns that off). The load average at the start is printed: other jobs on the machine make
every figure noisy. Results: a table on stdout (markdown), ``--json`` for everything (per-rank times too).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import gc
import glob
import json
import logging
import mmap
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import numpy as np

warnings.filterwarnings("ignore", message="No ccache found", category=UserWarning)

LOG = logging.getLogger("bench_ckpt")
GB = 1e9
WRITE_SLAB = 64 << 20
READ_SLAB = 16 << 20
FLOAT_BYTES = 4
STATE_COPIES = 3  # fp32 parameter + AdamW moment1 + moment2


# ============================================================================================ small helpers


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--size-gib", type=float, default=1.0, help="params + AdamW state in all (GiB, default 1)")
    p.add_argument("--dim", type=int, default=2048, help="Linear(dim, dim) per block (default 2048)")
    p.add_argument(
        "--world",
        type=int,
        default=None,
        help="ranks; when started without paddle.distributed.launch the script launches itself "
        "with this many (default 2); under launch it must match --nproc_per_node",
    )
    p.add_argument(
        "--load-world", type=int, default=None, help="ranks of the changed-world load (default: world + 1; 0 skips it)"
    )
    p.add_argument("--repeats", type=int, default=3, help="repetitions of every phase (default 3)")
    p.add_argument("--dir", default=None, help="work directory for the files (default: a temp dir in /tmp)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--json", default=None, help="write all results to this JSON file")
    p.add_argument("--no-torch", action="store_true", help="skip PyTorch DCP even if torch is importable")
    p.add_argument("--no-gather", action="store_true", help="skip the all_gather + paddle.save phase")
    p.add_argument(
        "--gather-repeats",
        type=int,
        default=None,
        help="repetitions of the slow all_gather + paddle.save phase (default: --repeats)",
    )
    p.add_argument("--no-trace", dest="trace", action="store_false", help="do not record engine phase timings")
    p.add_argument("--no-overlap", dest="overlap", action="store_false", help="skip the async overlap probe")
    p.add_argument("--seed", type=int, default=2024)
    # internal modes
    p.add_argument("--mode", default="full", choices=["full", "load-only", "torch-worker"], help=argparse.SUPPRESS)
    p.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--expect-checksum", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--torch-rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--torch-world", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--torch-port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--torch-task", default="save-load", choices=["save-load", "load"], help=argparse.SUPPRESS)
    return p.parse_args(argv)


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


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def cached_fraction(paths) -> float | None:
    """Fraction of the files' pages resident in the page cache (mincore), None if unknown."""
    total = hit = 0
    page = mmap.PAGESIZE
    for path in paths:
        size = os.path.getsize(path)
        if size == 0:
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        finally:
            os.close(fd)
        if addr in (None, ctypes.c_void_p(-1).value):
            return None
        n = (size + page - 1) // page
        vec = (ctypes.c_ubyte * n)()
        rc = _libc.mincore(addr, size, vec)
        _libc.munmap(addr, size)
        if rc != 0:
            return None
        total += n
        hit += sum(1 for v in bytes(vec) if v & 1)
    return hit / total if total else 0.0


_DROP_METHOD: str | None = None


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


def raw_write(path: str, arrays: list[np.ndarray]) -> int:
    """Write the arrays (uint8 views of tensor memory) to one file in 64 MiB writes, one fsync."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    n = 0
    try:
        for a in arrays:
            mv = memoryview(a).cast("B")
            for i in range(0, len(mv), WRITE_SLAB):
                part = mv[i : i + WRITE_SLAB]
                done = 0
                while done < len(part):
                    done += os.write(fd, part[done:])
            n += len(mv)
        os.fsync(fd)
    finally:
        os.close(fd)
    return n


def share_of(files: list[str], rank: int, world: int) -> list[tuple[str, int, int]]:
    """This rank's equal contiguous share of the concatenated files: [(path, offset, length)]."""
    sizes = [os.path.getsize(f) for f in files]
    total = sum(sizes)
    lo, hi = total * rank // world, total * (rank + 1) // world
    out, pos = [], 0
    for f, s in zip(files, sizes):
        a, b = max(lo, pos), min(hi, pos + s)
        if b > a:
            out.append((f, a - pos, b - a))
        pos += s
    return out


def read_buffer(segments) -> np.ndarray:
    """A resident buffer as large as the rank's share (touched before timing, like a model's tensors)."""
    buf = np.empty(max(1, sum(s[2] for s in segments)), np.uint8)
    buf[:] = 0
    return buf


def raw_read(segments, buf: np.ndarray, ring: bool = False) -> int:
    """pread the segments in 16 MiB reads into ``buf``: resident memory of the share's size, or (``ring``)
    one reused 16 MiB buffer."""
    mv = memoryview(buf).cast("B")
    n = 0
    for path, off, length in segments:
        fd = os.open(path, os.O_RDONLY)
        try:
            done = 0
            while done < length:
                take = min(READ_SLAB, length - done)
                dst = mv[:take] if ring else mv[n + done : n + done + take]
                got = os.preadv(fd, [dst], off + done)
                if got <= 0:
                    raise OSError(f"short read from {path}")
                done += got
            n += length
        finally:
            os.close(fd)
    return n


def raw_read_phase(comm, files: list[str]) -> dict:
    """Both raw-read variants of this world's equal shares of ``files``, page cache dropped before each.

    Returns {variant: (wall seconds, per-rank seconds, bytes read, cached fraction per rank)}; the load
    limit is the faster variant (resident memory is what a load fills; the ring isolates the I/O)."""
    segs = share_of(files, comm.rank, comm.world)
    out = {}
    for variant in ("resident", "ring"):
        if variant == "resident":
            buf = read_buffer(segs)
        else:
            buf = np.empty(READ_SLAB, np.uint8)
            buf[:] = 0
        if comm.rank == 0:
            drop_cache(files)
        comm.barrier()
        cached = comm.gather(cached_fraction(files))
        n, t, per = comm.timed(raw_read, segs, buf, variant == "ring")
        out[variant] = (t, per, sum(comm.gather(n)), cached)
        del buf
    return out


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
    return env


def setup_logging(rank: int, tag: str = "") -> None:
    """Progress on stderr from rank 0 (own handler: paddle configures the root logger on import)."""
    LOG.handlers.clear()
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(logging.Formatter(f"%(asctime)s bench{tag}[r{rank}] %(message)s", datefmt="%H:%M:%S"))
    LOG.addHandler(h)
    LOG.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    LOG.propagate = False


# ============================================================================================ paddle side


class Comm:
    def __init__(self):
        import paddle.distributed as dist

        self.dist = dist
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()

    def barrier(self):
        if self.world > 1:
            self.dist.barrier()

    def gather(self, obj) -> list:
        if self.world == 1:
            return [obj]
        out: list = []
        self.dist.all_gather_object(out, obj)
        return out

    def timed(self, fn, *a, **kw):
        """Run fn on every rank between barriers; returns (result, wall seconds = slowest rank, per-rank)."""
        self.barrier()
        t0 = time.perf_counter()
        r = fn(*a, **kw)
        dt = time.perf_counter() - t0
        per = self.gather(dt)
        return r, max(per), per


def tensor_bytes_view(t) -> np.ndarray:
    """uint8 view of a contiguous host tensor's memory (no copy)."""
    n = int(t.numel()) * t.element_size()
    if n == 0:
        return np.zeros(0, np.uint8)
    return np.frombuffer((ctypes.c_ubyte * n).from_address(t.data_ptr()), dtype=np.uint8)


class PaddleState:
    """The benchmark model, its FSDP wrapper and AdamW state on this rank."""

    def __init__(self, args, seed_moments: bool = True):
        import paddle
        from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight
        from paddle.distributed.fsdp import FullyShardFusion

        dim, n = model_shape(args)

        class Block(paddle.nn.Layer):
            def __init__(self):
                super().__init__()
                self.fc = paddle.nn.Linear(dim, dim)

            def forward(self, x):
                return self.fc(x)

        class Net(paddle.nn.Layer):
            def __init__(self):
                super().__init__()
                self.blocks = paddle.nn.LayerList([Block() for _ in range(n)])

            def forward(self, x):
                for b in self.blocks:
                    x = b(x)
                return x

        paddle.seed(args.seed)
        self.model = Net()
        self.fsdp = FullyShardFusion(self.model, fsdp_unit_layers=["Block"])
        self.opt = paddle.optimizer.AdamW(learning_rate=1e-3, parameters=self.model.parameters(), weight_decay=0.01)
        self.fsdp.init_optimizer_state(self.opt)
        state = {**self.fsdp.sharded_state_dict(), **self.fsdp.optimizer_sharded_state_dict(self.opt)}
        # the sharded (element-unique) tensors; replicated scalars (beta powers) are left out of checksums
        self.sharded = {k: v.local_tensor for k, v in state.items() if isinstance(v, ShardedWeight)}
        self.replicated = {k: v for k, v in state.items() if not isinstance(v, ShardedWeight)}
        self.views = {k: tensor_bytes_view(t) for k, t in self.sharded.items()}
        if seed_moments:
            rng = np.random.default_rng(args.seed + 1 + self._rank())
            for k, v in self.views.items():
                if ".moment" in k and len(v):
                    f = v.view(np.float32)
                    f[:] = rng.random(len(f), dtype=np.float32)
        self.bytes = sum(len(v) for v in self.views.values()) + sum(
            int(t.numel()) * t.element_size() for t in self.replicated.values()
        )

    @staticmethod
    def _rank() -> int:
        import paddle.distributed as dist

        return dist.get_rank()

    def arrays(self) -> list[np.ndarray]:
        out = [v for v in self.views.values() if len(v)]
        for t in self.replicated.values():
            out.append(tensor_bytes_view(t))
        return out

    def checksum(self) -> int:
        """Order- and layout-independent checksum of the sharded elements on this rank (sum of uint32 words)."""
        s = 0
        for v in self.views.values():
            if len(v):
                s += int(np.sum(v.view(np.uint32), dtype=np.uint64))
        return s % (1 << 64)

    def zero(self) -> None:
        for v in self.views.values():
            v[:] = 0


class Tracer:
    """Collect the engine's phase timings in-process through its public trace hook
    (``CheckpointOptions.trace_hook``); ``options`` is what every save and load of the benchmark passes."""

    def __init__(self, enabled: bool):
        from paddle.distributed.fsdp.checkpoint import CheckpointOptions

        self.records: list[dict] = []
        self.enabled = enabled
        # the PADDLE_FSDP_CKPT_* settings of the run still apply (from_env), plus the hook when tracing
        base = CheckpointOptions.from_env()
        self.options = base.replace(trace_hook=self._record) if enabled else base

    def _record(self, rec) -> None:
        self.records.append(
            {"what": rec.what, "marks": {n: round(d, 6) for n, d in rec.marks}, "total": round(rec.total, 6)}
        )

    def take(self) -> list[dict]:
        out = list(self.records)
        self.records.clear()
        return out


def ckpt_data_bytes(path: str) -> int:
    return sum(os.path.getsize(f) for f in data_files(path))


def memcpy_times(ps: PaddleState, comm: Comm) -> dict:
    """Host memcpy of the rank's state: into a preallocated (touched) buffer, and into fresh memory."""
    arrays = ps.arrays()
    total = sum(len(a) for a in arrays)
    buf = np.empty(total, np.uint8)
    buf[:] = 1

    def warm():
        pos = 0
        for a in arrays:
            np.copyto(buf[pos : pos + len(a)], a)
            pos += len(a)

    def fresh():
        return [a.copy() for a in arrays]

    warm()
    _, t_warm, _ = comm.timed(warm)
    copies, t_fresh, _ = comm.timed(fresh)
    del copies
    return {"prealloc_s": t_warm, "fresh_s": t_fresh}


def probe_rate(seconds: float = 1.0, stop=None) -> float:
    """Matmul iterations per second (a stand-in for training compute) for ``seconds`` or until stop()."""
    import paddle

    x = paddle.rand([384, 384])
    w = paddle.rand([384, 384])
    n = 0
    t0 = time.perf_counter()
    while True:
        y = paddle.matmul(x, w)
        float(y[0, 0])
        n += 1
        dt = time.perf_counter() - t0
        if (stop is not None and stop()) or (stop is None and dt >= seconds):
            return n / dt


def gather_and_paddle_save(ps: PaddleState, comm: Comm, path: str) -> dict:
    """The pre-fork way: gather the full state, rank 0 writes one paddle.save file (+ fsync)."""
    import paddle
    import paddle.distributed as dist

    t0 = time.perf_counter()
    full = ps.fsdp.full_parameters()
    # AdamW moments: one padded all_gather per (parameter, moment); pieces ordered by their flat range
    recs = ps.fsdp.optimizer_sharded_state_dict(ps.opt)
    ranges = {
        k: (v.flattened_range.start, v.flattened_range.stop, tuple(v.global_shape))
        for k, v in recs.items()
        if getattr(v, "flattened_range", None) is not None
    }
    all_ranges = comm.gather(ranges)
    keys = sorted(set().union(*[set(r) for r in all_ranges]))
    opt_full = {}
    for key in keys:
        spans = [r.get(key) for r in all_ranges]
        shape = next(s[2] for s in spans if s is not None)
        maxlen = max((s[1] - s[0]) for s in spans if s is not None)
        local = recs[key].local_tensor if key in recs else paddle.zeros([0], dtype="float32")
        pad = paddle.zeros([maxlen], dtype=local.dtype)
        if int(local.numel()):
            pad[: int(local.numel())] = local
        parts: list = []
        if comm.world > 1:
            dist.all_gather(parts, pad)
        else:
            parts = [pad]
        if comm.rank == 0:
            pieces = sorted((s[0], s[1], parts[r]) for r, s in enumerate(spans) if s is not None)
            opt_full[key] = paddle.concat([p[: b - a] for a, b, p in pieces]).reshape(list(shape))
        del parts, pad
    for key, t in ps.replicated.items():
        opt_full[key] = t
    t_gather = time.perf_counter() - t0
    t_save = t_fsync = 0.0
    if comm.rank == 0:
        t1 = time.perf_counter()
        paddle.save({"model": full, "optimizer": opt_full}, path)
        t2 = time.perf_counter()
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        t_save, t_fsync = t2 - t1, time.perf_counter() - t2
    del full, opt_full
    return {"gather_s": t_gather, "save_s": t_save, "fsync_s": t_fsync}


def run_full(args) -> None:
    import paddle.distributed as dist

    dist.init_parallel_env()
    comm = Comm()
    setup_logging(comm.rank)
    if args.world is not None and args.world != comm.world:
        raise SystemExit(f"--world {args.world} but launched with {comm.world} ranks")
    load_world = comm.world + 1 if args.load_world is None else args.load_world
    R = max(1, args.repeats)
    GR = R if args.gather_repeats is None else max(1, args.gather_repeats)
    dim, nblocks = model_shape(args)

    work = args.dir
    if comm.rank == 0:
        if work is None:
            work = tempfile.mkdtemp(prefix="bench_ckpt_", dir="/tmp")
        os.makedirs(work, exist_ok=True)
    work = comm.gather(work)[0]

    load_start = os.getloadavg()
    if comm.rank == 0 and load_start[0] > 1.0:
        LOG.warning("the machine is busy (load average %.2f before the start): expect noisy figures", load_start[0])
    LOG.info(
        "world %d, %d x Linear(%d, %d), params + AdamW = %.3f GiB, repeats %d, work dir %s",
        comm.world,
        nblocks,
        dim,
        dim,
        nblocks * (dim * dim + dim) * 12 / (1 << 30),
        R,
        work,
    )
    t0 = time.perf_counter()
    ps = PaddleState(args)
    LOG.info("model built, FSDP-wrapped, AdamW state created in %.1f s", time.perf_counter() - t0)
    rank_bytes = comm.gather(ps.bytes)
    state_bytes = sum(rank_bytes)
    checksum = sum(comm.gather(ps.checksum())) % (1 << 64)
    tracer = Tracer(args.trace)

    res: dict = {"phases": {}, "rss": {}, "trace": {}, "cache": {}}

    def add(name, seconds, nbytes, per=None, **extra):
        ph = res["phases"].setdefault(name, {"seconds": [], "bytes": nbytes, "per_rank": []})
        ph["seconds"].append(seconds)
        ph["per_rank"].append(per)
        for k, v in extra.items():
            ph.setdefault(k, []).append(v)

    def rss(name, pk: PeakRSS):
        res["rss"].setdefault(name, []).append(comm.gather({"base": pk.base, "peak": pk.peak, "extra": pk.extra}))
        res["rss_method"] = pk.method

    def trace(name):
        recs = comm.gather(tracer.take())
        if tracer.enabled:
            res["trace"].setdefault(name, []).append(recs)

    def note_cache(name, files):
        frac = cached_fraction(files)
        res["cache"].setdefault(name, []).append(comm.gather(frac))

    def timed_load(name, path, files=None):
        """Load ``path`` into zeroed targets from a dropped page cache; time it and verify the loaded state."""
        ps.zero()
        if comm.rank == 0:
            drop_cache(files_under(path))
        comm.barrier()
        if files is not None:
            note_cache(name, files)
        with PeakRSS() as pk:
            _, t, per = comm.timed(ps.fsdp.load_checkpoint, path, optimizer=ps.opt, options=tracer.options)
        rss(name, pk)
        trace(name)
        got = sum(comm.gather(ps.checksum())) % (1 << 64)
        if got != checksum:
            raise SystemExit(f"load verification failed: checksum {got} != {checksum}")
        add(name, t, state_bytes, per)
        LOG.info("%s: %.3f s (%.2f GB/s), checksum verified", name, t, state_bytes / t / GB)

    # memcpy baseline of the async blocked time: measured in every round right before the async save, so both
    # see the same machine (this VM's memory bandwidth drifts by up to 1.4x between minutes)
    res["memcpy"] = {"prealloc_s": [], "fresh_s": []}

    keep_ckpt = None
    for rep in range(R):
        LOG.info("---- round %d/%d", rep + 1, R)
        # (a) raw write + fsync
        raw_path = os.path.join(work, f"raw_{rep}_{comm.rank}.bin")
        n, t, per = comm.timed(raw_write, raw_path, ps.arrays())
        add("raw write+fsync", t, state_bytes, per)
        drop_cache([raw_path])
        os.unlink(raw_path)
        LOG.info("raw write+fsync: %.3f s (%.2f GB/s)", t, state_bytes / t / GB)

        # (b) our save, sync
        path = os.path.join(work, f"ckpt_sync_{rep}")
        with PeakRSS() as pk:
            _, t, per = comm.timed(ps.fsdp.save_checkpoint, path, optimizer=ps.opt, options=tracer.options)
        comm.barrier()
        rss("save sync", pk)
        trace("save sync")
        add("save sync", t, state_bytes, per, file_bytes=ckpt_data_bytes(path) if comm.rank == 0 else None)
        LOG.info("save sync: %.3f s (%.2f GB/s)", t, state_bytes / t / GB)
        if comm.rank == 0:
            drop_cache(files_under(path))
        comm.barrier()

        # (b) our save, async (after the memcpy baseline)
        mc = memcpy_times(ps, comm)
        res["memcpy"]["prealloc_s"].append(mc["prealloc_s"])
        res["memcpy"]["fresh_s"].append(mc["fresh_s"])
        LOG.info(
            "memcpy of the rank's state: %.3f s preallocated, %.3f s into fresh memory", mc["prealloc_s"], mc["fresh_s"]
        )
        apath = os.path.join(work, f"ckpt_async_{rep}")
        with PeakRSS() as pk:
            comm.barrier()
            t0 = time.perf_counter()
            handle = ps.fsdp.save_checkpoint(apath, optimizer=ps.opt, async_save=True, options=tracer.options)
            t_block = time.perf_counter() - t0
            handle.wait()
            t_total = time.perf_counter() - t0
        comm.barrier()
        per = comm.gather((t_block, t_total))
        rss("save async", pk)
        trace("save async")
        add("save async (total)", max(p[1] for p in per), state_bytes, [p[1] for p in per])
        add("save async (blocked)", max(p[0] for p in per), state_bytes, [p[0] for p in per])
        LOG.info("save async: blocked %.3f s, total %.3f s", max(p[0] for p in per), max(p[1] for p in per))
        if comm.rank == 0:
            shutil.rmtree(apath, ignore_errors=True)

        # (e) raw read of the checkpoint's data files, same world
        files = data_files(path)
        for variant, (t, per, nbytes, cached) in raw_read_phase(comm, files).items():
            add(f"raw read ({variant})", t, state_bytes, per, file_bytes=nbytes)
            res["cache"].setdefault(f"raw read ({variant})", []).append(cached)
            LOG.info("raw read into %s memory: %.3f s (%.2f GB/s of state)", variant, t, state_bytes / t / GB)
        res["drop_method"] = _DROP_METHOD

        # (d) our load, same world
        timed_load("load", path, files)

        if keep_ckpt is not None and comm.rank == 0:
            shutil.rmtree(keep_ckpt, ignore_errors=True)
        keep_ckpt = path
        comm.barrier()

    # (d) our load with fresh staging memory: no async-save buffer to borrow (like the first load of a job)
    from paddle.distributed.fsdp.checkpoint import release_host_buffers

    for _rep in range(R):
        release_host_buffers()
        timed_load("load (fresh staging)", keep_ckpt)

    # ---- async overlap: compute speed while the save persists in the background
    if args.overlap:
        idle = comm.gather(probe_rate(1.0))
        opath = os.path.join(work, "ckpt_overlap")
        comm.barrier()
        t0 = time.perf_counter()
        handle = ps.fsdp.save_checkpoint(opath, optimizer=ps.opt, async_save=True, options=tracer.options)
        t_block = time.perf_counter() - t0
        busy = probe_rate(stop=handle.done)
        handle.wait()
        t_total = time.perf_counter() - t0
        per = comm.gather((t_block, t_total, busy))
        tracer.take()
        res["overlap"] = {
            "idle_rate": idle,
            "busy_rate": [p[2] for p in per],
            "relative": [p[2] / i for p, i in zip(per, idle)],
            "blocked_s": max(p[0] for p in per),
            "total_s": max(p[1] for p in per),
        }
        LOG.info(
            "async overlap: compute during background save at %s of idle speed (total %.2f s)",
            ", ".join(f"{x:.0%}" for x in res["overlap"]["relative"]),
            res["overlap"]["total_s"],
        )
        if comm.rank == 0:
            shutil.rmtree(opath, ignore_errors=True)
        comm.barrier()

    # (c) all_gather + paddle.save on rank 0
    if not args.no_gather:
        for rep in range(GR):
            gpath = os.path.join(work, f"gathered_{rep}.pdparams")
            with PeakRSS() as pk:
                d, t, _ = comm.timed(gather_and_paddle_save, ps, comm, gpath)
            rss("all_gather + paddle.save", pk)
            size = os.path.getsize(gpath) if comm.rank == 0 else None
            add("all_gather + paddle.save", t, state_bytes, file_bytes=size, split=d)
            LOG.info(
                "all_gather + paddle.save: %.3f s (gather %.2f, save %.2f, fsync %.2f)",
                t,
                d["gather_s"],
                d["save_s"],
                d["fsync_s"],
            )
            if comm.rank == 0:
                os.unlink(gpath)
            comm.barrier()

    info = {"rank_bytes": rank_bytes, "state_bytes": state_bytes, "checksum": checksum}
    comm.barrier()
    # every collective is done: the other ranks leave; rank 0 runs the child jobs
    ps = None  # frees the state (the rank-0 child jobs need the memory)
    gc.collect()
    if comm.rank != 0:
        return

    res["loadavg"] = {"start": load_start, "end": os.getloadavg()}
    res["config"] = {
        "world": comm.world,
        "load_world": load_world,
        "dim": dim,
        "blocks": nblocks,
        "size_gib": args.size_gib,
        "repeats": R,
        "work_dir": work,
        **info,
    }
    if load_world:
        LOG.info("---- changed world: loading with %d ranks", load_world)
        res["changed_world"] = run_child_load(args, keep_ckpt, load_world, checksum, work)
    if not args.no_torch:
        res["torch"] = run_torch(args, comm.world, load_world, work)
    finish(args, res, work)


def run_child_load(args, ckpt: str, world: int, checksum: int, work: str) -> dict:
    out = os.path.join(work, f"load_world{world}.json")
    cmd = [
        sys.executable,
        "-m",
        "paddle.distributed.launch",
        "--nproc_per_node",
        str(world),
        "--log_dir",
        os.path.join(work, f"log_load{world}"),
        os.path.abspath(__file__),
        "--mode",
        "load-only",
        "--ckpt",
        ckpt,
        "--result",
        out,
        "--expect-checksum",
        str(checksum),
        "--size-gib",
        str(args.size_gib),
        "--dim",
        str(args.dim),
        "--repeats",
        str(args.repeats),
        "--seed",
        str(args.seed),
    ] + ([] if args.trace else ["--no-trace"])
    r = subprocess.run(cmd, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if r.returncode != 0 or not os.path.exists(out):
        logs = os.path.join(work, f"log_load{world}")
        raise SystemExit(f"changed-world load failed (exit {r.returncode}); see {logs}")
    with open(out) as f:
        return json.load(f)


def run_load_only(args) -> None:
    """Child job: the same model in another world, raw read + load of --ckpt, results to --result."""
    import paddle.distributed as dist

    dist.init_parallel_env()
    comm = Comm()
    setup_logging(comm.rank, tag=f"-load{comm.world}")
    ps = PaddleState(args, seed_moments=False)
    tracer = Tracer(args.trace)
    files = data_files(args.ckpt)
    res: dict = {
        "world": comm.world,
        "raw read (resident)": [],
        "raw read (ring)": [],
        "load": [],
        "load_per_rank": [],
        "raw_per_rank": [],
        "rss": [],
        "cache": [],
        "trace": [],
    }
    for _rep in range(max(1, args.repeats)):
        rr = raw_read_phase(comm, files)
        for variant, (t, _per, _n, _c) in rr.items():
            res[f"raw read ({variant})"].append(t)
        res["raw_per_rank"].append({v: x[1] for v, x in rr.items()})
        ps.zero()
        if comm.rank == 0:
            drop_cache(files_under(args.ckpt))
        comm.barrier()
        res["cache"].append(comm.gather(cached_fraction(files)))
        with PeakRSS() as pk:
            _, t, per = comm.timed(ps.fsdp.load_checkpoint, args.ckpt, optimizer=ps.opt, options=tracer.options)
        res["load_per_rank"].append(per)
        res["rss"].append(comm.gather({"base": pk.base, "peak": pk.peak, "extra": pk.extra, "slice": ps.bytes}))
        res["trace"].append(comm.gather(tracer.take()))
        got = sum(comm.gather(ps.checksum())) % (1 << 64)
        if args.expect_checksum is not None and got != args.expect_checksum:
            raise SystemExit(f"changed-world load verification failed: {got} != {args.expect_checksum}")
        res["load"].append(t)
        LOG.info(
            "world %d: raw read %.3f s (resident) / %.3f s (ring), load %.3f s (checksum verified)",
            comm.world,
            res["raw read (resident)"][-1],
            res["raw read (ring)"][-1],
            t,
        )
    res["rank_bytes"] = comm.gather(ps.bytes)
    if comm.rank == 0:
        with open(args.result, "w") as f:
            json.dump(res, f)


# ============================================================================================ torch side


def run_torch(args, world: int, load_world: int, work: str) -> dict | None:
    try:
        import importlib.util

        if importlib.util.find_spec("torch") is None:
            LOG.info("torch is not importable: PyTorch DCP skipped")
            return None
    except ImportError:
        return None
    ckpt = os.path.join(work, "torch_dcp")
    LOG.info("---- PyTorch DCP (FSDP2, gloo), %d ranks: save + load", world)
    out: dict = {"same": spawn_torch(args, world, "save-load", ckpt, work)}
    out["version"] = out["same"].get("version")
    saved = out["same"]["saved_param_sum"]
    if load_world:
        LOG.info("---- PyTorch DCP, changed world: load with %d ranks", load_world)
        out["changed"] = spawn_torch(args, load_world, "load", ckpt, work)
    for k in ("same", "changed"):
        if k in out:
            ok = abs(out[k]["param_sum"] - saved) <= 1e-9 * max(1.0, abs(saved))
            out[k]["verified"] = ok
            if not ok:
                LOG.warning("torch DCP %s-world load: parameter sum %r != saved %r", k, out[k]["param_sum"], saved)
    shutil.rmtree(ckpt, ignore_errors=True)
    return out


def spawn_torch(args, world: int, task: str, ckpt: str, work: str) -> dict:
    port = free_port()
    result = os.path.join(work, f"torch_{task}_{world}.json")
    procs = []
    logs = []
    for r in range(world):
        log = open(os.path.join(work, f"torch_{task}_{world}_rank{r}.log"), "w")
        logs.append(log)
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--mode",
            "torch-worker",
            "--torch-rank",
            str(r),
            "--torch-world",
            str(world),
            "--torch-port",
            str(port),
            "--torch-task",
            task,
            "--ckpt",
            ckpt,
            "--result",
            result,
            "--size-gib",
            str(args.size_gib),
            "--dim",
            str(args.dim),
            "--repeats",
            str(args.repeats),
            "--seed",
            str(args.seed),
        ]
        procs.append(subprocess.Popen(cmd, env=clean_env(), stdout=log, stderr=subprocess.STDOUT))
    codes = [p.wait() for p in procs]
    for log in logs:
        log.close()
    if any(codes) or not os.path.exists(result):
        raise SystemExit(f"torch workers failed ({codes}); see {work}/torch_{task}_{world}_rank*.log")
    with open(result) as f:
        return json.load(f)


def run_torch_worker(args) -> None:
    import torch
    import torch.distributed as tdist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, world = args.torch_rank, args.torch_world
    setup_logging(rank, tag=f"-torch{world}")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    tdist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.torch_port}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    dim, n = model_shape(args)
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(n)])
    for m in model:
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    msd, osd = get_state_dict(model, opt)  # creates the AdamW state (exp_avg, exp_avg_sq, step)
    g = torch.Generator().manual_seed(args.seed + 1 + rank)
    nbytes = 0
    with torch.no_grad():
        for p in model.parameters():
            nbytes += p.to_local().numel() * p.element_size()
        for st in opt.state.values():
            for k, v in st.items():
                loc = v.to_local() if hasattr(v, "to_local") else v
                if k in ("exp_avg", "exp_avg_sq"):
                    loc.copy_(torch.rand(loc.shape, generator=g))
                nbytes += loc.numel() * loc.element_size()
    res: dict = {"world": world, "save": [], "load": [], "load_split": [], "rss_save": [], "rss_load": []}

    def timed(fn):
        tdist.barrier()
        t0 = time.perf_counter()
        r = fn()
        dt = time.perf_counter() - t0
        per = [None] * world
        tdist.all_gather_object(per, dt)
        return r, max(per)

    def gather(obj):
        per = [None] * world
        tdist.all_gather_object(per, obj)
        return per

    def param_sum() -> float:
        with torch.no_grad():
            return sum(gather(sum(float(p.to_local().double().sum()) for p in model.parameters())))

    R = max(1, args.repeats)
    if args.torch_task == "save-load":
        res["saved_param_sum"] = param_sum()
        for _rep in range(R):
            if rank == 0 and os.path.exists(args.ckpt):
                shutil.rmtree(args.ckpt)
            tdist.barrier()
            with PeakRSS() as pk:
                _, t = timed(lambda: dcp.save({"model": msd, "optim": osd}, checkpoint_id=args.ckpt))
            res["rss_save"].append(gather({"base": pk.base, "peak": pk.peak, "extra": pk.extra}))
            res["save"].append(t)
            if rank == 0:
                drop_cache(files_under(args.ckpt))
            LOG.info("torch DCP save: %.3f s", t)
    # load: dcp.load into the live state dicts, then set_state_dict (as a resume does)
    for _rep in range(R):
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().zero_()
            for st in opt.state.values():
                for k in ("exp_avg", "exp_avg_sq"):
                    v = st[k]
                    (v.to_local() if hasattr(v, "to_local") else v).zero_()
        if rank == 0:
            drop_cache(files_under(args.ckpt))
        tdist.barrier()

        def load():
            m2, o2 = get_state_dict(model, opt)
            t0 = time.perf_counter()
            dcp.load({"model": m2, "optim": o2}, checkpoint_id=args.ckpt)
            t1 = time.perf_counter()
            set_state_dict(model, opt, model_state_dict=m2, optim_state_dict=o2)
            return (t1 - t0, time.perf_counter() - t1)

        with PeakRSS() as pk:
            split, t = timed(load)
        res["rss_load"].append(gather({"base": pk.base, "peak": pk.peak, "extra": pk.extra}))
        res["load"].append(t)
        res["load_split"].append(split)
        LOG.info("torch DCP load: %.3f s (dcp.load %.3f, set_state_dict %.3f)", t, *split)
    res["param_sum"] = param_sum()  # after the last load; compared with the saved sum by the parent
    res["version"] = torch.__version__
    res["rank_bytes"] = gather(nbytes)
    res["file_bytes"] = sum(os.path.getsize(f) for f in files_under(args.ckpt)) if rank == 0 else None
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump(res, f)
    tdist.barrier()
    # gloo's teardown at interpreter exit sometimes aborts ("terminate called without an active
    # exception") after all work is done: leave without it
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ============================================================================================ report


def finish(args, res: dict, work: str) -> None:
    cfg = res["config"]
    S = cfg["state_bytes"]
    ph = res["phases"]
    med = {k: median(v["seconds"]) for k, v in ph.items()}
    cw = res.get("changed_world")
    tor = res.get("torch") or {}
    tsame, tchg = tor.get("same"), tor.get("changed")
    M = cfg["load_world"]
    rows = []  # (name, seconds list, limit seconds, torch seconds)

    def row(name, secs, limit=None, torch_s=None, note=""):
        rows.append(
            {
                "name": name,
                "seconds": secs,
                "median_s": median(secs),
                "gbps": S / median(secs) / GB,
                "vs_limit": (limit / median(secs)) if limit else None,
                "vs_torch": (torch_s / median(secs)) if torch_s else None,
                "note": note,
            }
        )

    W = cfg["world"]

    def best_raw(d):
        """The faster raw-read variant: (name, seconds list)."""
        cands = [(v, d[f"raw read ({v})"]) for v in ("resident", "ring") if d.get(f"raw read ({v})")]
        return min(cands, key=lambda c: median(c[1]))

    raw_same = best_raw({k: v["seconds"] for k, v in ph.items()})
    raw_chg = best_raw(cw) if cw else None
    lim_w, lim_r = med["raw write+fsync"], median(raw_same[1])
    lim_r2 = median(raw_chg[1]) if cw else None
    ts = median(tsame["save"]) if tsame else None
    tl = median(tsame["load"]) if tsame else None
    tl2 = median(tchg["load"]) if tchg else None
    row(f"raw write+fsync ({W} ranks)", ph["raw write+fsync"]["seconds"], lim_w, ts, "limit for saves")
    row("save sync", ph["save sync"]["seconds"], lim_w, ts)
    row("save async, total", ph["save async (total)"]["seconds"], lim_w, ts)
    if "all_gather + paddle.save" in ph:
        row("all_gather + paddle.save (rank 0)", ph["all_gather + paddle.save"]["seconds"], lim_w, ts, "pre-fork")
    if tsame:
        row(f"torch DCP save ({W} ranks)", tsame["save"], lim_w, ts)
    for v in ("resident", "ring"):
        row(
            f"raw read ({W} ranks, {v})",
            ph[f"raw read ({v})"]["seconds"],
            lim_r,
            tl,
            "limit for loads" if v == raw_same[0] else "",
        )
    row(f"load ({W} ranks)", ph["load"]["seconds"], lim_r, tl, "staging: async-save buffer")
    if "load (fresh staging)" in ph:
        row(f"load ({W} ranks, fresh staging)", ph["load (fresh staging)"]["seconds"], lim_r, tl)
    if tsame:
        row(f"torch DCP load ({W} ranks)", tsame["load"], lim_r, tl)
    if cw:
        for v in ("resident", "ring"):
            row(
                f"raw read ({M} ranks, {v})",
                cw[f"raw read ({v})"],
                lim_r2,
                tl2,
                "limit, changed world" if v == raw_chg[0] else "",
            )
        row(f"load {W}->{M} ranks", cw["load"], lim_r2, tl2)
        if tchg:
            row(f"torch DCP load {W}->{M} ranks", tchg["load"], lim_r2, tl2)

    mc = median(res["memcpy"]["prealloc_s"])
    mcf = median(res["memcpy"]["fresh_s"])
    blocked = median(ph["save async (blocked)"]["seconds"])

    def rss_extra(name):
        runs = res["rss"].get(name, [])
        return [max(r[i]["extra"] for r in runs) for i in range(len(runs[0]))] if runs else []

    rank_bytes = cfg["rank_bytes"]
    save_extra = rss_extra("save sync")
    async_extra = rss_extra("save async")
    load_extra = rss_extra("load")
    fresh_extra = rss_extra("load (fresh staging)")
    chunk_bound = 64 << 20  # the engine's largest read window (reader.DEFAULT_WINDOW)
    cw_extra = []
    if cw:
        n = len(cw["rss"][0])
        cw_extra = [max(r[i]["extra"] for r in cw["rss"]) for i in range(n)]
        cw_slice = cw["rss"][0]
    targets = []

    def target(name, value, goal, ok, detail=""):
        targets.append({"target": name, "measured": value, "goal": goal, "met": bool(ok), "detail": detail})

    def r_of(title):
        return next((r for r in rows if r["name"] == title), None)

    def paired(limit_phase, phase):
        """Per-round speed ratios (limit time / phase time, both measured in the same round): drift of the
        machine between rounds cancels; shown next to the ratio of medians."""
        lim, got = ph[limit_phase]["seconds"], ph[phase]["seconds"]
        ratios = sorted(a / b for a, b in zip(lim, got))
        return f" (paired per round: median {median(ratios):.2f}x, {ratios[0]:.2f}-{ratios[-1]:.2f}x)"

    s = r_of("save sync")
    target(
        "save >= 0.9x raw write+fsync",
        f"{s['vs_limit']:.2f}x" + paired("raw write+fsync", "save sync"),
        ">= 0.90x",
        s["vs_limit"] >= 0.9,
    )
    if s["vs_torch"]:
        target("save >= 1.5x torch DCP", f"{s['vs_torch']:.2f}x", ">= 1.50x", s["vs_torch"] >= 1.5)
    for title in (f"load ({W} ranks)", f"load ({W} ranks, fresh staging)"):
        ld = r_of(title)
        if ld is None:
            continue
        extra = paired("raw read (ring)", "load") if title == f"load ({W} ranks)" else ""
        target(f"{title} >= 0.8x raw read", f"{ld['vs_limit']:.2f}x{extra}", ">= 0.80x", ld["vs_limit"] >= 0.8)
        if ld["vs_torch"]:
            target(f"{title} >= 1.2x torch DCP", f"{ld['vs_torch']:.2f}x", ">= 1.20x", ld["vs_torch"] >= 1.2)
    if cw:
        l2 = r_of(f"load {W}->{M} ranks")
        target(f"load {W}->{M} ranks >= 0.8x raw read", f"{l2['vs_limit']:.2f}x", ">= 0.80x", l2["vs_limit"] >= 0.8)
        if l2["vs_torch"]:
            target(
                f"load {W}->{M} ranks >= 1.2x torch DCP", f"{l2['vs_torch']:.2f}x", ">= 1.20x", l2["vs_torch"] >= 1.2
            )
    per_round = sorted(b / m for b, m in zip(ph["save async (blocked)"]["seconds"], res["memcpy"]["prealloc_s"]))
    target(
        "async blocked <= 1.5x memcpy",
        f"{blocked:.3f} s = {blocked / mc:.2f}x memcpy ({mc:.3f} s; per round "
        f"median {median(per_round):.2f}x, {per_round[0]:.2f}-{per_round[-1]:.2f}x)",
        "<= 1.50x",
        blocked <= 1.5 * mc,
        f"memcpy into fresh memory {mcf:.3f} s ({blocked / mcf:.2f}x)",
    )
    worst_save = max(e / b for e, b in zip(save_extra, rank_bytes))
    target(
        "extra RSS save <= 5% of state",
        f"{worst_save:.1%} (max over ranks)",
        "<= 5%",
        worst_save <= 0.05,
        "per rank MiB: " + ", ".join(f"{e / 2**20:.1f}" for e in save_extra),
    )
    worst_load = max(e - b for e, b in zip(load_extra, rank_bytes))
    target(
        f"extra RSS load ({W} ranks) <= slice + chunk",
        f"slice + {worst_load / 2**20:.1f} MiB",
        f"<= slice + {chunk_bound >> 20} MiB",
        worst_load <= chunk_bound,
        "extra per rank MiB: " + ", ".join(f"{e / 2**20:.1f}" for e in load_extra),
    )
    if fresh_extra:
        worst_f = max(e - b for e, b in zip(fresh_extra, rank_bytes))
        target(
            f"extra RSS load ({W} ranks, fresh staging) <= slice + chunk",
            f"slice + {worst_f / 2**20:.1f} MiB",
            f"<= slice + {chunk_bound >> 20} MiB",
            worst_f <= chunk_bound,
            "extra per rank MiB: " + ", ".join(f"{e / 2**20:.1f}" for e in fresh_extra),
        )
    if cw:
        worst2 = max(e - r["slice"] for e, r in zip(cw_extra, cw_slice))
        target(
            f"extra RSS load {W}->{M} <= slice + chunk",
            f"slice + {worst2 / 2**20:.1f} MiB",
            f"<= slice + {chunk_bound >> 20} MiB",
            worst2 <= chunk_bound,
            "extra per rank MiB: " + ", ".join(f"{e / 2**20:.1f}" for e in cw_extra),
        )

    # ---- print
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    lines = []
    lines.append(
        f"Checkpoint benchmark, {date}, {platform.node()} ({os.cpu_count()} cores), "
        f"paddle {_paddle_version()}" + (f", torch {tor.get('version')}" if tor else "")
    )
    lines.append(
        f"state: {S / GB:.3f} GB ({cfg['blocks']} x Linear({cfg['dim']}, {cfg['dim']}) + AdamW, fp32), "
        f"{W} ranks, changed world {M}, medians of {cfg['repeats']} runs; page cache: "
        f"{res.get('drop_method')}; cached before reads: {_cache_summary(res, cw)}; load average "
        f"{res['loadavg']['start'][0]:.2f} at start, {res['loadavg']['end'][0]:.2f} before the child jobs"
    )
    lines.append("")
    lines.append("| phase | seconds (median, min-max) | GB/s | x raw limit | x torch DCP |")
    lines.append("|---|---|---|---|---|")
    for r in rows:
        sec = r["seconds"]
        name = r["name"] + (f" ({r['note']})" if r["note"] else "")
        lines.append(
            f"| {name} | {r['median_s']:.3f} ({min(sec):.3f}-{max(sec):.3f}) | {r['gbps']:.2f} | "
            f"{_x(r['vs_limit'])} | {_x(r['vs_torch'])} |"
        )
    lines.append(f"| save async, caller blocked | {blocked:.3f} | - | {blocked / mc:.2f}x memcpy | - |")
    first = ph["save async (blocked)"]["seconds"][0]
    lines.append(
        f"| save async, caller blocked, first save (allocates the snapshot buffer) | {first:.3f} | - | "
        f"{first / mc:.2f}x memcpy | - |"
    )
    lines.append(
        f"| host memcpy of rank state (prealloc / fresh) | {mc:.3f} / {mcf:.3f} | "
        f"{S / W / mc / GB:.2f} / {S / W / mcf / GB:.2f} per rank | - | - |"
    )
    if res.get("overlap"):
        ov = res["overlap"]
        lines.append(
            f"| compute speed during async persistence | {ov['total_s']:.3f} total | - | "
            f"{', '.join(f'{x:.0%}' for x in ov['relative'])} of idle | - |"
        )
    lines.append("")
    lines.append("| peak RSS over baseline, per rank (MiB) | values | rank state (MiB) |")
    lines.append("|---|---|---|")
    rb = ", ".join(f"{b / 2**20:.0f}" for b in rank_bytes)
    lines.append(f"| save sync | {', '.join(f'{e / 2**20:.1f}' for e in save_extra)} | {rb} |")
    lines.append(f"| save async (snapshot) | {', '.join(f'{e / 2**20:.1f}' for e in async_extra)} | {rb} |")
    lines.append(
        f"| load ({W} ranks, staging in the resident async-save buffer) | "
        f"{', '.join(f'{e / 2**20:.1f}' for e in load_extra)} | {rb} |"
    )
    if fresh_extra:
        lines.append(
            f"| load ({W} ranks, fresh staging) | {', '.join(f'{e / 2**20:.1f}' for e in fresh_extra)} | {rb} |"
        )
    if cw:
        lines.append(
            f"| load {W}->{M} ranks | {', '.join(f'{e / 2**20:.1f}' for e in cw_extra)} | "
            + ", ".join(f"{r['slice'] / 2**20:.0f}" for r in cw_slice)
            + " |"
        )
    if tsame:
        ts_x = [max(r[i]["extra"] for r in tsame["rss_save"]) for i in range(W)]
        tl_x = [max(r[i]["extra"] for r in tsame["rss_load"]) for i in range(W)]
        lines.append(f"| torch DCP save | {', '.join(f'{e / 2**20:.1f}' for e in ts_x)} | {rb} |")
        lines.append(f"| torch DCP load | {', '.join(f'{e / 2**20:.1f}' for e in tl_x)} | {rb} |")
    if "all_gather + paddle.save" in res["rss"]:
        g_x = rss_extra("all_gather + paddle.save")
        lines.append(f"| all_gather + paddle.save | {', '.join(f'{e / 2**20:.1f}' for e in g_x)} | {rb} |")
    lines.append("")
    lines.append("| target | measured | goal | met |")
    lines.append("|---|---|---|---|")
    for t in targets:
        lines.append(f"| {t['target']} | {t['measured']} | {t['goal']} | {'yes' if t['met'] else 'NO'} |")
    lines += _trace_summary(res, cw)
    print("\n".join(lines), flush=True)
    if args.json:
        out = {
            "date": date,
            "host": platform.node(),
            "cores": os.cpu_count(),
            "paddle": _paddle_version(),
            "rows": rows,
            "targets": targets,
            "memcpy": res["memcpy"],
            "rss_method": res.get("rss_method"),
            "drop_method": res.get("drop_method"),
            **{k: res[k] for k in res if k not in ("memcpy",)},
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
        LOG.info("results written to %s", args.json)
    if not args.keep and args.dir is None:
        shutil.rmtree(work, ignore_errors=True)


def _x(v):
    return f"{v:.2f}x" if v else "-"


def _paddle_version():
    try:
        import paddle

        return paddle.__version__
    except ImportError:
        return "?"


def _cache_summary(res, cw) -> str:
    vals = [x for runs in res["cache"].values() for run in runs for x in run if x is not None]
    if cw:
        vals += [x for run in cw["cache"] for x in run if x is not None]
    return f"max {max(vals):.1%} of pages" if vals else "unknown"


def _trace_summary(res, cw) -> list[str]:
    """Median engine phase timings (rank 0 / slowest) from the engine's trace hook."""
    out = []
    groups = dict(res.get("trace", {}))
    if cw and cw.get("trace"):
        groups[f"load {cw['world']} ranks"] = cw["trace"]
    for name, runs in groups.items():
        per_what: dict = {}
        for run in runs:
            for rank, recs in enumerate(run):
                for rec in recs:
                    d = per_what.setdefault((rec["what"], rank), {})
                    for m, v in rec["marks"].items():
                        d.setdefault(m, []).append(v)
                    d.setdefault("total", []).append(rec["total"])
        if not per_what:
            continue
        if not out:
            out += ["", "engine phases (trace hook, median ms):"]
        for (what, rank), d in sorted(per_what.items(), key=lambda x: (x[0][1], x[0][0])):
            if rank > 1:
                continue
            out.append(
                f"  {name:>12} | {what} [rank {rank}]: " + " ".join(f"{m}={median(v) * 1000:.0f}" for m, v in d.items())
            )
    return out


# ============================================================================================ entry


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.mode == "torch-worker":
        run_torch_worker(args)
        return
    launched = "PADDLE_TRAINER_ID" in os.environ or "PADDLE_TRAINERS_NUM" in os.environ
    if not launched:
        world = args.world or 2
        setup_logging(0)
        log_dir = tempfile.mkdtemp(prefix="bench_ckpt_log_")
        cmd = [
            sys.executable,
            "-m",
            "paddle.distributed.launch",
            "--nproc_per_node",
            str(world),
            "--log_dir",
            log_dir,
            os.path.abspath(__file__),
            *(argv if argv is not None else sys.argv[1:]),
        ]
        LOG.info("launching: %s (worker logs in %s)", " ".join(cmd), log_dir)
        rc = subprocess.call(cmd)
        if rc == 0:
            shutil.rmtree(log_dir, ignore_errors=True)
        else:
            LOG.error("benchmark failed (exit %d); worker logs in %s", rc, log_dir)
        sys.exit(rc)
    if args.mode == "load-only":
        run_load_only(args)
    else:
        run_full(args)


if __name__ == "__main__":
    main()
