"""Stock use cases on several CPU ranks with the fork installed (see workers/stock_compat.py)."""

from __future__ import annotations

import pathlib

import pytest
from launch_util import run_launch

WORKER = pathlib.Path(__file__).parent / "workers" / "stock_compat.py"


def ok(res, n):
    for r in range(n):
        assert res.result(r) == "ok", f"rank {r}:\n{res.result(r)}"


@pytest.mark.parametrize("saved,loaded", [(2, 1), (1, 2)])
def test_semi_auto_dist_tensors_save_with_stock_and_load_at_any_world_size(tmp_path, saved, loaded):
    ok(run_launch(WORKER, saved, ["dist_save", str(tmp_path)], log_dir=tmp_path / "s"), saved)
    ok(run_launch(WORKER, loaded, ["dist_load", str(tmp_path)], log_dir=tmp_path / "l"), loaded)


def test_node_local_directories_load_through_an_exchange(tmp_path):
    ok(run_launch(WORKER, 2, ["node_local", str(tmp_path)], log_dir=tmp_path / "log"), 2)


def test_engine_save_with_different_directories_fails_on_every_rank(tmp_path):
    ok(run_launch(WORKER, 2, ["different_dirs", str(tmp_path)], log_dir=tmp_path / "log"), 2)


def test_stock_checkpoint_loads_into_fsdp_model(tmp_path):
    ok(run_launch(WORKER, 2, ["fsdp_from_stock", str(tmp_path)], log_dir=tmp_path / "log"), 2)
