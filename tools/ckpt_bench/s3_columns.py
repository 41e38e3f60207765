"""A column-wise reshard on S3: bytes fetched, GET requests and time against the checksum chunk size.

Rerun: ``python tools/ckpt_bench/s3_columns.py [--rows 4096] [--cols 1024] [--chunks 262144,2048]``.

Starts a real SeaweedFS (``weed mini`` on 127.0.0.1, test/collective/fsdp/s3_server.py), saves one fp32 tensor of
``rows x cols`` whole (one process) with each chunk size, then loads its right half of the columns: every row's
needed segment is half a row, so with chunks longer than that every chunk is needed (2x the share), and with
chunks aligned to half rows each needed run is its own ranged GET. Every load is checked against the tensor.
Why: docs/reports/s3-2026-12-03-session3.md section 4 (smaller chunks are no fix for column reads on an object store).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "test" / "collective" / "fsdp"))

KEY_ID, SECRET = "bench", "bench-secret"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=1024)
    ap.add_argument("--chunks", default="262144,2048", help="checksum chunk sizes in bytes, comma-separated")
    args = ap.parse_args()
    import numpy as np
    import paddle
    import paddle.distributed.fsdp.checkpoint as ck
    import s3_server
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight
    from paddle.distributed.fsdp.checkpoint.s3 import S3Options
    from paddle.distributed.fsdp.checkpoint.s3.client import make_client
    from paddle.distributed.fsdp.checkpoint.s3.storage import S3Storage

    work = Path(tempfile.mkdtemp(prefix="s3-columns-"))
    server = s3_server.start_weed(work / "weed", credentials=(KEY_ID, SECRET))
    try:
        opts = S3Options(endpoint_url=server.endpoint, region="us-east-1", access_key_id=KEY_ID,
                         secret_access_key=SECRET, part_size=16 << 20, concurrency=8)  # fmt: skip
        make_client(opts).create_bucket(Bucket="cols")
        storage = S3Storage(opts)
        options = ck.CheckpointOptions(storage=storage)
        rows, cols, half = args.rows, args.cols, args.cols // 2
        full = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
        print(f"{rows} x {cols} fp32 ({full.nbytes / 2**20:.1f} MiB), load of the right half of the columns")
        print("| chunk bytes | fetched / share | GET requests | load s | checksum sidecar bytes |")
        print("|---|---|---|---|---|")
        for chunk in (int(c) for c in args.chunks.split(",")):
            url = f"s3://cols/chunk{chunk}"
            ck.save_state_dict({"t": paddle.to_tensor(full)}, url, options=options, chunk_bytes=chunk)
            objs = next(iter(storage._buckets.values()))
            gets: list[int] = []

            def count(gets: list = gets, **_kw) -> None:
                gets.append(1)

            objs.client.meta.events.register("before-call.s3.GetObject", count)
            target = {"t": ShardedWeight("t", paddle.zeros([rows, half]), [rows, half], [rows, cols], [0, half])}
            before, t0 = objs.bytes_read, time.perf_counter()
            ck.load_state_dict(target, url, options=options)
            seconds = time.perf_counter() - t0
            objs.client.meta.events.unregister("before-call.s3.GetObject", count)
            assert np.array_equal(target["t"].local_tensor.numpy(), full[:, half:]), chunk
            fetched = (objs.bytes_read - before) / (rows * half * 4)
            sidecar = len(storage.get(url, "0_0.safetensors.sums") or b"")
            print(f"| {chunk:,} | {fetched:.3f}x | {len(gets):,} | {seconds:.3f} | {sidecar:,} |", flush=True)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
