"""Every door restores every item of the resume state (state/resume_state.py), bit for bit.

Usage: resume_state.py doors WORKDIR DOOR[,DOOR...]   (S3: the URL in FSDP_TEST_S3_URL, the AWS_* environment)
       resume_state.py reshard WORKDIR save|load       (save at this world size; load it at another)

doors: a reference run trains SAVE_AT steps (TinyLM with dropout and a registered buffer, AdamW + StepDecay, a
CPU-enabled GradScaler skipping a step with an inf gradient, a ShardedEMA, the resumable sampler over 2 epochs of
a dataset, a per-rank stateful counter, extra_state), saves through every door, then trains on. Per door: objects
built from another seed and settings (every item of ``resume_state.ITEMS`` must then differ from the saved
state), restored through the door, must equal the saved state item by item, and after MORE steps the
uninterrupted run's state item by item (RNG, scaler counters, sampler position, EMA included). The items come
from the owner module itself: an item added there is walked here too, and one this test does not exercise fails.

FSDP_TEST_RESUME_DTYPE=bfloat16: bf16 weights with fp32 master weights (MasterAdamW, computed in fp32), a
disabled GradScaler (CPU paddle cannot unscale bf16 gradients): the master weights through every door.

Doors: disk (save/load_checkpoint), async (an async save, the run training on while it copies), s3 (the same on a real S3 server), memory (the tier's own copy), peer (the own
copies deleted: the partner's copy), persist (the tier's background persist of its copy, loaded from storage),
flush (``flush_memory`` from one process after the job, loaded from storage), tier_storage (memory wiped: the
tier restores from its durable root).

reshard: 'save' trains and saves (disk) with the EMA and the sampler, recording the samples each rank saw;
'load' (another world size) loads, reports the EMA's records (to compare with the saved EMA exported by
``to-hf --ema``) and the samples of the rest of the epoch.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys

import _paths  # noqa: F401  (puts launch_util on sys.path)
import numpy as np
import paddle
import paddle.distributed as dist
from grad_scaler import cpu_grad_scaler, inject_inf
from launch_util import report, run_cases
from master_adamw import MasterAdamW
from models import SEQ, VOCAB, make_model
from paddle.distributed.fsdp import FullyShardFusion
from paddle.distributed.fsdp.memtier import MemoryTier, identity
from paddle.distributed.fsdp.memtier.flush import flush_memory
from paddle.distributed.fsdp.sampler import ResumableDistributedBatchSampler
from paddle.distributed.fsdp.state import resume_state
from paddle.distributed.fsdp.state.stateful import StatefulMismatchError

N_SAMPLES, BATCH = 12, 2  # 3 steps an epoch at world 2
SAVE_AT, MORE = 4, 4  # saved mid-epoch 1; the run goes on across the boundary into epoch 2
INF_STEPS = {2, 6}  # the scaler skips these steps (one before the save, one after)
DATA = np.random.default_rng(3).integers(0, VOCAB, (N_SAMPLES, 2, SEQ))
JOB = "doors"
DTYPE = os.environ.get("FSDP_TEST_RESUME_DTYPE", "float32")
UNEXERCISED = {"grad_scaler"} if DTYPE == "bfloat16" else set()  # a disabled scaler's state is the same everywhere


class Counter:
    """A stateful object whose state differs per rank (the samples this rank saw)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.seen = rank, []

    def state_dict(self) -> dict:
        return {"rank": self.rank, "seen": list(self.seen)}

    def set_state_dict(self, state: dict) -> None:
        self.rank, self.seen = state["rank"], list(state["seen"])


class Run:
    """The objects of one training run and its step."""

    def __init__(self, seed: int, rank: int, world: int) -> None:
        fresh = seed != 7  # a restore target: other settings wherever the saved state must replace them
        self.rank, self.world = rank, world
        self.model = make_model(seed, dropout=0.1, dtype=DTYPE)
        self.model.register_buffer("ticks", paddle.full([3], float(seed)))
        compute = "float32" if DTYPE == "bfloat16" else None  # CPU paddle has no bf16 kernels for the forward
        self.fsdp = FullyShardFusion(self.model, fsdp_unit_layers=["Block"], compute_dtype=compute)
        self.lr = paddle.optimizer.lr.StepDecay(0.02, step_size=2, gamma=0.5)
        # bf16: fp32 master weights, stepped the way paddle's GPU kernel does (CPU paddle's never update)
        opt_class = MasterAdamW if DTYPE == "bfloat16" else paddle.optimizer.AdamW
        self.opt = opt_class(self.lr, weight_decay=0.1, parameters=self.model.parameters(), multi_precision=True)
        init, every = (2.0**3, 5) if fresh else (2.0**8, 2)
        if DTYPE == "bfloat16":  # CPU paddle cannot unscale bf16 gradients: a (disabled) stock scaler
            self.scaler = paddle.amp.GradScaler()
        else:
            self.scaler = cpu_grad_scaler(init_loss_scaling=init, incr_every_n_steps=every, decr_every_n_nan_or_inf=1)
        self.ema = self.fsdp.ema(0.75)
        self.sampler = ResumableDistributedBatchSampler(
            list(range(N_SAMPLES)), BATCH, world, rank, shuffle=True, seed=seed
        )
        self.counter = Counter(rank + (100 if fresh else 0))
        self.stateful = {"sampler": self.sampler, "counter": self.counter}
        self.extra: dict | None = None
        self._iter = None
        paddle.seed(seed * 1000 + rank)
        if fresh:
            self.fsdp.init_optimizer_state(self.opt)  # zero accumulators: every item must come from the restore

    def kwargs(self) -> dict:
        return dict(optimizer=self.opt, grad_scaler=self.scaler, stateful=self.stateful, ema=self.ema)

    def objects(self) -> resume_state.ResumeObjects:
        return resume_state.ResumeObjects(self.fsdp, self.opt, self.scaler, self.stateful, self.ema, self.extra)

    def batch(self) -> list[int]:
        for _attempt in range(2):
            if self._iter is None:
                self._iter = iter(self.sampler)
            try:
                return next(self._iter)
            except StopIteration:
                self._iter = None
        raise AssertionError("an empty epoch")

    def step(self, k: int) -> None:
        indices = self.batch()
        self.counter.seen.extend(indices)
        data = DATA[indices]
        x, y = paddle.to_tensor(data[:, 0]), paddle.to_tensor(data[:, 1])
        with paddle.amp.auto_cast(enable=False, dtype="float16"):
            loss = self.scaler.scale(self.model(x, y))
        loss.backward()
        if k in INF_STEPS and DTYPE == "float32":
            inject_inf(self.model, self.fsdp)
        self.scaler.step(self.opt)
        self.scaler.update()
        self.opt.clear_grad()
        self.lr.step()
        self.ema.update()
        with paddle.no_grad():
            self.model.ticks.add_(paddle.ones([3]))
        self.extra = {"step": k + 1}


def snapshot(run: Run) -> dict[str, str]:
    """Item name -> digest of everything the owner module builds for it (tensor bytes, JSON values)."""
    built = resume_state.build(run.objects())
    out = {}
    for item in resume_state.ITEMS:
        if item.checked_only:  # checked by a load, never restored (the frozen base reference: test_lora.py)
            continue
        keys = built.by_item[item.name]
        assert keys, f"item {item.name!r} holds nothing in this test: exercise it (resume_state.ITEMS)"
        h = hashlib.sha256()
        for key in sorted(keys):
            h.update(key.encode())
            if key in built.tensors:
                t = built.tensors[key]
                h.update(np.ascontiguousarray(getattr(t, "local_tensor", t).numpy()).tobytes())
            else:
                h.update(json.dumps(built.values[key], sort_keys=True).encode())
        out[item.name] = h.hexdigest()
    return out


def _differing(a: dict, b: dict) -> list[str]:
    return sorted(name for name in a if a[name] != b[name])


def _tier(run: Run, workdir: str, durable: str, **kw) -> MemoryTier:
    return MemoryTier(run.fsdp, run.opt, durable_root=durable, memory_root=os.path.join(workdir, "mem"),
                      job_id=JOB, partners={0: 1, 1: 0} if run.world == 2 else {}, keep_last=None,
                      grad_scaler=run.scaler, stateful=run.stateful, ema=run.ema, **kw)  # fmt: skip


def _sync() -> None:
    if dist.get_world_size() > 1:
        dist.barrier()


def doors(rank: int, world: int, workdir: str, names: list[str]) -> dict:
    ref = Run(7, rank, world)
    for k in range(SAVE_AT):
        ref.step(k)
    if DTYPE == "float32":
        scaler = ref.scaler.state_dict()  # 512 after steps 0-1, halved by the inf step 2, one good step since
        assert float(np.asarray(scaler["scale"]).reshape(-1)[0]) == 256.0 and scaler["incr_count"] == 1, scaler
    else:  # the variant for master weights: they go through every door
        masters = [k for k in resume_state.build(ref.objects()).by_item["optimizer"] if k.endswith(".master_weight")]
        assert masters, "no master weight in the bf16 run"
    saved = snapshot(ref)
    extra = dict(ref.extra)
    disk, url = os.path.join(workdir, "disk"), os.environ.get("FSDP_TEST_S3_URL")
    tier_root, flush_root = os.path.join(workdir, "tier_durable"), os.path.join(workdir, "flushed")
    if "disk" in names:
        ref.fsdp.save_checkpoint(disk, extra_state=extra, **ref.kwargs())
    pending = None
    if "async" in names:  # the run goes on while the save copies and writes: what it holds is the call's state
        pending = ref.fsdp.save_checkpoint(f"{disk}_async", extra_state=extra, async_save=True, **ref.kwargs())
    if "s3" in names:
        ref.fsdp.save_checkpoint(url, extra_state=extra, step=SAVE_AT, **ref.kwargs())
    if set(names) & {"memory", "peer", "persist", "flush", "tier_storage"}:
        tier = _tier(ref, workdir, tier_root, persist_every=SAVE_AT)
        tier.save(SAVE_AT, extra_state=extra, grad_scaler=ref.scaler, stateful=ref.stateful, ema=ref.ema)
        tier.wait_persisted()
        tier.close(remove=False)
        _sync()
        if rank == 0:  # flush into a root of the same identity as the tier's durable root (memtier/identity.py:
            # copies are flushed only into the root they name), but without the step the tier persisted there
            os.makedirs(flush_root)
            shutil.copy(os.path.join(tier_root, identity.ID_OBJECT), flush_root)
            flush_memory([os.path.join(workdir, "mem")], flush_root, job=JOB)
        _sync()
    assert snapshot(ref) == saved, "a save changed the state it saved"
    for k in range(SAVE_AT, SAVE_AT + MORE):
        ref.step(k)
    if pending is not None:
        pending.wait()
    final = snapshot(ref)
    out = {}
    for door in names:
        run = Run(99, rank, world)
        same = [name for name in saved if snapshot(run)[name] == saved[name] and name not in UNEXERCISED]
        assert same == [], f"{door}: items {same} equal the saved state before the restore: the test proves nothing"
        if door in ("disk", "async"):
            run.extra = dict(run.fsdp.load_checkpoint(disk if door == "disk" else f"{disk}_async", **run.kwargs()))
        elif door == "s3":
            run.extra = dict(run.fsdp.load_checkpoint(url, **run.kwargs()))
        elif door in ("persist", "flush"):
            run.extra = dict(run.fsdp.load_checkpoint(tier_root if door == "persist" else flush_root, **run.kwargs()))
        else:
            if door == "peer":  # every own copy lost: each rank's state comes from its partner
                os.unlink(os.path.join(workdir, "mem", JOB, f"rank{rank:05d}.own"))
            if door == "tier_storage":  # every memory copy lost: the durable root
                for name in os.listdir(os.path.join(workdir, "mem", JOB)):
                    if name.startswith(f"rank{rank:05d}."):
                        os.unlink(os.path.join(workdir, "mem", JOB, name))
            _sync()
            tier = _tier(run, workdir, tier_root)
            result = tier.restore()
            want = {"memory": "memory", "peer": "peer", "tier_storage": "storage"}[door]
            assert result.sources == [want] * world, (door, result.sources)
            run.extra = dict(result)
            tier.close(remove=False)
            _sync()
        lost = _differing(saved, snapshot(run))
        assert lost == [], f"door {door} did not restore the items {lost}"
        for k in range(SAVE_AT, SAVE_AT + MORE):
            run.step(k)
        diverged = _differing(final, snapshot(run))
        assert diverged == [], (
            f"door {door}: after {MORE} more steps the items {diverged} differ from the uninterrupted run"
        )
        out[door] = "ok"
    return out


def reshard(rank: int, world: int, workdir: str, mode: str) -> dict:
    path = os.path.join(workdir, "ckpt")
    if mode == "save":
        run = Run(7, rank, world)
        for k in range(SAVE_AT):
            run.step(k)
        run.fsdp.save_checkpoint(path, extra_state=run.extra, **run.kwargs())
        run.fsdp.save_checkpoint(f"{path}_plain")  # no EMA: to-hf --ema refuses it
        return {"seen": run.counter.seen, "epoch": run.sampler.epoch, "consumed": run.sampler.consumed}
    run = Run(99, rank, world)
    try:  # the counter is per-rank state: refused at another world size, on every rank, before any write
        run.fsdp.load_checkpoint(path, **run.kwargs())
        raise AssertionError("per-rank stateful state loaded at another world size")
    except StatefulMismatchError as e:
        assert "counter" in str(e), e
    assert run.counter.seen == [] and run.sampler.consumed == 0
    run.stateful = {"sampler": run.sampler}
    run.fsdp.load_checkpoint(path, **run.kwargs())
    ema = {key: np.asarray(rec.local_tensor.numpy()).tolist() for key, rec in run.ema.records().items()}
    run.fsdp.save_checkpoint(f"{path}_w{world}", ema=run.ema)  # the resharded EMA, saved again: to-hf --ema
    seen = [i for batch in run.sampler for i in batch]  # the rest of the epoch
    return {"ema": ema if world == 1 else None, "seen": seen, "updates": run.ema.updates}


def main() -> None:
    what, workdir, arg = sys.argv[1], sys.argv[2], sys.argv[3]
    if dist.get_world_size() > 1:
        dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    results: dict = {}

    def case(rank: int, world: int) -> None:
        if what == "doors":
            results["doors_data"] = doors(rank, world, workdir, arg.split(","))
        else:
            results["reshard_data"] = reshard(rank, world, workdir, arg)

    run_cases({what: case}, rank, world, results=results)
    report(results)


if __name__ == "__main__":
    main()
