"""A URL the engine does not serve is refused at every path entry point with UnsupportedURLError, and nothing is
created: before, ``save_state_dict(sd, "s3://bucket/run")`` "succeeded" into a directory named ``s3:``."""

from __future__ import annotations

import os

import paddle
import paddle.distributed.fsdp.checkpoint as ck
import pytest
from paddle.distributed.fsdp.checkpoint.errors import CheckpointError
from paddle.distributed.fsdp.checkpoint.paths import UnsupportedURLError, local_path

URLS = ["s3://bkt/run", "gs://bkt/run", "S3://bkt/run", "file:///tmp/x", "hdfs://nn:8020/ckpt"]


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
