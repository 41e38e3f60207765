"""The measured phases on the paddle side: raw write/read limits, the engine's sync/async save and load (through
``fsdp.save_checkpoint`` / ``load_checkpoint`` with the engine's public trace hook), the pre-fork all-gather +
``paddle.save``, and a load in a changed world (a child launch of the entry point)."""

from __future__ import annotations

import ctypes
import gc
import json
import math
import os
import shutil
import subprocess
import tempfile
import time

import numpy as np

from .common import (
    DIRECT_SLAB,
    GB,
    LOG,
    RAW_READ_VARIANTS,
    READ_SLAB,
    WRITE_SLAB,
    PeakRSS,
    cached_fraction,
    clean_env,
    data_files,
    drop_cache,
    drop_method,
    files_under,
    launch_cmd,
    model_shape,
    setup_logging,
    state_args,
)
from .report import finish
from .torch_dcp import TorchDCP


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


def raw_write_direct(path: str, arrays: list[np.ndarray]) -> int:
    """Write the arrays to one file with O_DIRECT: copied into one reused page-aligned DIRECT_SLAB buffer, each full
    buffer written, the last one padded and the file truncated to its size, one fsync (buffered where the file
    system refuses O_DIRECT)."""
    import mmap

    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        dfd = os.open(path, os.O_WRONLY | getattr(os, "O_DIRECT", 0))
    except OSError:
        dfd = fd
    buf = np.frombuffer(mmap.mmap(-1, DIRECT_SLAB), np.uint8)
    n = fill = off = 0
    try:
        for a in arrays:
            mv = np.frombuffer(memoryview(a).cast("B"), np.uint8)
            i = 0
            while i < len(mv):
                take = min(len(mv) - i, DIRECT_SLAB - fill)
                buf[fill : fill + take] = mv[i : i + take]
                fill += take
                i += take
                if fill == DIRECT_SLAB:
                    off += os.pwrite(dfd, buf, off)
                    fill = 0
            n += len(mv)
        if fill:
            aligned = -(-fill // 4096) * 4096
            buf[fill:aligned] = 0
            os.pwrite(dfd, memoryview(buf)[:aligned], off)
            os.ftruncate(fd, off + fill)
        os.fsync(fd)
    finally:
        if dfd != fd:
            os.close(dfd)
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


def raw_read_direct(segments, buf) -> int:
    """pread the segments with O_DIRECT in DIRECT_SLAB reads into one reused page-aligned buffer (segment ends
    widened to 4 KiB, as O_DIRECT needs); where the file system refuses O_DIRECT, buffered."""
    mv = memoryview(buf).cast("B")
    n = 0
    for path, off, length in segments:
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        except OSError:
            fd = os.open(path, os.O_RDONLY)
        try:
            pos, end = (off // 4096) * 4096, -(-(off + length) // 4096) * 4096
            while pos < end:
                got = os.preadv(fd, [mv[: min(DIRECT_SLAB, end - pos)]], pos)
                if got <= 0:
                    break
                pos += got
            n += length
        finally:
            os.close(fd)
    return n


def raw_read_phase(comm, files: list[str]) -> dict:
    """The raw-read variants (RAW_READ_VARIANTS) of this world's equal shares of ``files``, page cache dropped
    before each.

    Returns {variant: (wall seconds, per-rank seconds, bytes read, cached fraction per rank)}; the load
    limit is the fastest variant (resident memory is what a load fills; the rings isolate the I/O; O_DIRECT
    skips the page cache, which is faster on some machines)."""
    import mmap

    segs = share_of(files, comm.rank, comm.world)
    out = {}
    for variant in RAW_READ_VARIANTS:
        if variant == "resident":
            buf = read_buffer(segs)
        elif variant == "ring":
            buf = np.empty(READ_SLAB, np.uint8)
            buf[:] = 0
        else:
            buf = np.frombuffer(mmap.mmap(-1, DIRECT_SLAB), np.uint8)  # page aligned
            buf[:] = 0
        if comm.rank == 0:
            drop_cache(files)
        comm.barrier()
        cached = comm.gather(cached_fraction(files))
        if variant == "direct":
            n, t, per = comm.timed(raw_read_direct, segs, buf)
        else:
            n, t, per = comm.timed(raw_read, segs, buf, variant == "ring")
        out[variant] = (t, per, sum(comm.gather(n)), cached)
        del buf
    return out


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
    """uint8 view of a contiguous host tensor's memory (no copy); device memory is refused, not read through
    a pointer the CPU cannot follow (that segfaults on a GPU)."""
    from paddle.distributed.fsdp.devices import device

    n = math.prod(t.shape) * t.element_size()  # from the shape: numel() is an op (none may run on staging)
    if n == 0:
        return np.zeros(0, np.uint8)
    if not device.is_host(t) or not t.is_contiguous():
        raise device.DeviceMemoryAccessError(
            f"bench: a tensor on {t.place} is not contiguous host memory; its bytes cannot be viewed in place "
            "(copy it with paddle.distributed.fsdp.devices.device.to_host)"
        )
    return np.frombuffer((ctypes.c_ubyte * n).from_address(device.data_ptr(t)), dtype=np.uint8)


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
        n, t, per = comm.timed(raw_write_direct, raw_path, ps.arrays())
        add("raw write+fsync, O_DIRECT", t, state_bytes, per)
        os.unlink(raw_path)
        LOG.info("raw write+fsync, O_DIRECT: %.3f s (%.2f GB/s)", t, state_bytes / t / GB)

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

        res["drop_method"] = drop_method()

        if keep_ckpt is not None and comm.rank == 0:
            shutil.rmtree(keep_ckpt, ignore_errors=True)
        keep_ckpt = path
        comm.barrier()

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

    # ---- many small keys: the engine's bookkeeping per key (many_keys.py)
    if args.keys > 0:
        from .many_keys import run_many_keys, summary

        res["many_keys"] = run_many_keys(comm, args.keys, R, work, tracer.options.replace(trace_hook=None))
        LOG.info("%s", summary(res["many_keys"]))

    # ---- hybrid sharding: bytes written/read per rank, HSDP against plain FSDP (hsdp.py)
    hsdp_r = getattr(args, "hsdp_replicas", 0)
    if hsdp_r > 1 and comm.world % hsdp_r == 0 and comm.world // hsdp_r > 1:
        from .hsdp import run_hsdp, summary

        res["hsdp"] = run_hsdp(comm, hsdp_r, args.hsdp_dim, work)
        for line in summary(res["hsdp"]):
            LOG.info("%s", line)

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
    # (d) + (e) loads, each the first load of a fresh process (no buffer left by an earlier save or load), next to
    # the raw reads of the same bytes in that process (before and after it); configurations, and torch DCP's
    # loads, round robin so drift hits all alike
    # (name, ranks, page cache, atomic, verify checksums)
    configs = [("same", comm.world, "cold", False, True), ("warm", comm.world, "warm", False, True)]
    if load_world:
        configs.append(("changed", load_world, "cold", False, True))
    configs.append(("atomic", comm.world, "cold", True, True))
    configs.append(("warm, unverified", comm.world, "warm", False, False))  # what checksums cost from the cache
    res["fresh_loads"] = {name: [] for name, *_ in configs}
    torch_dcp = None if args.no_torch else TorchDCP.start(args, comm.world, load_world, work)
    for rep in range(R):
        for name, world, cache, atomic, verify in configs:
            tag = f"{name.replace(', ', '_')}_{rep}"
            got = run_child_load(args, keep_ckpt, world, checksum, work, cache, atomic, tag, verify)
            res["fresh_loads"][name].append(got)
            LOG.info(
                "fresh-process load, %s (%d ranks, %s cache%s): load %.3f s, raw read before / after it %s",
                name,
                world,
                cache,
                ", atomic" if atomic else "",
                got["load"],
                ", ".join(f"{k} {v:.3f} / {got['raw_after'][k]:.3f} s" for k, v in got["raw"].items()),
            )
        if torch_dcp is not None:  # torch's loads in the same rounds: the disk's drift hits both alike
            torch_dcp.load_round(rep)
    if torch_dcp is not None:
        res["torch"] = torch_dcp.finish()
    if args.train:
        from .train_loop import run_training_loops

        res["train_loop"] = run_training_loops(args, [comm.world, 1], work)
    finish(args, res, work)


def run_child_load(
    args, ckpt: str, world: int, checksum: int, work: str, cache: str, atomic: bool, tag: str, verify: bool = True
) -> dict:
    """One fresh ``paddle.distributed.launch`` of ``world`` ranks: raw read + the first load of the process."""
    out = os.path.join(work, f"load_{tag}.json")
    script_args = ["--mode", "load-only", "--ckpt", ckpt, "--result", out, "--expect-checksum", str(checksum)]
    script_args += state_args(args) + ["--cache", cache] + ([] if args.trace else ["--no-trace"])
    script_args += (["--atomic"] if atomic else []) + ([] if verify else ["--no-verify"])
    cmd = launch_cmd(world, os.path.join(work, f"log_load_{tag}"), script_args)
    r = subprocess.run(cmd, env=clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if r.returncode != 0 or not os.path.exists(out):
        logs = os.path.join(work, f"log_load_{tag}")
        raise SystemExit(f"fresh-process load {tag} failed (exit {r.returncode}); see {logs}")
    with open(out) as f:
        return json.load(f)


def warm_page_cache(files: list[str]) -> None:
    """Read every file once (into one reused buffer), so its pages are in the page cache."""
    buf = np.empty(READ_SLAB, np.uint8)
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            off = 0
            while True:
                n = os.preadv(fd, [buf], off)
                if n <= 0:
                    break
                off += n
        finally:
            os.close(fd)


def raw_limits(comm, args, files: list[str]) -> tuple[dict, dict]:
    """The raw reads a fresh load is compared with, as ({variant: wall s}, {variant: per-rank s}): cold, every
    RAW_READ_VARIANTS with the page cache dropped before each; warm, a plain read into resident memory of the
    files read once just before."""
    if args.cache == "cold":
        rr = raw_read_phase(comm, files)
        return {v: x[0] for v, x in rr.items()}, {v: x[1] for v, x in rr.items()}
    if comm.rank == 0:
        warm_page_cache(files_under(args.ckpt))
    comm.barrier()
    segs = share_of(files, comm.rank, comm.world)
    buf = read_buffer(segs)
    _n, t_res, per_res = comm.timed(raw_read, segs, buf)
    return {"resident": t_res}, {"resident": per_res}


def run_load_only(args) -> None:
    """Child job: in a fresh process, the raw read of this world's shares of --ckpt's files, then the first load
    of the process, then the raw read again (cold: page cache dropped before each; warm: files read once before
    each), results to --result."""
    import paddle.distributed as dist

    dist.init_parallel_env()
    comm = Comm()
    setup_logging(comm.rank, tag=f"-load{comm.world}")
    ps = PaddleState(args, seed_moments=False)
    ps.zero()  # targets resident (touched), as a model's tensors are
    tracer = Tracer(args.trace)
    files = data_files(args.ckpt)
    res: dict = {"world": comm.world, "cache_mode": args.cache, "atomic": args.atomic}
    res["raw"], res["raw_per_rank"] = raw_limits(comm, args, files)
    if args.cache == "cold" and comm.rank == 0:
        drop_cache(files_under(args.ckpt))
    comm.barrier()
    res["cache"] = comm.gather(cached_fraction(files))
    with PeakRSS() as pk:
        result, t, per = comm.timed(
            ps.fsdp.load_checkpoint,
            args.ckpt,
            optimizer=ps.opt,
            atomic=args.atomic,
            verify_checksums=args.verify,
            options=tracer.options,
        )
    res["load"] = t
    res["load_per_rank"] = per
    res["rss"] = comm.gather({"base": pk.base, "peak": pk.peak, "extra": pk.extra, "slice": ps.bytes})
    res["engine_host"] = comm.gather(
        {"peak": result.report.peak_host_bytes, "budget": result.report.host_budget, "slice": ps.bytes}
    )
    res["trace"] = comm.gather(tracer.take())
    got = sum(comm.gather(ps.checksum())) % (1 << 64)
    if args.expect_checksum is not None and got != args.expect_checksum:
        raise SystemExit(f"fresh-process load verification failed: {got} != {args.expect_checksum}")
    res["rank_bytes"] = comm.gather(ps.bytes)
    # the raw reads once more after the load (A-B-A): their mean with the ones before cancels a steady drift of
    # the disk or memory speed over the ~10 s of this process, which a read before the load alone would not
    res["raw_after"], res["raw_after_per_rank"] = raw_limits(comm, args, files)
    if comm.rank == 0:
        with open(args.result, "w") as f:
            json.dump(res, f)
