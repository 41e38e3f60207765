#!/usr/bin/env python3
"""What derived weights (issue #52) cost and save in time: saves and loads with ``derive_weights`` on (the
default) and off, in one run, round robin, medians.

    python tools/ckpt_bench/derive_speed.py --repeats 7 --json derive_speed.json

The bf16 + fp32-master model of bytes.py (``--vocab 16384 --dim 512 --blocks 6``: 20,971,520 parameters,
``FullyShardFusion`` in this process, AdamW). Per mode and repeat: a synchronous save (its calling thread's
``derive`` phase: the save-time check), an async save (the time the training loop is blocked: the call, and
until its handle is done), a resume (``load_checkpoint`` with the optimizer: weights cast from the masters' own
targets) and a model-only ``load_state_dict`` under the default memory bound (the masters read by windows and
cast). Each load reads the checkpoint just saved (warm page cache: the engine's CPU cost, not the disk's).
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bytes as bytes_bench  # noqa: E402 - the model of the bytes benchmark

LOG = logging.getLogger("bench_derive_speed")
MODES = {"stored": False, "derived": True}  # derive_weights


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--blocks", type=int, default=6)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--seed", type=int, default=2024)
    p.add_argument("--dir", default=None, help="work directory (default: a temporary one, removed)")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def _one_round(fsdp, opt, model_keys, work: str, derive: bool) -> dict:
    import paddle.distributed.fsdp.checkpoint as ck

    marks: list = []
    opts = ck.CheckpointOptions(trace_hook=marks.append)
    path = os.path.join(work, "derived" if derive else "stored")
    out = {}
    for kind in ("sync", "async"):
        shutil.rmtree(path, ignore_errors=True)
        marks.clear()
        t0 = time.perf_counter()
        handle = fsdp.save_checkpoint(
            path, optimizer=opt, derive_weights=derive, options=opts, async_save=kind == "async"
        )
        t1 = time.perf_counter()
        if handle is not None:
            handle.wait()
        out[f"save_{kind}_s"] = time.perf_counter() - t0
        out[f"save_{kind}_call_s"] = t1 - t0
        calling = [m for m in marks if m.what == "save (calling thread)"]
        out[f"check_{kind}_s"] = sum(d for n, d in calling[0].marks if n == "derive") if calling else 0.0
    t0 = time.perf_counter()
    fsdp.load_checkpoint(path, optimizer=opt)
    out["resume_s"] = time.perf_counter() - t0
    model = fsdp.sharded_state_dict()
    t0 = time.perf_counter()
    report = ck.load_state_dict({k: model[k] for k in model_keys}, path)
    out["model_only_s"] = time.perf_counter() - t0
    out["model_only_peak_host_bytes"] = report.peak_host_bytes
    out["bytes"] = sum(os.path.getsize(os.path.join(path, n)) for n in os.listdir(path))
    return out


def run(args) -> dict:
    import paddle

    paddle.set_device("cpu")
    fsdp, opt, n = bytes_bench.build("bf16+master", args)
    model_keys = sorted(fsdp.sharded_state_dict())
    work = args.dir or tempfile.mkdtemp(prefix="bench_derive_")
    rounds: dict = {m: [] for m in MODES}
    try:
        for _ in range(args.repeats):  # round robin: a drift of the machine's load hits both modes alike
            for mode, derive in MODES.items():
                rounds[mode].append(_one_round(fsdp, opt, model_keys, work, derive))
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    results = {"params": n, "repeats": args.repeats, "load_average": os.getloadavg()}
    for mode, rs in rounds.items():
        results[mode] = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        results[mode]["all"] = {k: [round(r[k], 4) for r in rs] for k in rs[0] if k.endswith("_s")}
    return results


def table(results: dict) -> str:
    cols = [
        ("bytes", "checkpoint MB", 1e-6),
        ("save_sync_s", "sync save s", 1),
        ("check_sync_s", "of which check s", 1),
        ("save_async_call_s", "async save: call s", 1),
        ("check_async_s", "of which check s", 1),
        ("save_async_s", "async save: until done s", 1),
        ("resume_s", "resume load s", 1),
        ("model_only_s", "model-only load s", 1),
    ]
    lines = ["| mode | " + " | ".join(c[1] for c in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for mode in MODES:
        r = results[mode]
        lines.append(f"| {mode} | " + " | ".join(f"{r[k] * s:.3f}" for k, _, s in cols) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    results = run(args)
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
