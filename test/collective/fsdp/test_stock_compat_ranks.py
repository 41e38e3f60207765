"""Stock use cases on several CPU ranks with the fork installed (see workers/stock_compat.py)."""

from __future__ import annotations

import pathlib

import pytest
from launch_util import run_launch

WORKER = pathlib.Path(__file__).parent / "workers" / "stock_compat.py"


def ok(res, n, case):
    for r in range(n):
        got = res.result(r).get(case, f"case {case} did not run")
        assert got == "ok", f"rank {r}:\n{got}"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Three launches for the seven cases (each case in a directory of its own): 2 ranks save DistTensors and run
    the three 2-rank cases; 1 rank loads those and saves its own; 2 ranks load that."""
    base = tmp_path_factory.mktemp("stock_ranks")
    dirs = {name: base / name for name in ("saved2", "saved1", "node_local", "fsdp_from_stock", "different_dirs")}
    for path in dirs.values():
        path.mkdir()
    launches = {
        "two": (2, ["dist_save", dirs["saved2"], "node_local", dirs["node_local"],
                    "fsdp_from_stock", dirs["fsdp_from_stock"], "different_dirs", dirs["different_dirs"]]),
        "one": (1, ["dist_load", dirs["saved2"], "dist_save", dirs["saved1"]]),
        "two_load": (2, ["dist_load", dirs["saved1"]]),
    }  # fmt: skip
    return {
        name: run_launch(WORKER, n, [str(a) for a in args], log_dir=base / f"log-{name}")
        for name, (n, args) in launches.items()
    }


@pytest.mark.parametrize("saved,loaded", [(2, 1), (1, 2)])
def test_semi_auto_dist_tensors_save_with_stock_and_load_at_any_world_size(runs, saved, loaded):
    save, load = ("two", "one") if saved == 2 else ("one", "two_load")
    ok(runs[save], saved, "dist_save")
    ok(runs[load], loaded, "dist_load")


def test_node_local_directories_load_through_an_exchange(runs):
    ok(runs["two"], 2, "node_local")


def test_engine_save_with_different_directories_fails_on_every_rank(runs):
    ok(runs["two"], 2, "different_dirs")


def test_stock_checkpoint_loads_into_fsdp_model(runs):
    ok(runs["two"], 2, "fsdp_from_stock")
