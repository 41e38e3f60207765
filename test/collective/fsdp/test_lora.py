"""LoRA-style fine-tuning under FSDP (issue #51): a frozen base with small trainable adapters.

Training equals one process at 1, 2 and 3 ranks; frozen parameters hold no gradient and no optimizer state.
"""

from __future__ import annotations

import os

import pytest
from _results import assert_case_ok
from launch_util import LaunchResult, beside_one_rank, run_launch

WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers")
TRAIN_CASES = ["parity_units", "parity_root", "frozen_hold_nothing"]


@pytest.fixture(scope="module")
def train_runs(tmp_path_factory):
    """The 1-rank launch beside the 2-rank one (CI time; they write nothing but their logs), then the 3-rank one."""

    logs = {n: tmp_path_factory.mktemp(f"lora{n}") for n in (1, 2, 3)}

    def train(n: int):
        return lambda: run_launch(os.path.join(WORKERS, "lora_train.py"), n, log_dir=logs[n])

    runs = dict(zip((1, 2), beside_one_rank(train(1), train(2))))
    runs[3] = train(3)()
    return runs


@pytest.mark.parametrize("nproc", [1, 2, 3])
@pytest.mark.parametrize("case", TRAIN_CASES)
def test_lora_training(train_runs, nproc, case):
    """Losses within 1e-5 of one process, frozen base bit-unchanged; no gradient or optimizer state for it."""
    assert_case_ok(train_runs[nproc], case, nproc)


# ---- checkpoints: trainable state plus a reference to the frozen base ------------------------------------------
CKPT = os.path.join(WORKERS, "lora_ckpt.py")
CKPT_CASES = ["contents", "refusal", "separate_base"]


class Phase:
    """One mode's report out of a launch that ran several (workers/lora_ckpt.py's ``MODE ARGS + MODE ARGS``): read
    as the launch of that mode alone would be (``result(rank)``)."""

    def __init__(self, run: LaunchResult, index: int):
        self.run, self.index = run, index

    def result(self, rank: int = 0) -> dict:
        return self.run.result(rank)["phases"][self.index]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    """One 2-rank launch (a launch's start-up costs more than each of these): the uninterrupted reference run of 6
    steps (no save; first, in a fresh process), the run saved at step 3 that the resumes start from, the cases."""
    root = tmp_path_factory.mktemp("lora_2ranks")
    args = ["train", root / "unused", "6", "99", "+", "train", root / "saved3", "3", "3", "+", "cases", root / "ckpt"]
    run = run_launch(CKPT, 2, args, log_dir=root / "logs")
    return {"reference": Phase(run, 0), "saved3": root / "saved3", "cases": Phase(run, 2)}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, two_ranks) -> dict:
    """One 1-rank launch: the cases, then the resume of the 2-rank run's step-3 checkpoint on 1 rank."""
    root = tmp_path_factory.mktemp("lora_1rank")
    run = run_launch(CKPT, 1, ["cases", root / "ckpt", "+", "resume", two_ranks["saved3"], "6"], log_dir=root / "logs")
    return {"cases": Phase(run, 0), "resumed": Phase(run, 1)}


@pytest.fixture(scope="module")
def ckpt_cases(one_rank, two_ranks) -> dict:
    return {1: one_rank["cases"], 2: two_ranks["cases"]}


@pytest.fixture(scope="module")
def reference_2ranks(two_ranks) -> Phase:
    """An uninterrupted 2-rank run of 6 steps (no save)."""
    return two_ranks["reference"]


@pytest.mark.parametrize("nproc", [1, 2])
@pytest.mark.parametrize("case", CKPT_CASES)
def test_lora_checkpoint(ckpt_cases, nproc, case):
    """Default checkpoints hold no frozen tensor and a base reference; another base is refused by name on every
    rank; save_frozen=True restores the base; a base loaded separately plus the checkpoint is the trained model."""
    assert_case_ok(ckpt_cases[nproc], case, nproc)


def test_lora_under_hsdp(ckpt_cases, tmp_path):
    """HSDP (4 ranks: 2 replicas x 2 shards): frozen parameters hold no gradient or optimizer state; the checkpoint
    holds the adapters, their optimizer state, the resume state and the base reference (FSDP's fingerprint); a
    fresh HSDP model resumed from it continues bit for bit."""
    run = run_launch(CKPT, 4, ["hsdp", str(tmp_path / "ckpt")], log_dir=tmp_path / "logs")
    assert_case_ok(run, "hsdp", 4)
    assert run.result(0)["figures"]["fingerprint"] == ckpt_cases[2].result(0)["figures"]["fingerprint"]


def test_fingerprint_is_independent_of_world_size(ckpt_cases):
    prints = {(n, r): ckpt_cases[n].result(r)["figures"]["fingerprint"] for n in (1, 2) for r in range(n)}
    assert len(set(prints.values())) == 1 and None not in prints.values(), prints
    assert ckpt_cases[1].result(0)["figures"]["tensor_keys"] == ckpt_cases[2].result(0)["figures"]["tensor_keys"]


@pytest.mark.parametrize("nproc", [1, 3])
def test_resume_at_another_world_size(tmp_path, two_ranks, one_rank, reference_2ranks, nproc):
    """Saved at step 3 on 2 ranks, resumed on 1 and 3: losses and adapters within 1e-5 of the 2-rank run."""
    if nproc == 1:
        resumed = one_rank["resumed"]
    else:  # (resume only reads the checkpoint: both world sizes start from the same one)
        resumed = run_launch(CKPT, nproc, ["resume", two_ranks["saved3"], "6"], log_dir=tmp_path / "resume")
    want, got = reference_2ranks.result(0), resumed.result(0)
    assert got["resumed_at"] == 3
    assert max(abs(a - b) for a, b in zip(got["losses"], want["losses"])) <= 1e-5, (got["losses"], want["losses"])
    for key, values in want["values"].items():
        error = max(abs(a - b) for a, b in zip(got["values"][key], values))
        assert error <= 1e-5, f"{key} differs by {error:.2e}"


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory) -> dict:
    """Two 2-rank runs whose rank 1 is SIGKILLed in step 5: one saving checkpoints (from step 2 on), one saving to
    the memory tier after every step; then one 2-rank launch resuming both (each from its own root)."""
    root = tmp_path_factory.mktemp("lora_kill9")
    disk, memory = root / "disk", root / "memtier"
    crashed = {
        "disk": run_launch(CKPT, 2, ["train", disk, "6", "2", "5"], log_dir=root / "crash_disk", check=False),
        "memtier": run_launch(CKPT, 2, ["memtier", memory, "6", "5"], log_dir=root / "crash_memtier", check=False),
    }
    resumed = run_launch(CKPT, 2, ["resume", disk, "6", "+", "memtier", memory, "6"], log_dir=root / "resume")
    return {"crashed": crashed, "disk": Phase(resumed, 0), "memtier": Phase(resumed, 1)}


def test_resume_after_kill9_is_bit_exact(killed_and_resumed, reference_2ranks):
    """Rank 1 is SIGKILLed in step 5 (checkpoints of steps 3 and 4 committed); a 2-rank resume from the newest
    equals the uninterrupted run bit for bit: losses and every adapter."""
    assert killed_and_resumed["crashed"]["disk"].returncode != 0, "the killed run exited normally"
    want = reference_2ranks.result(0)
    for rank in (0, 1):
        got = killed_and_resumed["disk"].result(rank)
        assert got["resumed_at"] == 4, got["resumed_at"]
        assert got["losses"] == want["losses"], (got["losses"], want["losses"])
        assert got["digest"] == want["digest"]


def test_memory_tier_resume_after_kill9_is_bit_exact(killed_and_resumed, reference_2ranks):
    """LoRA saving to the memory tier after every step (nothing persisted): rank 1 is SIGKILLed in step 5; the
    relaunch restores from memory (the newest step complete on both ranks, the frozen base's fingerprint checked)
    and equals the uninterrupted run bit for bit."""
    assert killed_and_resumed["crashed"]["memtier"].returncode != 0, "the killed run exited normally"
    want = reference_2ranks.result(0)
    for rank in (0, 1):
        got = killed_and_resumed["memtier"].result(rank)
        assert got["resumed_at"] in (3, 4), got["resumed_at"]  # step 4's copy may still be in flight at the kill
        assert set(got["sources"]) == {"memory"}, got["sources"]
        assert got["losses"] == want["losses"], (got["losses"], want["losses"])
        assert got["digest"] == want["digest"]


# ---- exports: to-hf --merge-adapter, and one rank per export file ----------------------------------------------
MERGE_CASES = ["merged_logits", "merged_bit_equal", "wrong_base", "missing_base", "help"]


@pytest.fixture(scope="module")
def merge_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_merge")
    return run_launch(os.path.join(WORKERS, "lora_merge.py"), 2, [str(root / "run")], log_dir=root / "logs")


@pytest.mark.parametrize("case", MERGE_CASES)
def test_merge_adapter_cli(merge_run, case):
    """`to-hf --merge-adapter` of a LoRA checkpoint trained on 2 ranks: logits of the merged model within 1e-5 of
    the adapter model's; bit-equal tensors whether the base comes from the checkpoint (the Trainer's route),
    --base or the recorded source; another base refused (exit 2, FrozenBaseMismatchError) with nothing written;
    no base: FrozenBaseMissingError naming --base."""
    assert_case_ok(merge_run, case, 1)


def test_one_rank_writes_each_export_file(merge_run, tmp_path_factory):
    """The adapter export (save_model / save_hf_steps) called on both ranks: every file of the export was opened
    for writing or renamed into place by exactly one rank (recorded by an audit hook in each rank)."""
    written = {rank: set(merge_run.result(rank)["written"]) for rank in (0, 1)}
    out = merge_run.log_dir.parent / "run" / "exports" / "adapter"
    files = sorted(os.listdir(out))
    assert len(files) == 4, files  # two layouts: config + weights each
    for name in files:
        writers = [rank for rank in (0, 1) if f"adapter/{name}" in written[rank]]
        assert len(writers) == 1, (name, writers, written)
    both = written[0] & written[1]
    assert not both, f"files written by both ranks: {sorted(both)}"
