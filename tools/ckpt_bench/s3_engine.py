"""The checkpoint engine on S3 against the same engine on a local disk and against plain boto3, in one run.

Rerun: ``python tools/ckpt_bench/s3_engine.py [--mib-per-rank 128] [--repeats 3] [--json out.json]``.

Starts a real SeaweedFS (``weed mini`` on 127.0.0.1, free ports, test/collective/fsdp/s3_server.py), then
``--world`` ranks (``paddle.distributed.launch``, default 2) that each hold ``--mib-per-rank`` MiB of fp32 state as
row shards of 4 tensors. Each round, timed from a barrier to the slowest rank (page cache dropped before every
read phase; before every write phase ``sync`` and a short pause, so that no phase pays for the write-back of the
one before; the raw put and the S3 save alternate which goes first, round by round):

* ``raw put`` / ``raw get``: boto3's own managed transfer (``upload_fileobj`` / ``download_fileobj``, same part
  size and concurrency as the engine) of each rank's state bytes as one object: the client's limit;
* ``S3 save`` / ``S3 load``: ``save_state_dict`` / ``load_state_dict`` (memory-bounded, checksums verified) on
  ``s3://``; every load is checked against the saved bytes;
* ``local save`` / ``local load``: the same calls on a local directory (``--local-dir``, default under /tmp);
* ``S3 load, rows``: a reshard into row shards cut at a third instead of the middle; ``S3 load, columns``: into
  column shards (each rank needs half of every row of both ranks' objects): bytes fetched against the share.

Reported: per round and as medians, ratios (S3 save / raw put, S3 load / raw get as throughput ratios: >= 1 is faster than plain
boto3), S3 vs local, bytes fetched / share, peak extra RSS and the engine's own host-memory account of a load, and the
S3 save split (trace) into its data upload (``write+fsync``: the rank's object, until the store completed it) and
the rest (sidecar, hand-over, metadata, commit record, publish), and the S3 server's CPU time during the raw put
and the save (the store is CPU-bound on a small machine: what a request costs it is throughput).
"""

# ruff: noqa: B023 - every lambda of a round is called at once, inside its round

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TEST_DIR = REPO / "test" / "collective" / "fsdp"
sys.path.insert(0, str(TEST_DIR))
sys.path.insert(0, str(REPO / "tools"))

KEY_ID, SECRET = "bench", "bench-secret"
N_TENSORS = 4
PART = 16 << 20
CONCURRENCY = 8


def _options(endpoint: str):
    from paddle.distributed.fsdp.checkpoint.s3 import S3Options

    return S3Options(
        endpoint_url=endpoint,
        region="us-east-1",
        access_key_id=KEY_ID,
        secret_access_key=SECRET,
        part_size=PART,
        concurrency=CONCURRENCY,
    )


# ------------------------------------------------------------------------------------------------ worker side


def _state(rank: int, world: int, mib: int, seed: int, columns: bool = False, shifted: bool = False) -> dict:
    import numpy as np
    import paddle
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    cols = 1024
    rows = (mib << 20) // (N_TENSORS * cols * 4)
    out = {}
    for i in range(N_TENSORS):
        g = [world * rows, cols]
        if columns:  # the same global tensors, cut into column shards instead of row shards
            c = cols // world
            local = paddle.zeros([g[0], c])
            out[f"t{i}"] = ShardedWeight(f"t{i}", local, [g[0], c], g, [0, rank * c])
        elif shifted:  # row shards cut at a third instead of the middle (as a 3 -> 2 or 2 -> 3 reshard cuts)
            cut = g[0] // 3
            lo, hi = (0, cut) if rank == 0 else (cut, g[0])
            out[f"t{i}"] = ShardedWeight(f"t{i}", paddle.zeros([hi - lo, cols]), [hi - lo, cols], g, [lo, 0])
        else:
            data = np.random.default_rng(seed * 100 + rank * 10 + i).standard_normal((rows, cols), dtype=np.float32)
            out[f"t{i}"] = ShardedWeight(f"t{i}", paddle.to_tensor(data), [rows, cols], g, [rank * rows, 0])
    return out


def _bytes_of(state: dict) -> bytes:
    import numpy as np

    return b"".join(np.ascontiguousarray(state[k].local_tensor.numpy()).tobytes() for k in sorted(state))


def _server_cpu(pid: int) -> float:
    """CPU seconds (user + system) the S3 server process has used so far (Linux /proc), 0 when unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _settle() -> None:
    """Before a write phase: the previous phases' dirty pages (the server's volume files) written back."""
    os.sync()
    time.sleep(0.2)


def _timed(comm_barrier, fn, settle: bool = False):
    if settle:
        _settle()
    comm_barrier()
    t0 = time.perf_counter()
    out = fn()
    comm_barrier()
    return time.perf_counter() - t0, out


def worker(args) -> None:
    import boto3
    import numpy as np
    import paddle.distributed as dist
    import paddle.distributed.fsdp.checkpoint as ck
    from boto3.s3.transfer import TransferConfig
    from launch_util import report
    from paddle.distributed.fsdp.checkpoint.s3.storage import S3Storage

    from ckpt_bench.common import PeakRSS, drop_cache

    dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    barrier = dist.barrier if world > 1 else (lambda: None)  # one rank: no global group to wait on
    opts = _options(args.endpoint)
    storage = S3Storage(opts, who=f"rank {rank}")
    traces: list = []
    copts = ck.CheckpointOptions(storage=storage)
    traced = ck.CheckpointOptions(storage=storage, trace_hook=traces.append)
    client = boto3.client(
        "s3",
        endpoint_url=args.endpoint,
        aws_access_key_id=KEY_ID,
        aws_secret_access_key=SECRET,
        region_name="us-east-1",
    )
    transfer = TransferConfig(multipart_chunksize=PART, multipart_threshold=PART, max_concurrency=CONCURRENCY)
    state = _state(rank, world, args.mib_per_rank, seed=1)
    payload = _bytes_of(state)
    rounds = []
    for r in range(args.repeats):
        res = {}
        url, local = f"s3://{args.bucket}/round{r}/ckpt", os.path.join(args.local_dir, f"round{r}")
        raw_key = f"raw{r}/rank{rank}"
        for phase in ("raw_put", "s3_save") if r % 2 == 0 else ("s3_save", "raw_put"):
            cpu0 = _server_cpu(args.weed_pid)
            if phase == "raw_put":
                res["raw_put"], _ = _timed(
                    barrier,
                    lambda: client.upload_fileobj(io.BytesIO(payload), args.bucket, raw_key, Config=transfer),
                    settle=True,
                )
            else:
                traces.clear()
                res["s3_save"], _ = _timed(barrier, lambda: ck.save_state_dict(state, url, options=traced), True)
                ranks = [t.phases_ms() for t in traces if t.what.startswith("save rank")]
                res["s3_save_data"] = ranks[0].get("write+fsync", 0.0) / 1000 if ranks else 0.0
                for t in traces:  # every phase of the coordinator (rank 0): calling thread and save thread
                    if rank == 0:
                        res.update({f"trace {t.what}: {k}": v / 1000 for k, v in t.phases_ms().items()})
            res[f"{phase}_server_cpu"] = _server_cpu(args.weed_pid) - cpu0  # the store's work for this phase
        res["local_save"], _ = _timed(barrier, lambda: ck.save_state_dict(state, local), settle=True)
        files = [os.path.join(local, n) for n in os.listdir(local)]

        def raw_get():
            sink = io.BytesIO()
            client.download_fileobj(args.bucket, raw_key, sink, Config=transfer)
            assert sink.getbuffer().nbytes == len(payload)

        drop_cache(files)
        res["raw_get"], _ = _timed(barrier, raw_get)
        for name, where, o in (("s3_load", url, copts), ("local_load", local, None)):
            target = _state(rank, world, args.mib_per_rank, seed=2)
            drop_cache(files)
            objects = next(iter(storage._buckets.values()))
            before = objects.bytes_read
            with PeakRSS() as rss:
                res[name], rep = _timed(barrier, lambda: ck.load_state_dict(target, where, options=o))
            assert _bytes_of(target) == payload, f"{name}: loaded bytes differ from the saved ones"
            res[f"{name}_rss_mib"] = (rss.peak - rss.base) / 2**20
            res[f"{name}_engine_mib"] = rep.peak_host_bytes / 2**20
            if name == "s3_load":
                res["s3_load_fetched"] = objects.bytes_read - before
        for name, kind in (("rows", {"shifted": True}), ("columns", {"columns": True})):
            target = _state(rank, world, args.mib_per_rank, seed=0, **kind)
            drop_cache(files)
            before = next(iter(storage._buckets.values())).bytes_read
            res[f"s3_load_{name}"], _ = _timed(barrier, lambda: ck.load_state_dict(target, url, options=copts))
            res[f"{name}_fetched"] = next(iter(storage._buckets.values())).bytes_read - before
            res[f"{name}_share"] = sum(v.local_tensor.numel().item() * 4 for v in target.values())
            res[f"{name}_ratio"] = res[f"{name}_fetched"] / res[f"{name}_share"]
            full = {k: v.numpy() for k, v in ck.load_full_state_dict(local).items()}
            for k, v in target.items():  # each shard equals the same part of the local checkpoint's full tensor
                o, n = v.global_offset, v.local_shape
                want = full[k][o[0] : o[0] + n[0], o[1] : o[1] + n[1]]
                assert np.array_equal(v.local_tensor.numpy(), want), (name, k)
        rounds.append(res)
    report({"bytes": len(payload), "rounds": rounds})


# ------------------------------------------------------------------------------------------------ driver side


def _table(results: dict) -> tuple[str, dict]:
    per_rank = results[0]["bytes"]
    by_round = list(zip(*(results[r]["rounds"] for r in sorted(results))))  # [round][rank] -> figures
    med = {}
    for k in (
        k for k in results[0]["rounds"][0] if not k.startswith("trace ")
    ):  # the slowest (largest) rank per round, then the median over rounds
        med[k] = statistics.median(max(ranks[i][k] for i in range(len(ranks))) for ranks in by_round)
    med["save_ratio_rounds"] = statistics.median(
        max(x["raw_put"] for x in ranks) / max(x["s3_save"] for x in ranks) for ranks in by_round
    )
    # the save beyond the slowest rank's data upload (a rank's own "rest" includes waiting for the others' data)
    med["s3_save_rest"] = statistics.median(
        max(x["s3_save"] for x in ranks) - max(x["s3_save_data"] for x in ranks) for ranks in by_round
    )
    total = per_rank * len(results) / 1e9
    lines = [
        "| phase | seconds (median) | GB/s | ratio | note |",
        "|---|---|---|---|---|",
        f"| raw put (boto3 upload_fileobj) | {med['raw_put']:.3f} | {total / med['raw_put']:.2f} | 1.00x | limit for saves |",
        f"| S3 save (save_state_dict) | {med['s3_save']:.3f} | {total / med['s3_save']:.2f} | "
        f"**{med['raw_put'] / med['s3_save']:.2f}x** raw put | vs local save {med['local_save'] / med['s3_save']:.2f}x |",
        f"| local save | {med['local_save']:.3f} | {total / med['local_save']:.2f} | - | |",
        f"| raw get (boto3 download_fileobj) | {med['raw_get']:.3f} | {total / med['raw_get']:.2f} | 1.00x | limit for loads |",
        f"| S3 load (load_state_dict, checksums) | {med['s3_load']:.3f} | {total / med['s3_load']:.2f} | "
        f"**{med['raw_get'] / med['s3_load']:.2f}x** raw get | vs local load {med['local_load'] / med['s3_load']:.2f}x; "
        f"fetched {med['s3_load_fetched'] / per_rank:.3f}x its share |",
        f"| local load (cold) | {med['local_load']:.3f} | {total / med['local_load']:.2f} | - | |",
        f"| S3 load into row shards cut at 1/3 (reshard) | {med['s3_load_rows']:.3f} | "
        f"{total / med['s3_load_rows']:.2f} | {med['raw_get'] / med['s3_load_rows']:.2f}x raw get | "
        f"fetched {med['rows_ratio']:.3f}x its share (the rank furthest above) |",
        f"| S3 load into column shards (reshard) | {med['s3_load_columns']:.3f} | "
        f"{total / med['s3_load_columns']:.2f} | {med['raw_get'] / med['s3_load_columns']:.2f}x raw get | "
        f"fetched {med['columns_ratio']:.3f}x its share |",
        "",
        f"S3 save split (slowest rank, medians): data upload {med['s3_save_data']:.3f} s, the rest (sidecar, "
        f"hand-over, metadata, commit record, publish) {med['s3_save_rest']:.3f} s.",
        "",
        f"The S3 server's CPU time during the phase (user + system, medians): raw put "
        f"{med['raw_put_server_cpu']:.2f} s, S3 save {med['s3_save_server_cpu']:.2f} s.",
        "",
        "Median of the per-round ratios raw put / S3 save (each round's two phases ran back to back): "
        f"{med['save_ratio_rounds']:.2f}x.",
        "",
        "Per round (slowest rank; the raw put went first in even rounds): raw put s / S3 save s / ratio: "
        + "; ".join(
            f"{max(x['raw_put'] for x in ranks):.3f} / {max(x['s3_save'] for x in ranks):.3f} / "
            f"{max(x['raw_put'] for x in ranks) / max(x['s3_save'] for x in ranks):.2f}x"
            for ranks in by_round
        ),
        "",
        "Coordinator's save phases (trace, round medians, ms): "
        + ", ".join(
            f"{k[6:]}={1000 * statistics.median(rd[k] for rd in results[0]['rounds']):.1f}"
            for k in results[0]["rounds"][0]
            if k.startswith("trace ")
        ),
        "",
        f"Peak extra host memory per rank during a load (RSS over its base / the engine's account): S3 "
        f"{med['s3_load_rss_mib']:.1f} / {med['s3_load_engine_mib']:.1f} MiB, local "
        f"{med['local_load_rss_mib']:.1f} / {med['local_load_engine_mib']:.1f} MiB "
        f"({per_rank / 2**20:.0f} MiB per rank).",
    ]
    return "\n".join(lines), med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib-per-rank", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--world", type=int, default=2, choices=(1, 2))
    ap.add_argument("--local-dir", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--endpoint", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--bucket", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--weed-pid", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    import s3_server
    from launch_util import run_launch

    work = Path(tempfile.mkdtemp(prefix="s3-engine-bench-"))
    server = s3_server.start_weed(work / "weed", credentials=(KEY_ID, SECRET))
    try:
        s3_server_bucket(server.endpoint, "bench")
        local = args.local_dir or str(work / "local")
        os.makedirs(local, exist_ok=True)
        cmd = [
            "--worker", "--endpoint", server.endpoint, "--bucket", "bench", "--local-dir", local,
            "--mib-per-rank", str(args.mib_per_rank), "--repeats", str(args.repeats),
            "--weed-pid", str(server.process.pid),
        ]  # fmt: skip
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        res = run_launch(__file__, args.world, cmd, timeout=3600, log_dir=work / "logs")
        table, med = _table(res.results)
        print(
            f"S3 engine benchmark, {started}, {args.world} rank(s), {args.mib_per_rank} MiB per rank, {args.repeats} rounds"
        )
        print(table)
        if args.json:
            Path(args.json).write_text(json.dumps({"started": started, "median": med, "raw": res.results}, indent=1))
    finally:
        server.stop()
        # the server's volumes and the local checkpoints take GBs per run; the launch logs stay
        shutil.rmtree(work / "weed", ignore_errors=True)
        shutil.rmtree(work / "local", ignore_errors=True)


def s3_server_bucket(endpoint: str, name: str) -> None:
    import boto3

    boto3.client(
        "s3", endpoint_url=endpoint, aws_access_key_id=KEY_ID, aws_secret_access_key=SECRET, region_name="us-east-1"
    ).create_bucket(Bucket=name)


if __name__ == "__main__":
    main()
