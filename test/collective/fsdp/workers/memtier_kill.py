"""Memory tier under kill -9 at random moments (test_memtier_slots.py drives it and kills every rank).

One rank: build a model under FSDP with AdamW, ``fsdp.memory_tier(...)`` (which restores), log what was restored,
then train and save to memory after every step until TOTAL, logging BEFORE each save the digest of the state it
saves (so a copy that completed always has its digest logged). The state depends only on the step (data drawn
from the step number, no dropout), so the restored state must equal what was saved at that step, bit for bit.

Usage: memtier_kill.py WORKDIR TOTAL. Environment: FSDP_TEST_SLOTS (memory_slots), FSDP_TEST_DIM (model width), FSDP_TEST_PERSIST_EVERY,
PADDLE_FSDP_CKPT_FAULT_DELAY (fault_storage.py: a slowed persist). Log: WORKDIR/log/rank<R>.jsonl, one JSON object
a line: ``{"start": step, "digest", "sources"}``, ``{"save": step, "digest", "skipped", "persists_skipped"}``,
``{"call_ms": ...}`` (the save call's time), ``{"done": TOTAL}``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import _paths  # noqa: F401  (puts the test directory on sys.path)
import fault_storage
import numpy as np
import paddle
import paddle.distributed as dist
from memtier_util import state_bytes
from paddle.distributed.fsdp import FullyShardFusion

# 1024: 25 MB of state per rank, a copy takes long enough to be killed in (FSDP_TEST_DIM: another width)
DIM, LAYERS, BATCH = int(os.environ.get("FSDP_TEST_DIM", "1024")), 4, 8


def digest(fsdp, opt, extra: dict) -> str:
    """Every saved record, the LR and the extra state, hashed."""
    h = hashlib.sha256()
    for key, raw in sorted(state_bytes(fsdp, opt).items()):
        h.update(key.encode())
        h.update(raw)
    h.update(repr(float(opt.get_lr())).encode())
    h.update(json.dumps(extra, sort_keys=True).encode())
    return h.hexdigest()


def main() -> None:
    workdir, total = sys.argv[1], int(sys.argv[2])
    slots = int(os.environ.get("FSDP_TEST_SLOTS", "2"))
    persist_every = int(os.environ.get("FSDP_TEST_PERSIST_EVERY", "5"))
    if os.environ.get(fault_storage.DELAY_ENV):
        fault_storage.install()  # the slowed persist
    dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    paddle.seed(7)
    layers = [paddle.nn.Linear(DIM, DIM) for _ in range(LAYERS)]
    model = paddle.nn.Sequential(*layers, paddle.nn.Linear(DIM, 8))
    fsdp = FullyShardFusion(model)
    lr = paddle.optimizer.lr.StepDecay(0.01, step_size=3, gamma=0.9)
    opt = paddle.optimizer.AdamW(lr, parameters=model.parameters())
    tier = fsdp.memory_tier(
        opt, durable_root=os.path.join(workdir, "durable"), persist_every=persist_every, keep_last=2,
        memory_slots=slots, peer_timeout_s=20.0,
    )  # fmt: skip
    os.makedirs(os.path.join(workdir, "log"), exist_ok=True)
    log = open(os.path.join(workdir, "log", f"rank{rank}.jsonl"), "a", buffering=1)
    restored = tier.restored
    extra = dict(restored) if restored is not None else {}
    log.write(json.dumps({"start": tier.start_step, "digest": digest(fsdp, opt, extra),
                          "sources": restored.sources if restored is not None else None}) + "\n")  # fmt: skip
    for step in range(tier.start_step, total):
        rng = np.random.default_rng(1000 + step)  # the data of a step: the same whenever it is trained
        x = paddle.to_tensor(rng.standard_normal((BATCH, DIM), dtype=np.float32)[rank::world])
        model(x).square().mean().backward()
        opt.step()
        opt.clear_grad()
        lr.step()
        extra = {"data_position": (step + 1) * BATCH}
        log.write(json.dumps({"save": step + 1, "digest": digest(fsdp, opt, extra), "skipped": tier.skipped,
                              "persists_skipped": tier.persists_skipped,
                              "overwrites": tier.slots.overwrites}) + "\n")  # fmt: skip
        t0 = time.perf_counter()
        tier.save(step + 1, extra_state=extra)
        log.write(json.dumps({"call_ms": (time.perf_counter() - t0) * 1e3}) + "\n")  # the figures of the report
    tier.wait()
    tier.wait_persisted()
    log.write(json.dumps({"done": total}) + "\n")
    tier.close(remove=False)  # the copies stay: a relaunch resumes at TOTAL from memory


if __name__ == "__main__":
    main()
