#!/usr/bin/env python3
"""Bytes per parameter of a checkpoint, per save mode (issue #52).

    python tools/ckpt_bench/bytes.py --json bytes.json          # also: python tools/bench_ckpt.py --bytes

Two models of ~2.6M parameters (``--vocab``/``--dim``/``--blocks``: an embedding, then per block
``Linear(dim, 4 dim)`` and ``Linear(4 dim, dim)`` weights), each wrapped in ``FullyShardFusion`` in this process
(one rank: bytes per parameter do not depend on the world size but for the per-rank files, ~1 KB a rank):

* ``fp32``: fp32 parameters, AdamW (moment1, moment2): 12 bytes of state a parameter;
* ``bf16+master``: bf16 parameters, AdamW with fp32 master weights (``multi_precision=True``): 14.

The optimizer state is made by ``fsdp.init_optimizer_state`` and then given trained-like values: master weights
and moments from a seeded normal distribution (moment2 as squares), each bf16 parameter set to its master weight
cast, as the multi-precision AdamW kernel's last step does (CPU paddle has no bf16 AdamW kernel to run).
Each mode of ``MODES`` (``fsdp.save_checkpoint`` keywords: the helpers adding save modes extend it) saves the
same state (``--repeats`` times, each followed by a ``load_checkpoint`` of it: median seconds, warm page
cache, noisy on a shared machine); the table gives every file of the checkpoint directory in bytes per parameter, by kind: the data
of model weights, master weights, moments (the safetensors data files, by their pieces' keys), the data files'
headers and checksum sidecars, the index (metadata.json, index.*, <rank>.values, 0.metadata, COMMIT).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time

LOG = logging.getLogger("bench_bytes")

# mode -> save_checkpoint keywords. raw: every tensor stored as it is; default: what a save does by default
MODES: dict[str, dict] = {
    "raw": {"derive_weights": False},
    "default": {},
    # lossless: byte planes + zstd per chunk (codec "auto" picks it on object stores only)
    "lossless": {"options": {"codec": "byteplane-zstd"}},
    # lossy, opt-in: int8 / int4 moments (format/quant.py)
    "int8": {"quantize_moments": "int8"},
    "int8+zstd": {"quantize_moments": "int8", "options": {"codec": "byteplane-zstd"}},
    "int4": {"quantize_moments": "int4"},
}


def save_keywords(mode: str) -> dict:
    """``fsdp.save_checkpoint`` keywords of ``mode`` (an ``options`` dict becomes its CheckpointOptions)."""
    from paddle.distributed.fsdp.checkpoint import CheckpointOptions

    kw = dict(MODES[mode])
    if "options" in kw:
        kw["options"] = CheckpointOptions(**kw["options"])
    return kw


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--blocks", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES), help=f"modes to run (default: all: {','.join(MODES)})")
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one, removed)")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    p.add_argument("--seed", type=int, default=2024)
    p.add_argument("--repeats", type=int, default=3, help="saves and loads per mode; medians (default 3)")
    return p.parse_args(argv)


def build(kind: str, args):
    """(fsdp, optimizer, parameters) of model ``kind`` ("fp32" or "bf16+master") with trained-like state."""
    import numpy as np
    import paddle
    from paddle.distributed.fsdp import FullyShardFusion

    dtype = "float32" if kind == "fp32" else "bfloat16"
    paddle.seed(args.seed)

    class Model(paddle.nn.Layer):
        def __init__(self):
            super().__init__()
            self.embed = self.create_parameter([args.vocab, args.dim], dtype=dtype)
            self.up = paddle.nn.ParameterList(
                [self.create_parameter([args.dim, 4 * args.dim], dtype=dtype) for _ in range(args.blocks)]
            )
            self.down = paddle.nn.ParameterList(
                [self.create_parameter([4 * args.dim, args.dim], dtype=dtype) for _ in range(args.blocks)]
            )

    model = Model()
    fsdp = FullyShardFusion(model)
    opt = paddle.optimizer.AdamW(1e-3, parameters=model.parameters(), multi_precision=kind != "fp32")
    fsdp.init_optimizer_state(opt)
    rng = np.random.default_rng(args.seed)
    inner = getattr(opt, "_inner_opt", opt)
    with paddle.no_grad():
        for _key, param, _buffer, _index in fsdp.managed_parameters():
            shape = list(param.shape)
            master = inner._master_weights.get(param.name)
            value = (0.02 * rng.standard_normal(shape)).astype(np.float32)
            if master is not None:
                master.set_value(paddle.to_tensor(value))
                param.set_value(master.astype(param.dtype))  # (the kernel's last step: param = cast(master))
            else:
                param.set_value(paddle.to_tensor(value))
        # the moments: under FSDP the optimizer's accumulators belong to the fused buffers, not to the parameters,
        # so every moment accumulator is filled (zeros would make the compressed modes' figures meaningless)
        for name, accs in inner._accumulators.items():
            if "moment" not in name:
                continue
            for t in accs.values():
                m = (1e-3 * rng.standard_normal(list(t.shape))).astype(np.float32)
                t.set_value(paddle.to_tensor(m * m if "2" in name else m))
    n = sum(int(np.prod(p.shape)) for p in model.parameters())
    return fsdp, opt, n


def kind_of(key: str) -> str:
    key = key.split("@q", 1)[0]  # a quantized moment's codes and scales (format/quant.py) count as the moment
    if key.endswith(".master_weight"):
        return "master"
    if key.endswith((".moment1", ".moment2")):
        return "moments"
    if key.startswith("__fsdp__.") or key.endswith("_pow_acc"):
        return "other"  # (AdamW's beta1/beta2 powers: one element a parameter tensor)
    return "weights"


def measure(path: str, params: int) -> dict:
    """Bytes per parameter of every file of the checkpoint at ``path``, by kind."""
    from paddle.distributed.fsdp.checkpoint import read_metadata

    md = read_metadata(path)
    md.prefetch(list(md.tensors))
    out = {"weights": 0, "master": 0, "moments": 0, "other": 0, "headers+sums": 0, "index": 0}
    # a compressed data file (format 4 "codecs") stores fewer bytes than its pieces declare: each piece counts at
    # its file's stored / decoded ratio
    ratio = {n: os.path.getsize(os.path.join(path, n)) / f.size for n, f in md.files.items() if f.size}
    for key, tm in md.tensors.items():
        out[kind_of(key)] += sum(p.nbytes * ratio.get(p.file, 1.0) for p in tm.pieces)
    data = sum(out.values())
    files = {n: os.path.getsize(os.path.join(path, n)) for n in os.listdir(path)}
    in_data = sum(size for n, size in files.items() if n.endswith((".safetensors", ".sums", ".chunks")))
    out["headers+sums"] = in_data - data
    out["index"] = sum(files.values()) - in_data
    per = {k: v / params for k, v in out.items()}
    per["total"] = sum(files.values()) / params
    per["derived_keys"] = len(md.derived)
    per["format"] = md.version
    return per


def run(args) -> dict:
    import paddle

    paddle.set_device("cpu")
    work = args.dir or tempfile.mkdtemp(prefix="bench_bytes_")
    results: dict = {}
    try:
        for kind in ("fp32", "bf16+master"):
            fsdp, opt, n = build(kind, args)
            modes = args.modes.split(",")
            times: dict = {m: ([], []) for m in modes}
            for _ in range(args.repeats):  # round robin over the modes: a drift of the machine hits each alike
                for mode in modes:
                    path = os.path.join(work, f"{kind.replace('+', '_')}_{mode}")
                    shutil.rmtree(path, ignore_errors=True)
                    t0 = time.perf_counter()
                    fsdp.save_checkpoint(path, optimizer=opt, **save_keywords(mode))
                    t1 = time.perf_counter()
                    fsdp.load_checkpoint(path, optimizer=opt)  # (warm page cache: the engine's own cost)
                    times[mode][0].append(t1 - t0)
                    times[mode][1].append(time.perf_counter() - t1)
            for mode in modes:
                path = os.path.join(work, f"{kind.replace('+', '_')}_{mode}")
                saves, loads = times[mode]
                timing = {"save_s": statistics.median(saves), "load_s": statistics.median(loads)}
                results[f"{kind}/{mode}"] = {"params": n, **measure(path, n), **timing}
                LOG.info("%s %s: %.3f bytes/param", kind, mode, results[f"{kind}/{mode}"]["total"])
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    return results


def table(results: dict) -> str:
    cols = ["weights", "master", "moments", "other", "headers+sums", "index", "total"]
    head = "| model / mode | params | format | " + " | ".join(cols) + " | save s | load s |"
    lines = [head, "|---" * (len(cols) + 5) + "|"]
    for name, r in results.items():
        cells = " | ".join(f"{r[c]:.3f}" for c in cols)
        lines.append(f"| {name} | {r['params']:,} | {r['format']} | {cells} | {r['save_s']:.3f} | {r['load_s']:.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown:
        raise SystemExit(f"unknown mode(s) {sorted(unknown)}; known: {', '.join(MODES)}")
    results = run(args)
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
