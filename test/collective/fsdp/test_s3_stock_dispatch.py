"""Stock paddle's ``paddle.distributed.save_state_dict`` / ``load_state_dict`` with an ``s3://`` URL and stock's
default arguments, against a real S3 server (SeaweedFS on 127.0.0.1, the default backend configured by the AWS
environment). Stock itself takes ``s3://b/run`` for a relative path and writes a local directory named ``s3:``;
with the fork the URL is written by the engine and read back through the same stock API. What asks for stock's own
files on a URL (``safetensors=False`` passed, ``unique_id`` > 0, ``save_replicas``, ``aoa_config``) is refused by
name, and nothing is written anywhere.
"""

from __future__ import annotations

import os

import numpy as np
import paddle
import paddle.distributed as dist
import pytest
from paddle.distributed.fsdp.checkpoint import verify_checkpoint
from paddle.distributed.fsdp.checkpoint.stock import StockFormatError


def _state(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "w": paddle.to_tensor(rng.standard_normal((64, 48)).astype("float32")),
        "h": paddle.to_tensor(rng.standard_normal((7,)).astype("float32")).astype("bfloat16"),
        "i": paddle.to_tensor(rng.integers(0, 1000, (5,)).astype("int64")),
        "opt": {"m": paddle.to_tensor(rng.standard_normal((3, 4)).astype("float32"))},  # nested: stock's "opt.m"
    }


def _host(sd: dict) -> dict:
    out = {}
    for k, v in sd.items():
        if isinstance(v, dict):
            out.update({f"{k}.{kk}": vv for kk, vv in _host(v).items()})
        else:
            out[k] = v.view("uint16").numpy() if v.dtype == paddle.bfloat16 else v.numpy()
    return out


def test_stock_api_round_trip_on_s3_with_default_arguments(tmp_path, s3_bucket, s3_env, monkeypatch):
    monkeypatch.chdir(tmp_path)
    url = f"s3://{s3_bucket}/stock/ckpt"
    saved = _state(1)
    assert dist.save_state_dict(saved, url) is None
    storage = s3_env.default_storage()
    assert {"COMMIT", "metadata.json", "0_0.safetensors"} <= set(storage.list(url))
    assert verify_checkpoint(url) == []
    target = _state(2)
    assert not np.array_equal(_host(target)["w"], _host(saved)["w"])
    assert dist.load_state_dict(target, url) is None
    got, want = _host(target), _host(saved)
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and np.array_equal(got[k], want[k]), k
    saved2 = _state(3)  # a second save replaces the first, atomically
    dist.save_state_dict(saved2, url, safetensors=True)
    dist.load_state_dict(target, url)
    assert all(np.array_equal(_host(target)[k], v) for k, v in _host(saved2).items())
    assert os.listdir(tmp_path) == []  # no local directory named "s3:" (stock's own behaviour)


def test_stock_only_requests_on_s3_are_refused_and_write_nothing(tmp_path, s3_bucket, s3_env, monkeypatch):
    monkeypatch.chdir(tmp_path)
    url = f"s3://{s3_bucket}/stock/refused"
    sd = _state(4)
    calls = {
        "safetensors=False": lambda: dist.save_state_dict(sd, url, safetensors=False),
        "every stock argument": lambda: dist.save_state_dict(sd, url, None, 0, None, False, False, False),
        "unique_id": lambda: dist.save_state_dict(sd, url, unique_id=1),
        "save_replicas": lambda: dist.save_state_dict(sd, url, save_replicas=True),
    }
    for what, call in calls.items():
        with pytest.raises(StockFormatError, match="is a URL"):
            call()
        storage = s3_env.default_storage()
        assert storage.list(url) == [] and storage.children(url) == [] and storage.stagings(url) == [], what
    dist.save_state_dict(sd, url)
    for kw in ({"aoa_config": {"aoa_statements": []}}, {"unique_id": 2}):
        with pytest.raises(StockFormatError, match="is a URL"):
            dist.load_state_dict(_state(5), url, **kw)
    assert os.listdir(tmp_path) == []
