"""HF -> ours at EP=2 -> HF: PaddleFormers 0.4.1's Qwen3-MoE, its experts split over 2 EP ranks (fleet ep_degree=2).

``ep_hf.py CONFIG IN_CKPT OUT_CKPT``: builds the tiny Qwen3-MoE of CONFIG (other random values than the checkpoint's),
keeps on each EP rank its half of every sparse layer's experts (``None`` for the others, as PaddleFormers' own
MoELayer does under EP: PaddleFormers 0.4.1 cannot build that layer on CPU, it needs DeepEP), wraps it with fleet's
EP groups and the default ``moe_layers_name`` (``Qwen3MoeMLP``, members of an expert list only: layer 1's dense
``Qwen3MoeMLP`` stays dense), loads IN_CKPT (a ``from-hf`` output) and saves OUT_CKPT at EP=2.
"""

from __future__ import annotations

import json
import sys
import traceback

import _paths  # noqa: F401  (puts launch_util on sys.path)
import paddle
import paddle.distributed as dist
import pf_models
from launch_util import report
from paddle.distributed import fleet
from paddle.distributed.fsdp import FullyShardFusion
from paddle.distributed.fsdp.comm.topology import barrier_after_new_group

ORDER = ["pp", "moe_sharding", "ep", "dp", "sharding", "sep", "cp", "mp"]


def keep_local_experts(model, ep_rank: int, ep: int) -> int:
    """Drop the experts of the other EP ranks (global indices kept: ``None`` in their place); returns how many
    sparse layers there are."""
    from paddleformers.transformers.qwen3_moe.modeling import Qwen3MoeSparseMoeBlock

    sparse = 0
    for layer in model.sublayers():
        if isinstance(layer, Qwen3MoeSparseMoeBlock):
            per = len(layer.experts) // ep
            kept = [e if i // per == ep_rank else None for i, e in enumerate(layer.experts)]
            layer.experts = paddle.nn.LayerList()
            for e in kept:
                layer.experts.append(e)
            sparse += 1
    return sparse


def main() -> None:
    config, source, target = sys.argv[1:4]
    dist.init_parallel_env()
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {
        "dp_degree": 1,
        "mp_degree": 1,
        "pp_degree": 1,
        "sharding_degree": 2,
        "ep_degree": 2,
        "moe_sharding_degree": 1,
        "order": ORDER,
    }
    with open(config) as f:
        cfg = json.load(f)
    # built before fleet.init: with fleet's ep_degree > 1 PaddleFormers builds its DeepEP layer, which CPU lacks
    model = pf_models.paddle_model("qwen3-moe", False, cfg, seed=7)
    with barrier_after_new_group(reuse_identical=True):
        fleet.init(is_collective=True, strategy=strategy)
    results = {}
    try:
        assert keep_local_experts(model, dist.get_rank(), 2) > 0
        fsdp = FullyShardFusion(model, [pf_models.decoder_layer("qwen3-moe")])
        experts = sorted({s.key for b in fsdp.buffers if b.layout.attrs.get("expert") for s in b.layout.slots})
        assert experts and all(".mlp.experts." in k for k in experts), experts
        fsdp.load_checkpoint(source)
        fsdp.save_checkpoint(target)
        results["round_trip"] = "ok"
    except Exception:
        results["round_trip"] = traceback.format_exc()
        print(results["round_trip"], file=sys.stderr, flush=True)
    report(results)


if __name__ == "__main__":
    main()
