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
