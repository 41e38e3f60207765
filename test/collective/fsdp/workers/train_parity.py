"""FSDP training on N ranks equals the same model trained in one process on the same global batch.

Usage: train_parity.py RESULT_JSON. Each rank checks every configuration, records "ok" or the failure,
and rank 0 writes the JSON the pytest side asserts on.
"""

from __future__ import annotations

import json
import sys
import traceback

import numpy as np
import paddle
import paddle.distributed as dist
from models import decay_fun_for, global_batches, local_part, make_model

from paddle.distributed.fsdp import FullyShardFusion

STEPS, BATCH = 3, 24  # two micro-batches of 12 rows split evenly over 1, 2, 3 and 4 ranks


def make_optimizer(kind: str, model, fsdp_side: bool):
    params = model.parameters()
    if kind == "sgd":
        return paddle.optimizer.SGD(0.2, parameters=params)
    if kind == "momentum":
        return paddle.optimizer.Momentum(0.1, momentum=0.9, use_nesterov=True, parameters=params)
    if kind == "adam_l2":
        if not fsdp_side:  # stock Adam knows no `no_weight_decay`; give the reference a zero regulariser
            for p in params:
                if getattr(p, "no_weight_decay", False):
                    p.regularizer = paddle.regularizer.L2Decay(0.0)
        return paddle.optimizer.Adam(0.01, weight_decay=0.05, parameters=params)
    lr = paddle.optimizer.lr.StepDecay(0.01, step_size=2, gamma=0.5)
    if kind == "adamw_attr":  # FSDP honours param.no_weight_decay; the reference gets the same via names
        fun = decay_fun_for(model) if not fsdp_side else None
        return paddle.optimizer.AdamW(lr, weight_decay=0.3, apply_decay_param_fun=fun, parameters=params)
    if kind in ("adamw_clip", "adamw_accum"):
        for p in params:  # exemption by name only: the optimizer's own rule
            p.no_weight_decay = False
        exempt = {p.name for n, p in model.named_parameters() if n.endswith("bias") or "norm" in n}
        clip = paddle.nn.ClipGradByGlobalNorm(0.05) if kind == "adamw_clip" else None
        return paddle.optimizer.AdamW(
            lr, weight_decay=0.3, grad_clip=clip, apply_decay_param_fun=lambda n: n not in exempt,
            parameters=params,
        )
    raise ValueError(kind)


def train(model, opt, rank, world, micro_batches: int):
    batches = global_batches(STEPS, BATCH)
    losses = []
    for ids, labels in batches:
        for k in range(micro_batches):
            part = slice(k * BATCH // micro_batches, (k + 1) * BATCH // micro_batches)
            x = paddle.to_tensor(local_part(ids[part], rank, world))
            y = paddle.to_tensor(local_part(labels[part], rank, world))
            loss = model(x, y) / micro_batches
            loss.backward()
            losses.append(float(loss))
        opt.step()
        opt.clear_grad()
        if hasattr(opt._learning_rate, "step"):
            opt._learning_rate.step()
    return losses


def check(kind: str, rank: int, world: int) -> None:
    micro = 2 if kind == "adamw_accum" else 1
    ref = make_model(7)
    train(ref, make_optimizer(kind, ref, fsdp_side=False), 0, 1, micro)
    model = make_model(7)
    fsdp = FullyShardFusion(model, fsdp_unit_layers=["Block"])
    train(model, make_optimizer(kind, model, fsdp_side=True), rank, world, micro)
    full = fsdp.full_parameters()
    for key, param in ref.named_parameters():
        # relative to the tensor's norm: an element whose gradient is ~0 may flip Adam's sign by
        # rounding (reduction order differs across ranks), so elementwise rtol would flag noise
        got, want = full[key].numpy(), param.numpy()
        error = np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-12)
        assert error <= 1e-5, f"{kind}: {key} differs from the one-process run by {error:.2e} (relative)"
    # resident storage is this rank's shard only: about total / world
    total = fsdp.total_parameter_bytes()
    resident = fsdp.resident_parameter_bytes()
    padded = sum(b.layout.padded_numel * b.shard.element_size() for b in fsdp.buffers)
    assert resident * world == padded, (resident, world, padded)
    assert padded - total <= 256 * (len(fsdp.param_keys) + len(fsdp.buffers) * world), (padded, total)
    for key, param, buffer, index in fsdp.managed_parameters():
        piece = buffer.pieces.get(index)
        assert param.shape == [piece.length if piece else 0], (key, param.shape)


def main() -> None:
    result_path = sys.argv[1]
    if paddle.distributed.get_world_size() > 1:
        dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for kind in ["sgd", "momentum", "adam_l2", "adamw_attr", "adamw_clip", "adamw_accum"]:
        try:
            check(kind, rank, world)
            results[kind] = "ok"
        except Exception:
            results[kind] = traceback.format_exc()
    gathered = []
    if world > 1:
        dist.all_gather_object(gathered, results)
    else:
        gathered = [results]
    if rank == 0:
        merged = {k: [r[k] for r in gathered] for k in results}
        with open(result_path, "w") as f:
            json.dump(merged, f, indent=1)


if __name__ == "__main__":
    main()
