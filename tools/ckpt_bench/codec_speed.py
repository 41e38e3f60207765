"""Chunk codecs (byte-plane zstd) against raw: encoder/decoder throughput by thread count, and save + cold load
compressed vs raw against raw I/O on the local disk and against raw PUT/GET on a local S3 server, in one run.

Rerun: ``python tools/ckpt_bench/codec_speed.py [--mib 256] [--repeats 3] [--baseline REV] [--json out.json]``.

The state is one process's share of bf16 + fp32-master AdamW training state (bf16 weight = its master cast, fp32
master ~ N(0, 0.02), moment1 ~ N(0, 1e-3), moment2 = moment1^2-like), in 8 parameters, so the ratios are those of
float training state (issue 52 measured 1.19-1.48x per kind on a trained model; this state is synthetic). Phases,
each the median of ``--repeats`` (page cache of the read files evicted before every cold load):

* ``compare`` (with ``--baseline REV``): the codec of git revision REV (``format/codecs.py`` as it was there,
  loaded beside this one) against this tree's, on the same chunks in the same run, interleaved, best of
  ``--repeats``: ratio and encode/decode MB/s of raw bytes per core (CPU time of the one thread doing it, so other
  processes on a shared machine do not enter it), per kind of state, for the synthetic state and a trained one
  (a small MLP trained with AdamW a few dozen steps: real weights and moments); and that every chunk this tree
  writes decodes bit-exactly with REV's decoder;
* ``codec``: encode and decode of every 256 KiB chunk on 1, 2, ... ``--threads`` threads (the save's and load's
  pools), MB/s of raw bytes; plus the per-chunk CPU time of one thread, from which the throughput at k threads
  on a k-core host is modelled (``k * per-core``, capped by the one calling thread's own share of the work);
* ``local``: raw I/O (write + fsync of the same bytes; cold read) against ``save_state_dict`` / ``load_state_dict``
  raw and ``byteplane-zstd``;
* ``s3``: a real SeaweedFS on 127.0.0.1 (test/collective/fsdp/s3_server.py): raw PUT/GET of the same bytes through
  the engine's S3 objects against save/load raw and ``byteplane-zstd``.
"""

# ruff: noqa: B023 - every lambda of a loop is called at once, inside its iteration

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "test" / "collective" / "fsdp"))
sys.path.insert(0, str(REPO / "tools"))

logger = logging.getLogger("codec_speed")
CHUNK = 256 << 10
CODEC_VARIANTS = ("raw", "byteplane-zstd")  # the I/O phases' codecs ("auto" too: tools/ckpt_bench/bytes.py --io)
KEY_ID, SECRET = "bench", "bench-secret"


def make_state(mib: int, seed: int = 0) -> dict:
    """``{key: numpy array}``: per parameter a bf16 weight, its fp32 master and two fp32 moments."""
    import numpy as np

    rng = np.random.default_rng(seed)
    n = (mib << 20) // 14 // 8  # 14 bytes per parameter, 8 parameters
    out = {}
    for p in range(8):
        master = (rng.standard_normal(n) * 0.02).astype(np.float32)
        bits = master.view(np.uint32)
        bf16 = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even
        m1 = (rng.standard_normal(n) * 1e-3).astype(np.float32)
        m2 = ((rng.standard_normal(n) * 1e-3) ** 2 + 1e-12).astype(np.float32)
        out.update({f"p{p}.weight": bf16, f"p{p}.master": master, f"p{p}.moment1": m1, f"p{p}.moment2": m2})
    return out


def to_paddle(state: dict) -> dict:
    import paddle

    out = {}
    for k, a in state.items():
        t = paddle.to_tensor(a.view("int16") if a.dtype.name == "uint16" else a)
        out[k] = t.view("bfloat16") if a.dtype.name == "uint16" else t
    return out


def timed(fn, repeats: int, before=None) -> float:
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def timed_rss(fn, repeats: int, before=None) -> tuple[float, int, float]:
    """``timed`` plus the largest extra peak RSS (bytes over the RSS at its start) of one call and the spread of
    the calls' times (slowest / fastest: this machine's noise)."""
    from ckpt_bench.common import PeakRSS

    times, peaks = [], []
    for _ in range(repeats):
        if before is not None:
            before()
        with PeakRSS() as rss:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        peaks.append(rss.extra)
    return statistics.median(times), max(peaks), max(times) / max(min(times), 1e-9)


def stored_codec(path: str, opts) -> str:
    """The codec the checkpoint at ``path`` stored its data with (what ``auto`` chose)."""
    import paddle.distributed.fsdp.checkpoint as ck

    codecs = set(ck.read_metadata(path, options=opts).codecs.values())
    return codecs.pop() if len(codecs) == 1 else ("raw" if not codecs else "mixed")


def auto_rates(storage, path: str) -> dict:
    """What codec ``auto`` compared at ``path``'s root: this process's encoder (one thread, MB/s of CPU time)
    and the storage's write rate its saves measured (MB/s)."""
    from paddle.distributed.fsdp.checkpoint import codec_choice
    from paddle.distributed.fsdp.checkpoint.encoded_write import default_threads

    store = codec_choice.storage_rate(codec_choice.storage_root(storage, path))
    return {
        "encode_thread_mb_s": codec_choice.encode_rate() / 1e6,
        "threads": default_threads(),
        "storage_mb_s": None if store is None else store / 1e6,
    }


def cpu_split(fn) -> dict:
    """CPU seconds of ``fn`` on the calling thread and in the whole process (the helpers' share is the rest)."""
    t0, p0 = time.thread_time(), os.times()
    fn()
    t1, p1 = time.thread_time(), os.times()
    total = (p1.user + p1.system) - (p0.user + p0.system)
    return {"main": t1 - t0, "total": total}


def trained_state(steps: int = 25, seed: int = 0) -> dict:
    """``{key: numpy array}`` of a small MLP (1.6M parameters) trained ``steps`` steps with AdamW on a synthetic
    regression: its fp32 weights, their bf16 casts, and AdamW's two moments (real training state, not drawn)."""
    import numpy as np
    import paddle

    paddle.seed(seed)
    net = paddle.nn.Sequential(
        paddle.nn.Linear(256, 1024),
        paddle.nn.GELU(),
        paddle.nn.Linear(1024, 1024),
        paddle.nn.GELU(),
        paddle.nn.Linear(1024, 256),
    )
    opt = paddle.optimizer.AdamW(1e-3, parameters=net.parameters(), weight_decay=0.01)
    target = paddle.randn([256, 256])
    for _ in range(steps):
        x = paddle.randn([64, 256])
        loss = ((net(x) - paddle.tanh(x @ target)) ** 2).mean()
        loss.backward()
        opt.step()
        opt.clear_grad()
    out = {}
    for p in net.parameters():
        master = p.numpy().astype(np.float32)
        bits = master.view(np.uint32)
        out[f"{p.name}.weight"] = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        out[f"{p.name}.master"] = master
    for k, v in opt.state_dict().items():
        for kind in ("moment1", "moment2"):
            if f"_{kind}_" in k:
                out[f"{k}.{kind}"] = v.numpy().astype(np.float32)
    return out


def load_codecs_at(rev: str):
    """``format/codecs.py`` as it is at git revision ``rev``, imported beside this tree's (its relative imports
    resolve in this tree's package)."""
    import importlib.util
    import subprocess

    rel = "python/paddle/distributed/fsdp/checkpoint/format/codecs.py"
    src = subprocess.run(["git", "-C", str(REPO), "show", f"{rev}:{rel}"], check=True, capture_output=True).stdout
    path = Path(tempfile.mkdtemp(prefix="codecs-at-")) / "codecs.py"
    path.write_bytes(src)
    name = "paddle.distributed.fsdp.checkpoint.format._codecs_baseline"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _chunks_of(arrays: list) -> list:
    out = []
    for a in arrays:
        mv = memoryview(a).cast("B")
        out += [(mv[c : c + CHUNK], a.itemsize) for c in range(0, len(mv), CHUNK)]
    return out


def _codec_rates(mod, chunks: list, repeats: int) -> tuple[float, float, float, list]:
    """Ratio, encode and decode MB/s of raw bytes per core (thread CPU time, best of ``repeats``) of codec module
    ``mod`` on ``chunks``; and the stored chunks."""
    import numpy as np

    total = sum(len(c) for c, _w in chunks)
    outs = [memoryview(np.empty(len(c), np.uint8)) for c, _w in chunks]
    enc = dec = float("inf")
    stored = []
    for _ in range(repeats):
        t0 = time.thread_time()
        stored = [mod.encode_byteplanes(c, w) for c, w in chunks]
        enc = min(enc, time.thread_time() - t0)
        t0 = time.thread_time()
        for s, (c, w), o in zip(stored, chunks, outs):
            if s is not None:
                mod.decode_chunk(1, w, memoryview(s), o, lambda: "bench")
            else:
                o[:] = c  # a chunk stored raw is copied on a load
        dec = min(dec, time.thread_time() - t0)
    size = sum(len(s) if s is not None else len(c) for s, (c, _w) in zip(stored, chunks))
    return total / size, total / enc / 1e6, total / dec / 1e6, stored


def compare_phase(states: dict, before, after, repeats: int) -> dict:
    """Codec ``before`` (a module) against ``after`` per state and kind of state (see the module doc)."""
    import numpy as np

    out = {}
    for sname, state in states.items():
        rows = {}
        kinds = ("weight", "master", "moment1", "moment2")
        for kind in (*kinds, "all"):
            arrays = [a for k, a in state.items() if kind == "all" or k.endswith(kind)]
            chunks = _chunks_of(arrays)
            row = {"raw_bytes": sum(len(c) for c, _w in chunks)}
            for label, mod in (("before", before), ("after", after)):
                ratio, enc, dec, stored = _codec_rates(mod, chunks, repeats)
                row[label] = {"ratio": ratio, "encode_mb_s_per_core": enc, "decode_mb_s_per_core": dec}
            for s, (c, w) in zip(stored, chunks):  # this tree's chunks through the baseline's decoder
                if s is not None:
                    o = np.empty(len(c), np.uint8)
                    before.decode_chunk(1, w, memoryview(s), memoryview(o), lambda: "bench")
                    assert o.tobytes() == bytes(c), "a chunk of this tree does not decode with the baseline"
            for m in ("encode_mb_s_per_core", "decode_mb_s_per_core"):
                row[m.replace("_mb_s_per_core", "_speedup")] = row["after"][m] / row["before"][m]
            rows[kind] = row
            logger.info(
                "%s %s: ratio %.3f -> %.3f, encode %.0f -> %.0f MB/s/core, decode %.0f -> %.0f MB/s/core",
                sname,
                kind,
                row["before"]["ratio"],
                row["after"]["ratio"],
                row["before"]["encode_mb_s_per_core"],
                row["after"]["encode_mb_s_per_core"],
                row["before"]["decode_mb_s_per_core"],
                row["after"]["decode_mb_s_per_core"],
            )
        out[sname] = rows
    return out


def codec_phase(state: dict, threads: list[int], repeats: int) -> dict:
    import numpy as np
    from paddle.distributed.fsdp.checkpoint.format import codecs

    chunks = []
    for a in state.values():
        mv = memoryview(a).cast("B")
        chunks += [(mv[c : c + CHUNK], a.itemsize) for c in range(0, len(mv), CHUNK)]
    total = sum(len(c) for c, _w in chunks)
    stored = [codecs.encode_byteplanes(c, w) for c, w in chunks]
    ratio = total / sum(len(s) if s is not None else len(c) for s, (c, _w) in zip(stored, chunks))
    by_kind = {}
    for kind in ("weight", "master", "moment1", "moment2"):
        raw = sum(a.nbytes for k, a in state.items() if k.endswith(kind))
        enc = 0
        for k, a in state.items():
            if k.endswith(kind):
                mv = memoryview(a).cast("B")
                for c in range(0, len(mv), CHUNK):
                    s = codecs.encode_byteplanes(mv[c : c + CHUNK], a.itemsize)
                    enc += len(s) if s is not None else len(mv[c : c + CHUNK])
        by_kind[kind] = raw / enc
    out = {"raw_bytes": total, "ratio": ratio, "ratio_by_kind": by_kind, "encode": {}, "decode": {}}
    dst = np.empty(CHUNK, np.uint8)

    def dec(i):
        s = stored[i]
        c, w = chunks[i]
        if s is not None:
            codecs.decode_chunk(1, w, memoryview(s), memoryview(np.empty(len(c), np.uint8)), lambda: "bench")

    for k in threads:
        with ThreadPoolExecutor(k) as pool:
            t = timed(lambda: list(pool.map(lambda cw: codecs.encode_byteplanes(*cw), chunks)), repeats)
            out["encode"][k] = total / t / 1e6
            t = timed(lambda: list(pool.map(dec, range(len(chunks)))), repeats)
            out["decode"][k] = total / t / 1e6
    # one thread's CPU time per byte (thread_time: not the wall clock of a shared machine)
    c0 = time.thread_time()
    for c, w in chunks:
        codecs.encode_byteplanes(c, w)
    out["encode_cpu_mb_s"] = total / (time.thread_time() - c0) / 1e6
    c0 = time.thread_time()
    for i in range(len(chunks)):
        dec(i)
    out["decode_cpu_mb_s"] = total / (time.thread_time() - c0) / 1e6
    del dst
    return out


@contextlib.contextmanager
def engine_of(variant: str, baseline):
    """Saves and loads as ``variant`` does: ``<codec>`` this tree; ``<codec>@baseline`` this tree's engine with the
    baseline revision's codec (its encoder and decoder) and read path (no readahead of stored files): the only
    parts of the engine the codec work changed, so the baseline's compressed save and load, in this process, on
    the same data."""
    if not variant.endswith("@baseline"):
        yield variant
        return
    from paddle.distributed.fsdp.checkpoint import decoded_read
    from paddle.distributed.fsdp.checkpoint.format import codecs

    codec = variant.split("@")[0]
    saved = codecs.CODECS[codec], decoded_read.decode_chunk, decoded_read.Readahead.begin
    codecs.CODECS[codec] = dataclasses.replace(saved[0], encode=baseline.encode_byteplanes)
    decoded_read.decode_chunk = baseline.decode_chunk
    decoded_read.Readahead.begin = lambda self, *args: None
    try:
        yield codec
    finally:
        codecs.CODECS[codec], decoded_read.decode_chunk, decoded_read.Readahead.begin = saved


def local_phase(state: dict, pstate: dict, work: Path, repeats: int, variants=CODEC_VARIANTS, baseline=None) -> dict:
    import paddle.distributed.fsdp.checkpoint as ck

    from ckpt_bench.common import drop_cache

    payload = b"".join(memoryview(a).cast("B") for a in state.values())
    raw_file = work / "raw.bin"
    res = {"bytes": len(payload)}

    def raw_write():
        with open(raw_file, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())

    res["raw_write"], res["rss_raw_write"], res["raw_write_spread"] = timed_rss(raw_write, repeats)
    res["raw_read"], res["rss_raw_read"], res["raw_read_spread"] = timed_rss(
        lambda: raw_file.read_bytes(), repeats, before=lambda: drop_cache([str(raw_file)])
    )
    for variant in variants:
        with engine_of(variant, baseline) as codec:
            local_variant(res, variant, ck.CheckpointOptions(codec=codec), pstate, work, repeats)
    return res


def local_variant(res: dict, codec: str, opts, pstate: dict, work: Path, repeats: int) -> None:
    """Save and cold load of ``pstate`` with ``opts`` on the local disk; figures into ``res`` under ``codec``."""
    import paddle
    import paddle.distributed.fsdp.checkpoint as ck

    from ckpt_bench.common import drop_cache

    path = work / f"ck-{codec.replace('@', '-')}"

    def save():
        shutil.rmtree(path, ignore_errors=True)
        ck.save_state_dict(pstate, str(path), options=opts)

    res[f"save_{codec}"], res[f"save_rss_{codec}"], res[f"save_{codec}_spread"] = timed_rss(save, repeats)
    res[f"stored_{codec}"] = stored_codec(str(path), opts)
    if codec == "auto":  # (a further save would be measured too and move what auto compares)
        from paddle.distributed.fsdp.checkpoint.io.local import LocalStorage

        res["auto_rates"] = auto_rates(LocalStorage(), str(path))
    else:
        res[f"save_cpu_{codec}"] = cpu_split(save)
    files = [str(p) for p in path.iterdir() if p.is_file()]
    res[f"bytes_{codec}"] = sum(os.path.getsize(p) for p in files if ".safetensors" in p)
    targets = {k: paddle.zeros_like(v) for k, v in pstate.items()}
    res[f"load_{codec}"], res[f"load_rss_{codec}"], res[f"load_{codec}_spread"] = timed_rss(
        lambda: ck.load_state_dict(targets, str(path), options=opts), repeats, before=lambda: drop_cache(files)
    )
    drop_cache(files)
    if codec != "auto":
        res[f"load_cpu_{codec}"] = cpu_split(lambda: ck.load_state_dict(targets, str(path), options=opts))
    for k, v in pstate.items():  # the loaded bytes are the saved ones
        assert targets[k].numpy().tobytes() == v.numpy().tobytes(), k


def s3_phase(
    state: dict, pstate: dict, work: Path, repeats: int, variants=CODEC_VARIANTS, baseline=None, link_mbit=None
) -> dict:
    """``link_mbit``: cap the S3 port on loopback at that many mbit per direction (tc, ckpt_bench.link_shaper)."""
    import paddle
    import paddle.distributed.fsdp.checkpoint as ck
    import s3_server
    from paddle.distributed.fsdp.checkpoint.s3 import S3Options
    from paddle.distributed.fsdp.checkpoint.s3.client import make_client
    from paddle.distributed.fsdp.checkpoint.s3.storage import S3Storage

    from ckpt_bench.common import drop_cache, files_under

    server = s3_server.start_weed(work / "weed", credentials=(KEY_ID, SECRET))
    link = contextlib.nullcontext()
    if link_mbit:
        from ckpt_bench.link_shaper import shaped

        link = shaped(int(server.endpoint.rsplit(":", 1)[1].rstrip("/")), link_mbit)
    try:
        with link:
            sopts = S3Options(
                endpoint_url=server.endpoint, region="us-east-1", access_key_id=KEY_ID, secret_access_key=SECRET
            )
            client = make_client(sopts)
            client.create_bucket(Bucket="bench")
            storage = S3Storage(sopts)
            payload = b"".join(memoryview(a).cast("B") for a in state.values())
            res = {"bytes": len(payload)}
            from boto3.s3.transfer import TransferConfig

            cfg = TransferConfig(
                multipart_chunksize=sopts.part_size,
                multipart_threshold=sopts.part_size,
                max_concurrency=sopts.concurrency,
            )
            import io

            res["raw_put"], res["rss_raw_put"], res["raw_put_spread"] = timed_rss(
                lambda: client.upload_fileobj(io.BytesIO(payload), "bench", "raw", Config=cfg), repeats
            )
            cold = lambda: drop_cache(files_under(str(work / "weed")))  # noqa: E731 - the server's files
            res["raw_get"], res["rss_raw_get"], res["raw_get_spread"] = timed_rss(
                lambda: client.download_fileobj("bench", "raw", io.BytesIO(), Config=cfg), repeats, before=cold
            )
            for variant in variants:
                with engine_of(variant, baseline) as codec:
                    opts = ck.CheckpointOptions(codec=codec, storage=storage)
                    url = f"s3://bench/ck-{variant.replace('@', '-')}"
                    res[f"save_{variant}"], res[f"save_rss_{variant}"], res[f"save_{variant}_spread"] = timed_rss(
                        lambda: ck.save_state_dict(pstate, url, options=opts), repeats
                    )
                    res[f"stored_{variant}"] = stored_codec(url, opts)
                    if variant == "auto":
                        res["auto_rates"] = auto_rates(storage, url)
                    h = storage.open_read(url, "0_0.safetensors")
                    res[f"bytes_{variant}"] = h.size
                    h.close()
                    targets = {k: paddle.zeros_like(v) for k, v in pstate.items()}
                    res[f"load_{variant}"], res[f"load_rss_{variant}"], res[f"load_{variant}_spread"] = timed_rss(
                        lambda: ck.load_state_dict(targets, url, options=opts), repeats, before=cold
                    )
                    for k, v in pstate.items():
                        assert targets[k].numpy().tobytes() == v.numpy().tobytes(), k
            return res
    finally:
        server.stop()


def model(res: dict, cores: list[int]) -> dict:
    """CPU-bound ceiling of a compressed save and load on k cores: the calling thread's CPU (copies, table, the
    write or read calls: serial) on one core, the helpers' CPU (encode/decode: parallel) spread over k - 1 cores
    (k = 1: all on one); bytes / max(serial, parallel / (k - 1)). Measured CPU times, not wall times, so another
    process on a shared machine does not enter it."""
    out = {}
    n = res["bytes"]
    for op in ("save", "load"):
        cpu = res[f"{op}_cpu_byteplane-zstd"]
        serial, par = cpu["main"], max(0.0, cpu["total"] - cpu["main"])
        out[op] = {
            "serial_cpu_s": serial,
            "parallel_cpu_s": par,
            "by_cores_mb_s": {
                k: n / max(serial + par if k == 1 else max(serial, par / (k - 1)), 1e-9) / 1e6 for k in cores
            },
        }
    return out


def _this_codecs():
    from paddle.distributed.fsdp.checkpoint.format import codecs

    return codecs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256, help="MiB of training state (one process's share)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="largest thread count measured (1..N)")
    ap.add_argument("--no-s3", action="store_true", help="skip the S3 phase (no SeaweedFS here)")
    ap.add_argument("--baseline", help="git revision whose codec is measured against this tree's (e.g. main)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    state = make_state(args.mib)
    pstate = to_paddle(state)
    out = {"mib": args.mib, "repeats": args.repeats, "cpus": os.cpu_count()}
    baseline = load_codecs_at(args.baseline) if args.baseline else None
    if baseline is not None:
        logger.info("codec of %s against this tree's", args.baseline)
        states = {"synthetic": state, "trained": trained_state()}
        out["baseline"] = args.baseline
        out["compare"] = compare_phase(states, baseline, _this_codecs(), args.repeats)
    logger.info("codec throughput")
    out["codec"] = codec_phase(state, list(range(1, args.threads + 1)), args.repeats)
    work = Path(tempfile.mkdtemp(prefix="codec-speed-", dir=os.environ.get("CODEC_BENCH_DIR")))
    try:
        logger.info("local disk")
        variants = (*CODEC_VARIANTS, "byteplane-zstd@baseline") if baseline is not None else CODEC_VARIANTS
        out["local"] = local_phase(state, pstate, work, args.repeats, variants, baseline)
        out["model"] = model(out["local"], [1, 2, 4, 8, 16, 32, 64])
        if not args.no_s3:
            logger.info("S3 (SeaweedFS on 127.0.0.1)")
            out["s3"] = s3_phase(state, pstate, work, args.repeats, variants, baseline)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(out, indent=1, default=float)
    if args.json:
        Path(args.json).write_text(text)
    sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
