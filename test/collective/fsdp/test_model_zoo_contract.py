"""Hidden-configuration zoo: FSDP on 1, 2 and 3 ranks against the same model in one process.

BatchNorm (buffers updated in forward, train/eval switch), tied embedding + lm head (registered twice, or read
by the root's own forward), frozen and trainable parameters in one unit, LayerNorm with no-weight-decay
parameters and optimizer parameter groups (different LR and decay), gradient accumulation
(``clear_grad(set_to_zero=False)`` and zeroing), units plus loose layers and a root parameter, one unit under two
names, reentrant recompute around units, submodules called on their own (the root's forward never runs), an
optimizer built before wrapping, skip-idle-experts MoE inside units / without units / registered outside the
unit (per-rank data, so ranks run different experts) and with the expert class as unit (refused on every rank
with CollectiveOrderError, never a gloo abort), eval under no_grad; PaddleFormers Llama, Qwen2 (fused and
unfused attention) and tied Qwen2, and the gathered-memory peak with embedding/lm head as units:
FSDP vs one process, print, summon_full_params(writeback=True) + a step, bit-exact resume, full_state_dict into
an unwrapped model (identical logits). All cases of one world size run in one launch.
"""

from __future__ import annotations

import os
import sys

import pytest
from _results import assert_case_ok
from launch_util import run_launch

WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers")
sys.path.insert(0, WORKERS)
try:
    import model_zoo
finally:
    sys.path.remove(WORKERS)

GENERIC = list(model_zoo.CASES)
PADDLEFORMERS = list(model_zoo.PF_CASES)
#: PaddleFormers cases run on 2 ranks only (time budget); the generic zoo on 1, 2 and 3.
PLAN = {1: GENERIC, 2: GENERIC + PADDLEFORMERS, 3: GENERIC}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return {
        n: run_launch(
            os.path.join(WORKERS, "model_zoo.py"),
            n,
            args=[",".join(cases)],
            log_dir=tmp_path_factory.mktemp(f"modelzoo{n}"),
            timeout=300,
        )
        for n, cases in PLAN.items()
    }


@pytest.mark.parametrize("nproc,case", [(n, c) for n, cases in PLAN.items() for c in cases])
def test_model_matches_one_process(runs, nproc, case):
    """Losses, gradient pieces (fp64: rtol 1e-9), parameters and buffers after the steps equal the unwrapped
    model's; a case that hangs is reported as such by the worker's watchdog (the launch never waits for gloo)."""
    assert_case_ok(runs[nproc], case, nproc)
