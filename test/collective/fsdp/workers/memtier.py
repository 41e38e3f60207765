"""Memory tier worker (one rank of a simulated node; the memory root is PADDLE_FSDP_MEMTIER_ROOT).

Two models train side by side, each with its own MemoryTier (own job id, durable root WORKDIR/<model>/durable):
``tiny`` (TinyLM with dropout, AdamW + StepDecay) and ``qwen3`` (PaddleFormers' Qwen3ForCausalLM, AdamW with
LinearWarmup(CosineAnnealingDecay) and global-norm clipping).

Usage:
  memtier.py run WORKDIR TOTAL [--crash-at N] [--keep-at N]
      build with ``fsdp.memory_tier`` (restores; a fresh start when nothing is stored), train to TOTAL with a save
      after every step (persisted every PERSIST_EVERY), dump the final records to WORKDIR/<model>/final.rank<R>.npz,
      close the tier (a clean end removes the copies). --crash-at N: once the saves of step N are complete on
      every rank, every rank kills itself with SIGKILL. --keep-at N: after the saves of step N, copy this rank's
      slot files to WORKDIR/<model>/kept/ (older copies for the agreement scenario). --kill-mid-copy N: rank 1
      is SIGKILLed while copying its state into its slot at the save of step N; the others complete their own
      copy, see their exchange with rank 1 fail, then SIGKILL themselves.
  memtier.py restore WORKDIR TOTAL SCENARIO[,SCENARIO...]
      per scenario, in this process: put back the crashed run's memory roots and storage from WORKDIR/bak (saved
      by the test), damage them as the scenario says, build the models from ANOTHER seed, restore, train to TOTAL
      and compare every record, the RNG and the LR with the uninterrupted run's (WORKDIR/ref/<model>).
      Scenarios: memory (all copies intact), node1 (node 1's root wiped), both (every root wiped), agree (rank 1
      has only older copies), corrupt (rank 1's own copy has a flipped bit), corrupt2 (rank 1's own copy and its
      peer copy have one: found while reading, after rank 0 read step 6 into its tensors), world1 (on ONE rank: the 2-rank
      copies must be refused and storage loaded at the new world size; no comparison), skip (a fresh TinyLM:
      rank 0's persist of step 2 is held until its save of step 3 was called: step 3 must be skipped on every
      rank alike, step 4 taken, and the persisted step 2 be the memory step).
Each rank reports its results as JSON.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import traceback
from dataclasses import dataclass
from typing import Any, Callable

import _paths  # noqa: F401  (puts launch_util on sys.path)
import numpy as np
import paddle
import paddle.distributed as dist
import paddleformers_models as pf
from launch_util import report
from models import global_batches, make_model
from paddle.distributed.fsdp import FullyShardFusion
from paddle.distributed.fsdp.checkpoint import host_memory
from paddle.distributed.fsdp.checkpoint.save import wait_pending
from paddle.distributed.fsdp.memtier import MemoryTier
from paddle.distributed.fsdp.memtier.slot import Slot
from training import records, train

BATCH, PERSIST_EVERY = 8, 4
MODELS = tuple(os.environ.get("FSDP_TEST_MEMTIER_MODELS", "tiny,qwen3").split(","))
PEER_TIMEOUT_S = float(os.environ.get("FSDP_TEST_MEMTIER_PEER_TIMEOUT", "60"))
# these scenarios damage and copy THE slot file of a step: the single-slot layout (memtier_kill.py: two slots)
SLOTS = int(os.environ.get("FSDP_TEST_MEMTIER_SLOTS", "1"))


def _sync() -> None:
    if dist.get_world_size() > 1:
        dist.barrier()


@dataclass
class Case:
    name: str
    workdir: str
    fsdp: Any
    opt: Any
    tier: MemoryTier
    step: Callable[[int], None]  # trains step i (0-based)


def build(name: str, workdir: str, seed: int, rank: int, world: int, restore_now: bool) -> Case:
    workdir = os.path.join(workdir, name)
    os.makedirs(workdir, exist_ok=True)
    if name == "tiny":
        model = make_model(seed + 100 * rank, dropout=0.1)  # another init per rank: every value must come back
        paddle.seed(seed + rank)
        fsdp = FullyShardFusion(model, fsdp_unit_layers=["Block"])
        lr = paddle.optimizer.lr.StepDecay(0.02, step_size=2, gamma=0.5)
        opt = paddle.optimizer.AdamW(lr, weight_decay=0.1, parameters=model.parameters())
        batches = global_batches(16, BATCH)

        def step(i: int) -> None:
            train(model, opt, batches[i : i + 1], rank, world)
    else:
        model, unit, _cls = pf.build("qwen3", seed + 100 * rank)
        fsdp = FullyShardFusion(model, fsdp_unit_layers=[unit])
        opt = pf.optimizer(model)

        def step(i: int) -> None:
            pf.train(model, opt, [i], rank, world)

    durable = os.path.join(workdir, "durable")
    if restore_now:  # the documented form (docs/memory-tier.md): built and restored in one call
        tier = fsdp.memory_tier(opt, durable_root=durable, persist_every=PERSIST_EVERY, keep_last=None,
                                peer_timeout_s=PEER_TIMEOUT_S, memory_slots=SLOTS)  # fmt: skip
    else:
        tier = MemoryTier(fsdp, opt, durable_root=durable, persist_every=PERSIST_EVERY, keep_last=None,
                          peer_timeout_s=PEER_TIMEOUT_S, memory_slots=SLOTS)  # fmt: skip
    return Case(name, workdir, fsdp, opt, tier, step)


def _slot_files(tier: MemoryTier) -> list:
    return [list(os.stat(p)[1:2]) + [os.stat(p).st_size] for p in (tier.copies.own_path(), tier.copies.peer_path())]


def _copy_half_then_die(real_finish):
    """SaveIntoSlot.finish that copies half of the deferred records into the slot, then SIGKILLs the process."""

    def finish(job) -> None:
        half = job._jobs[: len(job._jobs) // 2]
        for dst, t in half:
            np.copyto(dst, host_memory.raw_view(t, allow_copy=False)[0])
        os.kill(os.getpid(), signal.SIGKILL)

    return finish


def _die_mid_copy(cases: list[Case]) -> None:
    """After the save calls of this step: rank 1 was killed while copying (patched before the calls); every
    other rank's copy completes, its exchange with rank 1 fails (named), then it is killed too."""
    for c in cases:
        try:
            c.tier.wait()
        except Exception as e:  # noqa: BLE001 - the partner died: expected
            print(f"save failed as expected: {type(e).__name__}: {e}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def train_to_end(cases: list[Case], start: int, total: int, crash_at=None, keep_at=None, kill_mid_copy=None) -> dict:
    """Train every case from ``start`` to ``total`` with a save per step; returns per case its final records, RNG
    draw, LR and whether the slots stayed the same files without a new allocation after the first save."""
    growth: dict[str, list] = {c.name: [] for c in cases}
    allocations = None
    for i in range(start, total):
        for c in cases:
            c.step(i)
            if i + 1 in (keep_at, crash_at) or kill_mid_copy:  # not to be skipped for a persist still writing
                c.tier.wait_persisted()
            if kill_mid_copy == i + 1 and dist.get_rank() == 1:
                import paddle.distributed.fsdp.memtier.copies as copies_mod

                copies_mod.SaveIntoSlot.finish = _copy_half_then_die(copies_mod.SaveIntoSlot.finish)
            c.tier.save(i + 1, extra_state={"data_position": (i + 1) * BATCH})
        if i == start:
            for c in cases:
                c.tier.wait()
                growth[c.name].append(_slot_files(c.tier) if c.tier.disabled_reason is None else None)
            allocations = Slot.allocations
        if keep_at == i + 1:
            for c in cases:
                c.tier.wait()
                kept = os.path.join(c.workdir, "kept")
                os.makedirs(kept, exist_ok=True)
                for path in (c.tier.copies.own_path(), c.tier.copies.peer_path()):
                    shutil.copy(path, os.path.join(kept, os.path.basename(path)))
        if kill_mid_copy == i + 1:
            _die_mid_copy(cases)
        if crash_at == i + 1:
            for c in cases:
                c.tier.wait()
            wait_pending(raise_error=True)
            _sync()
            os.kill(os.getpid(), signal.SIGKILL)
    out = {}
    for c in cases:
        c.tier.wait()
        growth[c.name].append(_slot_files(c.tier) if c.tier.disabled_reason is None else None)
        final = {k: np.array(getattr(v, "local_tensor", v).numpy()) for k, v in records(c.fsdp, c.opt).items()}
        out[c.name] = {
            "final": final,
            "rng": float(paddle.rand([1]).numpy()[0]),  # the RNG state must have been restored too
            "lr": float(c.opt.get_lr()),
            "same_slots": growth[c.name][0] == growth[c.name][-1] and Slot.allocations == allocations,
        }
    return out


def _left(tier: MemoryTier) -> list[str]:
    return sorted(os.listdir(tier.copies.dir)) if os.path.isdir(tier.copies.dir) else []


def run(args, rank, world) -> dict:
    cases = [build(m, args.workdir, 11, rank, world, restore_now=True) for m in MODELS]
    starts = {c.tier.start_step for c in cases}
    assert len(starts) == 1, starts
    done = train_to_end(cases, starts.pop(), args.total, args.crash_at, args.keep_at, args.kill_mid_copy)
    out = {}
    for c in cases:
        res = done[c.name]
        np.savez(os.path.join(c.workdir, f"final.rank{rank}.npz"), **res.pop("final"))
        c.tier.close()
        disabled = type(c.tier.disabled_reason).__name__ if c.tier.disabled_reason is not None else None
        out[c.name] = dict(res, files_left=_left(c.tier), disabled=disabled, durable=c.tier.durable_saves)
    return out


def _flip_bit(path: str) -> None:
    """One flipped bit in the middle of the copy's largest record."""
    slot = Slot.open(path)
    header, data_off, _len = slot.header()
    slot.close()
    _key, _dtype, _shape, off, nbytes, _sums = max(header["records"], key=lambda rec: rec[4])
    with open(path, "r+b") as f:
        f.seek(data_off + off + nbytes // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))


def _prepare(workdir: str, scenario: str, rank: int, node: int, local_rank: int, cases: list[Case]) -> None:
    """Put the crashed run's state back (storage by rank 0, each node's root by its local rank 0), then damage."""
    bak = os.path.join(workdir, "bak")
    root = os.environ["PADDLE_FSDP_MEMTIER_ROOT"]
    if rank == 0:
        for c in cases:
            shutil.rmtree(os.path.join(c.workdir, "durable"), ignore_errors=True)
            shutil.copytree(os.path.join(bak, c.name, "durable"), os.path.join(c.workdir, "durable"))
    if local_rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        if not (scenario == "both" or (scenario == "node1" and node == 1)):
            shutil.copytree(os.path.join(bak, f"node{node}"), root)
    _sync()
    for c in cases:
        if scenario == "agree":  # rank 1 has only step-5 copies: its own, and the one rank 0 holds for it
            names = {0: ["rank00000.peer"], 1: ["rank00001.own", "rank00001.peer"]}.get(rank, [])
            for name in names:
                shutil.copy(os.path.join(c.workdir, "kept", name), os.path.join(c.tier.copies.dir, name))
        if scenario == "corrupt" and rank == 1:
            _flip_bit(c.tier.copies.own_path())
        if scenario == "corrupt2":  # rank 1's own copy AND the one rank 0 holds for it: storage (step 4) for all
            _flip_bit(c.tier.copies.own_path() if rank == 1 else c.tier.copies.peer_path())
    _sync()


def _differ_from_checkpoint(c: Case, root: str, step: int) -> list[str]:
    """Keys whose state (one rank: every element) differs from the uninterrupted run's checkpoint of ``step``."""
    from paddle.distributed.fsdp.tools import CheckpointReader

    mine = {k: np.array(getattr(v, "local_tensor", v).numpy()) for k, v in records(c.fsdp, c.opt).items()}
    with CheckpointReader(os.path.join(root, f"step_{step:08d}")) as ref:
        return [k for k, v in mine.items() if v.tobytes() != ref.read(k).tobytes()]


def _skip(workdir: str, rank: int, world: int) -> dict:
    """The ``skip`` scenario (see the module docstring)."""
    import threading

    import paddle.distributed.fsdp.memtier.manager as manager_mod

    gate, real = threading.Event(), manager_mod.persist_copy
    if rank == 0:
        manager_mod.persist_copy = lambda *a: (gate.wait(120), real(*a))[1]
    try:
        model = make_model(5 + 100 * rank, dropout=0.0)
        fsdp = FullyShardFusion(model, fsdp_unit_layers=["Block"])
        opt = paddle.optimizer.AdamW(0.01, parameters=model.parameters())
        batches, durable = global_batches(8, BATCH), os.path.join(workdir, "skip", "durable")
        tier = MemoryTier(
            fsdp, opt, durable_root=durable, persist_every=2, keep_last=None, job_id="skip", memory_slots=SLOTS
        )
        for i in range(4):
            train(model, opt, batches[i : i + 1], rank, world)
            tier.save(i + 1)
            if i + 1 == 2:
                want = {k: np.array(getattr(v, "local_tensor", v).numpy()) for k, v in records(fsdp, opt).items()}
            if i + 1 == 3:
                gate.set()
                tier.wait_persisted()
        tier.wait_persisted()
        out = dict(skipped=tier.skipped, durable=tier.durable_saves, errors=tier.persist_errors)
        fsdp.load_checkpoint(os.path.join(durable, "step_00000002"), optimizer=opt)
        got = {k: np.array(getattr(v, "local_tensor", v).numpy()) for k, v in records(fsdp, opt).items()}
        out["differ"] = [k for k in want if want[k].tobytes() != got[k].tobytes()]
        tier.close()
        return out
    finally:
        manager_mod.persist_copy = real


def restore(args, rank, world) -> dict:
    per_node = int(os.environ.get("PADDLE_LOCAL_SIZE", world))
    node, local_rank = rank // per_node, rank % per_node
    out = {}
    for scenario in args.scenarios.split(","):
        try:
            if scenario == "skip":
                out[scenario] = _skip(args.workdir, rank, world)
                _sync()
                continue
            cases = [build(m, args.workdir, 77, rank, world, restore_now=False) for m in MODELS]  # another seed
            _prepare(args.workdir, scenario, rank, node, local_rank, cases)
            restored = {c.name: c.tier.restore() for c in cases}
            reserved = {}  # after a restore from the peer copy: the own slot reserved in the background
            for c in cases:
                c.tier.wait()
                own = c.tier.copies.own_path()
                reserved[c.name] = os.path.exists(own) and os.stat(own).st_blocks * 512 >= os.stat(own).st_size > 0
            starts = {r.step for r in restored.values()}
            assert len(starts) == 1, starts
            if scenario == "world1":  # copies of a 2-rank job: refused (world size), storage resharded to 1 rank
                for c in cases:
                    c.tier.close()
                    got = restored[c.name]
                    differ = _differ_from_checkpoint(c, os.path.join(args.workdir, "ref", c.name, "durable"), got.step)
                    out[f"{scenario}/{c.name}"] = dict(
                        step=got.step, sources=got.sources, extra=dict(got), differ=differ
                    )
                continue
            done = train_to_end(cases, starts.pop(), args.total)
            for c in cases:
                c.tier.close()
                res, got = done[c.name], restored[c.name]
                ref = np.load(os.path.join(args.workdir, "ref", c.name, f"final.rank{rank}.npz"))
                final = res.pop("final")
                assert sorted(ref.files) == sorted(final), sorted(set(ref.files) ^ set(final))
                out[f"{scenario}/{c.name}"] = dict(
                    res,
                    step=got.step,
                    sources=got.sources,
                    persisted=got.persisted,
                    extra=dict(got),
                    differ=[k for k in ref.files if not np.array_equal(ref[k], final[k])],
                    reserved=reserved[c.name],
                    files_left=_left(c.tier),
                )
        except Exception:
            out[scenario] = {"error": traceback.format_exc()}
        _sync()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["run", "restore"])
    ap.add_argument("workdir")
    ap.add_argument("total", type=int)
    ap.add_argument("scenarios", nargs="?", default="")
    ap.add_argument("--crash-at", type=int)
    ap.add_argument("--keep-at", type=int)
    ap.add_argument("--kill-mid-copy", type=int)
    args = ap.parse_args()
    dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    report((run if args.mode == "run" else restore)(args, rank, world))


if __name__ == "__main__":
    main()
