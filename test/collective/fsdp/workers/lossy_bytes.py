"""Bytes per parameter of a bf16 + fp32-master AdamW checkpoint, exact and with quantized moments (the report's
figures, docs/reports/2026-12-07-lossy-moments.md)::

    python lossy_bytes.py --layers 8 --dim 512 --out bytes.json

One process: a stack of bf16 Linear layers (``dim x dim`` + bias), MasterAdamW (master_adamw.py: the GPU
multi-precision AdamW arithmetic on CPU) for 3 steps, then ``save_checkpoint`` exact, ``int8`` and ``int4``. Bytes
are counted by stored key (parameters, master weights, moment codes + scales, the rest) from the checkpoint's own
index, and on disk (every file, metadata included).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile

import paddle

logger = logging.getLogger("lossy_bytes")


class Stack(paddle.nn.Layer):
    def __init__(self, layers: int, dim: int) -> None:
        super().__init__()
        self.layers = paddle.nn.LayerList([paddle.nn.Linear(dim, dim) for _ in range(layers)])

    def forward(self, x):
        for layer in self.layers:
            x = paddle.nn.functional.gelu(
                paddle.nn.functional.linear(x, layer.weight.astype("float32"), layer.bias.astype("float32"))
            )
        return x.square().mean()


def measure(layers: int, dim: int, workdir: str) -> dict:
    from master_adamw import MasterAdamW
    from paddle.distributed.fsdp import FullyShardFusion
    from paddle.distributed.fsdp.checkpoint import read_metadata

    paddle.seed(1)
    model = Stack(layers, dim)
    model.to(dtype="bfloat16")
    fsdp = FullyShardFusion(model)
    opt = MasterAdamW(1e-3, parameters=model.parameters(), multi_precision=True)
    for _step in range(3):
        model(paddle.randn([4, dim])).backward()
        opt.step()
        opt.clear_grad()
    params = sum(int(p.size) for p in model.parameters())
    out = {"params": params}
    for mode in (None, "int8", "int4"):
        path = os.path.join(workdir, str(mode))
        fsdp.save_checkpoint(path, optimizer=opt, quantize_moments=mode)
        md = read_metadata(path)
        by = {"weights": 0, "master_weight": 0, "moment1": 0, "moment2": 0, "other tensors": 0}
        for key in md.tensors:
            tm = md.tensors[key]
            n = 1
            for s in tm.shape:
                n *= s
            nbytes = n * {"bfloat16": 2, "float32": 4, "int8": 1, "uint8": 1}.get(tm.dtype, 8)
            name = key.split("@")[0].rsplit(".", 1)[-1]
            if name in ("master_weight", "moment1", "moment2"):
                by[name] += nbytes
            elif key in dict(fsdp.sharded_state_dict()):
                by["weights"] += nbytes
            else:
                by["other tensors"] += nbytes
        disk = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        per = {k: v / params for k, v in by.items()}
        per["metadata and headers"] = (disk - sum(by.values())) / params
        per["total"] = disk / params
        per["total without stored weights (derived)"] = (disk - by["weights"]) / params
        out[str(mode)] = per
        logger.info("%s: %s", mode, json.dumps({k: round(v, 4) for k, v in per.items()}))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--out")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    result = measure(a.layers, a.dim, tempfile.mkdtemp(prefix="lossy_bytes_"))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
