"""The memory tier with its durable root on S3 (a real SeaweedFS, s3_fixtures.py): the background persist and
``paddle-fsdp-ckpt flush-memory`` write ``s3://`` checkpoints through the Storage interface, which load bit for bit.

One process: steps 1-3 saved into memory, step 2 persisted to S3 from the copy; the process "crashes" (the tier is
left, copies stay); ``flush-memory s3://...`` writes step 3 from the copy, points ``latest`` at it, writes nothing
the second time; a fresh model restores from S3 (memory wiped): step 3, every record and the LR equal to the
saved run's; ``verify`` passes on the flushed checkpoint.
"""

from __future__ import annotations

import shutil

import numpy as np
import paddle
from paddle.distributed.fsdp import FullyShardFusion
from paddle.distributed.fsdp.checkpoint import verify_checkpoint
from paddle.distributed.fsdp.checkpoint.io import storage as storage_mod
from paddle.distributed.fsdp.memtier import MemoryTier
from s3_fixtures import s3_options_for


def _build(seed: int):
    paddle.seed(seed)
    model = paddle.nn.Sequential(paddle.nn.Linear(64, 64), paddle.nn.ReLU(), paddle.nn.Linear(64, 8))
    fsdp = FullyShardFusion(model)
    lr = paddle.optimizer.lr.StepDecay(0.02, step_size=1, gamma=0.5)
    return model, fsdp, paddle.optimizer.AdamW(lr, parameters=model.parameters())


def _records(fsdp, opt) -> dict:
    state = fsdp.sharded_state_dict()
    state.update(fsdp.optimizer_sharded_state_dict(opt))
    return {k: np.array(getattr(v, "local_tensor", v).numpy()).tobytes() for k, v in state.items()}


def test_persist_and_flush_memory_to_s3_load_bit_exact(tmp_path, s3_server, s3_bucket, monkeypatch, capsys):
    from paddle.distributed.fsdp.checkpoint.s3.storage import S3Storage
    from paddle.distributed.fsdp.tools.cli import main as cli

    store = S3Storage(s3_options_for(s3_server.endpoint))
    monkeypatch.setitem(storage_mod._schemes, "s3", lambda: store)
    url, mem = f"s3://{s3_bucket}/run/durable", str(tmp_path / "mem")
    model, fsdp, opt = _build(1)
    tier = MemoryTier(fsdp, opt, durable_root=url, memory_root=mem, persist_every=2, job_id="s3job")
    wants = {}
    for step in (1, 2, 3):
        model(paddle.randn([4, 64])).square().mean().backward()
        opt.step()
        opt.clear_grad()
        opt._learning_rate.step()
        tier.save(step, extra_state={"pos": step})
        tier.wait_persisted()
        wants[step] = (_records(fsdp, opt), opt.get_lr())
    assert tier.persist_errors == [] and tier.durable_saves == [2]
    tier.close(remove=False)  # the "crash": the copies stay in memory
    assert store.get(url, "latest").decode().strip() == "step_00000002"
    args = ["flush-memory", url, "--memory-root", mem, "--job", "s3job", "--no-progress"]
    assert cli(args) == 0
    assert "step 3 (world 1" in capsys.readouterr().out
    assert store.get(url, "latest").decode().strip() == "step_00000003"
    assert cli(args) == 0 and "nothing written" in capsys.readouterr().out
    assert verify_checkpoint(f"{url}/step_00000003") == []
    shutil.rmtree(mem)  # memory lost: the restore comes from S3
    for step in (2, 3):
        _m, fsdp2, opt2 = _build(9)
        if step == 3:
            tier2 = MemoryTier(fsdp2, opt2, durable_root=url, memory_root=mem, job_id="s3job")
            got = tier2.restore()
            assert (got.step, got.sources, dict(got)) == (3, ["storage"], {"pos": 3})
            tier2.close()
        else:
            assert dict(fsdp2.load_checkpoint(f"{url}/step_00000002", optimizer=opt2)) == {"pos": 2}
        want, lr = wants[step]
        mine = _records(fsdp2, opt2)
        assert [k for k in want if mine[k] != want[k]] == [] and opt2.get_lr() == lr, step
