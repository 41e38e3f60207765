"""FSDPTrainer against the real PaddleFormers 1.2.0 Trainer, in real processes (paddle.distributed.launch, gloo).

Resumed against uninterrupted (bit-exact at the same world size, after kill -9; within 1e-5 at 1 and 3 ranks),
FSDP against stock data parallel, exports against their consumer (PaddleFormers' ``from_pretrained``; transformers'
when torch is installed), rotation and crashed saves against what a resume picks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from launch_util import run_launch

HERE = Path(__file__).resolve().parent
WORKER = HERE / "pf_worker.py"
STEPS, SAVE_AT = 6, 3


def train(out: Path, nproc: int = 2, check: bool = True, env: dict | None = None, **cfg) -> dict:
    """One run of pf_worker.py; the per-rank reports (rank 0's first)."""
    cfg = {"output_dir": str(out), "max_steps": STEPS, "save_steps": SAVE_AT, "eval": True, **cfg}
    res = run_launch(WORKER, nproc, [json.dumps(cfg)], log_dir=out.parent / f"logs-{out.name}", check=check, env=env)
    return res


def losses(res, rank: int = 0) -> dict[int, float]:
    return {int(k): v for k, v in res.result(rank)["losses"].items()}


def ckpt_diff(a: Path, b: Path, *extra: str) -> subprocess.CompletedProcess:
    cli = [sys.executable, "-m", "paddle.distributed.fsdp.tools", "diff", str(a), str(b), *extra]
    return subprocess.run(cli, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """The uninterrupted 2-rank run (checkpoints at steps 3 and 6, HF export at the end)."""
    out = tmp_path_factory.mktemp("straight") / "run"
    res = train(out, save_model=str(out / "final"))
    got = losses(res)
    assert sorted(got) == list(range(1, STEPS + 1)) and got == losses(res, 1)
    return out, got


def test_resume_after_kill_minus_9_is_bit_exact(straight, tmp_path):
    ref_dir, ref = straight
    out = tmp_path / "run"
    killed = train(out, kill_after_save=SAVE_AT, check=False)
    assert killed.returncode != 0
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == [f"checkpoint-{SAVE_AT}"]
    resumed = losses(train(out, resume=True))
    assert resumed == {s: ref[s] for s in range(SAVE_AT + 1, STEPS + 1)}
    d = ckpt_diff(ref_dir / f"checkpoint-{STEPS}", out / f"checkpoint-{STEPS}")
    assert d.returncode == 0 and "IDENTICAL" in d.stdout, d.stdout + d.stderr


def test_async_saves_hold_what_sync_saves_hold(straight, tmp_path):
    ref_dir, ref = straight
    out = tmp_path / "run"
    assert losses(train(out, async_save=True)) == ref
    for step in (SAVE_AT, STEPS):
        d = ckpt_diff(ref_dir / f"checkpoint-{step}", out / f"checkpoint-{step}")
        assert d.returncode == 0 and "IDENTICAL" in d.stdout, d.stdout + d.stderr


@pytest.mark.parametrize("nproc", [1, 3])
def test_resume_at_another_world_size_continues_within_1e5(straight, tmp_path, nproc):
    ref_dir, ref = straight
    out = tmp_path / "run"
    out.mkdir()
    shutil.copytree(ref_dir / f"checkpoint-{SAVE_AT}", out / f"checkpoint-{SAVE_AT}")
    got = losses(train(out, nproc=nproc, resume=True))
    assert sorted(got) == list(range(SAVE_AT + 1, STEPS + 1))
    np.testing.assert_allclose([got[s] for s in sorted(got)], [ref[s] for s in sorted(got)], rtol=0, atol=1e-5)
    # every tensor within 1e-5; the per-rank RNG (stateful) differs by design (another world), the Trainer state not
    d = ckpt_diff(ref_dir / f"checkpoint-{STEPS}", out / f"checkpoint-{STEPS}", "--atol", "1e-5")
    assert "0 missing, 0 extra, 0 dtype, 0 shape" in d.stdout, d.stdout + d.stderr
    off = [line for line in d.stdout.splitlines() if "DIFFERS" in line and "(within tolerance)" not in line]
    assert not off and "value __fsdp__.stateful: differs" in d.stdout, off
    assert "value __fsdp__.extra_state" not in d.stdout, d.stdout


def test_fsdp_matches_stock_data_parallel_in_training_and_evaluation(straight, tmp_path):
    ref_dir, ref = straight
    stock = train(tmp_path / "stock", stock="dp")
    got = losses(stock)
    np.testing.assert_allclose([ref[s] for s in sorted(ref)], [got[s] for s in sorted(ref)], rtol=0, atol=1e-5)
    ours = json.loads((ref_dir.parent / "logs-run" / "results" / "rank0.json").read_text())["eval_losses"]
    assert sorted(ours) == ["3", "6"]
    np.testing.assert_allclose([ours[k] for k in ours], [stock.result(0)["eval_losses"][k] for k in ours], atol=1e-5)


def test_gradient_accumulation_matches_one_big_batch(straight, tmp_path):
    _ref_dir, ref = straight
    got = losses(train(tmp_path / "accum", accumulation=3, save_steps=100))  # 1 sample x 3 micro-steps per rank
    np.testing.assert_allclose([got[s] for s in sorted(ref)], [ref[s] for s in sorted(ref)], rtol=0, atol=1e-5)


def test_save_model_loads_with_paddleformers_from_pretrained(straight):
    from paddle.distributed.fsdp.checkpoint import load_full_state_dict
    from paddleformers.transformers import AutoTokenizer
    from paddleformers.transformers.llama.modeling import LlamaForCausalLM

    ref_dir, _ = straight
    final = ref_dir / "final"
    model = LlamaForCausalLM.from_pretrained(str(final))
    trained = load_full_state_dict(str(ref_dir / f"checkpoint-{STEPS}"))
    loaded = model.state_dict()
    assert len(loaded) == 21 and set(loaded) <= set(trained)
    for key, value in loaded.items():
        np.testing.assert_array_equal(value.numpy(), np.asarray(trained[key]), err_msg=key)
    tok = AutoTokenizer.from_pretrained(str(final))
    assert tok.convert_tokens_to_ids(["w0", "w1"]) == [4, 5]


def test_save_model_loads_with_transformers_when_torch_is_installed(straight):
    """Same logits from transformers (torch) and PaddleFormers (paddle) on the exported directory."""
    pytest.importorskip("torch", reason="transformers' from_pretrained needs torch (CI has none; run locally)")
    from paddleformers.transformers.llama.modeling import LlamaForCausalLM

    code = (
        "import sys, json, torch\n"
        "sys.modules['torchcodec'] = None  # paddlecodec installs a torchcodec module without metadata\n"
        "import transformers\n"
        "m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()\n"
        "ids = torch.arange(4, 20).reshape(2, 8)\n"
        "print(json.dumps(m(ids).logits.detach().numpy().tolist()))\n"
    )
    ref_dir, _ = straight
    final = str(ref_dir / "final")
    out = subprocess.run([sys.executable, "-c", code, final], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    torch_logits = np.array(json.loads(out.stdout.strip().splitlines()[-1]))
    import paddle

    model = LlamaForCausalLM.from_pretrained(final)
    model.eval()
    with paddle.no_grad():
        output = model(paddle.arange(4, 20).reshape([2, 8]))
    paddle_logits = (output.logits if hasattr(output, "logits") else output[0]).numpy()
    np.testing.assert_allclose(torch_logits, paddle_logits, rtol=0, atol=1e-4)


def test_rotation_keeps_the_newest_committed_and_removes_crashed_stagings(tmp_path):
    """Async saves every step with save_total_limit=2, HF exports every 2 steps with save_hf_total_limit=1."""
    out = tmp_path / "run"
    (out / "checkpoint-1.tmp-0123abcd").mkdir(parents=True)  # a crashed save's staging
    train(out, max_steps=4, save_steps=1, save_total_limit=2, async_save=True, save_hf_steps=2, save_hf_total_limit=1)
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-3", "checkpoint-4", "hf_checkpoint-4"]
    assert all((out / n / "COMMIT").is_file() for n in ("checkpoint-3", "checkpoint-4"))
    index = json.loads((out / "hf_checkpoint-4" / "model.safetensors.index.json").read_text())
    assert index["metadata"]["paddle_fsdp"]["preset"] == "llama-pf1" and len(index["weight_map"]) == 21
    assert (out / "hf_checkpoint-4" / "tokenizer.json").is_file() and (
        out / "hf_checkpoint-4" / "config.json"
    ).is_file()


@pytest.mark.parametrize("leftover", ["checkpoint-1000", "checkpoint-20"])
def test_leftovers_never_make_rotation_delete_or_resume_skip_this_runs_newest(straight, tmp_path, leftover):
    """Issue #50 item 2: (a) an earlier run left ``checkpoint-1000`` in output_dir; (b) a torn copy ``checkpoint-20``
    (COMMIT, a data file missing). This run saves checkpoint-3 with save_total_limit=1 and is killed: rotation kept
    checkpoint-3; resume_from_checkpoint=True picks it (bit-exact continuation), names the leftover in a warning,
    and the leftover is still there at the end, never counted: the run's own checkpoint-3 was rotated away."""
    ref_dir, ref = straight
    out = tmp_path / "run"
    out.mkdir()
    shutil.copytree(ref_dir / f"checkpoint-{STEPS}", out / leftover)  # another (earlier) run's checkpoint
    if leftover == "checkpoint-20":
        data = sorted((out / leftover).glob("*.safetensors"))
        assert data, list((out / leftover).iterdir())
        data[-1].unlink()
    killed = train(out, save_total_limit=1, kill_after_save=SAVE_AT, check=False)
    assert killed.returncode != 0
    names = sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint"))
    assert names == sorted([f"checkpoint-{SAVE_AT}", leftover]), names
    assert leftover in killed.worker_logs[0]  # rotation named what it left alone
    resumed = train(out, save_total_limit=1, resume=True)
    assert losses(resumed) == {s: ref[s] for s in range(SAVE_AT + 1, STEPS + 1)}  # from checkpoint-3, bit-exact
    log = resumed.worker_logs[0]
    assert f"not resuming from {out / leftover}" in log and f"checkpoint-{SAVE_AT}" in log, log[-3000:]
    names = sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint"))
    assert names == sorted([f"checkpoint-{STEPS}", leftover]), names
    d = ckpt_diff(ref_dir / f"checkpoint-{STEPS}", out / f"checkpoint-{STEPS}")
    assert d.returncode == 0 and "IDENTICAL" in d.stdout, d.stdout + d.stderr


def test_what_fsdp_trainer_cannot_do_is_refused_by_name(tmp_path):
    import paddle
    from paddle.distributed.fsdp.integrations.paddleformers import FSDPTrainer, UnsupportedTrainingArgumentError
    from paddleformers.trainer import TrainingArguments
    from trainer_fsdp import tiny_llama

    model = tiny_llama()
    opt = paddle.optimizer.AdamW(parameters=model.parameters())
    args = TrainingArguments(
        output_dir=str(tmp_path), sharding="", amp_master_grad=False, device="cpu", report_to="none"
    )
    with pytest.raises(UnsupportedTrainingArgumentError, match="optimizers=.*let the Trainer build it"):
        FSDPTrainer(model=model, args=args, optimizers=(opt, None))
    assert not hasattr(model, "_fsdp") or model._fsdp is None  # refused before anything was sharded


@pytest.mark.parametrize("fault", ["mid_data:1:2", "before_rename:0:2"])
def test_crash_mid_save_leaves_no_checkpoint_a_resume_would_pick(straight, tmp_path, fault):
    ref_dir, ref = straight
    out = tmp_path / "run"
    crashed = train(out, check=False, env={"PADDLE_FSDP_CKPT_FAULT": fault})
    assert crashed.returncode != 0
    names = sorted(p.name for p in out.iterdir())
    assert f"checkpoint-{STEPS}" not in names and f"checkpoint-{SAVE_AT}" in names, names
    from paddleformers.trainer.trainer_utils import get_last_checkpoint

    assert get_last_checkpoint(str(out)) == str(out / f"checkpoint-{SAVE_AT}")  # stock's choice agrees
    resumed = losses(train(out, resume=True))
    assert resumed == {s: ref[s] for s in range(SAVE_AT + 1, STEPS + 1)}
    assert not [n for n in os.listdir(out) if ".tmp-" in n]  # the crashed staging was rotated away


def test_s3_output_dir_saves_rotates_and_resumes(straight, tmp_path, s3_env, s3_bucket):
    """output_dir=s3://...: checkpoints on a real S3 server (SeaweedFS), kill -9, resume, rotation there."""
    _ref_dir, ref = straight
    env = {k: os.environ[k] for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION")}
    url = f"s3://{s3_bucket}/run"
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    cfg = {"output_dir": url, "max_steps": STEPS, "save_steps": SAVE_AT, "eval": True, "save_total_limit": 1}
    killed = run_launch(WORKER, 2, [json.dumps({**cfg, "kill_after_save": SAVE_AT})], env=env, cwd=cwd, check=False)
    assert killed.returncode != 0
    resumed = run_launch(WORKER, 2, [json.dumps({**cfg, "resume": True})], env=env, cwd=cwd)
    assert losses(resumed) == {s: ref[s] for s in range(SAVE_AT + 1, STEPS + 1)}
    from paddle.distributed.fsdp.integrations.paddleformers import checkpoints

    assert [s for s, _ in checkpoints.complete_checkpoints(url)] == [STEPS]  # rotated on the object store
    assert not [n for n in os.listdir(cwd) if n.startswith("s3")]  # no local "s3:" tree left behind


def test_example_script_trains_resumes_and_exports(tmp_path):
    """examples/trainer_fsdp.py, as the README runs it (plus --output_dir), then once more with --resume."""
    example = HERE.parents[2] / "examples" / "trainer_fsdp.py"
    out = tmp_path / "run"
    first = run_launch(example, 2, ["--output_dir", out, "--max_steps", "4"], log_dir=tmp_path / "log1")
    assert "step 4: loss" in first.worker_logs[0]
    second = run_launch(example, 2, ["--output_dir", out, "--max_steps", "8", "--resume"], log_dir=tmp_path / "log2")
    log = second.worker_logs[0]
    assert "step 1: loss" not in log and "step 5: loss" in log and "step 8: loss" in log
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-4", "checkpoint-8", "final"]
    assert (out / "final" / "model.safetensors.index.json").is_file()


def test_hsdp_groups_resume_a_fsdp_checkpoint_and_train_like_it(tmp_path):
    """4 ranks as 2 replicas x 2 shards (replicate_group / shard_group) continue a 2-rank FSDP run."""
    ref_dir = tmp_path / "fsdp"
    ref = losses(train(ref_dir, global_batch=12, eval=False))
    out = tmp_path / "hsdp"
    out.mkdir()
    shutil.copytree(ref_dir / f"checkpoint-{SAVE_AT}", out / f"checkpoint-{SAVE_AT}")
    got = losses(train(out, nproc=4, global_batch=12, eval=False, hsdp=2, resume=True))
    assert sorted(got) == list(range(SAVE_AT + 1, STEPS + 1))
    np.testing.assert_allclose([got[s] for s in sorted(got)], [ref[s] for s in sorted(got)], rtol=0, atol=1e-5)
    d = ckpt_diff(ref_dir / f"checkpoint-{STEPS}", out / f"checkpoint-{STEPS}", "--atol", "1e-5")
    assert "0 missing, 0 extra, 0 dtype, 0 shape" in d.stdout, d.stdout + d.stderr
    assert not [line for line in d.stdout.splitlines() if "DIFFERS" in line and "(within tolerance)" not in line]


def test_memory_tier_saves_to_memory_persists_every_kth_and_resumes_after_kill_minus_9(straight, tmp_path):
    """fsdp_memory_tier: saves every step, every 2nd one a committed checkpoint-N; kill -9 after the memory save of
    step 3; resume_from_checkpoint=True continues from memory (step 3, newer than checkpoint-2), bit-exact."""
    ref_dir, ref = straight
    out = tmp_path / "run"
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    tier = {"memory_root": str(shm), "persist_every": 2}
    killed = train(out, save_steps=1, memory_tier=tier, kill_after_save=SAVE_AT, check=False)
    assert killed.returncode != 0
    names = sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint"))
    assert names == ["checkpoint-2"], names  # step 1 and 3 went to memory only
    resumed = train(out, save_steps=1, memory_tier=tier, resume=True)
    assert losses(resumed) == {s: ref[s] for s in range(SAVE_AT + 1, STEPS + 1)}
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == [
        "checkpoint-2",
        "checkpoint-4",
        "checkpoint-6",
    ]
    d = ckpt_diff(ref_dir / f"checkpoint-{STEPS}", out / f"checkpoint-{STEPS}")
    assert d.returncode == 0 and "IDENTICAL" in d.stdout, d.stdout + d.stderr


def test_memory_tier_options_are_checked_by_name():
    from paddle.distributed.fsdp.integrations.paddleformers import memory_saves
    from paddle.distributed.fsdp.memtier import MemoryTierError

    assert memory_saves.check_options(None) is None
    opts = memory_saves.check_options({"persist_every": 3, "memory_root": "/dev/shm/x"})
    assert [memory_saves.persists(opts, s, 2) for s in (2, 4, 6, 12)] == [False, False, True, True]
    for bad, match in (({"durable_root": "x"}, "set by FSDPTrainer"), ({"nope": 1}, "unknown option 'nope'"),
                       ({"persist_every": 0}, "persist_every must be")):  # fmt: skip
        with pytest.raises(MemoryTierError, match=match):
            memory_saves.check_options(bad)


def test_ckpt_quant_stage_o1_saves_int8_moments_and_any_stage_resumes_them_with_a_warning(tmp_path):
    """One process, no launch: ckpt_quant_stage="O3" refused by name before anything is sharded; "O1" writes
    checkpoint-3 with int8 moments (named in its metadata); a run with "O0" resumes it, warning that the resume is
    not bit-exact (docs/trainer.md)."""
    import warnings

    from paddle.distributed.fsdp.checkpoint.lossy import LossyCheckpointWarning
    from paddle.distributed.fsdp.integrations.paddleformers import FSDPTrainer, UnsupportedTrainingArgumentError
    from paddleformers.trainer import TrainingArguments
    from trainer_fsdp import CountingDataset, make_tokenizer, tiny_llama

    def trainer(stage: str, steps: int, model=None):
        args = TrainingArguments(
            output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=2, learning_rate=3e-3,
            logging_steps=1, save_steps=SAVE_AT, sharding="", amp_master_grad=False, device="cpu",
            report_to="none", disable_tqdm=True, seed=42, ckpt_quant_stage=stage,
        )  # fmt: skip
        model = model if model is not None else tiny_llama()
        return FSDPTrainer(model=model, args=args, train_dataset=CountingDataset(24), tokenizer=make_tokenizer())

    model = tiny_llama()
    with pytest.raises(UnsupportedTrainingArgumentError, match="ckpt_quant_stage='O3'"):
        trainer("O3", SAVE_AT, model)
    assert not hasattr(model, "_fsdp") or model._fsdp is None  # refused before anything was sharded
    trainer("O1", SAVE_AT).train()
    md = json.loads((tmp_path / f"checkpoint-{SAVE_AT}" / "metadata.json").read_text())
    schemes = {q["scheme"] for q in md["quant"]["keys"].values()}
    assert schemes == {"int8-absmax", "uint8-sqrt"} and all(
        k.endswith(("moment1", "moment2")) for k in md["quant"]["keys"]
    )
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer("O0", SAVE_AT + 1).train(resume_from_checkpoint=True)
    assert any(issubclass(w.category, LossyCheckpointWarning) and "not bit-exact" in str(w.message) for w in seen)
