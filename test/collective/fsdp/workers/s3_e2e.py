"""Checkpoints on a real S3 server (SeaweedFS) from 2 ranks (test_s3_checkpoints.py).

Usage (under paddle.distributed.launch, 2 ranks); the server is given by FSDP_TEST_S3_ENDPOINT and the AWS_*
variables (the default ``s3://`` backend reads those):
    s3_e2e.py roundtrip URL LOCALDIR
        every rank's FSDP state (params + AdamW state) plus a 6 MiB row-sharded tensor (multipart uploads) is
        saved to URL and to LOCALDIR; loads from both, memory-bounded and atomic, give the saved bytes back; a
        CheckpointManager on URL/mgr with keep_last=2 saves steps 1..3: steps [2, 3], latest 3, step 1's objects
        gone, load_latest gives the saved bytes back; FullyShardFusion.save_checkpoint / load_checkpoint and
        paddle.distributed.save_state_dict(safetensors=True) / load_state_dict on s3:// give the saved bytes back.
    s3_e2e.py fault URL
        step 1 saved through the server, then step 2 through FSDP_TEST_S3_PROXY (a proxy the test made fail every
        data upload) with short S3 deadlines. Each rank reports how its save ended and how long it took.
    s3_e2e.py kill URL WORK
        step 1 saved, then rank 1 is killed with SIGKILL half way through uploading its step-2 object; rank 0
        reports how its save ended and the seconds from rank 1's start of that save to its error.
Each rank reports {case: "ok" | text, ...}.
"""

from __future__ import annotations

import os
import sys
import time
import traceback

import _paths  # noqa: F401  (puts launch_util on sys.path)
import fault_storage
import numpy as np
import paddle
import paddle.distributed as dist
import paddle.distributed.fsdp.checkpoint as ck
from launch_util import report
from models import trained_fsdp
from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight
from paddle.distributed.fsdp.checkpoint.io import backend_for
from state_compare import assert_bit_equal, host_values

BIG_ROWS, BIG_COLS = 768, 2048  # rows per rank: 6 MiB of float32 per rank, above the 5 MiB part size


def state_of(fsdp, opt, seed: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    state = fsdp.sharded_state_dict()
    state.update(fsdp.optimizer_sharded_state_dict(opt))
    rows = np.random.default_rng(seed * 10 + rank).standard_normal((BIG_ROWS, BIG_COLS), dtype=np.float32)
    state["big"] = ShardedWeight(
        "big", paddle.to_tensor(rows), [BIG_ROWS, BIG_COLS], [world * BIG_ROWS, BIG_COLS], [rank * BIG_ROWS, 0]
    )
    return state


def fresh_target(seed: int) -> dict:
    fsdp, opt = trained_fsdp(seed=seed, steps=1)
    return state_of(fsdp, opt, seed)


def roundtrip(url: str, local: str) -> None:
    fsdp, opt = trained_fsdp(seed=3, steps=2)
    state = state_of(fsdp, opt, 3)
    saved = host_values(state)
    ck.save_state_dict(state, url)
    ck.save_state_dict(state, local)
    for where in (url, local):  # S3 against local: both give the saved bytes back, bounded and atomic
        for atomic in (False, True):
            target = fresh_target(11)
            assert not np.array_equal(host_values(target)["big"], saved["big"])
            ck.load_state_dict(target, where, atomic=atomic)
            assert_bit_equal(host_values(target), saved, f"{where} atomic={atomic}")
    root = f"{url}-mgr"
    manager = ck.CheckpointManager(root, keep_last=2)
    for step in (1, 2, 3):
        manager.save(step, state_of(fsdp, opt, 3 + step))
    dist.barrier()
    assert manager.steps() == [2, 3], manager.steps()
    assert manager.latest_step() == 3 and manager.latest() == f"{root}/step_00000003", manager.latest()
    storage = backend_for(root)
    assert storage.list(manager.path_for(1)) == [], "rotation left step 1's objects"
    target = fresh_target(12)
    manager.load_latest(target)
    assert_bit_equal(host_values(target), host_values(state_of(fsdp, opt, 6)), "load_latest")
    # the model-level entry points and the stock dispatch (paddle.distributed.*) on s3:// too
    from paddle.distributed.fsdp.state import rng

    saved_rng = rng.capture()  # what save_checkpoint saves as this rank's per-rank value (its own object)
    fsdp.save_checkpoint(f"{url}-fsdp", optimizer=opt, step=4, keep_last=1, extra_state={"step": 4})
    fsdp2, opt2 = trained_fsdp(seed=13, steps=1)
    assert rng.capture() != saved_rng
    result = fsdp2.load_checkpoint(f"{url}-fsdp", optimizer=opt2)
    assert result.step == 4 and result["step"] == 4, (result.step, dict(result))
    assert rng.capture() == saved_rng, "the RNG state of this rank was not restored from its values object"
    assert f"{dist.get_rank()}.values" in storage.list(result.path), storage.list(result.path)
    assert ck.verify_checkpoint(result.path) == []
    want = host_values(state_of(fsdp, opt, 3))
    got = host_values(state_of(fsdp2, opt2, 3))
    assert_bit_equal(got, want, "FullyShardFusion.load_checkpoint")
    paddle.distributed.save_state_dict(state, f"{url}-stock", safetensors=True)
    target = fresh_target(14)
    paddle.distributed.load_state_dict(target, f"{url}-stock")
    assert_bit_equal(host_values(target), saved, "paddle.distributed.load_state_dict")
    dist.barrier()
    report({"roundtrip": "ok"})


def fault(url: str) -> None:
    from paddle.distributed.fsdp.checkpoint.s3.storage import S3Storage
    from s3_fixtures import s3_options_for

    rank = dist.get_rank()
    fsdp, opt = trained_fsdp(seed=5, steps=1)
    root = url
    manager = ck.CheckpointManager(root, keep_last=2)
    manager.save(1, state_of(fsdp, opt, 5))
    dist.barrier()
    tight = s3_options_for(
        os.environ["FSDP_TEST_S3_PROXY"],
        max_attempts=2,
        retry_deadline_s=8.0,
        stall_timeout_s=2.0,
        connect_timeout_s=2.0,
    )
    opts = ck.CheckpointOptions(storage=S3Storage(tight, who=f"rank {rank}"))
    out = {}
    t0 = time.monotonic()
    try:
        manager.save(2, state_of(fsdp, opt, 6), options=opts)
        out["save2"] = "ok"
    except ck.CheckpointError as e:
        out["save2"] = f"{type(e).__name__}: {e}"
    out["seconds"] = time.monotonic() - t0
    report(out)
    sys.stdout.flush()
    os._exit(0)  # the save failed on every rank: no collective clean-up needed


def kill(url: str, work: str) -> None:
    """Rank 1 is killed with SIGKILL half way through uploading its step-2 object (PADDLE_FSDP_CKPT_FAULT set by the
    test); rank 0 reports how its save ended and the seconds from rank 1's start of that save to its error."""
    import signal

    from paddle.distributed.fsdp.checkpoint.s3.storage import S3Storage
    from s3_fixtures import s3_options_for

    rank = dist.get_rank()
    fsdp, opt = trained_fsdp(seed=5, steps=1)
    manager = ck.CheckpointManager(url, keep_last=2)
    # 5 MiB parts: each rank's 6 MiB object is a multipart upload, pending when rank 1 is killed
    storage = S3Storage(s3_options_for(os.environ["AWS_ENDPOINT_URL"]))
    opts = ck.CheckpointOptions.from_env().replace(storage=storage)  # the test's heartbeat lease and timeout
    manager.save(1, state_of(fsdp, opt, 5), options=opts)
    stamp = os.path.join(work, "rank1_started")
    dist.barrier()
    if rank == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the engine must end the wait, not the launcher

    else:
        with open(stamp, "w") as f:
            f.write(repr(time.time()))
    out = {}
    try:
        manager.save(2, state_of(fsdp, opt, 6), options=opts)
        out["save2"] = "ok"
    except ck.SaveFailedError as e:
        t_err = time.time()
        out["save2"] = f"SaveFailedError: {e}"
        with open(stamp) as f:
            out["detect_seconds"] = t_err - float(f.read())
    out["latest"] = manager.latest()
    report(out)
    sys.stdout.flush()
    os._exit(0)  # the peer is dead: no collective clean-up


if __name__ == "__main__":
    fault_storage.install()  # the kill a test arms (PADDLE_FSDP_CKPT_FAULT)
    case = sys.argv[1]
    dist.init_parallel_env()
    if case == "roundtrip":
        try:
            roundtrip(sys.argv[2], sys.argv[3])
        except BaseException:  # noqa: BLE001 - the test shows the traceback
            report({case: traceback.format_exc()})
            sys.stdout.flush()
            os._exit(1)
    elif case == "fault":
        fault(sys.argv[2])
    elif case == "kill":
        kill(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit(f"unknown case {case!r}")
