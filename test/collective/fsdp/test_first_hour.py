"""What a new user met in the first hour (#53), each fixed and kept so: a refused load names the same keys on every
rank; a path that is a file says so, on load and on save; import-stock and verify report the same bytes; the
optimizer-mismatch message reads as English; diff compares parts of a checkpoint (--only).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import paddle
import paddle.distributed.fsdp.checkpoint as ck
import pytest
import safetensors.numpy as stnp
from _results import assert_case_ok
from launch_util import LaunchResult, run_launch
from paddle.distributed.fsdp.checkpoint.errors import TargetNotADirectoryError
from paddle.distributed.fsdp.tools.cli import main as cli_main

TEST_DIR = Path(__file__).resolve().parent
MISMATCH_WORKER = TEST_DIR / "workers" / "mismatch_ranks.py"
NPROC = 2


def _cli(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = cli_main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out, out.err


# ------------------------------------------------------------------------------- the same error on every rank


class SeedView:
    """One seed's reports out of the launch that ran both seeds, read as that seed's launch alone would be."""

    def __init__(self, run: LaunchResult, seed: int):
        self.run, self.seed = run, str(seed)

    def result(self, rank: int) -> dict:
        return self.run.result(rank)[self.seed]


@pytest.fixture(scope="module")
def mismatch_run(tmp_path_factory) -> LaunchResult:
    """Both seeds in one 2-rank launch (each in a directory of its own)."""
    root = tmp_path_factory.mktemp("mismatch")
    return run_launch(MISMATCH_WORKER, NPROC, [str(root / "work"), "0,1"], log_dir=root / "logs")


@pytest.mark.parametrize("seed", [0, 1])
def test_a_refused_load_names_the_same_keys_on_every_rank(mismatch_run, seed):
    result = SeedView(mismatch_run, seed)
    for case in ("fsdp_load", "plain_load", "each_rank"):
        assert_case_ok(result, case, NPROC)
        seen = [result.result(r)["figures"][case] for r in range(NPROC)]
        assert len(set(seen)) == 1, f"{case}: ranks saw different errors:\n" + "\n".join(seen)
    figures = result.result(0)["figures"]
    changed = figures["fsdp_load_changed"]
    for case in ("fsdp_load", "plain_load"):
        assert figures[case].startswith("ShapeMismatchError"), figures[case]
        named = set(re.findall(r"'layers\.(\d+)\.", figures[case]))
        assert named and named <= {str(i) for i in changed} | {str(i + 1) for i in changed}, figures[case]
    # rank r asked for k{r} wrongly: one message on both ranks, naming both keys and the ranks
    each = figures["each_rank"]
    assert "'k0'" in each and "'k1'" in each and "rank 1" in each, each


# ------------------------------------------------------------------------------- paths that are files


def test_loading_a_file_says_it_is_a_file(tmp_path, capsys):
    f = tmp_path / "ckpt"
    f.write_bytes(b"not a checkpoint")
    for call in (
        lambda: ck.load_state_dict({"w": paddle.zeros([2])}, str(f)),
        lambda: ck.load_full_state_dict(str(f)),
    ):
        with pytest.raises(ck.NotACheckpointError, match="it is a file, not a checkpoint directory"):
            call()
    (problem,) = ck.verify_checkpoint(str(f))
    assert problem.startswith("NotACheckpointError") and "it is a file" in problem, problem
    with pytest.raises(ck.NotACheckpointError, match="no such directory"):
        ck.load_full_state_dict(str(tmp_path / "absent"))
    for command in ("verify", "inspect"):
        rc, _, err = _cli(capsys, command, f)
        assert rc == 2 and "it is a file" in err and "no such directory" not in err, err


@pytest.mark.parametrize("kind", ["file", "fifo", "symlink_to_file"])
def test_saving_onto_a_file_is_a_named_error_and_leaves_it(tmp_path, kind):
    target = tmp_path / "ckpt"
    if kind == "file":
        target.write_bytes(b"keep me")
    elif kind == "fifo":
        os.mkfifo(target)
    else:
        (tmp_path / "real").write_bytes(b"keep me")
        target.symlink_to(tmp_path / "real")
    with pytest.raises(TargetNotADirectoryError, match=r"cannot save to .*ckpt: it is (a file|not a directory)"):
        ck.save_state_dict({"w": paddle.ones([3])}, str(target))
    assert issubclass(TargetNotADirectoryError, ck.CheckpointError)
    if kind != "fifo":
        assert target.read_bytes() == b"keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["ckpt"] + (["real"] if kind == "symlink_to_file" else [])
    )


# ------------------------------------------------------------------------------- the same bytes in every report


def _sizes(line: str) -> tuple[str, str]:
    """(tensor bytes, bytes on disk) as the tool printed them."""
    m = re.search(r"tensors \(([^)]+)\).*data file\(s\) \(([^)]+) on disk\)", line)
    assert m, line
    return m.group(1), m.group(2)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_import_stock_and_verify_report_the_same_bytes(tmp_path, capsys, seed):
    from paddle.distributed.fsdp.tools.progress import human_bytes

    rng = np.random.default_rng(seed)
    src = tmp_path / "st"
    src.mkdir()
    dtypes = [np.float32, np.float16, np.int64, np.float64]
    tensors = {
        f"t{i}": rng.standard_normal(tuple(rng.integers(1, 9, size=rng.integers(1, 4)))).astype(dtypes[i % 4])
        for i in range(int(rng.integers(2, 7)))
    }
    stnp.save_file(tensors, str(src / "model.safetensors"))
    out = tmp_path / "ours"
    rc, imported, _ = _cli(capsys, "import-stock", src, out)
    assert rc == 0, imported
    rc, verified, _ = _cli(capsys, "verify", out)
    assert rc == 0 and verified.startswith("OK:"), verified
    assert _sizes(imported) == _sizes(verified), (imported, verified)
    tensor_bytes = sum(a.nbytes for a in tensors.values())
    on_disk = sum(p.stat().st_size for p in out.rglob("*.safetensors"))
    assert _sizes(verified) == (human_bytes(tensor_bytes), human_bytes(on_disk)), (verified, tensor_bytes, on_disk)


# ------------------------------------------------------------------------------- messages


def test_optimizer_mismatch_message_reads_as_english(tmp_path):
    from paddle.distributed.fsdp import FullyShardFusion

    paddle.seed(3)
    model = paddle.nn.Linear(4, 4)
    fsdp = FullyShardFusion(model)
    fsdp.save_checkpoint(str(tmp_path / "ckpt"))  # no optimizer
    for opt_cls in (paddle.optimizer.AdamW, paddle.optimizer.SGD):
        opt = opt_cls(parameters=model.parameters())
        with pytest.raises(ck.StateDictMismatchError) as info:
            fsdp.load_checkpoint(str(tmp_path / "ckpt"), optimizer=opt)
        msg = str(info.value)
        assert f"an optimizer ({opt_cls.__name__}) was given" in msg, msg
        assert not re.search(r"\ba [AEIOU]", msg), msg


def test_memory_tier_guide_says_a_save_returns_at_once():
    text = (TEST_DIR.parents[2] / "docs" / "memory-tier.md").read_text()
    assert "A save blocks like an async save" not in text
    assert "A save returns at once, as an async save does" in text


# ------------------------------------------------------------------------------- diff --only


def test_diff_parts_in_the_parser_are_the_tools(capsys):
    from paddle.distributed.fsdp.tools.cli_parser import DIFF_PARTS
    from paddle.distributed.fsdp.tools.diff_cmd import PARTS

    assert DIFF_PARTS == PARTS


@pytest.fixture(scope="module")
def round_trip(tmp_path_factory):
    """A 2-rank FSDP checkpoint with AdamW state, and its to-hf -> from-hf round trip (weights only)."""
    from test_tools import TO_HF_RULES, WORKER, write_json

    work = tmp_path_factory.mktemp("rt")
    result = run_launch(WORKER, NPROC, ["save", str(work)], log_dir=tmp_path_factory.mktemp("rt_logs"))
    assert_case_ok(result, "save", NPROC)
    ckpt = work / "fsdp_ckpt"
    rules = write_json(work / "rules.json", TO_HF_RULES)
    assert cli_main(["to-hf", str(ckpt), str(work / "hf"), "--rules", str(rules)]) == 0
    assert cli_main(["from-hf", str(work / "hf"), str(work / "back")]) == 0
    return ckpt, work / "back"


def test_diff_only_model_of_a_round_trip_is_identical(round_trip, capsys):
    ckpt, back = round_trip
    rc, out, _ = _cli(capsys, "diff", ckpt, back)
    missing = [line for line in out.splitlines() if line.strip().startswith("MISSING")]
    assert rc == 1 and missing and all(line.endswith("[optimizer] only in A") for line in missing), out
    rc, out, _ = _cli(capsys, "diff", ckpt, back, "--only", "model")
    assert rc == 0 and out.splitlines()[-1].startswith("IDENTICAL"), out
    assert "[optimizer]" not in out and "MISSING" not in out
    rc, out, _ = _cli(capsys, "diff", ckpt, back, "--only", "model", "--json")
    report = json.loads(out)
    roles = {k["role"] for k in report["keys"]}
    assert rc == 0 and roles <= {"model", "buffer"} and report["keys"] and report["values"] == {}, roles
    rc, out, _ = _cli(capsys, "diff", ckpt, back, "--only", "optimizer", "--json")
    report = json.loads(out)
    assert rc == 1 and {k["role"] for k in report["keys"]} == {"optimizer"}
    assert {k["status"] for k in report["keys"]} == {"missing"} and len(report["keys"]) == len(missing)
    rc, out, _ = _cli(capsys, "diff", ckpt, back, "--only", "values", "--json")
    report = json.loads(out)
    assert report["keys"] == [] and report["values"], report  # the optimizer class is in A only
    rc, out, _ = _cli(capsys, "diff", ckpt, ckpt, "--only", "model,optimizer,values")
    assert rc == 0 and "IDENTICAL" in out


@pytest.mark.parametrize("bad", ["", "weights", "model,", "model,bogus"])
def test_diff_only_refuses_unknown_parts(round_trip, capsys, bad):
    ckpt, back = round_trip
    rc, _, err = _cli(capsys, "diff", ckpt, back, "--only", bad)
    if bad == "model,":  # an empty item after a comma is ignored
        assert rc == 0, err
        return
    assert rc == 2 and "choose from model, optimizer, values" in err, err


# ------------------------------------------------------------------------------- the README's demo


def test_the_demo_leaves_no_checkpoint_behind(tmp_path):
    """README's demo, as its Quick start runs it: trains, reloads identically, and removes its temporary checkpoint
    (it used to leave a fixed /tmp/fsdp_demo_checkpoint)."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    demo = TEST_DIR.parents[2] / "examples" / "demo_train.py"
    result = run_launch(demo, NPROC, log_dir=tmp_path / "logs", env={"TMPDIR": str(scratch)})
    log = result.worker_logs[0]
    assert "reloaded checkpoint at step 10: parameters identical = True" in log, log[-3000:]
    saved = re.search(r"saved checkpoint to (\S+)", log)
    assert saved and saved.group(1).startswith(str(scratch)), log[-3000:]
    assert not [p.name for p in scratch.iterdir() if p.name.startswith("fsdp_demo_")]
