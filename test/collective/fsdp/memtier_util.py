"""Shared pieces of the memory-tier tests: a hand-written memory copy and a small FSDP model to save."""

from __future__ import annotations

import numpy as np
import paddle
from paddle.distributed.fsdp import FullyShardFusion
from paddle.distributed.fsdp.checkpoint import checksums
from paddle.distributed.fsdp.checkpoint.format.reserved import BUFFERS_KEY, EXTRA_KEY, RNG_KEY
from paddle.distributed.fsdp.memtier.copies import offsets_of
from paddle.distributed.fsdp.memtier.slot import Slot

DURABLE_ID = "0" * 32  # the durable root identity a hand-written copy names (memtier/identity.py)


def write_copy(path: str, rng: np.random.Generator, layout: list[list], header: dict, chunk: int) -> dict:
    """A memory copy of random records laid out as ``layout`` (``[key, dtype, shape, nbytes]``), with the
    header fields ``header`` (job, world, rank, step, values) and checksums of ``chunk`` bytes; returns each
    record's bytes."""
    offsets, data_len = offsets_of(layout)
    slot = Slot.allocate(path, 8192, data_len)
    data = slot.data(slot.data_off, data_len)
    fn = checksums.digest_function(checksums.XXH3_64)
    recs = []
    for (key, dtype, shape, n), off in zip(layout, offsets):
        data[off : off + n] = rng.integers(0, 256, n, dtype=np.uint8)
        recs.append([key, dtype, shape, off, n, checksums.chunk_digests(data[off : off + n], chunk, fn)])
    header = dict({"durable_id": DURABLE_ID, "descs": [None] * len(layout)}, **header)
    header["values"] = {EXTRA_KEY: {}, BUFFERS_KEY: [], RNG_KEY: None, **header.get("values", {})}
    slot.write_header(dict(header, algo=checksums.XXH3_64, chunk=chunk, records=recs), slot.data_off, data_len)
    records = {key: bytes(data[off : off + n]) for (key, _d, _s, n), off in zip(layout, offsets)}
    slot.close()
    return records


def small_fsdp(seed: int, batch_norm: bool = False):
    """A two-layer model under FSDP with AdamW and a step-decay schedule: ``(model, fsdp, optimizer)``;
    ``batch_norm``: BatchNorm statistics between the layers (records a forward changes: saved at the call)."""
    paddle.seed(seed)
    middle = paddle.nn.BatchNorm1D(64) if batch_norm else paddle.nn.ReLU()
    model = paddle.nn.Sequential(paddle.nn.Linear(64, 64), middle, paddle.nn.Linear(64, 8))
    fsdp = FullyShardFusion(model)
    lr = paddle.optimizer.lr.StepDecay(0.02, step_size=1, gamma=0.5)
    return model, fsdp, paddle.optimizer.AdamW(lr, parameters=model.parameters())


def state_bytes(fsdp, opt) -> dict:
    """Every saved record of the model and its optimizer as bytes (what a bit-exact comparison needs)."""
    state = fsdp.sharded_state_dict()
    state.update(fsdp.optimizer_sharded_state_dict(opt))
    return {k: np.array(getattr(v, "local_tensor", v).numpy()).tobytes() for k, v in state.items()}


def train_and_save(model, fsdp, opt, tier, steps, extra_key: str = "step") -> dict:
    """One AdamW step and one tier save (waiting for its persist) per step: ``{step: (state_bytes, lr)}``."""
    wants = {}
    for step in steps:
        train_step(model, opt)
        tier.save(step, extra_state={extra_key: step})
        tier.wait_persisted()
        wants[step] = (state_bytes(fsdp, opt), opt.get_lr())
    return wants


def train_step(model, opt) -> None:
    """One AdamW step of ``small_fsdp``'s model on random data, then one step of its schedule."""
    model(paddle.randn([4, 64])).square().mean().backward()
    opt.step()
    opt.clear_grad()
    opt._learning_rate.step()


def bf16_fsdp(seed: int):
    """A bf16 model (its embedding fp32) under FSDP with MasterAdamW (fp32 master weights that really move, each
    weight its master cast after a step): ``(model, fsdp, optimizer)``."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers"))
    from master_adamw import MasterAdamW
    from models import Bf16MLP

    paddle.seed(seed)
    model = Bf16MLP()
    fsdp = FullyShardFusion(model)
    opt = MasterAdamW(0.01, parameters=model.parameters(), weight_decay=0.1, multi_precision=True)
    fsdp.init_optimizer_state(opt)
    return model, fsdp, opt


def bf16_train_step(model, opt, seed: int) -> None:
    """One MasterAdamW step of ``bf16_fsdp``'s model on seeded token ids."""
    rng = np.random.default_rng(seed)
    ids, labels = (paddle.to_tensor(rng.integers(0, 37, (4, 6))) for _ in range(2))
    model(ids, labels).backward()
    opt.step()
    opt.clear_grad()
