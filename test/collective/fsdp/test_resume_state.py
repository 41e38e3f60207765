"""One owner of the resume state (state/resume_state.py): every door restores every item, bit for bit, and a
resume continues the uninterrupted run (workers/resume_state.py, real gloo processes).

* every door (disk, an async disk save, memory own copy, peer copy, the tier's persist, flush-memory, the tier falling back to storage)
  and S3 (a real SeaweedFS): each item of ``resume_state.ITEMS`` differs before the restore, equals the saved
  state after it, and equals the uninterrupted run after more steps (an item a door drops fails by name);
* at another world size (saved at 2, loaded at 3 and 1): the sampler continues the epoch with no sample seen
  twice or skipped (besides the last step's padding); the EMA is resharded exactly (``to-hf --ema`` of the
  checkpoint saved at 2 and of the one saved again at 3 are equal, and equal the EMA the 1-rank load holds);
  per-rank state at another world size is refused by name.
"""

from __future__ import annotations

import os
from collections import Counter

import numpy as np
import pytest
from _results import assert_case_ok
from launch_util import run_launch
from s3_fixtures import S3_CREDENTIALS

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "resume_state.py")
DOORS = "disk,async,memory,peer,persist,flush,tier_storage"


def _check(res, case: str, world: int, doors: str) -> None:
    assert_case_ok(res, case, world)
    for rank in range(world):
        assert res.result(rank)[case + "_data"] == dict.fromkeys(doors.split(","), "ok"), res.result(rank)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_door_restores_every_item(tmp_path, dtype):
    """float32: every item, the GradScaler after a skipped step; bfloat16: fp32 master weights (the optimizer
    item) through every door, with a disabled scaler (CPU paddle cannot unscale bf16 gradients)."""
    env = {"FSDP_TEST_RESUME_DTYPE": dtype}
    res = run_launch(WORKER, 2, ["doors", str(tmp_path), DOORS], timeout=600, env=env, log_dir=tmp_path / "logs")
    _check(res, "doors", 2, DOORS)


def test_s3_door_restores_every_item(tmp_path, s3_server, s3_bucket):
    env = {
        "AWS_ENDPOINT_URL": s3_server.endpoint,
        "AWS_ACCESS_KEY_ID": S3_CREDENTIALS[0],
        "AWS_SECRET_ACCESS_KEY": S3_CREDENTIALS[1],
        "AWS_REGION": "us-east-1",
        "FSDP_TEST_S3_URL": f"s3://{s3_bucket}/doors",
    }
    res = run_launch(WORKER, 2, ["doors", str(tmp_path), "s3"], timeout=600, env=env, log_dir=tmp_path / "logs")
    _check(res, "doors", 2, "s3")


@pytest.fixture(scope="module")
def resharded(tmp_path_factory):
    work = tmp_path_factory.mktemp("reshard")
    out = {"save": run_launch(WORKER, 2, ["reshard", str(work), "save"], timeout=300, log_dir=work / "l2")}
    for n in (3, 1):
        out[n] = run_launch(WORKER, n, ["reshard", str(work), "load"], timeout=300, log_dir=work / f"l{n}")
    out["work"] = work
    return out


@pytest.mark.parametrize("world", [3, 1])
def test_sampler_at_another_world_size_sees_each_sample_once(resharded, world):
    from paddle.distributed.fsdp.sampler import ResumableDistributedBatchSampler

    saved = resharded["save"]
    assert_case_ok(saved, "reshard", 2)
    assert_case_ok(resharded[world], "reshard", world)
    state = saved.result(0)["reshard_data"]
    n, batch = 12, 2
    order = ResumableDistributedBatchSampler(list(range(n)), batch, 1, 0, shuffle=True, seed=7).order(state["epoch"])
    before = order[: state["consumed"]].tolist()
    after = [i for r in range(world) for i in resharded[world].result(r)["reshard_data"]["seen"]]
    seen = Counter(before + after)
    left, wide = n - state["consumed"], world * batch
    assert 0 < state["consumed"] < n, "the checkpoint must be mid-epoch"
    assert set(seen) == set(range(n)), f"samples skipped: {set(range(n)) - set(seen)}"
    assert sum(seen.values()) - n == (wide - left % wide) % wide, f"samples seen twice beyond the padding: {seen}"
    assert not set(before) & {i for i, c in seen.items() if c > 1} - set(order[:wide].tolist())


def test_ema_resharded_exactly_and_exported_as_weights(resharded, tmp_path):
    from paddle.distributed.fsdp.tools.cli import main as cli
    from safetensors.numpy import load_file

    work = resharded["work"]

    def export(ckpt: str, *extra: str) -> dict:
        out = tmp_path / f"hf{len(list(tmp_path.iterdir()))}"
        assert cli(["to-hf", str(ckpt), str(out), "--no-progress", *extra]) == 0
        tensors = {}
        for name in sorted(os.listdir(out)):
            if name.endswith(".safetensors"):
                tensors.update(load_file(str(out / name)))
        return tensors

    ema2, ema3 = export(work / "ckpt", "--ema"), export(work / "ckpt_w3", "--ema")
    plain = export(work / "ckpt")
    assert sorted(ema2) == sorted(ema3) == sorted(plain)
    assert all(np.array_equal(ema2[k], ema3[k]) for k in ema2), "the EMA changed when loaded at 3 ranks"
    moved = [k for k in ema2 if not np.array_equal(ema2[k], plain[k])]
    assert moved and "pos" not in moved, "to-hf --ema did not export the EMA (or exported one of a frozen weight)"
    one = resharded[1].result(0)["reshard_data"]
    assert one["updates"] == 4
    for key, value in one["ema"].items():
        name = key[: -len(".ema")]
        got = np.asarray(value, dtype=np.float32).reshape(ema2[name].shape)
        assert np.array_equal(got, ema2[name]), name
    assert cli(["to-hf", str(work / "ckpt_plain"), str(tmp_path / "none"), "--ema", "--no-progress"]) != 0
