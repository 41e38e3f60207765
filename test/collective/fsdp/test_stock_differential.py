"""Differential test: the same stock use cases run on stock paddle (PADDLE_FSDP_FORK_DISABLE=1) and with the fork.

workers/stock_differential.py runs every case in one process per mode (two launches of 2 ranks for the
multi-rank cases) and records observations; this file compares them. Where they differ:

* both raised: the fork's exception must be an instance of stock's type (``except <stock type>`` still works);
* stock raised, the fork did not: allowed only where listed in ``STOCK_FAILS`` (stock crashes on an input it
  documents, or refuses one the fork adds on top); the fork's values must then equal the worker's ``expect_*``;
* stock succeeded, the fork raised: allowed only where listed in ``STOCK_UNSAFE`` (stock silently loads wrong
  data); docs/stock-compatibility.md says so;
* values differ (tensors bit for bit, files, return values): the fork's must equal the worker's ``expect_<key>``,
  i.e. the fork is right where stock is wrong.

Stock's resharder calls ``.cuda()``; the worker makes it a counting no-op so stock produces its CPU results;
where stock needed it (stock fails on a plain CPU build), the fork must not call ``.cuda()`` at all.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
from launch_util import run_launch

WORKER = pathlib.Path(__file__).parent / "workers" / "stock_differential.py"
STOCK = {"PADDLE_FSDP_FORK_DISABLE": "1"}
FORK = {"PADDLE_FSDP_FORK_DISABLE": ""}

#: (case, observation) -> why stock raising while the fork works is right
STOCK_FAILS = {
    ("model_optimizer_nested", "load"): "stock 3.3.1 cannot load nested dicts (ValueError / KeyError after loading)",
    ("nested", "load"): "stock 3.3.1 cannot load nested dicts",
    ("structure_change", "load_nested"): "stock 3.3.1 cannot load nested dicts",
    ("structure_change", "load_nested_from_flat"): "stock 3.3.1 cannot load nested dicts",
    ("optimizer_with_scheduler", "save"): "fork addition: JSON values (LR_Scheduler) go to the engine",
    **{("non_tensor_values", f"save{i}"): "fork addition: JSON values go to the engine" for i in range(6)},
    ("aoa", "load"): "stock's aoa path on one process: KeyError in its resharder",
    ("master_weight_names", "load_compat"): "stock computes the compatible name but reads the original (KeyError)",
    ("sharded_weight_boxes", "load_top"): "stock refuses non-replicated ShardedWeights in one process",
    ("sharded_weight_boxes", "load_bottom"): "stock refuses non-replicated ShardedWeights in one process",
    ("unique_ids", "loadNone"): "stock asserts on a directory holding several versions",
    ("async_save", "save"): "stock's async save calls paddle.device.synchronize(): TypeError on CPU builds",
    ("async_save", "load"): "stock's failed async save left no data file",
    ("safetensors_true", "default_load_load"): "stock needs safetensors=True to read its safetensors variant",
    ("format_flags_crossed", "pickles_load"): "stock reads .distcp files as safetensors when safetensors=True",
    ("format_flags_crossed", "st_load"): "stock needs safetensors=True to read its safetensors variant",
    ("unique_ids@2", "loadNone"): "stock asserts on a directory holding several versions",
}
#: (case, observation) -> why the fork refusing an input stock accepts is right
STOCK_UNSAFE = {
    ("mismatches", "shape"): "stock silently loads the overlapping corner of a differently shaped tensor",
    ("mismatches", "dtype"): "stock silently changes the target tensor's dtype to the checkpoint's",
    ("mismatches", "dtype_bf16"): "stock silently changes the target tensor's dtype to the checkpoint's",
}


def _is_raise(v) -> bool:
    return isinstance(v, str) and v.startswith("raise:")


def _leaves(a, b, path=()):
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            yield from _leaves(a.get(k, "<absent>"), b.get(k, "<absent>"), (*path, k))
    elif a != b:
        yield path, a, b


def compare(stock: dict, fork: dict, label: str) -> list[str]:
    problems = []
    assert set(stock) == set(fork), (sorted(stock), sorted(fork))
    for case in sorted(stock):
        s, f = stock[case], fork[case]
        kind = case.split("@")[0] + ("@2" if "@" in case else "")
        for side, name in ((s, "stock"), (f, "fork")):
            if "harness_error" in side["obs"]:
                problems.append(f"{label}/{case}: harness error under {name}:\n{side['obs']['harness_error']}")
        if f["cuda_calls"]:
            problems.append(f"{label}/{case}: the fork called .cuda() {f['cuda_calls']} times (fails on CPU)")
        for key, want in f["obs"].items():  # the fork is right, whatever stock did
            if key.startswith("expect_") and f["obs"].get(key[7:]) != want:
                problems.append(f"{label}/{case}/{key[7:]}: fork {f['obs'].get(key[7:])!r}, expected {want!r}")
        for path, sv, fv in _leaves(s["obs"], f["obs"]):
            key = path[0]
            if key.startswith("expect_"):  # computed from the inputs, the same in both runs
                continue
            where = f"{label}/{case}/{'/'.join(path)}: stock {sv!r}, fork {fv!r}"
            if _is_raise(sv) and _is_raise(fv):
                if sv.split(":")[1].split("/")[0] not in fv.split(":")[1].split("/"):
                    problems.append(f"{where}: the fork's error is not a {sv.split(':')[1].split('/')[0]}")
            elif _is_raise(sv):
                if (kind, key) not in STOCK_FAILS:
                    problems.append(f"{where}: stock refuses, the fork accepts (not a documented addition)")
            elif _is_raise(fv):
                if (kind, key) not in STOCK_UNSAFE:
                    problems.append(f"{where}: stock accepts, the fork refuses")
            else:
                expect = f["obs"].get(f"expect_{key}", "<no expectation>")
                got = f["obs"].get(key)
                if got != expect:
                    problems.append(f"{where}: differs, and the fork's value is not the expected {expect!r}")
    return problems


def _run_one(tmp: pathlib.Path, mode: str, env: dict, group: str = "one", work: pathlib.Path | None = None) -> dict:
    out = tmp / f"{mode}-{group}.json"
    e = {**os.environ, **env}
    if not env["PADDLE_FSDP_FORK_DISABLE"]:
        e.pop("PADDLE_FSDP_FORK_DISABLE", None)
    proc = subprocess.run(
        [sys.executable, str(WORKER), group, str(work or tmp / mode), str(out)],
        env=e,
        cwd=str(tmp),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"{mode} worker failed:\n{proc.stderr[-4000:]}"
    return _results(tmp / f"{mode}-{group}.json.rank0", mode)


def _results(path: pathlib.Path, mode: str) -> dict:
    data = json.loads(path.read_text())
    assert data["fork_active"] == (mode == "fork"), f"{path}: the overlay is {'on' if data['fork_active'] else 'off'}"
    return data["results"]


def test_one_process_stock_use_cases(tmp_path):
    stock = _run_one(tmp_path, "stock", STOCK)
    fork = _run_one(tmp_path, "fork", FORK)
    assert len(stock) >= 25
    problems = compare(stock, fork, "one")
    assert not problems, "\n".join(problems)


def _run_two(tmp: pathlib.Path, mode: str, env: dict) -> dict:
    out = tmp / f"{mode}.json"
    e = dict(env) if env["PADDLE_FSDP_FORK_DISABLE"] else {}
    run_launch(WORKER, 2, ["two", str(tmp / mode), str(out)], env=e, log_dir=tmp / f"log-{mode}", timeout=300)
    ranks = [_results(tmp / f"{mode}.json.rank{r}", mode) for r in range(2)]
    return {f"{case}@rank{r}": ranks[r][case] for r in range(2) for case in ranks[r]}


def test_two_rank_stock_use_cases(tmp_path):
    stock = _run_two(tmp_path, "stock", STOCK)
    fork = _run_two(tmp_path, "fork", FORK)
    problems = compare(stock, fork, "two")
    # the checkpoints stock wrote on 2 ranks, read in one process by stock and by the fork
    reload_fork = _run_one(tmp_path, "fork", FORK, "reload", tmp_path / "stock")
    problems += compare(_run_one(tmp_path, "stock", STOCK, "reload", tmp_path / "stock"), reload_fork, "2->1")
    for case in ("tp_checkpoint_in_one_process", "dist_tensor_checkpoint_in_one_process"):
        obs = reload_fork[case]["obs"]
        assert obs["load"] == "None" and obs["loaded"] == obs["expect_loaded"], (case, obs)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    "stock_obs,fork_obs,ok",
    [
        ({"load": "raise:KeyError/LookupError"}, {"load": "raise:MissingKeyError/KeyError/LookupError"}, True),
        ({"load": "raise:KeyError/LookupError"}, {"load": "raise:ShapeMismatchError/RuntimeError"}, False),
        ({"load": "None"}, {"load": "raise:ValueError"}, False),
        ({"loaded": {"w": "a"}}, {"loaded": {"w": "b"}, "expect_loaded": {"w": "a"}}, False),
        ({"loaded": {"w": "b"}}, {"loaded": {"w": "b"}, "expect_loaded": {"w": "a"}}, False),
        ({"loaded": {"w": "a"}}, {"loaded": {"w": "b"}, "expect_loaded": {"w": "b"}}, True),
    ],
)
def test_comparator_catches_differences(stock_obs, fork_obs, ok):
    res = compare({"c": {"obs": stock_obs, "cuda_calls": 0}}, {"c": {"obs": fork_obs, "cuda_calls": 0}}, "x")
    assert (not res) == ok, res
