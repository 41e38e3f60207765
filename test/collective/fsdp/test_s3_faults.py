"""The S3 object layer under injected faults: a proxy in front of the real SeaweedFS answers chosen requests with
503 SlowDown / 500, resets the connection, or stalls mid-request / mid-reply.

What must hold: transient faults are retried and the data is intact; persistent faults fail within the bounds
(tries, retry deadline, stall timeout) with an error naming the rank, the object and the last error; a failed
multipart upload is aborted (no pending upload left on the server) and no object appears.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from paddle.distributed.fsdp.checkpoint.s3 import S3StalledError, S3TransferError, S3Url
from paddle.distributed.fsdp.checkpoint.s3.objects import S3Objects
from s3_fault_proxy import Rule
from s3_fixtures import s3_options_for

MIB = 1 << 20


def _pair(s3_server, proxy, bucket, **opts) -> tuple[S3Objects, S3Objects]:
    """(through the proxy, straight to the server) on the same prefix."""
    url = S3Url(bucket, "job/step-1")
    return (
        S3Objects(url, s3_options_for(proxy.endpoint, **opts), who="rank 1"),
        S3Objects(url, s3_options_for(s3_server.endpoint)),
    )


def _part(n: int):
    return lambda method, target: method == "PUT" and f"partNumber={n}&" in target + "&"


def _data(nbytes: int, seed: int) -> bytes:
    return np.random.default_rng(seed).bytes(nbytes)


def test_throttling_5xx_and_resets_are_retried_and_data_is_intact(s3_server, fault_proxy, s3_bucket):
    faulty, direct = _pair(s3_server, fault_proxy, s3_bucket)
    blob = _data(12 * MIB + 5, 1)
    fault_proxy.add(Rule(_part(1), "503", times=2))
    fault_proxy.add(Rule(_part(2), "reset", times=1))
    fault_proxy.add(Rule(_part(3), "500", times=1))
    fault_proxy.add(Rule(lambda m, t: m == "PUT" and t.endswith("/small"), "503", times=1))
    fault_proxy.add(Rule(lambda m, t: m == "GET" and "/data" in t, "reset", times=1))
    with faulty, direct:
        faulty.upload("data", [memoryview(blob)[: 3 * MIB], memoryview(blob)[3 * MIB :]])
        faulty.put("small", b"tiny")
        assert bytes(faulty.read_ranges("data", [(0, len(blob))])[0]) == blob
        assert direct.read("data") == blob and direct.read("small") == b"tiny"
        assert all(r.hits == r.times for r in fault_proxy.rules), [(r.action, r.hits) for r in fault_proxy.rules]
        assert direct.pending_uploads() == []


def test_persistent_5xx_fails_after_max_attempts_naming_the_part_and_aborts(s3_server, fault_proxy, s3_bucket):
    faulty, direct = _pair(s3_server, fault_proxy, s3_bucket, max_attempts=3)
    fault_proxy.add(Rule(_part(2), "500"))
    with faulty, direct:
        with pytest.raises(S3TransferError) as info:
            faulty.upload("data/rank1", _data(11 * MIB, 2))
        msg = str(info.value)
        assert "rank 1: " in msg and "UploadPart 2/3" in msg and f"s3://{s3_bucket}/job/step-1/data/rank1" in msg
        assert "3 tries" in msg and "HTTP 500" in msg
        assert len(fault_proxy.seen("PUT", "partNumber=2")) == 3
        assert fault_proxy.seen("DELETE", "uploadId="), "the failed upload was not aborted"
        assert direct.pending_uploads() == [] and direct.size("data/rank1") is None


def test_stalled_upload_fails_after_the_stall_timeout_and_aborts(s3_server, fault_proxy, s3_bucket):
    faulty, direct = _pair(s3_server, fault_proxy, s3_bucket, max_attempts=2, stall_timeout_s=1.0)
    fault_proxy.add(Rule(_part(2), "stall_request", after_bytes=256 << 10))
    with faulty, direct:
        began = time.monotonic()
        with pytest.raises(S3StalledError) as info:
            faulty.upload("data/rank1", _data(11 * MIB, 3))
        elapsed = time.monotonic() - began
        msg = str(info.value)
        assert "rank 1: " in msg and "UploadPart 2/3" in msg and "data/rank1" in msg and "last error" in msg
        # the bound: a stalled request fails after the configured deadline, not never. 2 tries of at most
        # stall (1 s) + connect (2 s: urllib3 times the send with it) each, + backoff: well under 10 s
        assert elapsed < 10.0, elapsed
        assert len(fault_proxy.seen("PUT", "partNumber=2")) == 2
        assert direct.pending_uploads() == [] and direct.size("data/rank1") is None


def test_retries_are_bounded_in_time(s3_server, fault_proxy, s3_bucket):
    faulty, direct = _pair(s3_server, fault_proxy, s3_bucket, max_attempts=10_000, retry_deadline_s=1.5)
    fault_proxy.add(Rule(lambda m, t: m == "PUT", "503"))
    with faulty, direct:
        began = time.monotonic()
        with pytest.raises(S3TransferError, match=r"retry deadline 1.5 s reached.*503 SlowDown"):
            faulty.put("manifest.json", b"{}", if_absent=True)
        assert time.monotonic() - began < 1.5 + 5.0  # the deadline + at most one try's stall/connect time
        assert direct.size("manifest.json") is None


def test_read_stalled_mid_body_resumes_and_a_dead_read_is_named(s3_server, fault_proxy, s3_bucket):
    faulty, direct = _pair(s3_server, fault_proxy, s3_bucket, stall_timeout_s=1.0, max_attempts=2)
    blob = _data(3 * MIB, 4)
    with faulty, direct:
        direct.put("data", blob)
        fault_proxy.add(Rule(lambda m, t: m == "GET", "stall_reply", times=1, after_bytes=MIB))
        assert bytes(faulty.read_ranges("data", [(0, len(blob))])[0]) == blob
        assert len(fault_proxy.seen("GET", "/data")) == 2
        fault_proxy.add(Rule(lambda m, t: m == "GET", "stall_reply", after_bytes=MIB))
        with pytest.raises(S3StalledError, match=r"rank 1: GetObject bytes=0-.*data.*2 tries"):
            faulty.read_ranges("data", [(0, len(blob))])
