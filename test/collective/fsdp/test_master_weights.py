"""fp32 master weights that really move (MasterAdamW, GPU multi-precision AdamW arithmetic) on bf16
parameters: resume bit-exact on 1, 2 and 3 ranks, and reshard N -> M bit-exact."""

from __future__ import annotations

import os

import numpy as np
import pytest
from _results import assert_case_ok
from launch_util import beside_one_rank, run_launch
from paddle.distributed.fsdp.checkpoint import load_full_state_dict

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "master_weights.py")
WORLDS = (1, 2, 3)
SOURCE_OF = {1: 3, 2: 1, 3: 2}  # resume on M ranks also loads the checkpoint saved by SOURCE_OF[M] ranks


@pytest.fixture(scope="module")
def saves(tmp_path_factory) -> tuple:
    """(workdir, {world: its save launch}). Each save launch runs the writeback case too: one start-up per world
    size instead of two (CI time); the two cases are reported and asserted apart. The 1-rank save runs beside the
    2-rank one (independent: each its own A_/REF_ directories)."""
    root = tmp_path_factory.mktemp("master")

    def save(n: int):
        return lambda: run_launch(WORKER, n, ["save,writeback", str(root)], log_dir=root / f"save{n}")

    launches = dict(zip((1, 2), beside_one_rank(save(1), save(2))))
    launches[3] = save(3)()
    return root, launches


@pytest.fixture(scope="module")
def workdir(saves):
    """Every save checked, then the resumes; the 1-rank resume beside the 2-rank one (they read the saves only and
    write their own RES_/B_ directories)."""
    root, launches = saves
    for n in WORLDS:
        assert_case_ok(launches[n], "save", n)

    def resume(m: int):
        return lambda: run_launch(WORKER, m, ["resume", str(root), str(SOURCE_OF[m])], log_dir=root / f"resume{m}")

    runs = dict(zip((1, 2), beside_one_rank(resume(1), resume(2))))
    runs[3] = resume(3)()
    for m in WORLDS:
        assert_case_ok(runs[m], "resume", m)
    return root


def _tensors(path) -> dict:
    full = load_full_state_dict(str(path))
    return {k: np.array(v.numpy()) for k, v in full.items() if not k.startswith("__fsdp__.")}


def _assert_bit_equal(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b), sorted(set(a) ^ set(b))
    for key in a:
        assert a[key].dtype == b[key].dtype and np.array_equal(a[key], b[key]), f"{key} differs"


@pytest.mark.parametrize("world", WORLDS)
def test_resume_is_bit_exact_with_moving_master_weights(workdir, world):
    ref = _tensors(workdir / f"REF_{world}")
    assert any(k.endswith(".master_weight") for k in ref), sorted(ref)
    start = _tensors(workdir / f"A_{world}")
    masters = [k for k in ref if k.endswith(".master_weight")]
    assert any(not np.array_equal(ref[k], start[k]) for k in masters), "master weights did not move"
    _assert_bit_equal(_tensors(workdir / f"RES_{world}"), ref)


@pytest.mark.parametrize("world", WORLDS)
def test_reshard_is_bit_exact_with_master_weights(workdir, world):
    source = SOURCE_OF[world]
    _assert_bit_equal(_tensors(workdir / f"B_{source}_{world}"), _tensors(workdir / f"A_{source}"))


@pytest.mark.parametrize("world", WORLDS)
def test_writeback_survives_the_next_multi_precision_step(saves, world):
    """summon_full_params(writeback=True) re-casts the fp32 master weights of the elements it changed (others keep
    full precision, bit-equal), so the next MasterAdamW step starts from the written values; equals one process
    that sets the values and their masters by hand. (Run by the save launch of that world size.)"""
    assert_case_ok(saves[1][world], "writeback", world)


@pytest.mark.parametrize("world", WORLDS)
def test_saves_derive_the_bf16_weights_from_their_masters(workdir, world):
    """Every bf16 weight of these checkpoints was its master weight cast: none is stored (format 4's "derived",
    issue #52), and the resume / reshard tests above read them back derived, bit-exactly."""
    import json

    for name in (f"A_{world}", f"REF_{world}", f"RES_{world}", f"B_{SOURCE_OF[world]}_{world}"):
        md = json.loads((workdir / name / "metadata.json").read_text())
        masters = [k for k in _tensors(workdir / name) if k.endswith(".master_weight")]
        assert md["version"] == 4 and masters, (name, md["version"])
        assert sorted(md["derived"]) == sorted(k[: -len(".master_weight")] for k in masters), name
