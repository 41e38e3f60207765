#!/usr/bin/env python3
"""Lossy moments' CPU cost by thread count (issue 52; checkpoint/quant_threads.py): wall and process CPU time of
``lossy.quantize_state`` (one process, world 1) and of the dequantize of a load, split into the serial part (the
device-to-host fp32 copy, tensors made of the results, Python per key) and the ranges the pool runs.

Usage::

    python tools/bench_lossy_threads.py --mib 64 256 --threads 1 2 --repeats 3 [--json out.json]

The state: ``--keys`` parameters (equal sizes) with AdamW ``moment1`` (normal) and ``moment2`` (its square), fp32,
``--mib`` MiB of moments in all. Each figure is the median of ``--repeats`` runs (round robin over thread counts).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def _state(mib: int, keys: int):
    import paddle

    n = mib * (1 << 20) // 4 // (2 * keys)
    rng = np.random.default_rng(0)
    state = {}
    for k in range(keys):
        m = rng.standard_normal(n, dtype=np.float32) * np.float32(1e-3)
        state[f"p{k}.moment1"] = paddle.to_tensor(m)
        state[f"p{k}.moment2"] = paddle.to_tensor(m * m)
    return state


def _timed(fn):
    w, c = time.perf_counter(), time.process_time()
    out = fn()
    return out, time.perf_counter() - w, time.process_time() - c


def _once(state: dict, threads: int, mode: str) -> dict:
    """One quantize and one dequantize of ``state``; its parallel parts timed alone as well."""
    import paddle
    from paddle.distributed.fsdp.checkpoint import lossy, quant_threads
    from paddle.distributed.fsdp.checkpoint.coordination import Comm
    from paddle.distributed.fsdp.checkpoint.format.quant import DEFAULT_BLOCK, MOMENT_SCHEMES, SCHEMES

    out, q_wall, q_cpu = _timed(lambda: lossy.quantize_state(state, mode, Comm(None), threads=threads)[0])
    hosts, h_wall, h_cpu = _timed(lambda: {k: lossy._host_fp32(t) for k, t in state.items()})

    def ranges_only():  # maxima then codes, every key queued before waiting, as quantize_state does
        schemes = {k: SCHEMES[MOMENT_SCHEMES[k.rpartition(".")[2]][mode]] for k in hosts}
        maxima = {
            k: quant_threads.block_maxima_async(x, 0, DEFAULT_BLOCK, schemes[k], threads) for k, x in hosts.items()
        }
        maxima = {k: p.result() for k, p in maxima.items()}
        codes = {
            k: quant_threads.packed_codes_async(x, 0, maxima[k], DEFAULT_BLOCK, schemes[k], 0, threads)
            for k, x in hosts.items()
        }
        return {k: p.result() for k, p in codes.items()}

    _, p_wall, p_cpu = _timed(ranges_only)
    quant = {k: lossy.QuantizedKey(k, SCHEMES[MOMENT_SCHEMES[k.rpartition(".")[2]][mode]], DEFAULT_BLOCK,
                                   tuple(t.shape), "float32", k + "@qcodes", k + "@qscales")
             for k, t in state.items()}  # fmt: skip
    targets = {k: paddle.zeros_like(t) for k, t in state.items()}
    pending = lossy.swap_targets(dict(targets), quant)
    for item in pending.items:  # the codes and scales a load would have read
        for dst, src in ((item[2], out[item[0].codes]), (item[3], out[item[0].scales])):
            dst.local_tensor.copy_(getattr(src, "local_tensor", src), False)
    _, d_wall, d_cpu = _timed(lambda: pending.finish(None, threads))

    def deq_ranges():
        pend = [
            quant_threads.dequantize_async(
                lossy._np(i[2]), 0, lossy._np(i[3]), 0, 0, i[0].numel, DEFAULT_BLOCK, i[0].scheme, threads
            )  # fmt: skip
            for i in pending.items
        ]
        return [p.result() for p in pend]

    _, dp_wall, dp_cpu = _timed(deq_ranges)
    worst = max(float(np.abs(targets[k].numpy() - state[k].numpy()).max()) for k in state)
    return {
        "quantize_wall": q_wall, "quantize_cpu": q_cpu, "host_copy_wall": h_wall, "host_copy_cpu": h_cpu,
        "quantize_ranges_wall": p_wall, "quantize_ranges_cpu": p_cpu,
        "dequantize_wall": d_wall, "dequantize_cpu": d_cpu, "dequantize_ranges_wall": dp_wall,
        "dequantize_ranges_cpu": dp_cpu, "max_abs_error": worst,
    }  # fmt: skip


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--keys", type=int, default=8)
    ap.add_argument("--mode", choices=["int8", "int4"], default="int8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    for mib in args.mib:
        state = _state(mib, args.keys)
        runs = {t: [] for t in args.threads}
        for _ in range(args.repeats):
            for t in args.threads:
                runs[t].append(_once(state, t, args.mode))
        for t in args.threads:
            med = {k: statistics.median(r[k] for r in runs[t]) for k in runs[t][0]}
            rows.append({"mib": mib, "threads": t, "mode": args.mode, **med})
    head = ("MiB", "thr", "quant wall", "quant cpu", "ranges wall", "ranges cpu", "host copy", "deq wall",
            "deq cpu", "deq ranges wall", "deq ranges cpu")  # fmt: skip
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for r in rows:
        vals = [r["quantize_wall"], r["quantize_cpu"], r["quantize_ranges_wall"], r["quantize_ranges_cpu"],
                r["host_copy_wall"], r["dequantize_wall"], r["dequantize_cpu"], r["dequantize_ranges_wall"],
                r["dequantize_ranges_cpu"]]  # fmt: skip
        print(f"| {r['mib']} | {r['threads']} | " + " | ".join(f"{v:.3f} s" for v in vals) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
