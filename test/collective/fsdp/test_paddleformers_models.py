"""Real model code: PaddleFormers 0.4.1 Qwen3ForCausalLM and Qwen3MoeForCausalLM (tiny random configs).

PaddleFormers is installed by the `test` extra; these tests fail (not skip) without it, as the suite promises
real model code.
"""

from __future__ import annotations

import os

import pytest
from _results import assert_case_ok
from launch_util import run_launch

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "paddleformers_models.py")
MODELS = ["qwen3", "qwen3_moe"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("paddleformers")
    out = {"train": (2, run_launch(WORKER, 2, ["train", str(work)], log_dir=work / "logs2"))}
    for n in (1, 3):
        out[f"load{n}"] = (n, run_launch(WORKER, n, ["load", str(work)], log_dir=work / f"logs_load{n}"))
    return out


@pytest.mark.parametrize("model", MODELS)
def test_two_ranks_match_one_process_and_resume_bit_exact(runs, model):
    """2-rank FSDP equals one process after 3 steps (AdamW, global-norm clipping, warmup + cosine LR); a fresh
    model from another seed resumes from the checkpoint and its next 3 steps are bit-exact (every parameter and
    optimizer record); save_pretrained inside summon_full_params on rank 0 gives a directory from_pretrained
    loads unwrapped with identical logits."""
    nproc, result = runs["train"]
    assert_case_ok(result, model, nproc)


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("model", MODELS)
def test_two_rank_checkpoint_loads_on_other_world_sizes(runs, model, world):
    """The 2-rank checkpoint loads on 1 and 3 ranks: parameters bit-exact, then 3 more steps close to the 2-rank
    run's (other summation order)."""
    nproc, result = runs[f"load{world}"]
    assert_case_ok(result, model, nproc)
