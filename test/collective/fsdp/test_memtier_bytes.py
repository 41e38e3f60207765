"""The memory tier writes the bytes a direct save writes (issue #52): a persist (persist.py) and a flush (flush.py)
of a bf16 + fp32-master model derive the weights equal to their master cast (format 4 ``"derived"``), store one
that is not, compress through the tier's codec, and load bit for bit. One process each.

* persist: ``derived`` lists every bf16 weight, its data files are the direct save's size (smaller than a save that
  stores every weight), and it loads bit-exactly equal to the direct save of the same step and to the live state;
* flush after a simulated crash (the tier left, its copies kept): the same, from the copy alone;
* a weight one bit off its master cast (in the copy) is stored by the persist and by the flush;
* ``codec="byteplane-zstd"`` on the tier: persist and flush store compressed files, a restore from storage (memory
  wiped) is bit-exact, ``verify`` passes; ``quantize_moments="int8"`` on the tier reaches the persist.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import paddle
from memtier_util import bf16_fsdp, bf16_train_step, state_bytes
from paddle.distributed.fsdp.checkpoint import CheckpointOptions, load_full_state_dict, verify_checkpoint
from paddle.distributed.fsdp.memtier import MemoryTier
from paddle.distributed.fsdp.memtier.flush import flush_memory

WEIGHTS = ["b1", "w1", "w2"]  # Bf16MLP's bf16 parameters (its embedding is fp32: no master, stored)


def _metadata(path) -> dict:
    return json.loads((Path(path) / "metadata.json").read_text())


def _data_bytes(path) -> int:
    return sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))


def _full(path) -> dict:
    out = {}
    for k, v in load_full_state_dict(str(path)).items():
        if not k.startswith("__fsdp__."):
            out[k] = np.array(v.view("uint16").numpy() if v.dtype == paddle.bfloat16 else v.numpy()).tobytes()
    return out


def _run(tmp_path, steps, persist_every, **tier_kw):
    """Train ``steps`` MasterAdamW steps, a tier save after each; ``(model, fsdp, opt, tier, wants)``."""
    model, fsdp, opt = bf16_fsdp(3)
    kw = dict(durable_root=str(tmp_path / "durable"), memory_root=str(tmp_path / "mem"), job_id="j")
    tier = MemoryTier(fsdp, opt, persist_every=persist_every, **kw, **tier_kw)
    wants = {}
    for step in steps:
        bf16_train_step(model, opt, step)
        tier.save(step, extra_state={"step": step})
        tier.wait_persisted()
        wants[step] = state_bytes(fsdp, opt)
    return model, fsdp, opt, tier, wants


def _restored(tmp_path, step: int, from_path=None, **tier_kw) -> dict:
    """A fresh model's state after loading ``from_path`` (or a tier restore from storage, memory wiped)."""
    _m, fsdp, opt = bf16_fsdp(99)
    if from_path is not None:
        fsdp.load_checkpoint(str(from_path), optimizer=opt)
        return state_bytes(fsdp, opt)
    shutil.rmtree(tmp_path / "mem", ignore_errors=True)
    tier = MemoryTier(fsdp, opt, durable_root=str(tmp_path / "durable"), memory_root=str(tmp_path / "mem"),
                      job_id="j", **tier_kw)  # fmt: skip
    got = tier.restore()
    assert (got.step, got.sources) == (step, ["storage"]), (got.step, got.sources)
    tier.close()
    return state_bytes(fsdp, opt)


def _diff(a: dict, b: dict) -> list[str]:
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    return [k for k in a if a[k] != b[k]]


def test_persist_derives_weights_like_a_direct_save(tmp_path):
    _model, fsdp, opt, tier, wants = _run(tmp_path, (1, 2), persist_every=2)
    direct = tmp_path / "direct"
    fsdp.save_checkpoint(str(direct), optimizer=opt, extra_state={"step": 2})
    stored = tmp_path / "stored"
    fsdp.save_checkpoint(str(stored), optimizer=opt, extra_state={"step": 2}, derive_weights=False)
    tier.close()
    persisted = tmp_path / "durable" / "step_00000002"
    md = _metadata(persisted)
    assert md["version"] == 4 and sorted(md["derived"]) == WEIGHTS, (md["version"], md.get("derived"))
    assert _data_bytes(persisted) == _data_bytes(direct) < _data_bytes(stored)
    assert _diff(_full(persisted), _full(direct)) == []
    assert _diff(_restored(tmp_path, 2, persisted), wants[2]) == []
    assert _diff(_restored(tmp_path, 2), wants[2]) == []  # the tier's own restore from storage


def test_flush_after_a_crash_derives_weights(tmp_path):
    _model, fsdp, opt, tier, wants = _run(tmp_path, (1, 2), persist_every=100)
    direct = tmp_path / "direct"
    fsdp.save_checkpoint(str(direct), optimizer=opt, extra_state={"step": 2})
    tier.close(remove=False)  # the "crash": no persist of step 2, its copy stays in memory
    flushed = flush_memory([str(tmp_path / "mem")], str(tmp_path / "durable"))
    assert flushed.step == 2 and flushed.nbytes == _data_bytes(flushed.path) == _data_bytes(direct), flushed
    md = _metadata(flushed.path)
    assert md["version"] == 4 and sorted(md["derived"]) == WEIGHTS, (md["version"], md.get("derived"))
    assert verify_checkpoint(flushed.path) == []
    assert _diff(_full(flushed.path), _full(direct)) == []
    assert _diff(_restored(tmp_path, 2, flushed.path), wants[2]) == []


def test_a_weight_off_its_master_cast_is_stored(tmp_path):
    """w2's first element one bit off in the live weight at the save: the copy holds it so, and the persist and the
    flush both store w2 (and derive the others); each loads bit-exactly."""
    model, fsdp, opt = bf16_fsdp(3)
    kw = dict(durable_root=str(tmp_path / "durable"), memory_root=str(tmp_path / "mem"), job_id="j")
    tier = MemoryTier(fsdp, opt, persist_every=1, **kw)
    bf16_train_step(model, opt, 1)
    bits = np.array(model.w2.numpy()).view(np.uint16).copy()
    bits.reshape(-1)[0] ^= 1
    model.w2.set_value(paddle.to_tensor(bits).view(paddle.bfloat16))
    tier.save(1, extra_state={"step": 1})
    tier.wait_persisted()
    want = state_bytes(fsdp, opt)
    tier.close(remove=False)
    persisted = tmp_path / "durable" / "step_00000001"
    assert sorted(_metadata(persisted)["derived"]) == ["b1", "w1"]
    assert _diff(_restored(tmp_path, 1, persisted), want) == []
    shutil.rmtree(persisted)
    os.unlink(tmp_path / "durable" / "latest")
    flushed = flush_memory([str(tmp_path / "mem")], str(tmp_path / "durable"))
    assert flushed.step == 1 and sorted(_metadata(flushed.path)["derived"]) == ["b1", "w1"]
    assert _diff(_restored(tmp_path, 1, flushed.path), want) == []


def test_compressed_persist_and_flush_load_bit_exact(tmp_path):
    opts = CheckpointOptions(codec="byteplane-zstd")
    model, fsdp, opt, tier, wants = _run(tmp_path, (1, 2), persist_every=1, options=opts)
    raw = tmp_path / "raw"
    fsdp.save_checkpoint(str(raw), optimizer=opt, extra_state={"step": 2}, options=CheckpointOptions(codec="raw"))
    bf16_train_step(model, opt, 3)
    tier.save(3, extra_state={"step": 3})  # persist_every=1, but the crash comes first: not waited for
    tier.wait()
    wants[3] = state_bytes(fsdp, opt)
    tier.close(remove=False)
    persisted = tmp_path / "durable" / "step_00000002"
    md = _metadata(persisted)
    assert md["version"] == 4 and set(md["codecs"].values()) == {"byteplane-zstd"} and sorted(md["derived"]) == WEIGHTS
    assert _data_bytes(persisted) < _data_bytes(raw) and verify_checkpoint(str(persisted)) == []
    assert _diff(_full(persisted), _full(raw)) == []
    if (tmp_path / "durable" / "step_00000003").exists():  # the persist of step 3 raced the "crash" and won
        shutil.rmtree(tmp_path / "durable" / "step_00000003")
        (tmp_path / "durable" / "latest").write_text("step_00000002\n")
    flushed = flush_memory([str(tmp_path / "mem")], str(tmp_path / "durable"))
    md = _metadata(flushed.path)
    assert flushed.step == 3 and set(md["codecs"].values()) == {"byteplane-zstd"}, (flushed, md.get("codecs"))
    assert sorted(md["derived"]) == WEIGHTS and verify_checkpoint(flushed.path) == []
    assert _diff(_restored(tmp_path, 3, options=opts), wants[3]) == []


def test_quantize_moments_on_the_tier_reaches_persist_and_flush(tmp_path):
    """The tier's ``quantize_moments="int8"``: the persist of step 2 and the flush of step 3 store what a direct
    ``save_checkpoint(quantize_moments="int8")`` of the same step stores (the same codes and scales, bit for bit)."""
    model, fsdp, opt, tier, _wants = _run(tmp_path, (1, 2), persist_every=2, quantize_moments="int8")
    fsdp.save_checkpoint(str(tmp_path / "direct2"), optimizer=opt, quantize_moments="int8")
    bf16_train_step(model, opt, 3)
    tier.save(3, extra_state={"step": 3})
    tier.wait()
    fsdp.save_checkpoint(str(tmp_path / "direct3"), optimizer=opt, quantize_moments="int8")
    tier.close(remove=False)
    flushed = flush_memory([str(tmp_path / "mem")], str(tmp_path / "durable"))
    assert flushed.step == 3, flushed
    moments = sorted(f"{k}.{m}" for k in WEIGHTS + ["embed.weight"] for m in ("moment1", "moment2"))
    for got, direct in ((tmp_path / "durable" / "step_00000002", "direct2"), (flushed.path, "direct3")):
        md = _metadata(got)
        assert sorted(md.get("quant", {}).get("keys", {})) == moments and sorted(md["derived"]) == WEIGHTS, got
        assert _data_bytes(got) == _data_bytes(tmp_path / direct) and verify_checkpoint(str(got)) == []
        assert _diff(_full(got), _full(tmp_path / direct)) == [], got
