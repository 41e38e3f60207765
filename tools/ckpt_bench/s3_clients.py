"""Compare S3 client libraries against a local SeaweedFS: multipart upload, ranged parallel GETs, conditional put,
multipart abort. Rerun: ``python tools/ckpt_bench/s3_clients.py [--mib 256] [--part-mib 16] [--concurrency 8]``.

Why: the checkpoint engine's S3 backend is built on one client; the choice is made on figures from this script
(docs/reports/s3-client-choice-*.md), not on reputation. Each client does the same work on the same bytes; every
transfer is checked byte for byte. The server is started here on 127.0.0.1 (free ports) and stopped at the end.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import hashlib
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "test" / "collective" / "fsdp"))

import s3_server  # noqa: E402

KEY_ID, SECRET, REGION = "bench", "bench-secret", "us-east-1"


def _ranges(total: int, part: int) -> list[tuple[int, int]]:
    return [(s, min(s + part, total)) for s in range(0, total, part)]


class Boto3Client:
    name = "boto3 (own thread pool)"

    def __init__(self, endpoint: str, bucket: str, conc: int) -> None:
        import boto3
        from botocore.config import Config

        self.bucket, self.conc = bucket, conc
        cfg = Config(max_pool_connections=conc * 2, retries={"mode": "standard", "max_attempts": 3})
        self.c = boto3.client(
            "s3", endpoint_url=endpoint, aws_access_key_id=KEY_ID, aws_secret_access_key=SECRET,
            region_name=REGION, config=cfg,
        )  # fmt: skip

    def put(self, key: str, data: memoryview, part: int) -> None:
        up = self.c.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"]

        def one(i: int, s: int, e: int) -> dict:
            r = self.c.upload_part(Bucket=self.bucket, Key=key, UploadId=up, PartNumber=i + 1, Body=data[s:e].tobytes())
            return {"PartNumber": i + 1, "ETag": r["ETag"]}

        with concurrent.futures.ThreadPoolExecutor(self.conc) as ex:
            parts = list(ex.map(lambda a: one(*a), [(i, s, e) for i, (s, e) in enumerate(_ranges(len(data), part))]))
        self.c.complete_multipart_upload(Bucket=self.bucket, Key=key, UploadId=up, MultipartUpload={"Parts": parts})

    def get_ranges(self, key: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        def one(r: tuple[int, int]) -> bytes:
            return self.c.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={r[0]}-{r[1] - 1}")["Body"].read()

        with concurrent.futures.ThreadPoolExecutor(self.conc) as ex:
            return list(ex.map(one, ranges))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.c.put_object(Bucket=self.bucket, Key=key, Body=data, IfNoneMatch="*")
            return True
        except ClientError as exc:
            if exc.response["Error"]["Code"] in ("PreconditionFailed", "412"):
                return False
            raise

    def abort_leaves_nothing(self, key: str) -> str:
        up = self.c.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"]
        self.c.upload_part(Bucket=self.bucket, Key=key, UploadId=up, PartNumber=1, Body=b"x" * (5 << 20))
        self.c.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=up)
        left = [u for u in self.c.list_multipart_uploads(Bucket=self.bucket).get("Uploads", []) if u["Key"] == key]
        return "yes: explicit create/upload_part/abort/list" if not left else "abort left the upload listed"


class LayerClient:
    """The engine's own S3 object layer (checkpoint/s3/objects.py, over boto3): its ratio to the plain client."""

    name = "checkpoint/s3 object layer (boto3)"

    def __init__(self, endpoint: str, bucket: str, conc: int, part: int = 16 << 20) -> None:
        from paddle.distributed.fsdp.checkpoint.s3 import S3Options, S3Url
        from paddle.distributed.fsdp.checkpoint.s3.objects import S3Objects

        opts = S3Options(
            endpoint_url=endpoint, region=REGION, access_key_id=KEY_ID, secret_access_key=SECRET, part_size=part,
            concurrency=conc,
        )  # fmt: skip
        self.o = S3Objects(S3Url(bucket), opts)

    def put(self, key: str, data: memoryview, part: int) -> None:
        self.o.upload(key, [data])  # sent from the memoryview, no copy into part buffers

    def get_ranges(self, key: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        return self.o.read_ranges(key, ranges)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        from paddle.distributed.fsdp.checkpoint.s3 import S3CommitConflictError

        try:
            self.o.put(key, data, if_absent=True)
            return True
        except S3CommitConflictError:
            return False

    def abort_leaves_nothing(self, key: str) -> str:
        return "yes: every failed upload aborted (test_s3_faults.py)"


class ObstoreClient:
    name = "obstore 0.12 (Rust object_store)"

    def __init__(self, endpoint: str, bucket: str, conc: int) -> None:
        from obstore.store import S3Store

        self.conc = conc
        self.s = S3Store(
            bucket, endpoint=endpoint, access_key_id=KEY_ID, secret_access_key=SECRET, region=REGION,
            allow_http=True,
        )  # fmt: skip

    def put(self, key: str, data: memoryview, part: int) -> None:
        import obstore

        obstore.put(self.s, key, data, chunk_size=part, max_concurrency=self.conc, use_multipart=True)

    def get_ranges(self, key: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        import obstore

        # get_ranges issues the requests concurrently inside the Rust runtime
        out = obstore.get_ranges(self.s, key, starts=[r[0] for r in ranges], ends=[r[1] for r in ranges])
        return [memoryview(b) for b in out]

    def put_if_absent(self, key: str, data: bytes) -> bool:
        import obstore
        from obstore.exceptions import AlreadyExistsError

        try:
            obstore.put(self.s, key, data, mode="create")
            return True
        except AlreadyExistsError:
            return False

    def abort_leaves_nothing(self, key: str) -> str:
        return "no API: no create/abort/list of multipart uploads exposed (abort only inside a failed put)"


class S3fsClient:
    name = "fsspec+s3fs (aiobotocore)"

    def __init__(self, endpoint: str, bucket: str, conc: int) -> None:
        import s3fs

        self.bucket, self.conc = bucket, conc
        self.fs = s3fs.S3FileSystem(
            key=KEY_ID, secret=SECRET, endpoint_url=endpoint, client_kwargs={"region_name": REGION},
            max_concurrency=conc, skip_instance_cache=True,
        )  # fmt: skip

    def put(self, key: str, data: memoryview, part: int) -> None:
        # pipe_file splits into parts itself; it needs bytes (no memoryview input)
        self.fs.pipe_file(f"{self.bucket}/{key}", data.tobytes(), chunksize=part, max_concurrency=self.conc)

    def get_ranges(self, key: str, ranges: list[tuple[int, int]]) -> list[bytes]:
        p = f"{self.bucket}/{key}"
        return self.fs.cat_ranges([p] * len(ranges), [r[0] for r in ranges], [r[1] for r in ranges])

    def put_if_absent(self, key: str, data: bytes) -> bool:
        try:
            self.fs.pipe_file(f"{self.bucket}/{key}", data, mode="create")
            return True
        except FileExistsError:
            return False
        except OSError as exc:  # s3fs 2026.9 maps 412 to a generic OSError(EINVAL), not FileExistsError
            if "pre-condition" in str(exc):
                self.precondition_as = "OSError(EINVAL), not FileExistsError"
                return False
            raise

    def abort_leaves_nothing(self, key: str) -> str:
        f = self.fs.open(f"{self.bucket}/{key}", "wb", block_size=5 << 20)
        f.write(b"x" * (6 << 20))  # one part flushed: a multipart upload exists
        f.discard()
        left = self._uploads_sync(key)
        return "yes: S3File.discard() aborts" if not left else "discard left the upload listed"

    def _uploads_sync(self, key: str) -> list:
        lst = self.fs.call_s3("list_multipart_uploads", Bucket=self.bucket)
        return [u for u in lst.get("Uploads", []) if u["Key"] == key]


def _digest(chunks) -> str:
    h = hashlib.sha256()
    for c in chunks:
        h.update(c)
    return h.hexdigest()


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def bench(client, data: memoryview, part: int, reps: int) -> dict:
    rss0 = rss_mib()
    key = f"bench/{client.__class__.__name__}"
    puts, gets = [], []
    ranges = _ranges(len(data), part)
    want = _digest(data[s:e] for s, e in ranges)
    for _ in range(reps):
        t = time.perf_counter()
        client.put(key, data, part)
        puts.append(time.perf_counter() - t)
        t = time.perf_counter()
        got = client.get_ranges(key, ranges)
        gets.append(time.perf_counter() - t)
        if _digest(got) != want:
            raise AssertionError(f"{client.name}: bytes read back differ")
        del got
    ck = f"bench/{client.__class__.__name__}-commit-{time.time_ns()}"
    first, second = client.put_if_absent(ck, b"one"), client.put_if_absent(ck, b"two")
    mib = len(data) / (1 << 20)
    return {
        "client": client.name,
        # peak RSS of the process minus its RSS once the data and the client existed (run one client per process
        # for a per-client figure): what the transfers themselves held, including the bytes read back
        "extra_peak_rss_MiB": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - rss0, 1),
        "put_MiBps": [round(mib / t, 1) for t in puts],
        "get_MiBps": [round(mib / t, 1) for t in gets],
        "conditional_put": ("yes" if (first and not second) else f"NO (first={first}, second={second})")
        + (f", refusal raised as {client.precondition_as}" if getattr(client, "precondition_as", None) else ""),
        "multipart_abort": client.abort_leaves_nothing(f"bench/{client.__class__.__name__}-abort"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--part-mib", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--clients", default="boto3,obstore,s3fs", help="also: layer (the engine's S3 object layer)")
    args = ap.parse_args()
    data = memoryview(bytearray(os.urandom(1 << 20)) * args.mib)
    results = []
    with tempfile.TemporaryDirectory(prefix="s3bench-") as tmp:
        srv = s3_server.start_weed(Path(tmp) / "weed")
        try:
            s3_server.new_bucket(srv.endpoint, "bench")
            classes = {"boto3": Boto3Client, "obstore": ObstoreClient, "s3fs": S3fsClient, "layer": LayerClient}
            for name in args.clients.split(","):
                client = classes[name](srv.endpoint, "bench", args.concurrency)
                with contextlib.suppress(KeyboardInterrupt):
                    results.append(bench(client, data, args.part_mib << 20, args.reps))
                print(json.dumps(results[-1]), flush=True)
        finally:
            srv.stop()


if __name__ == "__main__":
    main()
