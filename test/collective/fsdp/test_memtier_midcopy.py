"""One rank killed while copying its state into memory (the others' copies complete): the restart agrees on the
newest step EVERY rank can restore, with real processes (two simulated nodes, SIGKILL).

TinyLM (dropout, AdamW + StepDecay), a save per step, persisted every 4th. At the save of step 6 rank 1 is killed
half-way through copying its state into its slot (its own copy stays marked "writing"); rank 0's own copy of step
6 completes, its exchange with the dead rank 1 fails with PeerTransferError (the copy it holds for rank 1, step 5,
stays valid: it is marked "writing" only once a new copy arrives), then it is killed too. On restart: rank 0 has
step 6 (own) and 5 (held by rank 1), rank 1 only step 5 (held by rank 0), storage step 4: every rank resumes from
step 5, both from their peer's copy, and the run ends bit for bit equal to the uninterrupted one (records, RNG, LR).
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from nodes import launch_nodes, tails

TOTAL, KILL = 8, 6
ENV = {"FSDP_TEST_MEMTIER_MODELS": "tiny", "FSDP_TEST_MEMTIER_PEER_TIMEOUT": "5"}


def _ok(launched, log_dir) -> dict:
    codes, results = launched
    assert codes == [0, 0] and sorted(results) == [0, 1], f"exit {codes}, results {results}\n{tails(log_dir)}"
    return results


def test_one_rank_killed_mid_copy_resumes_from_the_common_step(tmp_path):
    roots = [Path(f"/dev/shm/fsdp-memtier-midcopy-{os.getpid()}-node{i}") for i in range(2)]
    ref_roots = [Path(f"/dev/shm/fsdp-memtier-midcopy-{os.getpid()}-ref-node{i}") for i in range(2)]
    try:
        # the uninterrupted reference runs beside the crashed run (CI time: one start-up less to wait for); its
        # own memory roots and work directory, nothing shared with the crashed run
        with ThreadPoolExecutor(1) as pool:
            ref_run = pool.submit(launch_nodes, tmp_path / "log-ref", "memtier.py",
                                  ["run", str(tmp_path / "ref"), str(TOTAL)], ref_roots, extra_env=[ENV, ENV])  # fmt: skip
            log = tmp_path / "log-crash"
            codes, _ = launch_nodes(log, "memtier.py", ["run", str(tmp_path), str(TOTAL), "--kill-mid-copy", str(KILL)],
                                    roots, extra_env=[ENV, ENV])  # fmt: skip
            ref = _ok(ref_run.result(), tmp_path / "log-ref")
        assert all(c != 0 for c in codes), f"the run did not die: {codes}\n{tails(log)}"
        rank0 = (log / "node0" / "workerlog.0").read_text(errors="replace")
        assert "save failed as expected: MemoryTierError" in rank0, tails(log)  # named: the partner is gone
        assert "rank 1 did not connect" in rank0 or "rank 1 died" in rank0, tails(log)
        for i, root in enumerate(roots):
            shutil.copytree(root, tmp_path / "bak" / f"node{i}")
        shutil.copytree(tmp_path / "tiny" / "durable", tmp_path / "bak" / "tiny" / "durable")
        log = tmp_path / "log-restore"
        got = _ok(launch_nodes(log, "memtier.py", ["restore", str(tmp_path), str(TOTAL), "memory"], roots,
                               extra_env=[ENV, ENV]), log)  # fmt: skip
        for r in (0, 1):
            assert "error" not in got[r].get("memory", {}), f"rank {r}:\n{got[r]['memory']['error']}"
            res = got[r]["memory/tiny"]
            assert (res["step"], res["sources"], res["extra"]) == (KILL - 1, ["peer", "peer"], {"data_position": 40})
            assert res["differ"] == [], f"rank {r}: records differ from the uninterrupted run"
            assert (res["rng"], res["lr"]) == (ref[r]["tiny"]["rng"], ref[r]["tiny"]["lr"]), (res, ref[r]["tiny"])
        restore_log = (log / "node1" / "workerlog.0").read_text(errors="replace")
        assert "was being written" in restore_log, "rank 1's interrupted own copy was not reported"
    finally:
        for root in roots + ref_roots:
            shutil.rmtree(root, ignore_errors=True)
