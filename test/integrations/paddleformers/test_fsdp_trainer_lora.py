"""FSDPTrainer fine-tuning a PaddleFormers ``LoRAModel`` (issue #51), in real processes against PaddleFormers 1.2.0.

Training equals stock data parallel at 1, 2 and 3 ranks; ``checkpoint-N`` holds the adapters, their optimizer state and the resume state
plus a reference to the frozen base; resumes are bit-exact after kill -9 and within 1e-5 at another world size;
``save_model`` and ``save_hf_steps`` write the adapter that ``LoRAModel.from_pretrained`` loads bit-equal, and peft's
layout, which peft's own loader loads (where torch + peft exist: ``FSDP_PEFT_PYTHON``, see peft_load.py); an export that cannot be made is refused before step 1.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_fsdp_trainer import STEPS, ckpt_diff, losses, train

HERE = Path(__file__).resolve().parent

SAVE_AT = 3
LORA = {"lora": True, "eval": False, "save_hf_steps": SAVE_AT, "hf_merge_adapter": True}


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """The uninterrupted 2-rank LoRA run: checkpoints and adapter exports at steps 3 and 6, save_model at the end."""
    out = tmp_path_factory.mktemp("lora") / "run"
    res = train(out, save_model=str(out / "final"), **LORA)
    got = losses(res)
    assert sorted(got) == list(range(1, STEPS + 1)) and got == losses(res, 1)
    return out, got


def _metadata(ckpt):
    from paddle.distributed.fsdp.checkpoint import read_metadata

    return read_metadata(str(ckpt))


def test_lora_matches_stock_data_parallel(lora_run, tmp_path):
    _out, ref = lora_run
    stock = losses(train(tmp_path / "stock", stock="dp", lora=True, eval=False, save_steps=100))
    np.testing.assert_allclose([ref[s] for s in sorted(ref)], [stock[s] for s in sorted(ref)], rtol=0, atol=1e-5)
    assert len({round(v, 6) for v in ref.values()}) > 1, ref


@pytest.mark.parametrize("nproc", [1, 3])
def test_lora_matches_stock_data_parallel_at_another_world_size(lora_run, tmp_path, nproc):
    """1 and 3 ranks (the 2-rank case is above): FSDP equals the stock Trainer at the same world size within 1e-5.
    The global batch is fixed, so both also equal the 2-rank run within 1e-5. No checkpoints: one short run each."""
    _out, ref = lora_run
    quick = {"lora": True, "eval": False, "save_steps": 100}
    got = losses(train(tmp_path / "fsdp", nproc=nproc, **quick))
    stock = losses(train(tmp_path / "stock", nproc=nproc, stock="dp", **quick))
    steps = sorted(ref)
    assert sorted(got) == sorted(stock) == steps, (got, stock)
    np.testing.assert_allclose([got[s] for s in steps], [stock[s] for s in steps], rtol=0, atol=1e-5)
    np.testing.assert_allclose([got[s] for s in steps], [ref[s] for s in steps], rtol=0, atol=1e-5)


def test_checkpoint_holds_the_adapters_and_a_base_reference(lora_run):
    out, _ = lora_run
    md = _metadata(out / f"checkpoint-{STEPS}")
    params = [k for k in md.tensors if k.endswith((".lora_A", ".lora_B"))]
    assert len(params) == 8, sorted(md.tensors)
    base = [k for k in md.tensors if k.startswith("model.") and k not in params and "lora_" not in k]
    assert not base, f"frozen base tensors written: {base[:4]}"
    ref = md.values["__fsdp__.frozen_base"]
    assert ref["saved"] is False and ref["parameters"] == 21 and ref["fingerprint"], ref
    assert ref["adapter"]["config"]["r"] == 4, ref["adapter"]
    adapter_bytes = sum(np.prod(md.tensors[k].shape) * 4 for k in md.tensors if k.split(".")[-1] != "" and "lora_" in k)
    data = sum(f.stat().st_size for f in (out / f"checkpoint-{STEPS}").rglob("*.safetensors"))
    assert data <= 1.1 * adapter_bytes + 64 * 1024, (data, adapter_bytes)  # headers: a few KB per file


def test_resume_after_kill_minus_9_is_bit_exact(lora_run, tmp_path):
    ref_dir, ref = lora_run
    out = tmp_path / "run"
    killed = train(out, kill_after_save=SAVE_AT, check=False, **LORA)
    assert killed.returncode != 0
    resumed = losses(train(out, resume=True, **LORA))
    assert resumed == {s: ref[s] for s in range(SAVE_AT + 1, STEPS + 1)}
    d = ckpt_diff(ref_dir / f"checkpoint-{STEPS}", out / f"checkpoint-{STEPS}")
    assert d.returncode == 0 and "IDENTICAL" in d.stdout, d.stdout + d.stderr


def test_resume_at_one_rank_continues_within_1e5(lora_run, tmp_path):
    ref_dir, ref = lora_run
    out = tmp_path / "run"
    out.mkdir()
    shutil.copytree(ref_dir / f"checkpoint-{SAVE_AT}", out / f"checkpoint-{SAVE_AT}")
    got = losses(train(out, nproc=1, resume=True, **LORA))
    assert sorted(got) == list(range(SAVE_AT + 1, STEPS + 1))
    np.testing.assert_allclose([got[s] for s in sorted(got)], [ref[s] for s in sorted(got)], rtol=0, atol=1e-5)


def _checkpoint_adapter(ckpt) -> dict:
    from paddle.distributed.fsdp.checkpoint import load_full_state_dict

    state = load_full_state_dict(str(ckpt))
    return {k[len("model.") :]: np.asarray(v) for k, v in state.items() if k.endswith((".lora_A", ".lora_B"))}


@pytest.mark.parametrize("where", ["final", f"hf_checkpoint-{SAVE_AT}", f"hf_checkpoint-{STEPS}"])
def test_adapter_loads_bit_equal_with_lora_model_from_pretrained(lora_run, where):
    """save_model and save_hf_steps: LoRAModel.from_pretrained gets the trained adapters bit for bit."""
    from paddleformers.peft import LoRAModel
    from trainer_fsdp import tiny_llama

    out, _ = lora_run
    export = out / where
    assert (export / "lora_config.json").is_file() and (export / "lora_model_state.pdparams").is_file()
    step = STEPS if where in ("final", f"hf_checkpoint-{STEPS}") else SAVE_AT
    want = _checkpoint_adapter(out / f"checkpoint-{step}")
    loaded = LoRAModel.from_pretrained(tiny_llama(), str(export))
    got = {k: v.numpy() for k, v in loaded.get_trainable_state_dict().items()}
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)
    assert any(np.abs(v).max() > 0 for k, v in got.items() if k.endswith("lora_B")), "lora_B all zero: not trained"


def test_peft_layout_matches_the_adapter(lora_run):
    """adapter_config.json + adapter_model.safetensors: peft's names, torch orientation, the same scaling."""
    from safetensors.numpy import load_file

    out, _ = lora_run
    final = out / "final"
    config = json.loads((final / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8), config
    assert config["target_modules"] == ["q_proj", "v_proj"]
    tensors = load_file(str(final / "adapter_model.safetensors"))
    want = _checkpoint_adapter(out / f"checkpoint-{STEPS}")
    assert sorted(tensors) == sorted(f"base_model.model.{k}.weight" for k in want)
    for key, value in want.items():
        np.testing.assert_array_equal(tensors[f"base_model.model.{key}.weight"], value.T, err_msg=key)


def _logits(model, ids) -> np.ndarray:
    out = model(input_ids=ids)
    return np.asarray((out[0] if isinstance(out, tuple) else out.logits).numpy())


def test_merged_model_loads_with_from_pretrained_and_gives_the_adapter_models_logits(lora_run):
    """hf_merge_adapter: final/merged is the base with scale * A @ B merged in (fp32, as the base), HF weights that
    LlamaForCausalLM.from_pretrained loads; its logits equal the adapter model's within 1e-5."""
    import paddle
    from paddleformers.peft import LoRAModel
    from paddleformers.transformers.llama.modeling import LlamaForCausalLM
    from trainer_fsdp import tiny_llama

    out, _ = lora_run
    merged = LlamaForCausalLM.from_pretrained(str(out / "final" / "merged"))
    adapter = LoRAModel.from_pretrained(tiny_llama(), str(out / "final"))
    plain = tiny_llama()  # the base alone: the merge must change what the adapters change
    ids = paddle.to_tensor(np.random.default_rng(0).integers(4, 128, (2, 16)).astype("int64"))
    for m in (merged, adapter, plain):
        m.eval()
    with paddle.no_grad():
        want, got, base = (_logits(m, ids) for m in (adapter, merged, plain))
    assert {str(v.dtype) for v in merged.state_dict().values()} == {"paddle.float32"}
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert np.abs(base - want).max() > 1e-4, "the adapters do not change the logits: the merge is not tested"


def _peft_python() -> str | None:
    """An interpreter with torch and peft: FSDP_PEFT_PYTHON (torch and Paddle need not share a venv), else this one."""
    if os.environ.get("FSDP_PEFT_PYTHON"):
        return os.environ["FSDP_PEFT_PYTHON"]
    has = all(importlib.util.find_spec(m) for m in ("torch", "peft", "transformers"))
    return sys.executable if has else None


def test_peft_loads_the_adapter(lora_run, tmp_path):
    """peft's own PeftModel.from_pretrained loads final/ (adapter_config.json + adapter_model.safetensors) into HF
    transformers' Llama with the same base: its lora_A/lora_B equal PaddleFormers' bit for bit, the logits within
    1e-5 (peft_load.py, run by an interpreter with torch + peft)."""
    import paddle
    from paddleformers.peft import LoRAModel
    from trainer_fsdp import tiny_llama

    python = _peft_python()
    if python is None:
        pytest.skip("torch + peft + transformers not installed here and FSDP_PEFT_PYTHON unset: peft's load not run")
    out, _ = lora_run
    final = out / "final"
    base = {}  # the frozen base in HF layout: Paddle's Linear weights are [in, out], HF's [out, in]
    for key, value in tiny_llama().state_dict().items():
        a = np.asarray(value.numpy())
        linear = a.ndim == 2 and not key.endswith(("embed_tokens.weight", "lm_head.weight"))
        base[f"base/{key}"] = np.ascontiguousarray(a.T) if linear else a
    adapter, plain = LoRAModel.from_pretrained(tiny_llama(), str(final)), tiny_llama()
    ids = np.random.default_rng(0).integers(4, 128, (2, 16)).astype("int64")
    for m in (adapter, plain):
        m.eval()
    with paddle.no_grad():
        logits, base_logits = (_logits(m, paddle.to_tensor(ids)) for m in (adapter, plain))
    assert np.abs(logits - base_logits).max() > 1e-4, "the adapters do not change the logits: nothing is tested"
    lora = {f"lora/{k}": np.asarray(v.numpy()) for k, v in adapter.state_dict().items() if ".lora_" in k}
    check = tmp_path / "check.npz"
    np.savez(check, ids=ids, logits=logits, base_logits=base_logits, **base, **lora)
    done = subprocess.run(
        [python, str(HERE / "peft_load.py"), str(final), str(check)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "peft loaded 8 adapter tensors" in done.stdout, done.stdout


def test_to_hf_of_a_lora_checkpoint_writes_the_adapter(lora_run, tmp_path):
    out, _ = lora_run
    dest = tmp_path / "adapter"
    cli = [sys.executable, "-m", "paddle.distributed.fsdp.tools", "to-hf", str(out / f"checkpoint-{STEPS}"), str(dest)]
    done = subprocess.run(cli, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    for name in ("lora_config.json", "lora_model_state.pdparams", "adapter_config.json", "adapter_model.safetensors"):
        assert (dest / name).read_bytes() == (out / "final" / name).read_bytes(), name


def test_to_hf_merge_adapter_equals_the_trainers_merged_export(lora_run, tmp_path):
    """`to-hf checkpoint-N --merge-adapter` (the checkpoint references its base; --base the base's own Hugging Face
    directory, as PaddleFormers' save_pretrained writes it): tensors bit-equal to the Trainer's final/merged (the
    same code: tools/adapter_merge.py), logits within 1e-5 of the adapter model's; another base is refused (exit 2,
    the fingerprint named) with nothing written."""
    import paddle
    from paddleformers.peft import LoRAModel
    from paddleformers.transformers.llama.modeling import LlamaForCausalLM
    from safetensors.numpy import load_file
    from trainer_fsdp import tiny_llama

    out, _ = lora_run
    base = tmp_path / "base"
    tiny_llama().save_pretrained(str(base))
    dest = tmp_path / "merged"
    argv = [str(out / f"checkpoint-{STEPS}"), "--merge-adapter", "--base", str(base), "--preset", "llama-pf1"]
    argv += ["--config", str(out / "final" / "merged" / "config.json")]
    cli = [sys.executable, "-m", "paddle.distributed.fsdp.tools", "to-hf"]
    done = subprocess.run([*cli, argv[0], str(dest), *argv[1:]], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr

    def tensors(d):
        return {k: v for f in sorted(d.glob("*.safetensors")) for k, v in load_file(str(f)).items()}

    want, got = tensors(out / "final" / "merged"), tensors(dest)
    assert sorted(got) == sorted(want) and len(want) > 20, (sorted(got)[:3], sorted(want)[:3])
    for key, value in want.items():
        assert got[key].dtype == value.dtype and got[key].tobytes() == value.tobytes(), key
    ids = paddle.to_tensor(np.random.default_rng(1).integers(4, 128, (2, 16)).astype("int64"))
    merged, adapter = (
        LlamaForCausalLM.from_pretrained(str(dest)),
        LoRAModel.from_pretrained(tiny_llama(), str(out / "final")),
    )
    for m in (merged, adapter):
        m.eval()
    with paddle.no_grad():
        np.testing.assert_allclose(_logits(merged, ids), _logits(adapter, ids), rtol=0, atol=1e-5)

    other = tmp_path / "other_base"
    model = tiny_llama()
    with paddle.no_grad():
        model.lm_head.weight[0, 0] = model.lm_head.weight[0, 0] + 1.0
    model.save_pretrained(str(other))
    refused = tmp_path / "refused"
    argv[3] = str(other)
    done = subprocess.run([*cli, argv[0], str(refused), *argv[1:]], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "fingerprint" in done.stderr, done.stdout + done.stderr
    assert not refused.exists() and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_merge_adapter_on_a_model_without_adapter_is_refused_when_the_trainer_is_built(tmp_path):
    """hf_merge_adapter=True without save_hf_steps, on a plain Llama: NoHfPresetError from FSDPTrainer(...)."""
    from paddle.distributed.fsdp.integrations.paddleformers import FSDPTrainer
    from paddle.distributed.fsdp.integrations.paddleformers.hf_export import NoHfPresetError
    from paddleformers.trainer import TrainingArguments
    from trainer_fsdp import tiny_llama

    args = TrainingArguments(
        output_dir=str(tmp_path), sharding="", amp_master_grad=False, device="cpu", report_to="none"
    )
    with pytest.raises(NoHfPresetError, match="not an adapter model"):
        FSDPTrainer(model=tiny_llama(), args=args, hf_merge_adapter=True)


def test_an_export_that_cannot_be_made_is_refused_before_step_1(tmp_path):
    out = tmp_path / "run"
    res = train(out, nproc=1, check=False, save_hf_steps=SAVE_AT, hf_preset="no-such-preset", eval=False)
    assert res.returncode != 0
    log = "".join(res.worker_logs.values())
    assert "NoHfPresetError" in log and "no-such-preset" in log, log[-3000:]
    assert not list(out.glob("checkpoint-*")), "the run trained before refusing its export"


def test_example_script_with_lora_trains_resumes_and_exports_the_adapter(tmp_path):
    """examples/trainer_fsdp.py --lora, as the README runs it: trains, resumes, and writes the adapter."""
    from launch_util import run_launch

    example = Path(__file__).resolve().parents[3] / "examples" / "trainer_fsdp.py"
    out = tmp_path / "run"
    first = run_launch(example, 2, ["--output_dir", out, "--max_steps", "4", "--lora"], log_dir=tmp_path / "l1")
    assert "step 4: loss" in first.worker_logs[0]
    again = ["--output_dir", out, "--max_steps", "8", "--resume", "--lora"]
    log = run_launch(example, 2, again, log_dir=tmp_path / "l2").worker_logs[0]
    assert "step 1: loss" not in log and "step 5: loss" in log and "step 8: loss" in log
    assert sorted(p.name for p in (out / "final").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "lora_config.json",
        "lora_model_state.pdparams",
    ]
