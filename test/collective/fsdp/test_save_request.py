"""A save is one SaveRequest (checkpoint/save/request.py): options and storage backend resolved once, at the door,
and what fails while resolving surfaces where the save reported it before (issue #42)."""

from __future__ import annotations

import paddle
import paddle.distributed.fsdp.checkpoint as ck
import pytest
from paddle.distributed.fsdp.checkpoint.options import CheckpointOptions
from paddle.distributed.fsdp.checkpoint.paths import UnsupportedURLError
from paddle.distributed.fsdp.checkpoint.save.request import save_request


def test_a_save_resolves_its_storage_once(tmp_path, monkeypatch):
    calls = []
    original = CheckpointOptions.storage_for

    def counting(self, location):
        calls.append(location)
        return original(self, location)

    monkeypatch.setattr(CheckpointOptions, "storage_for", counting)
    ck.save_state_dict({"x": paddle.ones([4])}, str(tmp_path / "c"))
    assert calls == [str(tmp_path / "c")]
    ck.CheckpointManager(str(tmp_path / "root")).save(1, {"x": paddle.ones([4])})
    assert calls[1:] == [ck.CheckpointManager(str(tmp_path / "root")).path_for(1)]


def test_the_request_keeps_a_malformed_variable_for_the_exchange(tmp_path, monkeypatch):
    monkeypatch.setenv("PADDLE_FSDP_CKPT_COMMIT_TIMEOUT", "soon")
    req = save_request({}, str(tmp_path / "c"), None, 0, None)
    assert isinstance(req.opts_error, ck.CheckpointError) and req.storage is None
    assert req.options == CheckpointOptions()
    with pytest.raises(ck.CheckpointError, match="PADDLE_FSDP_CKPT_COMMIT_TIMEOUT='soon'"):
        ck.save_state_dict({"x": paddle.ones([4])}, str(tmp_path / "c"))
    assert not (tmp_path / "c").exists()


def test_the_request_keeps_a_path_error_until_the_save_raises_it(tmp_path):
    req = save_request({}, "nosuch://bucket/c", None, 0, None)
    assert isinstance(req.path_error, UnsupportedURLError) and req.storage is None
    with pytest.raises(UnsupportedURLError):
        ck.save_state_dict({"x": paddle.ones([4])}, "nosuch://bucket/c")


def test_the_request_is_frozen(tmp_path):
    req = save_request({}, str(tmp_path / "c"), None, 0, None)
    assert req.path == str(tmp_path / "c") and req.backend() is req.storage
    with pytest.raises(AttributeError):
        req.path = "elsewhere"
