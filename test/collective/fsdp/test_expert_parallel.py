"""Expert parallelism (EP): experts in buffers of their own, sharded over fleet's moe_sharding group, trained like one
process; checkpoints independent of the EP degree. Two launches share one directory: 2 ranks (fleet ep_degree=2)
train, refuse, and save the EP=2 and EP=1 checkpoints; 4 ranks (ep2 x moe_sharding2, and EP=4 through explicit
groups) train and reshard them (workers/expert_parallel.py)."""

from __future__ import annotations

import os

import pytest
from _results import assert_case_ok
from launch_util import run_launch

TWO = ["groups", "refusals", "training_ep2", "save_once", "summon"]
FOUR = [
    "training_ep2x2",
    "reshard_ep2_to_ep2x2",
    "reshard_ep1_to_ep2x2",
    "reshard_ep2_to_ep4",
    "reshard_ep2_to_ep1",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "expert_parallel.py")
    work = str(tmp_path_factory.mktemp("ep_ckpts"))
    two = run_launch(worker, 2, [work], log_dir=tmp_path_factory.mktemp("ep2"))
    four = run_launch(worker, 4, [work], log_dir=tmp_path_factory.mktemp("ep4"))
    return {"two": two, "four": four, "dir": work}


@pytest.mark.parametrize("case", TWO)
def test_ep_two_ranks(runs, case):
    """groups: fleet's ep_degree=2 gives an EP group of both ranks and no expert sharding; experts of this EP rank
    only, in buffers of their own. refusals: EP layouts trained wrong are refused by name, the model untouched.
    training_ep2: equals one process (AdamW, weight decay, global-norm clipping), full_state_dict has every expert.
    save_once: the EP=2 checkpoint has EP=1's keys and shapes, every byte written once. summon: writeback."""
    assert_case_ok(runs["two"], case, 2)


@pytest.mark.parametrize("case", FOUR)
def test_ep_four_ranks(runs, case):
    """training_ep2x2: ep2 x moe_sharding2 (and EP=4) equal one process. reshard_*: the 2-rank checkpoints load at
    another EP and FSDP degree bit-exactly (re-saved and compared), each rank reading <= 1.1x its share, and
    continue within 1e-5 of the uninterrupted run."""
    assert_case_ok(runs["four"], case, 4)


def test_ep_checkpoint_tools(runs):
    """verify and diff read EP checkpoints like any other: the EP=2 and EP=1 checkpoints have the same keys."""
    from paddle.distributed.fsdp.tools.verify_cmd import verify

    for name in ("ep2", "ep1"):
        problems, _ = verify(os.path.join(runs["dir"], name), progress=False)
        assert problems == [], (name, problems)
