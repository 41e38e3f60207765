"""PaddleFormers models under FSDP for the preset tests (test_hf_presets.py).

Usage: hf_presets.py load CASES_JSON
         for every case {"name", "preset", "config", "ckpt", "ids", "out"}: the PaddleFormers model of the preset
         (fused or not) built from ANOTHER seed, wrapped in FullyShardFusion (its decoder layers are the units),
         loads `ckpt` with fsdp.load_checkpoint; rank 0 writes its logits on `ids` to `out` (.npy).
       hf_presets.py save WORKDIR PRESET
         the preset's model (seed 1) + AdamW, one step, fsdp.save_checkpoint(WORKDIR/ckpt_w<world>, optimizer=opt).
Each rank reports {case: "ok" | traceback}.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import _paths  # noqa: F401  (puts launch_util and pf_models on sys.path)
import numpy as np
import paddle
import paddle.distributed as dist
import pf_models
from launch_util import report
from paddle.distributed.fsdp import FullyShardFusion


def load_case(case: dict) -> None:
    family, fused = pf_models.family_of(case["preset"])
    with open(case["config"]) as f:
        config = json.load(f)
    model = pf_models.paddle_model(family, fused, config, seed=99)
    fsdp = FullyShardFusion(model, fsdp_unit_layers=[pf_models.decoder_layer(family)])
    fsdp.load_checkpoint(case["ckpt"])
    logits = pf_models.paddle_logits(model, np.load(case["ids"]))
    if dist.get_rank() == 0:
        np.save(case["out"], logits)


def save(workdir: str, preset: str) -> None:
    family, fused = pf_models.family_of(preset)
    with open(os.path.join(workdir, "config.json")) as f:
        config = json.load(f)
    model = pf_models.paddle_model(family, fused, config, seed=1)
    model.train()
    fsdp = FullyShardFusion(model, fsdp_unit_layers=[pf_models.decoder_layer(family)])
    opt = paddle.optimizer.AdamW(0.01, parameters=model.parameters())
    ids = pf_models.input_ids(config["vocab_size"], seed=11)
    world, rank = dist.get_world_size(), dist.get_rank()
    local = ids[rank * len(ids) // world : (rank + 1) * len(ids) // world]
    out = model(paddle.to_tensor(local))
    logits = out.logits if hasattr(out, "logits") else out[0]
    logits.astype("float32").square().mean().backward()
    opt.step()
    opt.clear_grad()
    fsdp.save_checkpoint(os.path.join(workdir, f"ckpt_w{world}"), optimizer=opt)


def main() -> None:
    dist.init_parallel_env()
    results = {}
    if sys.argv[1] == "load":
        with open(sys.argv[2]) as f:
            cases = json.load(f)
        for case in cases:
            try:
                load_case(case)
                results[case["name"]] = "ok"
            except Exception:  # noqa: BLE001 - reported to the test
                results[case["name"]] = traceback.format_exc()
    else:
        try:
            save(sys.argv[2], sys.argv[3])
            results["save"] = "ok"
        except Exception:  # noqa: BLE001
            results["save"] = traceback.format_exc()
    report(results)


if __name__ == "__main__":
    main()
