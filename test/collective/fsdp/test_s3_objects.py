"""The S3 object layer against a real S3 server (SeaweedFS on 127.0.0.1, started by the session fixture).

Round trips of multipart uploads from unaligned pieces, ranged parallel reads, per-part checksums checked by the
store, two writers racing a conditional put, listing, deletion, abort of pending uploads, and the named errors
for a wrong endpoint, a missing bucket and denied credentials.
"""

from __future__ import annotations

import base64
import hashlib
import threading
import zlib

import numpy as np
import pytest
from paddle.distributed.fsdp.checkpoint.errors import CheckpointError, SaveFailedError
from paddle.distributed.fsdp.checkpoint.s3 import (
    S3AccessDeniedError,
    S3BucketNotFoundError,
    S3CommitConflictError,
    S3ConfigError,
    S3EndpointError,
    S3Options,
    S3Url,
)
from paddle.distributed.fsdp.checkpoint.s3.errors import S3ObjectNotFoundError, S3ObjectTruncatedError
from paddle.distributed.fsdp.checkpoint.s3.objects import S3Objects
from s3_fixtures import s3_options_for
from s3_server import free_ports

MIB = 1 << 20


def _store(server, bucket, prefix="ckpt/run1", **opts) -> S3Objects:
    return S3Objects(S3Url(bucket, prefix), s3_options_for(server.endpoint, **opts), who="rank 0")


@pytest.mark.parametrize("algorithm", ["crc32", "sha256"])
def test_multipart_round_trip_from_unaligned_pieces(s3_server, s3_bucket, algorithm):
    rng = np.random.default_rng(7)
    # pieces whose boundaries fall inside parts, of several dtypes (views of the caller's memory, not copies)
    pieces = [
        rng.standard_normal(n).astype(dt) for n, dt in ((700_001, np.float32), (1_300_003, np.float64), (5, np.int8))
    ]
    pieces.append(bytearray(rng.bytes(2 * MIB + 17)))
    blob = b"".join(bytes(memoryview(p).cast("B")) for p in pieces)
    with _store(s3_server, s3_bucket, part_checksum=algorithm) as store:
        res = store.upload("data/rank0.bin", pieces)
        assert res.size == len(blob) and len(res.part_checksums) == -(-len(blob) // (5 * MIB)) > 1
        assert res.algorithm == algorithm
        for i, digest in enumerate(res.part_checksums):  # our per-part checksums (the store checked them)
            part = blob[i * 5 * MIB : (i + 1) * 5 * MIB]
            raw = hashlib.sha256(part).digest() if algorithm == "sha256" else zlib.crc32(part).to_bytes(4, "big")
            assert digest == base64.b64encode(raw).decode()
        assert store.size("data/rank0.bin") == len(blob)
        assert store.read("data/rank0.bin") == blob
        # random ranges, some across part boundaries and longer than a part (split into parallel GETs)
        ranges = [(0, 1), (5 * MIB - 3, 5 * MIB + 3), (len(blob) - 10, len(blob)), (17, 17), (MIB, 12 * MIB + 1)]
        ranges += [tuple(sorted(rng.integers(0, len(blob), 2).tolist())) for _ in range(8)]
        outs = [bytearray(e - s) for s, e in ranges]
        got = store.read_ranges("data/rank0.bin", ranges, [memoryview(o) for o in outs])
        for (s, e), view, out in zip(ranges, got, outs):
            assert bytes(view) == blob[s:e] and bytes(out) == blob[s:e]
        assert store.pending_uploads() == []


def test_small_object_single_put_and_listing_and_delete(s3_server, s3_bucket):
    with _store(s3_server, s3_bucket, prefix="a/b") as store, _store(s3_server, s3_bucket, prefix="a/bc") as other:
        for i in range(3):
            store.put(f"step-{i}/x", f"payload {i}".encode())
        other.put("y", b"not mine")  # a sibling prefix sharing the text "a/b" must not be listed
        assert sorted((o.name, o.size) for o in store.list()) == [(f"step-{i}/x", 9) for i in range(3)]
        assert [o.name for o in store.list("step-1")] == ["step-1/x"]
        store.delete([f"step-{i}/x" for i in range(3)] + ["never-existed"])
        assert store.list() == [] and [o.name for o in other.list()] == ["y"]
        assert store.size("step-0/x") is None
        with pytest.raises(S3ObjectNotFoundError, match="step-0/x"):
            store.read("step-0/x")


def test_read_past_the_end_is_a_named_truncation(s3_server, s3_bucket):
    with _store(s3_server, s3_bucket) as store:
        store.put("short", b"0123456789")
        with pytest.raises(S3ObjectTruncatedError, match="short"):
            store.read_ranges("short", [(5, 20)])
        with pytest.raises(S3ObjectTruncatedError, match="short"):
            store.read_ranges("short", [(12, 14)])


def test_two_writers_race_the_conditional_commit_one_wins(s3_server, s3_bucket):
    """Two writers of one key, If-None-Match: the second PUT to reach the server is refused. Their PUTs are made to
    arrive one after the other: SeaweedFS 4.48 lets two that arrive at the same instant both pass (1 run in ~10,
    2026-12-05); AWS S3 promises atomic conditional writes, the test server does not."""
    barrier, one_put_at_a_time, outcome = threading.Barrier(2), threading.Lock(), {}
    stores = [_store(s3_server, s3_bucket) for _ in range(2)]

    def commit(i: int) -> None:
        barrier.wait()
        try:
            with one_put_at_a_time:
                stores[i].put("step-5/manifest.json", f'{{"writer": {i}}}'.encode(), if_absent=True)
            outcome[i] = "won"
        except S3CommitConflictError as exc:
            outcome[i] = exc

    threads = [threading.Thread(target=commit, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    winners = [i for i, o in outcome.items() if o == "won"]
    assert len(winners) == 1, outcome
    loser = outcome[1 - winners[0]]
    assert isinstance(loser, SaveFailedError) and "step-5/manifest.json" in str(loser)
    assert stores[0].read("step-5/manifest.json") == f'{{"writer": {winners[0]}}}'.encode()
    for s in stores:
        s.close()


def test_abort_pending_cleans_an_upload_left_by_a_dead_writer(s3_server, s3_bucket):
    with _store(s3_server, s3_bucket) as store:
        key = store.url.key("data/rank1.bin")
        up = store.client.create_multipart_upload(Bucket=s3_bucket, Key=key)["UploadId"]
        store.client.upload_part(Bucket=s3_bucket, Key=key, UploadId=up, PartNumber=1, Body=b"x" * (5 * MIB))
        assert store.pending_uploads() == [(key, up)]
        assert store.abort_pending() == 1
        assert store.pending_uploads() == []


def test_wrong_endpoint_missing_bucket_denied_credentials_are_named(s3_server, s3_bucket):
    (dead_port,) = free_ports(1)
    cases = [
        (S3Url(s3_bucket), s3_options_for(f"http://127.0.0.1:{dead_port}", max_attempts=2), S3EndpointError),
        (S3Url("no-such-bucket-here"), s3_options_for(s3_server.endpoint), S3BucketNotFoundError),
        (S3Url(s3_bucket), s3_options_for(s3_server.endpoint, secret_access_key="wrong"), S3AccessDeniedError),
        (S3Url(s3_bucket), s3_options_for(s3_server.endpoint, access_key_id="nobody"), S3AccessDeniedError),
    ]
    for url, opts, err in cases:
        with S3Objects(url, opts, who="rank 3") as store:
            with pytest.raises(err, match=f"rank 3: .*{url.bucket}") as info:
                store.check_bucket()
            assert isinstance(info.value, CheckpointError)
            with pytest.raises(err):  # a write without the check fails the same way, not as a generic error
                store.upload("x", b"payload")
    # good credentials on the same bucket work: the cases above fail for their stated reason only
    with _store(s3_server, s3_bucket) as store:
        store.check_bucket()


@pytest.mark.parametrize(
    "url",
    [
        "s3:/bkt/x",
        "gs://bkt/x",
        "s3://Bkt/x",
        "s3://bk",
        "s3://bkt//x",
        "s3://bkt/../x",
        "s3://bkt/x?y=1",
        "s3://1.2.3.4/x",
    ],
)
def test_bad_urls_are_refused(url):
    with pytest.raises(S3ConfigError):
        S3Url.parse(url)


def test_url_parse_and_options_validation():
    assert S3Url.parse("s3://my-bkt.1/a/b/") == S3Url("my-bkt.1", "a/b")
    assert S3Url.parse("s3://my-bkt") == S3Url("my-bkt", "")
    assert str(S3Url.parse("s3://my-bkt/a").child("step-3")) == "s3://my-bkt/a/step-3"
    for bad in (dict(part_size=4 << 20), dict(concurrency=0), dict(stall_timeout_s=0), dict(endpoint_url="ftp://h"),
                dict(access_key_id="k"), dict(max_attempts=True), dict(part_checksum="md5")):  # fmt: skip
        with pytest.raises(S3ConfigError):
            S3Options(**bad)
    with pytest.raises(S3ConfigError, match="10000"):
        S3Options(part_size=5 << 20).parts_for(10_001 * (5 << 20))
