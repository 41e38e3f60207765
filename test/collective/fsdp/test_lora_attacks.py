"""Outside attacks on the LoRA exports (docs/reports/2026-12-07-attack-lora.md), kept as one-process tests.

Each builds a small PaddleFormers-shaped LoRA checkpoint in this process (workers/lora_models.WrappedLoRA, world
size 1: the exports are one-process tools and read a checkpoint of any world size) and drives the command line
or the library function a user would call.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest

WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers")
sys.path.insert(0, WORKERS)

SEED, ROWS = 11, 6


def _train(root: str, *, bias: bool = False, bf16: bool = False) -> dict:
    """A LoRA checkpoint (base referenced) trained 2 steps; ``bias``: the first q projection's bias trainable too
    (PaddleFormers' ``trainable_bias``); ``bf16``: bfloat16 parameters with fp32 master weights (computed in fp32:
    CPU has no bfloat16 matmul). Returns the trained model's weights as float32 arrays, by key."""
    import paddle
    from lora_models import adapter_batches, make_wrapped_lora
    from master_adamw import MasterAdamW
    from paddle.distributed.fsdp import FullyShardFusion

    model = make_wrapped_lora(SEED)
    if bias:
        model.model.blocks[0].q.bias.stop_gradient = False
    if bf16:
        model.to(dtype="bfloat16")
    fsdp = FullyShardFusion(model, fsdp_unit_layers=["BaseBlock"], compute_dtype="float32" if bf16 else None)
    opt = MasterAdamW(0.05, parameters=model.parameters(), multi_precision=True)
    for ids, labels in adapter_batches(2, ROWS):
        loss = model(paddle.to_tensor(ids), paddle.to_tensor(labels))
        loss.backward()
        opt.step()
        opt.clear_grad()
    fsdp.save_checkpoint(os.path.join(root, "ckpt"), optimizer=opt)
    fsdp.save_checkpoint(os.path.join(root, "whole"), save_frozen=True)  # holds its base: mergeable alone
    with fsdp.summon_full_params():
        return {k: v.astype("float32").numpy() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("lora_attack_plain"))
    return root, _train(root)


def _cli(*argv: str) -> tuple[int, str, str]:
    from paddle.distributed.fsdp.tools.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def _safetensors(path: str) -> dict[str, tuple[dict, bytes]]:
    """name -> (header entry, raw bytes) of a safetensors file (numpy has no bfloat16)."""
    with open(path, "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    return {k: (e, data[e["data_offsets"][0] : e["data_offsets"][1]]) for k, e in header.items() if k != "__metadata__"}


_KILL_AT_PUBLISH = """
import os, signal, sys
def hook(event, args):
    if event == "os.rename":  # the export's only rename: its staged output into place
        os.kill(os.getpid(), signal.SIGKILL)
sys.addaudithook(hook)
from paddle.distributed.fsdp.tools.cli import main
sys.exit(main(["to-hf", *sys.argv[1:]]))
"""


def test_adapter_export_killed_before_it_is_published_leaves_no_output_and_reruns(plain, tmp_path):
    """kill -9 while the adapter export writes: OUT is absent (never one layout complete without the other, never
    a torn adapter a consumer loads), and the rerun into the same OUT needs no cleanup."""
    root, _weights = plain
    ckpt, out = os.path.join(root, "ckpt"), str(tmp_path / "adapter")
    run = subprocess.run([sys.executable, "-c", _KILL_AT_PUBLISH, ckpt, out], capture_output=True, text=True)
    assert run.returncode == -9, (run.returncode, run.stderr[-2000:])
    assert not os.path.exists(out), f"a killed export left {sorted(os.listdir(out))} at OUT"
    code, _stdout, err = _cli("to-hf", ckpt, out)
    assert code == 0, err
    assert sorted(os.listdir(out)) == sorted(
        ["adapter_config.json", "adapter_model.safetensors", "lora_config.json", "lora_model_state.pdparams"]
    )


def test_trainable_bias_is_exported_and_the_layout_without_it_is_named(tmp_path):
    """A trainable weight besides LoRA's (PaddleFormers' trainable_bias): PaddleFormers' layout holds its trained
    value (as get_trainable_state_dict does); peft's layout, which has no place for it, is not written and the
    command says so (before, both layouts silently lacked it: a consumer got other outputs than the trained model)."""
    import paddle

    weights = _train(str(tmp_path), bias=True)
    out = str(tmp_path / "adapter")
    code, _stdout, err = _cli("to-hf", str(tmp_path / "ckpt"), out)
    assert code == 0, err
    assert "peft layout was not written" in err and "blocks.0.q.bias" in err, err
    assert sorted(os.listdir(out)) == ["lora_config.json", "lora_model_state.pdparams"]
    state = paddle.load(os.path.join(out, "lora_model_state.pdparams"), return_numpy=True)
    assert "blocks.0.q.bias" in state, sorted(state)
    np.testing.assert_array_equal(state["blocks.0.q.bias"], weights["model.blocks.0.q.bias"])


def test_bf16_adapter_with_master_weights_exports_both_layouts(tmp_path):
    """bfloat16 adapters with fp32 master weights (their bf16 values derived from the masters in the checkpoint):
    peft's safetensors holds them as BF16 ([out, in]), PaddleFormers' as bfloat16 tensors, both bit-equal to the
    trained model's bf16 weights (before: the peft layout was refused after PaddleFormers' had been written)."""
    import paddle

    weights = _train(str(tmp_path), bf16=True)
    out = str(tmp_path / "adapter")
    code, _stdout, err = _cli("to-hf", str(tmp_path / "ckpt"), out)
    assert code == 0, err
    peft = _safetensors(os.path.join(out, "adapter_model.safetensors"))
    state = paddle.load(os.path.join(out, "lora_model_state.pdparams"))
    assert len(peft) == len(state) == 8, (sorted(peft), sorted(state))
    for name, (entry, raw) in peft.items():
        key = name[len("base_model.model.") : -len(".weight")]
        assert entry["dtype"] == "BF16", (name, entry)
        value = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(entry["shape"]).T
        np.testing.assert_array_equal(value, weights[f"model.{key}"])
        assert state[key].dtype == paddle.bfloat16, (key, state[key].dtype)
        np.testing.assert_array_equal(state[key].astype("float32").numpy(), weights[f"model.{key}"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_merge_memory_stays_near_one_tensor(tmp_path, monkeypatch, dtype):
    """to-hf's promise (docs/tools.md: peak memory near one tensor) for --merge-adapter: merging LoRA into a
    2048 x 2048 weight holds the weight, its merged value and a block of rows at a time (numpy allocations traced);
    before, fp32 needed 3 and bf16 7 times the weight (full-size fp32 copies of W, A @ B and the sum)."""
    import tracemalloc

    import paddle
    from lora_models import LoRAConfigLike, MergeableLoRALinear, WrappedLoRA
    from paddle.distributed.fsdp import FullyShardFusion
    from paddle.distributed.fsdp.tools import adapter_merge
    from paddle.distributed.fsdp.tools.adapter_export import adapter_of
    from paddle.distributed.fsdp.tools.ckpt_io import CheckpointReader

    n, block = 2048, 256 << 10
    paddle.seed(SEED)
    model = WrappedLoRA.__new__(WrappedLoRA)
    paddle.nn.Layer.__init__(model)
    model.model = paddle.nn.LayerDict({"w": MergeableLoRALinear(n, n, r=8)})
    model.lora_config = LoRAConfigLike(r=8)
    for name, p in model.model.named_parameters():
        p.stop_gradient = not name.endswith(("lora_A", "lora_B"))
    model.to(dtype=dtype)
    whole = str(tmp_path / "whole")
    FullyShardFusion(model).save_checkpoint(whole, save_frozen=True)
    with CheckpointReader(whole) as reader:
        adapter = adapter_of(reader.md.values)
    monkeypatch.setattr(adapter_merge, "_BLOCK_BYTES", block, raising=False)
    tracemalloc.start()
    try:
        assert adapter_merge.merge_adapter(whole, str(tmp_path / "merged"), adapter) == 1
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    weight = n * n * (2 if dtype == "bfloat16" else 4)
    assert peak <= 2 * weight + 16 * block, f"merge peak {peak / weight:.2f}x the weight"


def test_a_second_export_into_the_same_directory_replaces_the_merged_model(tmp_path):
    """FSDPTrainer.save_model() twice into one output_dir with hf_merge_adapter=True (a rerun, a script that saves
    at the end of each phase): the second export's adapter files and merged/ replace the first's. Before, the
    rename of merged/ onto the non-empty old one failed (ENOTEMPTY) after the adapter files had been replaced:
    the new adapter beside the old merged model, and the call raised."""
    from paddle.distributed.fsdp.integrations.paddleformers import hf_export

    out = tmp_path / "final"
    for export in (1, 2):
        staged = tmp_path / f"staged{export}"
        (staged / "merged").mkdir(parents=True)
        (staged / "adapter_config.json").write_text(f"adapter {export}")
        (staged / "merged" / "model.safetensors").write_text(f"merged {export}")
        hf_export._move_into(str(staged), str(out))
    assert (out / "adapter_config.json").read_text() == "adapter 2"
    assert (out / "merged" / "model.safetensors").read_text() == "merged 2"
    assert sorted(os.listdir(out)) == ["adapter_config.json", "merged"], sorted(os.listdir(out))


def test_a_killed_merge_leaves_no_scratch_after_the_rerun(plain, tmp_path):
    """kill -9 in `to-hf --merge-adapter`: OUT is absent and the rerun works (held before); the scratch directory
    holding the whole merged checkpoint, which the kill left beside OUT, is removed by the rerun (before it stayed
    forever: a 7B merge killed leaves about 14 GB). A scratch directory of a live merge into OUT is left alone."""

    root, _weights = plain
    ckpt, out = os.path.join(root, "whole"), str(tmp_path / "merged")
    run = subprocess.run(
        [sys.executable, "-c", _KILL_AT_PUBLISH, ckpt, out, "--merge-adapter"], capture_output=True, text=True
    )
    assert run.returncode == -9, (run.returncode, run.stderr[-2000:])
    assert not os.path.exists(out)
    stale = [n for n in os.listdir(tmp_path) if ".fsdp-merge-" in n]
    assert len(stale) == 1, os.listdir(tmp_path)
    from paddle.distributed.fsdp.checkpoint.staged_output import owner_tag

    live = tmp_path / ".merged.fsdp-merge-live"  # a concurrent merge's (this process is alive)
    live.mkdir()
    (live / "owner").write_text(owner_tag() + "\n")
    code, _stdout, err = _cli("to-hf", ckpt, out, "--merge-adapter")
    assert code == 0, err
    left = sorted(n for n in os.listdir(tmp_path) if ".fsdp-merge-" in n)
    assert left == [live.name], left


def test_adapter_of_a_checkpoint_holding_its_base_is_the_lora_tensors_only(plain, tmp_path):
    """The Trainer exports the adapter from checkpoint-N also when that holds its base (save_frozen=True): the
    frozen base weights are not trainable weights besides LoRA's (the export tells them by their optimizer state)."""
    from paddle.distributed.fsdp.tools.adapter_export import export_adapter

    root, _weights = plain
    summary = export_adapter(os.path.join(root, "whole"), str(tmp_path / "adapter"))
    assert summary["tensors"] == 8 and summary["skipped"] == {}, summary
