"""The memory tier phase (issue 34): MemoryTier saves and restores against a memcpy and a cold disk load.

On the benchmark's state (PaddleState: Linear blocks + AdamW, sharded by FullyShardFusion), every rank:

* ``memcpy``: its state copied into a preallocated, touched buffer (the reference of a blocking save);
* ``memtier save``: ``tier.save`` blocking time (the call), the time until the tensors are copied (what the next
  optimizer step would wait for at worst) and until the background part ends (checksums + peer transfer); the
  first save (slot allocation) separately;
* ``host memory``: bytes the tier's files occupy (own copy + the peer copy it holds) against the state bytes;
* ``interference``: a fixed matmul workload on the training thread right after ``tier.save`` returned (the
  copy, checksums and peer transfer running in the background) against the same workload with nothing in flight;
* ``persist``: a save that is also persisted (from the memory copy, persist thread) until the checkpoint is
  committed;
* ``restore``: the state zeroed, then ``tier.restore()`` from the own memory copy, from the peer copy (every own
  file deleted; each rank receives while it sends), from the peer copy on the odd ranks only (a lost node),
  and ``fsdp.load_checkpoint`` of the same step from disk with the page cache dropped (cold); each checked
  against the saved state's checksum.

Partners: rank r's copy is held by rank r^1 (pairs), so the peer path crosses the process group.
Times are the slowest rank's, medians over ``--repeats``.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

from .common import LOG, drop_cache
from .phases import Comm, PaddleState, data_files


def _med(xs: list[float]) -> float:
    return statistics.median(xs)


def _timed_max(comm: Comm, fn) -> tuple[float, object]:
    comm.barrier()
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    return max(comm.gather(dt)), out


def _memcpy(ps: PaddleState, comm: Comm, repeats: int) -> float:
    arrays = ps.arrays()
    buf = np.empty(sum(len(a) for a in arrays), np.uint8)
    buf[:] = 1

    def copy():
        pos = 0
        for a in arrays:
            np.copyto(buf[pos : pos + len(a)], a)
            pos += len(a)

    return _med([_timed_max(comm, copy)[0] for _ in range(repeats)])


def _saves(tier, comm: Comm, repeats: int) -> dict:
    from paddle.distributed.fsdp.checkpoint import wait_for_snapshot

    first, _ = _timed_max(comm, lambda: (tier.save(1), tier.wait()))
    blocked, copied, total, exchange = [], [], [], []
    for i in range(repeats):
        comm.barrier()
        t0 = time.perf_counter()
        tier.save(2 + i)
        t1 = time.perf_counter()
        wait_for_snapshot()
        t2 = time.perf_counter()
        tier.wait()
        t3 = time.perf_counter()
        for lst, dt in ((blocked, t1 - t0), (copied, t2 - t0), (total, t3 - t0)):
            lst.append(max(comm.gather(dt)))
        exchange.append(max(comm.gather(getattr(tier, "save_timings", {}).get("exchange", 0.0))))
    out = {"first": first, "blocked": _med(blocked), "copied": _med(copied), "total": _med(total)}
    return dict(out, exchange=_med(exchange))


def _workload():
    import paddle

    a = paddle.randn([768, 768])

    def run() -> float:
        t0 = time.perf_counter()
        for _ in range(12):
            (a @ a).sum().numpy()
        return time.perf_counter() - t0

    return run


def _interference(tier, comm: Comm, repeats: int, step: int) -> dict:
    """The workload alone and right after a save returned (background part in flight), slowest rank."""
    run = _workload()
    run()
    alone, during = [], []
    for i in range(repeats):
        comm.barrier()
        alone.append(max(comm.gather(run())))
        comm.barrier()
        tier.save(step + i)
        during.append(max(comm.gather(run())))
        tier.wait()
    return {"alone": _med(alone), "during_save": _med(during)}


def _back_to_back(tier, comm: Comm, repeats: int, step: int) -> float:
    """Blocking time of a save called right after the previous one returned: it waits for the previous save's
    background part (copy, checksums, peer transfer), the worst case of a short save interval."""
    out = []
    for i in range(repeats):
        comm.barrier()
        tier.save(step + 2 * i)
        t0 = time.perf_counter()
        tier.save(step + 2 * i + 1)
        out.append(max(comm.gather(time.perf_counter() - t0)))
        tier.wait()
    return _med(out)


def _persist(tier, comm: Comm, step: int) -> float:
    """A save that is persisted too: from the call until every rank's persist committed."""

    def go():
        tier.persist_every = step
        tier.save(step)
        tier.wait_persisted()

    dt, _ = _timed_max(comm, go)
    tier.persist_every = 10**9
    return dt


def _limits(ps: PaddleState, comm: Comm, tier, path: str, repeats: int) -> dict:
    """What bounds a restore here, per rank (slowest rank, medians): mapping the own copy with its page tables
    filled (MAP_POPULATE), xxh3 of the state, pread of the copy from the tmpfs into a warm buffer."""
    import mmap

    import xxhash

    own = tier.copies.own_path()
    size = os.stat(own).st_size
    buf = np.empty(size, np.uint8)
    buf[:] = 1
    arrays = ps.arrays()
    kept = []

    def populate():
        fd = os.open(own, os.O_RDONLY)
        kept.append((fd, mmap.mmap(fd, size, mmap.MAP_SHARED | mmap.MAP_POPULATE, mmap.PROT_READ)))

    def pread(name: str) -> None:
        fd = os.open(name, os.O_RDONLY)
        try:
            mv = memoryview(buf)
            for off in range(0, os.fstat(fd).st_size, 8 << 20):
                os.preadv(fd, [mv[off : off + (8 << 20)]], off)
        finally:
            os.close(fd)

    out: dict[str, list] = {"populate": [], "xxh3": [], "pread_shm": []}
    for _ in range(repeats):
        out["populate"].append(_timed_max(comm, populate)[0])
        for fd, mm in kept:
            mm.close()
            os.close(fd)
        kept.clear()
        out["xxh3"].append(_timed_max(comm, lambda: [xxhash.xxh3_64_intdigest(a) for a in arrays])[0])
        out["pread_shm"].append(_timed_max(comm, lambda: pread(own))[0])
    return {k: _med(v) for k, v in out.items()}


def _restore(ps: PaddleState, comm: Comm, fn, want: int, tier=None) -> tuple[float, object]:
    ps.zero()
    if tier is not None:  # as after a restart: nothing of the copies mapped in this process (not timed)
        tier.unmap()
    dt, out = _timed_max(comm, fn)
    if ps.checksum() != want:
        raise AssertionError("restored state differs from the saved one")
    return dt, out


def run_memtier(args) -> dict:
    import paddle.distributed as dist
    from paddle.distributed.fsdp.memtier import MemoryTier

    comm = Comm()
    rank, world = dist.get_rank(), dist.get_world_size()
    ps = PaddleState(args)
    work = comm.gather(tempfile.mkdtemp(prefix="memtier-bench-", dir=args.dir))[0]
    shm = os.path.join(args.shm_root, f"bench-{os.getpid() if rank == 0 else 0}")
    shm = comm.gather(shm)[0]
    partners = {r: r ^ 1 for r in range(world)} if world % 2 == 0 else {}
    # one own slot: the phases below remove THE own copy to measure the peer path (two slots would keep another)
    tier = MemoryTier(ps.fsdp, ps.opt, durable_root=work, memory_root=shm, persist_every=10**9, partners=partners,
                      memory_slots=1)  # fmt: skip
    out = {"world": world, "state_bytes": max(comm.gather(ps.bytes))}
    out["memcpy"] = _memcpy(ps, comm, args.repeats)
    out["save"] = _saves(tier, comm, args.repeats)
    out["interference"] = _interference(tier, comm, args.repeats, 2 + args.repeats)
    out["back_to_back"] = _back_to_back(tier, comm, args.repeats, 2 + 2 * args.repeats)
    step = 2 + 4 * args.repeats
    out["persist"] = _persist(tier, comm, step)
    tier.save(step + 1)  # the first save after a persist exchanges its end (collective)
    tier.wait()
    step += 1
    files = [tier.copies.own_path(), tier.copies.peer_path()]
    out["tier_bytes"] = max(comm.gather(sum(os.stat(f).st_blocks * 512 for f in files if os.path.exists(f))))
    want = ps.checksum()
    ps.fsdp.save_checkpoint(work, optimizer=ps.opt, step=step)  # the same step on disk
    path = os.path.join(work, f"step_{step:08d}")
    out["limits"] = _limits(ps, comm, tier, path, args.repeats)
    disk, mem, peer, node_loss, phases = [], [], [], [], {"memory": [], "peer": []}
    for _ in range(args.repeats):
        drop_cache(data_files(path))
        disk.append(_restore(ps, comm, lambda: ps.fsdp.load_checkpoint(path, optimizer=ps.opt), want)[0])
        dt, res = _restore(ps, comm, tier.restore, want, tier)
        assert res.sources == ["memory"] * world, res.sources
        mem.append(dt)
        phases["memory"].append(comm.gather(res.timings))
        if partners:
            os.unlink(tier.copies.own_path())
            dt, res = _restore(ps, comm, tier.restore, want, tier)
            assert res.sources == ["peer"] * world, res.sources
            peer.append(dt)
            phases["peer"].append(comm.gather(res.timings))
            tier.save(step)  # a peer restore reads into the tensors only: the own copy comes with the next save
            tier.wait()
            if rank % 2 == 1:  # a lost node: only the odd ranks lose their own copies
                os.unlink(tier.copies.own_path())
            dt, res = _restore(ps, comm, tier.restore, want, tier)
            assert res.sources == ["memory", "peer"] * (world // 2), res.sources
            node_loss.append(dt)
            tier.save(step)
            tier.wait()
    out["load_disk_cold"], out["restore_memory"] = _med(disk), _med(mem)
    out["restore_peer"] = _med(peer) if peer else None
    out["restore_node_loss"] = _med(node_loss) if node_loss else None
    out["restore_phases"] = {k: _phase_medians(v) for k, v in phases.items() if v}
    tier.close()
    comm.barrier()
    if rank == 0:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    return out


def _phase_medians(runs: list[list[dict]]) -> dict:
    """Per phase: the median over runs of the slowest rank's seconds."""
    names = sorted({name for per_rank in runs for t in per_rank for name in t})
    return {n: _med([max(t.get(n, 0.0) for t in per_rank) for per_rank in runs]) for n in names}


def table(r: dict) -> str:
    gb = r["state_bytes"] / 1e9
    s = r["save"]
    rows = [
        ("state per rank", f"{gb:.3f} GB", ""),
        ("memcpy of the state", f"{r['memcpy'] * 1e3:.1f} ms", "1.00x"),
        ("memtier save: blocked (call)", f"{s['blocked'] * 1e3:.2f} ms", f"{s['blocked'] / r['memcpy']:.3f}x memcpy"),
        ("memtier save: tensors copied", f"{s['copied'] * 1e3:.1f} ms", f"{s['copied'] / r['memcpy']:.2f}x memcpy"),
        ("memtier save: + checksums + peer", f"{s['total'] * 1e3:.1f} ms", f"{s['total'] / r['memcpy']:.2f}x memcpy"),
        ("memtier save: of which the peer exchange", f"{s.get('exchange', 0) * 1e3:.1f} ms",
         f"{s.get('exchange', 0) / r['memcpy']:.2f}x memcpy"),
        ("memtier first save (allocation)", f"{s['first'] * 1e3:.1f} ms", ""),
        ("host memory of the tier", f"{r['tier_bytes'] / 1e9:.3f} GB", f"{r['tier_bytes'] / r['state_bytes']:.2f}x state"),
        ("workload alone", f"{r['interference']['alone'] * 1e3:.1f} ms", "1.00x"),
        ("workload right after a save returned", f"{r['interference']['during_save'] * 1e3:.1f} ms",
         f"{r['interference']['during_save'] / r['interference']['alone']:.2f}x"),
        ("save right after a save returned: blocked", f"{r['back_to_back'] * 1e3:.1f} ms",
         f"{r['back_to_back'] / r['memcpy']:.2f}x memcpy"),
        ("save + persist from the copy, until committed", f"{r['persist'] * 1e3:.1f} ms", ""),
        ("cold load from disk", f"{r['load_disk_cold'] * 1e3:.1f} ms", "1.00x"),
        ("restore from own memory", f"{r['restore_memory'] * 1e3:.1f} ms",
         f"{r['load_disk_cold'] / r['restore_memory']:.1f}x faster"),
    ]  # fmt: skip
    if r["restore_peer"] is not None:
        rows.append(
            (
                "restore from the peer copy",
                f"{r['restore_peer'] * 1e3:.1f} ms",
                f"{r['load_disk_cold'] / r['restore_peer']:.1f}x faster",
            )
        )
    lim = r.get("limits")
    if lim:
        rows += [
            ("limit: map + populate the own copy", f"{lim['populate'] * 1e3:.1f} ms", f"{lim['populate'] / r['memcpy']:.2f}x memcpy"),
            ("limit: xxh3 of the state", f"{lim['xxh3'] * 1e3:.1f} ms", f"{lim['xxh3'] / r['memcpy']:.2f}x memcpy"),
            ("limit: pread of the own copy from the tmpfs", f"{lim['pread_shm'] * 1e3:.1f} ms", f"{lim['pread_shm'] / r['memcpy']:.2f}x memcpy"),
            ("cold load from disk, in memcpys", "", f"{r['load_disk_cold'] / r['memcpy']:.2f}x memcpy"),
            ("best ratio possible: cold load / (populate + memcpy)", "", f"{r['load_disk_cold'] / (lim['populate'] + r['memcpy']):.1f}x"),
        ]  # fmt: skip
    if r.get("restore_node_loss") is not None:
        rows.append(("restore, odd ranks from the peer copy (a lost node)", f"{r['restore_node_loss'] * 1e3:.1f} ms",
                     f"{r['load_disk_cold'] / r['restore_node_loss']:.1f}x faster"))  # fmt: skip
    for kind, ph in r.get("restore_phases", {}).items():
        rows.append((f"restore from {kind}: phases", ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in ph.items()), ""))
    lines = ["| phase | time / size | ratio |", "|---|---|---|"] + [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


def main(args) -> None:
    import paddle.distributed as dist

    dist.init_parallel_env()
    result = run_memtier(args)
    if dist.get_rank() == 0:
        print(table(result))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        LOG.info("memtier phase done")
