#!/usr/bin/env python3
"""Bytes per parameter of a checkpoint, per save mode (issue #52).

    python tools/ckpt_bench/bytes.py --json bytes.json          # also: python tools/bench_ckpt.py --bytes
    python tools/bench_ckpt.py --bytes --io --json bytes.json   # + save / cold load against raw I/O, local and S3

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
headers and checksum sidecars, the index (metadata.json, index.*, <rank>.values, 0.metadata, COMMIT); ``codec``
is what the data files were stored with (``default`` runs codec ``auto``: measured, checkpoint/codec_choice.py,
after the ``raw`` mode's saves measured this directory).

``--io`` adds save and cold-load seconds of ``--io-mib`` MiB of bf16+master training state (one process's share,
tools/ckpt_bench/codec_speed.py's phases) stored raw, ``byteplane-zstd`` and ``auto``, against raw I/O of the same
bytes: write+fsync / cold read on the local disk (page cache of the read files dropped), PUT / GET on a local
SeaweedFS (``weed mini`` on 127.0.0.1; its files' cache dropped before each GET and load); peak RSS of each (extra
over the RSS at its start: common.PeakRSS); and whether each goal of issue 52 is met.
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
from pathlib import Path

LOG = logging.getLogger("bench_bytes")

# mode -> save_checkpoint keywords. raw: every tensor stored as it is; default: what a save does by default
MODES: dict[str, dict] = {
    "raw": {"derive_weights": False},
    "default": {},
    # lossless: byte planes + zstd per chunk (codec "auto" picks it where the encoder outruns the storage)
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
    p.add_argument("--io", action="store_true", help="also time save / cold load against raw I/O (local and S3)")
    p.add_argument("--io-mib", type=int, default=256, help="MiB of state of the --io phases (default 256)")
    p.add_argument("--no-s3", action="store_true", help="--io without the S3 phase (no SeaweedFS here)")
    p.add_argument(
        "--s3-mbps",
        type=int,
        default=None,
        help="emulate a link of N mbit/s per direction to the S3 server: tc htb on lo for the bench's own S3 port "
        "only (needs root and tc; removed on exit)",
    )
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
    per["codec"] = ",".join(sorted(set(md.codecs.values()))) or "raw"
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
    head = "| model / mode | params | format | codec | " + " | ".join(cols) + " | save s | load s |"
    lines = [head, "|---" * (len(cols) + 6) + "|"]
    for name, r in results.items():
        cells = " | ".join(f"{r[c]:.3f}" for c in cols)
        lines.append(
            f"| {name} | {r['params']:,} | {r['format']} | {r['codec']} | {cells} | {r['save_s']:.3f} "
            f"| {r['load_s']:.3f} |"
        )
    return "\n".join(lines)


IO_CODECS = ("raw", "byteplane-zstd", "auto")
LOCAL_NOISE = 1.10  # a local save / load within 10% of the raw one's time: this shared machine's noise


def run_io(args) -> dict:
    """codec_speed's local and S3 phases over raw, byteplane-zstd and auto (medians of ``--repeats``)."""
    from ckpt_bench import codec_speed

    state = codec_speed.make_state(args.io_mib)
    pstate = codec_speed.to_paddle(state)
    work = tempfile.mkdtemp(prefix="bench_bytes_io_", dir=args.dir)
    out = {"mib": args.io_mib, "repeats": args.repeats}
    try:
        LOG.info("--io: local disk")
        out["local"] = codec_speed.local_phase(state, pstate, Path(work), args.repeats, IO_CODECS)
        if not args.no_s3:
            link = f", link shaped to {args.s3_mbps} mbit/s per direction (tc)" if args.s3_mbps else ""
            LOG.info("--io: S3 (SeaweedFS on 127.0.0.1%s)", link)
            out["s3_mbit"] = args.s3_mbps
            out["s3"] = codec_speed.s3_phase(state, pstate, Path(work), args.repeats, IO_CODECS, link_mbit=args.s3_mbps)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def io_table(io: dict) -> str:
    """Seconds, ratio to the raw I/O of the same bytes, and peak RSS, per target and codec."""
    mib = 1 << 20
    lines = [
        "| target | codec (stored) | stored MB | save s | save / raw I/O | load s (cold) | load / raw I/O "
        "| save RSS MiB | load RSS MiB |",
        "|---" * 9 + "|",
    ]
    for target, (put, get) in (("local", ("raw_write", "raw_read")), ("s3", ("raw_put", "raw_get"))):
        r = io.get(target)
        if r is None:
            continue
        lines.append(
            f"| {target} | raw I/O ({put} / {get}) | {r['bytes'] / 1e6:.1f} | {r[put]:.3f} | 1.00 | {r[get]:.3f} "
            f"| 1.00 | {r['rss_' + put] / mib:.0f} | {r['rss_' + get] / mib:.0f} |"
        )
        for c in IO_CODECS:
            lines.append(
                f"| {target} | {c} ({r['stored_' + c]}) | {r['bytes_' + c] / 1e6:.1f} | {r['save_' + c]:.3f} "
                f"| {r['save_' + c] / r[put]:.2f} | {r['load_' + c]:.3f} | {r['load_' + c] / r[get]:.2f} "
                f"| {r['save_rss_' + c] / mib:.0f} | {r['load_rss_' + c] / mib:.0f} |"
            )
    return "\n".join(lines)


def goals(results: dict, io: dict | None) -> list[tuple[str, str, bool | None]]:
    """Issue 52's goals: ``(goal, what was measured, met)`` (None: not measured in this run)."""
    out = []
    default = results.get("bf16+master/default")
    if default is not None:
        out.append(
            (
                "default (lossless) <= 10.0 B/param, bf16+master",
                f"{default['total']:.3f} B/param (codec {default['codec']})",
                default["total"] <= 10.0,
            )
        )
    lossless = results.get("bf16+master/lossless")
    if lossless is not None:
        out.append(
            (
                "lossless mode (byteplane-zstd asked for) <= 10.0 B/param, bf16+master",
                f"{lossless['total']:.3f} B/param",
                lossless["total"] <= 10.0,
            )
        )
    int8 = [results[k]["total"] for k in ("bf16+master/int8", "bf16+master/int8+zstd") if k in results]
    if int8:
        out.append(("opt-in int8 <= 6.1 B/param, bf16+master", f"{min(int8):.3f} B/param", min(int8) <= 6.1))
    local = (io or {}).get("local")
    if local is not None:
        for op in ("save", "load"):
            ratio = local[f"{op}_auto"] / local[f"{op}_raw"]
            noise = max(LOCAL_NOISE, local[f"{op}_raw_spread"], local[f"{op}_auto_spread"])
            same = local["stored_auto"] == "raw"  # auto chose raw: the raw save's path and bytes, the ratio is noise
            out.append(
                (
                    f"local {op}: auto not slower than raw (within noise: {LOCAL_NOISE:.2f}x or the repeats' spread)",
                    f"{ratio:.2f}x, spread {noise:.2f}x (auto stored {local['stored_auto']}"
                    + (": the raw save itself)" if same else ")"),
                    same or ratio <= noise,
                )
            )
    s3 = (io or {}).get("s3")
    if s3 is not None:
        size = s3["bytes_raw"] / s3["bytes_byteplane-zstd"]  # what compressing saves (auto may not have)
        for op in ("save", "load"):
            speedup = s3[f"{op}_raw"] / s3[f"{op}_auto"]
            out.append(
                (
                    f"S3 {op}: auto faster than raw by >= 0.9 x size ratio ({0.9 * size:.2f}x)",
                    f"{speedup:.2f}x (size ratio {size:.2f}, auto stored {s3['stored_auto']})",
                    speedup >= 0.9 * size,
                )
            )
    return out


def goals_table(rows) -> str:
    lines = ["| goal (issue 52) | measured | met |", "|---|---|---|"]
    lines += [f"| {g} | {m} | {'yes' if ok else 'NO'} |" for g, m, ok in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown:
        raise SystemExit(f"unknown mode(s) {sorted(unknown)}; known: {', '.join(MODES)}")
    if args.s3_mbps:
        from ckpt_bench.link_shaper import ShapingUnavailable, require

        try:
            require()
        except ShapingUnavailable as e:
            raise SystemExit(f"ShapingUnavailable: {e}") from None
    results = run(args)
    io = run_io(args) if args.io else None
    print(table(results))
    if io is not None:
        print()
        print(io_table(io))
    print()
    print(goals_table(goals(results, io)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bytes": results, "io": io, "goals": goals(results, io)}, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
