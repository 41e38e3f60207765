"""The checkpoint engine on a real S3 server (SeaweedFS, started by the tests on 127.0.0.1): ``s3://`` URLs
through save/load, CheckpointManager and the CLI, compared with the same save on a local directory.

* 2 ranks save to S3 and to a local directory; loads from both (memory-bounded and atomic) give the saved bytes;
  a 2 -> 1 reshard (one process, ``load_full_state_dict``) from S3 equals the one from the local copy byte for
  byte; a one-key read fetches about that key's bytes only; rotation (keep_last) and ``latest`` on S3.
* a server that fails every data upload (fault proxy): every rank raises a named error within a bound, nothing is
  committed, ``latest`` still names the previous step, which verifies and loads.
* ``paddle-fsdp-ckpt verify s3://...`` passes on the saved checkpoint and names a flipped byte.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import paddle.distributed.fsdp.checkpoint as ck
import pytest
from launch_util import run_launch
from s3_fault_proxy import Rule
from s3_fixtures import S3_CREDENTIALS, s3_options_for

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "s3_e2e.py")
FAULT_BOUND_S = 30.0  # a failing server is named on every rank within this (deadlines: 2 tries x 2 s stalls)


def _env(endpoint: str) -> dict:
    return {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": S3_CREDENTIALS[0],
        "AWS_SECRET_ACCESS_KEY": S3_CREDENTIALS[1],
        "AWS_REGION": "us-east-1",
        "FSDP_TEST_S3_ENDPOINT": endpoint,
    }


def _storage(endpoint: str):
    from paddle.distributed.fsdp.checkpoint.s3.storage import S3Storage

    return S3Storage(s3_options_for(endpoint))


def test_two_ranks_s3_against_local_reshard_and_rotation(tmp_path, s3_server, s3_bucket):
    url, local = f"s3://{s3_bucket}/run/ckpt", str(tmp_path / "local")
    res = run_launch(
        WORKER, 2, ["roundtrip", url, local], timeout=300, env=_env(s3_server.endpoint), log_dir=tmp_path / "l"
    )
    for r in (0, 1):
        assert res.result(r) == {"roundtrip": "ok"}, res.result(r)
    storage = _storage(s3_server.endpoint)
    opts = ck.CheckpointOptions(storage=storage)
    # 2 -> 1: one process reads every key from S3; the bytes equal the same read from the local copy
    from_s3 = ck.load_full_state_dict(url, options=opts)
    from_local = ck.load_full_state_dict(local)
    assert sorted(from_s3) == sorted(from_local)
    for k, v in from_local.items():
        a, b = np.array(from_s3[k].numpy()), np.array(v.numpy())
        assert a.shape == b.shape and a.tobytes() == b.tobytes(), k
    assert ck.verify_checkpoint(url, options=opts) == []
    # a read of one key fetches that key's bytes (plus chunk alignment and the small metadata objects), not more
    objects = next(iter(storage._buckets.values()))
    before = objects.bytes_read
    md = ck.read_metadata(url, opts)
    one = ck.load_full_state_dict(url, ["big"], options=opts)["big"]
    fetched = objects.bytes_read - before
    share = one.numel().item() * 4
    small = len(md.dumps()) * 2 + 4096
    assert share <= fetched <= 1.1 * share + small, (fetched, share)


@pytest.mark.parametrize("action", ["500", "stall_request"])
def test_failing_server_is_named_on_every_rank_in_bounded_time(tmp_path, s3_server, s3_bucket, fault_proxy, action):
    url = f"s3://{s3_bucket}/run/mgr"
    fault_proxy.add(Rule(lambda m, t: m == "PUT" and ".safetensors" in t, action, after_bytes=1024))
    env = _env(s3_server.endpoint) | {"FSDP_TEST_S3_PROXY": fault_proxy.endpoint}
    res = run_launch(WORKER, 2, ["fault", url], timeout=300, env=env, log_dir=tmp_path / "l")
    for r in (0, 1):
        out = res.result(r)
        assert out["save2"].startswith("SaveFailedError"), out
        assert "S3" in out["save2"] and ("stall" in out["save2"].lower() or "500" in out["save2"]), out
        assert out["seconds"] < FAULT_BOUND_S, out
    assert fault_proxy.rules[0].hits >= 2, "the data uploads never reached the failing proxy"
    storage = _storage(s3_server.endpoint)
    opts = ck.CheckpointOptions(storage=storage)
    assert ck.latest_checkpoint(url, storage) == f"{url}/step_00000001"
    assert storage.list(f"{url}/step_00000002") == []  # nothing of the failed step is visible
    assert ck.verify_checkpoint(f"{url}/step_00000001", options=opts) == []
    objects = next(iter(storage._buckets.values()))
    assert objects.pending_uploads("run/") == [], "a failed upload was left pending"


def test_cli_verify_on_s3_passes_then_names_a_flipped_byte(tmp_path, s3_server, s3_bucket):
    import paddle

    storage = _storage(s3_server.endpoint)
    url = f"s3://{s3_bucket}/cli/ckpt"
    rng = np.random.default_rng(0)
    state = {"w": paddle.to_tensor(rng.standard_normal((512, 1024), dtype=np.float32)), "step": 7}
    ck.save_state_dict(state, url, options=ck.CheckpointOptions(storage=storage))
    env = dict(os.environ) | _env(s3_server.endpoint)
    cmd = [sys.executable, "-m", "paddle.distributed.fsdp.tools", "verify", url]
    ok = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and ok.stdout.startswith("OK: "), ok.stdout + ok.stderr
    # flip one byte of the data object, in place (same size), where the published version keeps it
    name = next(n for n in storage.list(url) if n.endswith(".safetensors"))
    objects, prefix = storage._resolve(url)
    handle = storage.open_read(url, name)
    data = bytearray(handle.size)
    handle.read_into(0, data)
    data[len(data) // 2] ^= 0x40
    objects.put(f"{prefix}/{name}", bytes(data))
    bad = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "checksum mismatch" in bad.stdout + bad.stderr, bad.stdout + bad.stderr


def test_bad_s3_locations_are_named(s3_server, s3_bucket):
    """Nothing at the prefix, a missing bucket, a checkpoint root: named errors, nothing written."""
    import paddle
    from paddle.distributed.fsdp.checkpoint.s3.errors import S3BucketNotFoundError

    opts = ck.CheckpointOptions(storage=_storage(s3_server.endpoint))
    with pytest.raises(ck.NotACheckpointError):
        ck.load_full_state_dict(f"s3://{s3_bucket}/nothing/here", options=opts)
    with pytest.raises(S3BucketNotFoundError):
        ck.load_full_state_dict(f"s3://no-such-bucket-{s3_bucket}/x", options=opts)
    root = f"s3://{s3_bucket}/root"
    ck.CheckpointManager(root).save(1, {"w": paddle.arange(4, dtype="float32")}, options=opts)
    with pytest.raises(ck.NotACheckpointError, match="checkpoint root"):
        ck.load_full_state_dict(root, options=opts)
    assert ck.verify_checkpoint(f"{root}/step_00000001", options=opts) == []


def test_rank_killed_mid_upload_is_named_in_bounded_time_and_its_upload_aborted(tmp_path, s3_server, s3_bucket):
    """kill -9 of rank 1 half way through its multipart upload: rank 0 names it within 10 s (heartbeat lease 1 s),
    nothing of step 2 is visible, step 1 stays latest and sound; the killed rank's pending upload (a dead rank
    cannot abort it) is aborted by the next save to that step, which finds the failed version (no orphan parts)."""
    import paddle

    url = f"s3://{s3_bucket}/kill/mgr"
    env = _env(s3_server.endpoint) | {
        "PADDLE_FSDP_CKPT_FAULT": "mid_data:1:2",  # rank 1 dies half way through its second save's object
        "PADDLE_FSDP_CKPT_HEARTBEAT_LEASE": "1",  # the launcher SIGKILLs the survivor a few seconds after a death
        "PADDLE_FSDP_CKPT_COMMIT_TIMEOUT": "600",  # far above the bound: only the heartbeat can end the wait
    }
    res = run_launch(WORKER, 2, ["kill", url, str(tmp_path)], timeout=300, env=env, log_dir=tmp_path / "l", check=False)
    assert "SIGKILL at stage mid_data" in res.worker_logs[1], res.worker_logs[1][-2000:]
    out = res.result(0)
    assert out["save2"].startswith("SaveFailedError") and "rank 1 stopped responding" in out["save2"], out
    assert out["detect_seconds"] < 10.0, out
    assert out["latest"] == f"{url}/step_00000001", out
    storage = _storage(s3_server.endpoint)
    opts = ck.CheckpointOptions(storage=storage)
    assert storage.list(f"{url}/step_00000002") == []
    assert ck.verify_checkpoint(f"{url}/step_00000001", options=opts) == []
    objects = next(iter(storage._buckets.values()))
    orphans = objects.pending_uploads("kill/")
    assert [k for k, _ in orphans if k.endswith("/1_0.safetensors")], orphans  # rank 1's, left by its death
    ck.CheckpointManager(url).save(2, {"w": paddle.ones([3])}, options=opts)  # the next save of that step
    assert objects.pending_uploads("kill/") == [], "the killed rank's upload was left pending"
    assert storage.stagings(f"{url}/step_00000002") == []
    assert ck.latest_checkpoint(url, storage) == f"{url}/step_00000002"
