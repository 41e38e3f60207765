"""FSDPTrainer's parts that need no PaddleFormers 1.2.0: the named error without it, the ``checkpoint-N`` directory
rules (complete and of this run only, rotation), the HF preset chosen by architecture. The Trainer itself is tested against the
real PaddleFormers 1.2.0 in test/integrations/paddleformers (its own venv, run by .ci/run).
"""

from __future__ import annotations

import paddle
import pytest
from paddle.distributed.fsdp.checkpoint.lineage import Lineage
from paddle.distributed.fsdp.checkpoint.save.request import save_request
from paddle.distributed.fsdp.checkpoint.save.save import run_save
from paddle.distributed.fsdp.integrations import paddleformers as pf_integration
from paddle.distributed.fsdp.integrations.paddleformers import checkpoints
from paddle.distributed.fsdp.integrations.paddleformers.hf_export import NoHfPresetError, choose_preset


def test_fsdp_trainer_needs_paddleformers_1_2_and_says_which_extra():
    import paddleformers

    if paddleformers.__version__ == pf_integration.SUPPORTED_VERSION:
        pytest.skip("this venv has PaddleFormers 1.2.0: the refusal is for other versions")
    with pytest.raises(pf_integration.PaddleFormersVersionError, match=r"paddle-fsdp-fork\[paddleformers\]"):
        pf_integration.FSDPTrainer  # noqa: B018 - the attribute access composes the class


def _checkpoint(root, name: str, committed: bool = True, lineage: Lineage | None = None):
    """A real checkpoint ``root/name`` saved by ``lineage``'s run (committed=False: a directory without COMMIT,
    as a stock Trainer's checkpoint)."""
    d = root / name
    if not committed:
        d.mkdir()
        (d / "metadata.json").write_text("{}")
        return d
    state = {"w": paddle.full([8], 1.0)}
    record = lineage.record if lineage is not None else None
    run_save(save_request(state, str(d), None, 0, None, lineage=record))
    return d


def test_newest_complete_skips_saves_that_never_committed(tmp_path):
    run = Lineage.fresh()
    _checkpoint(tmp_path, "checkpoint-2", lineage=run)
    _checkpoint(tmp_path, "checkpoint-10", lineage=run)
    _checkpoint(tmp_path, "checkpoint-12", committed=False)  # not the engine's: never picked
    (tmp_path / "checkpoint-14.tmp-00ab").mkdir()  # a crashed save's staging
    (tmp_path / "checkpoint-hf-16").mkdir()
    assert [s for s, _ in checkpoints.complete_checkpoints(str(tmp_path))] == [2, 10]
    assert checkpoints.newest_complete(str(tmp_path)).location == str(tmp_path / "checkpoint-10")
    assert checkpoints.newest_complete(str(tmp_path / "absent")) is None


@pytest.mark.parametrize("keep", [None, 0, 1, 2, 5])
def test_rotation_never_removes_the_newest_complete_of_the_run(tmp_path, keep):
    run, other = Lineage.fresh(), Lineage.fresh()
    for step in (1, 2, 3, 4):
        _checkpoint(tmp_path, f"checkpoint-{step}", lineage=run)
    _checkpoint(tmp_path, "checkpoint-5", committed=False)
    _checkpoint(tmp_path, "checkpoint-1000", lineage=other)  # a leftover of another run, higher step
    torn = _checkpoint(tmp_path, "checkpoint-20", lineage=run)  # a torn copy: COMMIT, a data file missing
    (torn / "0_0.safetensors").unlink()
    (tmp_path / "checkpoint-6.tmp-00ab").mkdir()
    warned: set = set()
    checkpoints.rotate(str(tmp_path), keep, run, protect=(str(tmp_path / "checkpoint-1"),), warned=warned)
    left = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".trash-"))  # deleted in background
    kept = {1, 2, 3, 4} if not keep else {1} | set(range(max(1, 5 - keep), 5))
    expect = [f"checkpoint-{s}" for s in kept] + ["checkpoint-5", "checkpoint-1000", "checkpoint-20"]
    assert left == sorted(expect)
    if keep:
        assert warned == {str(tmp_path / "checkpoint-1000"), str(torn)}


@pytest.mark.parametrize("resumes", [False, True])
def test_a_run_rotates_an_earlier_runs_checkpoints_only_when_it_resumed_from_them(tmp_path, resumes):
    """Red-team round 4, finding 5, the Trainer's side: ``output_dir`` holds an earlier run's checkpoint-1000 and
    -2000. A run that starts over (train() without resume_from_checkpoint) and rotates with save_total_limit=1
    leaves both (named once) and keeps its newest; a run that resumed from checkpoint-2000 continues its run
    and rotates its older ones away (FSDPTrainer._lineage_of is checkpoints.run_lineage)."""
    earlier = Lineage.fresh()
    for step in (1000, 2000):
        _checkpoint(tmp_path, f"checkpoint-{step}", lineage=earlier)
    run = checkpoints.run_lineage(str(tmp_path), str(tmp_path / "checkpoint-2000") if resumes else None)
    warned: set = set()
    for step in (2010, 2020):
        _checkpoint(tmp_path, f"checkpoint-{step}", lineage=run)
        checkpoints.rotate(str(tmp_path), 1, run, warned=warned)
    left = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".trash-"))
    if resumes:
        assert left == ["checkpoint-2020"] and warned == set()
    else:
        assert left == ["checkpoint-1000", "checkpoint-2000", "checkpoint-2020"]
        assert warned == {str(tmp_path / "checkpoint-1000"), str(tmp_path / "checkpoint-2000")}
    assert checkpoints.newest_complete(str(tmp_path)).location == str(tmp_path / "checkpoint-2020")


def test_hf_preset_is_chosen_by_architecture():
    pf12_llama = ["model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "lm_head.weight"]
    assert choose_preset("llama", pf12_llama) == "llama-pf1"
    pf04_llama = ["llama.embed_tokens.weight", "llama.layers.0.mlp.gate_up_fused_proj.weight", "lm_head.weight"]
    assert choose_preset("llama", pf04_llama) == "llama-fused"
    qwen3 = ["model.layers.0.self_attn.qkv_proj.weight", "model.layers.0.self_attn.q_norm.weight"]
    assert choose_preset("qwen3", qwen3) == "qwen3-fused"
    with pytest.raises(NoHfPresetError, match="no to-hf preset"):
        choose_preset("gemma3_text", ["model.layers.0.self_attn.q_proj.weight"])


def test_merge_adapter_without_an_adapter_is_refused_when_the_trainer_is_built():
    """hf_merge_adapter=True on a model that is not an adapter model: NoHfPresetError from the check the Trainer
    runs when it is built (with or without save_hf_steps: trainer.py), not at the first export; an adapter model
    passes the same check."""
    import os
    import sys

    from paddle.distributed.fsdp import FullyShardFusion
    from paddle.distributed.fsdp.integrations.paddleformers.hf_export import check_exportable

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers"))
    from lora_models import make_adapter_model, make_wrapped_lora

    plain = make_adapter_model(3)  # frozen base + adapters, but no lora_config: not an adapter model
    with pytest.raises(NoHfPresetError, match="hf_merge_adapter=True: this AdapterLM is not an adapter model"):
        check_exportable(FullyShardFusion(plain), plain, None, merged=True)
    wrapped = make_wrapped_lora(3)
    assert check_exportable(FullyShardFusion(wrapped), wrapped, None, merged=False) is None  # its adapter


def test_ckpt_quant_stage_maps_onto_quantize_moments():
    """TrainingArguments.ckpt_quant_stage (the field the installed PaddleFormers declares, default O0; read from
    its source: importing its Trainer takes seconds) -> the ``quantize_moments`` FSDPTrainer saves with; anything
    else is a named error when the Trainer is built."""
    import ast
    import importlib.util
    from pathlib import Path
    from types import SimpleNamespace

    from paddle.distributed.fsdp.integrations.paddleformers.quant_stage import quantize_moments_for

    source = Path(
        importlib.util.find_spec("paddleformers").submodule_search_locations[0], "trainer", "training_args.py"
    )
    declared = [
        node.value
        for cls in ast.walk(ast.parse(source.read_text()))
        if isinstance(cls, ast.ClassDef) and cls.name == "TrainingArguments"
        for node in cls.body
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "ckpt_quant_stage"
    ]
    assert len(declared) == 1
    default = next(k.value for k in declared[0].keywords if k.arg == "default")
    assert ast.literal_eval(default) == "O0"
    stages = {s: quantize_moments_for(SimpleNamespace(ckpt_quant_stage=s)) for s in ("O0", "O1", "O2")}
    assert stages == {"O0": None, "O1": "int8", "O2": "int4"}
    assert quantize_moments_for(SimpleNamespace()) is None  # arguments without the field: O0
    for bad in ("O3", "o1", "int8", "", None, 1):
        with pytest.raises(pf_integration.UnsupportedTrainingArgumentError, match=r"ckpt_quant_stage=.*\"O1\""):
            quantize_moments_for(SimpleNamespace(ckpt_quant_stage=bad))


def test_resume_from_an_o1_checkpoint_warns_and_exact_refuses(tmp_path):
    """What FSDPTrainer's save and resume do with ckpt_quant_stage="O1" (trainer.py: ``save_checkpoint(...,
    quantize_moments=<mapped>)``, ``load_checkpoint(path, optimizer=...)``), as docs/trainer.md says: int8 moments
    in the metadata; the resume dequantizes them with LossyCheckpointWarning; exact=True refuses before writing."""
    import json
    import os
    import sys
    import warnings
    from types import SimpleNamespace

    import numpy as np
    from paddle.distributed.fsdp import FullyShardFusion
    from paddle.distributed.fsdp.checkpoint.errors import LossyCheckpointError
    from paddle.distributed.fsdp.checkpoint.lossy import LossyCheckpointWarning
    from paddle.distributed.fsdp.integrations.paddleformers.quant_stage import quantize_moments_for

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers"))
    from models import global_batches, make_model

    def trained(seed: int):
        model = make_model(seed)
        fsdp = FullyShardFusion(model)
        opt = paddle.optimizer.AdamW(1e-2, parameters=model.parameters())
        for x, y in global_batches(2, 4):
            model(paddle.to_tensor(x), paddle.to_tensor(y)).backward()
            opt.step()
            opt.clear_grad()
        return fsdp, opt

    def moments(fsdp, opt) -> dict:
        state = fsdp.optimizer_sharded_state_dict(opt)
        return {k: v.local_tensor.numpy().copy() for k, v in state.items() if k.endswith((".moment1", ".moment2"))}

    fsdp, opt = trained(1)
    saved = moments(fsdp, opt)
    path = tmp_path / "checkpoint-2"
    fsdp.save_checkpoint(str(path), optimizer=opt, quantize_moments=quantize_moments_for(SimpleNamespace(ckpt_quant_stage="O1")))  # fmt: skip
    md = json.loads((path / "metadata.json").read_bytes())
    assert {q["scheme"] for q in md["quant"]["keys"].values()} == {"int8-absmax", "uint8-sqrt"}
    assert sorted(md["quant"]["keys"]) == sorted(saved)

    fsdp, opt = trained(5)  # a resume into another run's state: every moment comes from the checkpoint
    with pytest.warns(LossyCheckpointWarning, match="not bit-exact"):
        fsdp.load_checkpoint(str(path), optimizer=opt)
    loaded = moments(fsdp, opt)
    for k, want in saved.items():
        bound = np.abs(want).max() / 127 if k.endswith("moment1") else np.abs(want).max() * 2 / 255 + 1e-30
        assert np.abs(loaded[k] - want).max() <= bound, k
    assert any(not np.array_equal(loaded[k], saved[k]) for k in saved)  # lossy indeed

    fsdp, opt = trained(5)
    before = moments(fsdp, opt)
    with warnings.catch_warnings(), pytest.raises(LossyCheckpointError, match="cannot resume bit-exactly"):
        warnings.simplefilter("ignore", LossyCheckpointWarning)
        fsdp.load_checkpoint(str(path), optimizer=opt, exact=True)
    assert all(np.array_equal(before[k], v) for k, v in moments(fsdp, opt).items())  # nothing written
