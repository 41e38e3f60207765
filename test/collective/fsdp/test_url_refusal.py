"""A URL the engine does not serve is refused at every path entry point with UnsupportedURLError, and nothing is
created: before, ``save_state_dict(sd, "s3://bucket/run")`` "succeeded" into a directory named ``s3:``. URLs of a
served scheme (``s3://``, test_s3_checkpoints.py) pass as locations."""

from __future__ import annotations

import os

import paddle
import paddle.distributed.fsdp.checkpoint as ck
import pytest
from paddle.distributed.fsdp.checkpoint.errors import CheckpointError
from paddle.distributed.fsdp.checkpoint.paths import UnsupportedURLError, local_path

URLS = ["gs://bkt/run", "GS://bkt/run", "file:///tmp/x", "hdfs://nn:8020/ckpt", "s4://bkt/run"]


@pytest.mark.parametrize("url", URLS)
def test_every_entry_point_refuses_a_url_and_creates_nothing(url, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sd = {"w": paddle.arange(6, dtype="float32").reshape([2, 3])}
    calls = {
        "save_state_dict": lambda: ck.save_state_dict(sd, url),
        "load_state_dict": lambda: ck.load_state_dict(sd, url),
        "load_full_state_dict": lambda: ck.load_full_state_dict(url),
        "verify_checkpoint": lambda: ck.verify_checkpoint(url),
        "latest_checkpoint": lambda: ck.latest_checkpoint(url),
        "resolve_checkpoint": lambda: ck.resolve_checkpoint(url),
        "CheckpointManager": lambda: ck.CheckpointManager(url, keep_last=2),
    }
    for name, call in calls.items():
        with pytest.raises(UnsupportedURLError, match=r"://") as info:
            call()
        assert isinstance(info.value, CheckpointError) and url in str(info.value), name
    assert os.listdir(tmp_path) == []  # no "s3:" (or any) directory was made


def test_local_paths_still_pass(tmp_path):
    assert local_path(tmp_path / "a") == str(tmp_path / "a")
    assert local_path("rel/s3:x") == os.path.abspath("rel/s3:x")  # a colon without "//" is a plain name
    with pytest.raises(TypeError):
        local_path(3)


def test_served_schemes_pass_as_locations():
    assert local_path("s3://bkt/run/") == "s3://bkt/run"
    assert local_path("S3://bkt/run") == "s3://bkt/run"


def test_boto3_is_imported_only_when_an_s3_url_is_used(tmp_path):
    """``s3://`` is registered without importing its backend: local saves, loads and verify never load boto3."""
    import subprocess
    import sys

    code = (
        "import sys, paddle, paddle.distributed.fsdp.checkpoint as ck\n"
        f"p = {str(tmp_path / 'c')!r}\n"
        "sd = {'w': paddle.ones([4])}\n"
        "ck.save_state_dict(sd, p); ck.load_state_dict(sd, p); assert ck.verify_checkpoint(p) == []\n"
        "assert 's3' in ck.io.backends.served_schemes()\n"
        "print(sorted(m for m in sys.modules if m.startswith(('boto3', 'botocore')) or m.endswith('.s3.storage')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
