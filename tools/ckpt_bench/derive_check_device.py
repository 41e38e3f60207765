#!/usr/bin/env python3
"""The save-time derived-weight check of a rank's weights on their device against the host paths, one run, medians.

    python tools/ckpt_bench/derive_check_device.py --dtype bfloat16 --repeats 5

Per layout (160 FSDP shards of 131072 elements, and one tensor; 20,971,520 parameters each), round robin:
the device check (save/derive_on_device.py: paddle int32 ops where the tensors are), the former device path
(each weight and master copied to the host, ``equals_cast`` one at a time) and the host tensors' check
(``equals_cast_many``). Runs wherever paddle's default device is: on a CPU build the "device" is the CPU, so
the device check's figure is paddle's CPU integer kernels, not a GPU's.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import paddle
from paddle.distributed.fsdp.checkpoint.format import derived
from paddle.distributed.fsdp.checkpoint.save.derive_on_device import equals_cast_on_device
from paddle.distributed.fsdp.devices import device

LAYOUTS = {"160 x 131072": [131072] * 160, "1 x 20971520": [20971520]}


def _pairs(counts: list[int], dtype: str) -> list:
    rng = np.random.default_rng(0)
    out = []
    for n in counts:
        m = rng.standard_normal(n).astype(np.float32)
        w = paddle.to_tensor(derived.cast_bits(m, dtype).view(np.int16)).view(dtype)
        out.append((w, paddle.to_tensor(m), dtype))
    return out


def _through_host_copies(pairs) -> list[bool]:
    out = []
    for w, m, dtype in pairs:
        wh, mh = device.to_host([w])[0], device.to_host([m])[0]
        out.append(derived.equals_cast(wh.view("int16").numpy().view(np.uint16), mh.numpy(), dtype))
    return out


def _host_many(pairs) -> list[bool]:
    return derived.equals_cast_many([(w.view("int16").numpy().view(np.uint16), m.numpy(), d) for w, m, d in pairs])


CHECKS = {
    "device check (paddle ops)": equals_cast_on_device,
    "host copies + equals_cast (before)": _through_host_copies,
    "host tensors: equals_cast_many": _host_many,
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=derived.CAST_DTYPES, default="bfloat16")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    print(f"place {paddle.get_device()}, {args.dtype}, medians of {args.repeats} (wall ms, calling thread's CPU ms)")
    for layout, counts in LAYOUTS.items():
        pairs = _pairs(counts, args.dtype)
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in CHECKS}
        for _ in range(args.repeats):
            for name, check in CHECKS.items():
                t0, c0 = time.perf_counter(), time.thread_time()
                if not all(check(pairs)):
                    raise AssertionError(f"{name} found a weight that is its master's cast not equal")
                times[name].append((time.perf_counter() - t0, time.thread_time() - c0))
        for name, ts in times.items():
            wall, cpu = statistics.median(t for t, _ in ts), statistics.median(c for _, c in ts)
            print(f"| {layout} | {name} | {wall * 1e3:.0f} | {cpu * 1e3:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
