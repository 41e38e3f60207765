"""The memory tier with its durable root on S3 (a real SeaweedFS, s3_fixtures.py): the background persist and
``paddle-fsdp-ckpt flush-memory`` write ``s3://`` checkpoints through the Storage interface, which load bit for bit.

One process: steps 1-3 saved into memory, step 2 persisted to S3 from the copy; the process "crashes" (the tier is
left, copies stay); ``flush-memory s3://...`` writes step 3 from the copy, points ``latest`` at it, writes nothing
the second time; a fresh model restores from S3 (memory wiped): step 3, every record and the LR equal to the
saved run's; ``verify`` passes on the flushed checkpoint.
"""

from __future__ import annotations

import shutil

from memtier_util import small_fsdp, state_bytes, train_and_save
from paddle.distributed.fsdp.checkpoint import verify_checkpoint
from paddle.distributed.fsdp.checkpoint.io import backends as backends_mod
from paddle.distributed.fsdp.memtier import MemoryTier
from s3_fixtures import s3_options_for


def test_persist_and_flush_memory_to_s3_load_bit_exact(tmp_path, s3_server, s3_bucket, monkeypatch, capsys):
    from paddle.distributed.fsdp.checkpoint.s3.storage import S3Storage
    from paddle.distributed.fsdp.tools.cli import main as cli

    store = S3Storage(s3_options_for(s3_server.endpoint))
    monkeypatch.setitem(backends_mod._schemes, "s3", lambda: store)
    url, mem = f"s3://{s3_bucket}/run/durable", str(tmp_path / "mem")
    model, fsdp, opt = small_fsdp(1)
    tier = MemoryTier(fsdp, opt, durable_root=url, memory_root=mem, persist_every=2, job_id="s3job")
    wants = train_and_save(model, fsdp, opt, tier, (1, 2, 3), extra_key="pos")
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
        _m, fsdp2, opt2 = small_fsdp(9)
        if step == 3:
            tier2 = MemoryTier(fsdp2, opt2, durable_root=url, memory_root=mem, job_id="s3job")
            got = tier2.restore()
            assert (got.step, got.sources, dict(got)) == (3, ["storage"], {"pos": 3})
            tier2.close()
        else:
            assert dict(fsdp2.load_checkpoint(f"{url}/step_00000002", optimizer=opt2)) == {"pos": 2}
        want, lr = wants[step]
        mine = state_bytes(fsdp2, opt2)
        assert [k for k in want if mine[k] != want[k]] == [] and opt2.get_lr() == lr, step
