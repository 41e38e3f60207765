"""FSDP training on N ranks equals the same model trained in one process on the same global batch.

Each rank checks every configuration and reports {configuration: "ok" | traceback} (launch_util.report).
With ``--edge-cases``, the same launch then runs edge_cases.py's cases (gloo, no fleet) and reports them too: a
launch's start-up costs more than those cases.
"""

from __future__ import annotations

import sys
import traceback

import _paths  # noqa: F401  (puts launch_util on sys.path)
import numpy as np
import paddle
import paddle.distributed as dist
from launch_util import report, run_cases
from models import decay_fun_for, global_batches, make_model
from paddle.distributed.fsdp import FullyShardFusion
from training import train

CASES = [
    ("sgd", "float32"),
    ("momentum", "float32"),
    ("sgd", "float64"),
    ("momentum", "float64"),
    ("adam_l2", "float64"),
    ("adamw_attr", "float64"),
    ("adamw_clip", "float64"),
    ("adamw_accum", "float64"),
    ("adamw_groups", "float64"),
]
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
            lr,
            weight_decay=0.3,
            grad_clip=clip,
            apply_decay_param_fun=lambda n: n not in exempt,
            parameters=params,
        )
    if kind == "adamw_groups":  # parameter groups (dicts), each with its own weight decay and clip
        for p in params:
            p.no_weight_decay = False
        decayed = [p for n, p in model.named_parameters() if n.endswith("weight") and "norm" not in n]
        exempt = [p for n, p in model.named_parameters() if not (n.endswith("weight") and "norm" not in n)]
        return paddle.optimizer.AdamW(
            0.01,
            grad_clip=paddle.nn.ClipGradByGlobalNorm(0.05),
            parameters=[{"params": decayed, "weight_decay": 0.3}, {"params": exempt, "weight_decay": 0.0}],
        )
    raise ValueError(kind)


def check(kind: str, rank: int, world: int, dtype: str) -> None:
    micro = 2 if kind == "adamw_accum" else 1
    ref = make_model(7, dtype=dtype)
    train(ref, make_optimizer(kind, ref, fsdp_side=False), global_batches(STEPS, BATCH), 0, 1, micro)
    model = make_model(7, dtype=dtype)
    fsdp = FullyShardFusion(model, fsdp_unit_layers=["Block"])
    train(model, make_optimizer(kind, model, fsdp_side=True), global_batches(STEPS, BATCH), rank, world, micro)
    full = fsdp.full_parameters()
    for key, param in ref.named_parameters():
        # Reduction order differs between N ranks and one process. In fp32 Adam turns that rounding
        # into visible noise where a gradient element is ~0 (its update is +-lr whatever the size), so
        # the Adam family is compared in fp64, where the same rounding is ~1e-16 and 1e-10 is strict.
        got, want = full[key].numpy(), param.numpy()
        error = np.abs(got - want).max() / max(np.abs(want).max(), 1e-12)
        tolerance = 1e-10 if dtype == "float64" else 1e-5
        assert error <= tolerance, f"{kind}/{dtype}: {key} differs from the one-process run by {error:.2e}"
    # resident storage is this rank's shard only: about total / world
    total = fsdp.total_parameter_bytes()
    resident = fsdp.resident_parameter_bytes()
    padded = sum(b.layout.padded_numel * b.shard.element_size() for b in fsdp.buffers)
    assert resident * world == padded, (resident, world, padded)
    assert padded - total <= 256 * (len(fsdp._param_keys) + len(fsdp.buffers) * world), (padded, total)
    for key, param, buffer, index in fsdp.managed_parameters():
        piece = buffer.pieces.get(index)
        assert param.shape == [piece.length if piece else 0], (key, param.shape)


def main() -> None:
    if paddle.distributed.get_world_size() > 1:
        dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for kind, dtype in CASES:
        try:
            check(kind, rank, world, dtype)
            results[f"{kind}-{dtype}"] = "ok"
        except Exception:
            results[f"{kind}-{dtype}"] = traceback.format_exc()
    if "--edge-cases" in sys.argv:  # after every parity case: they see a process no other case touched
        from edge_cases import CASES as EDGE_CASES

        run_cases(EDGE_CASES, rank, world, results=results)
    report(results)


if __name__ == "__main__":
    main()
