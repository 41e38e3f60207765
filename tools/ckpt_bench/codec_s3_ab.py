"""Save and load on a local S3 server (SeaweedFS on 127.0.0.1), raw against this tree's ``byteplane-zstd`` against
a baseline revision's (codec_speed.engine_of), the three interleaved round by round in rotating order, so a shared
machine's changing load spreads over all three instead of biasing the one measured last.

Rerun: ``python tools/ckpt_bench/codec_s3_ab.py MIB ROUNDS [BASELINE_REV] [OUT.json]``.
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VARIANTS = ["raw", "byteplane-zstd", "byteplane-zstd@baseline"]


def run(mib: int, rounds: int, rev: str) -> dict:
    """``{variant: {"save"|"load": {"runs": [s], "median": s}}}``; every load checked bit-exact."""
    for p in ("tools/ckpt_bench", "tools", "test/collective/fsdp"):
        sys.path.insert(0, str(REPO / p))
    import codec_speed as cs
    import paddle
    import paddle.distributed.fsdp.checkpoint as ck
    import s3_server
    from paddle.distributed.fsdp.checkpoint.s3 import S3Options
    from paddle.distributed.fsdp.checkpoint.s3.client import make_client
    from paddle.distributed.fsdp.checkpoint.s3.storage import S3Storage

    ps = cs.to_paddle(cs.make_state(mib))
    base = cs.load_codecs_at(rev)
    work = Path(tempfile.mkdtemp(prefix="codec-s3-ab-"))
    server = s3_server.start_weed(work / "weed", credentials=(cs.KEY_ID, cs.SECRET))
    res: dict = {v: {"save": [], "load": []} for v in VARIANTS}
    try:
        so = S3Options(
            endpoint_url=server.endpoint, region="us-east-1", access_key_id=cs.KEY_ID, secret_access_key=cs.SECRET
        )
        make_client(so).create_bucket(Bucket="bench")
        storage = S3Storage(so)
        targets = {k: paddle.zeros_like(v) for k, v in ps.items()}
        for r in range(rounds):
            for v in VARIANTS[r % 3 :] + VARIANTS[: r % 3]:
                with cs.engine_of(v, base) as codec:
                    opts = ck.CheckpointOptions(codec=codec, storage=storage)
                    url = f"s3://bench/{v.replace('@', '-')}"
                    t0 = time.perf_counter()
                    ck.save_state_dict(ps, url, options=opts)
                    t1 = time.perf_counter()
                    ck.load_state_dict(targets, url, options=opts)
                    t2 = time.perf_counter()
                    for k, x in ps.items():
                        assert targets[k].numpy().tobytes() == x.numpy().tobytes(), k
                res[v]["save"].append(t1 - t0)
                res[v]["load"].append(t2 - t1)
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)
    return {v: {op: {"runs": x, "median": statistics.median(x)} for op, x in d.items()} for v, d in res.items()}


def main() -> None:
    mib, rounds = int(sys.argv[1]), int(sys.argv[2])
    out = run(mib, rounds, sys.argv[3] if len(sys.argv) > 3 else "main")
    if len(sys.argv) > 4:
        Path(sys.argv[4]).write_text(json.dumps(out, indent=1))
    sys.stdout.write(json.dumps({v: {op: round(x["median"], 3) for op, x in d.items()} for v, d in out.items()}) + "\n")


if __name__ == "__main__":
    main()
