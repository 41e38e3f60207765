"""A wrapped model is still a paddle model: printing, state_dict, full parameters and persistable buffers."""

from __future__ import annotations

import os

import pytest
from _results import assert_case_ok
from launch_util import run_launch

WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers")
CASES = [
    "print_and_state_dict",
    "summon_writeback",
    "summon_rank0_only_and_errors",
    "full_state_dict",
    "buffers_checkpointed",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    script = os.path.join(WORKERS, "full_access.py")
    for n in (2, 1):  # the 1-rank run also loads the 2-rank run's checkpoint (buffers_elastic)
        work = tmp_path_factory.mktemp(f"full{n}")
        args = [str(work)] + ([str(out[2].workdir)] if n == 1 else [])
        out[n] = run_launch(script, n, args, log_dir=work / "logs")
        out[n].workdir = work
    work = tmp_path_factory.mktemp("full3")
    out[3] = run_launch(script, 3, [str(work), str(out[2].workdir), "--only-elastic"], log_dir=work / "logs")
    return out


@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("case", CASES)
def test_full_access(runs, nproc, case):
    """print(model) equals the unwrapped repr; state_dict()/set_state_dict() (and aliases) refuse sharded
    pieces naming the alternatives; summon_full_params gives the unwrapped state_dict, discards changes without
    writeback and scatters them with it; full_state_dict gathers one buffer at a time and loads into an
    unwrapped model; persistable buffers round-trip (low level and one call), rank 0's value wins when ranks
    differ (with a warning), non-persistable buffers stay out."""
    assert_case_ok(runs[nproc], case, nproc)


@pytest.mark.parametrize("nproc", [1, 3])
def test_buffers_restored_on_another_world_size(runs, nproc):
    """The 2-rank checkpoint (buffers that differed across ranks included) loads on 1 and 3 ranks: every
    buffer equals the saved value (rank 0's) on every rank, and every parameter equals the saved one."""
    assert_case_ok(runs[nproc], "buffers_elastic", nproc)


def test_tools_show_buffers_and_to_hf_leaves_them_out(runs, tmp_path, capsys):
    """inspect labels persistable buffers "buffer"; to-hf leaves them out unless --include-buffers."""
    import json

    import safetensors.numpy as stnp
    from paddle.distributed.fsdp.tools.cli import main as cli_main

    ckpt = runs[2].workdir / "buffers_one_call"
    assert cli_main(["inspect", str(ckpt), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    buffers = {k for k, t in info["tensors"].items() if t["role"] == "buffer"}
    assert buffers == {f"blocks.{i}.{name}" for i in range(3) for name in ("steps", "ema")}
    assert info["buffer_tensors"] == 6 and not any("scratch" in k for k in info["tensors"])
    exported = {}
    for flag in ([], ["--include-buffers"]):
        out = tmp_path / f"hf{len(flag)}"
        assert cli_main(["to-hf", str(ckpt), str(out), *flag]) == 0
        names = set()
        for f in out.glob("*.safetensors"):
            names |= set(stnp.load_file(str(f)))
        exported[bool(flag)] = names
    assert not exported[False] & buffers and "head.weight" in exported[False]
    assert exported[True] == exported[False] | buffers
