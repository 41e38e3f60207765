"""A frozen rank or store never hangs a save (issue #50 item 1): SIGSTOP at every stage of the save's stage table.

Why: on clusters a rank more often freezes than dies (a hung kernel, a paused container, a stalled NFS client):
alive, silent, its sockets open. Rank 0 also serves the job's TCP store, through which every message of a save
goes; paddle's store client waited forever for a frozen store's reply, so a save whose coordinator froze never
ended. Here two 2-rank launches (coordinator rank 0, which also serves the store, and coordinator rank 1) each
run 16 saves; each save stops one process with SIGSTOP at one stage (docs/save-load.md, crash safety), the
coordinator and the other rank in turn, so every stage sees a frozen coordinator, a frozen non-coordinator and a
frozen store host (rank 0: the coordinator in the first launch, not in the second). The live rank's save must
end within the lease plus a margin: with SaveFailedError naming the frozen rank, or, where the frozen rank is no
longer needed (its data handed over; the checkpoint committed), with success. The frozen process is then
resumed (SIGCONT, a pause that ends) and must end its save too, with success or a SaveFailedError; at the end
every committed step verifies complete (a resumed coordinator never commits without the live rank's data).
"""

from __future__ import annotations

import json
import os
import re
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import fault_storage
import pytest
from launch_util import run_launch

TEST_DIR = Path(__file__).resolve().parent
WORKER = TEST_DIR / "workers" / "frozen_save.py"
LEASE = 2.0  # PADDLE_FSDP_CKPT_HEARTBEAT_LEASE of the launches (store calls: a 0.67 s deadline)
MARGIN = 20.0  # on top of the lease: a loaded 2-core machine
STORE_HOST = 0
OK = "ok"


def expected(stage: str, frozen: int, coordinator: int) -> str:
    """The live rank's outcome: OK, or a regex its SaveFailedError must match."""
    if frozen == coordinator:
        if stage == "before_prune":  # `latest` moved: the live rank reads the commit back from storage
            return OK
        named = rf"rank {frozen} stopped responding"
        return rf"did not move the 'latest' pointer.*{named}" if stage == "after_rename" else named
    if stage in ("before_data", "mid_data"):
        return rf"rank {frozen} stopped responding"
    if frozen != STORE_HOST:  # handed over: the coordinator commits without it
        return OK
    if stage == "after_data":  # the store froze right after the frozen rank's hand-over: read in time, or not
        return rf"{OK}|rank {STORE_HOST} stopped responding|served by rank {STORE_HOST}"
    if stage == "before_metadata":  # the check for late failures before COMMIT cannot be made: abort
        return rf"served by rank {STORE_HOST}|rank {STORE_HOST} stopped responding"
    return OK  # that check was made: the coordinator commits, its flags to the store are best effort


CELLS = [(stage, frozen) for frozen in (0, 1) for stage in fault_storage.STAGES]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    base = tmp_path_factory.mktemp("frozen")

    def one(coordinator: int):
        work = base / f"coordinator{coordinator}"
        (work / "fault").mkdir(parents=True)
        spec = {
            "root": str(work / "root"),
            "coordinator": coordinator,
            "cells": [{"stage": s, "frozen": f} for s, f in CELLS],
        }
        (work / "spec.json").write_text(json.dumps(spec))
        env = {
            "PADDLE_FSDP_CKPT_HEARTBEAT_LEASE": str(LEASE),
            "PADDLE_FSDP_CKPT_COMMIT_TIMEOUT": "600",  # the lease, never this timeout, must end every wait
            fault_storage.DIR_ENV: str(work / "fault"),
        }
        try:
            return run_launch(
                WORKER, 2, [str(work / "spec.json")], timeout=400, env=env, log_dir=work / "logs", check=False
            )
        finally:  # whatever happened, no process stays frozen
            for name in os.listdir(work / "fault"):
                if name.startswith("pid."):
                    try:
                        os.kill(int((work / "fault" / name).read_text()), signal.SIGKILL)
                    except (OSError, ValueError):
                        pass

    with ThreadPoolExecutor(2) as pool:
        return dict(zip((0, 1), pool.map(one, (0, 1))))


@pytest.mark.parametrize("coordinator", [0, 1], ids=["coordinator-is-store-host", "coordinator-is-not"])
def test_a_frozen_rank_or_store_ends_every_save_by_the_lease(coordinator, runs):
    res = runs[coordinator]
    tail = f"logs in {res.log_dir}"
    assert res.returncode == 0, f"launch exited {res.returncode}; {tail}"
    reports = {r: res.result(r) for r in (0, 1)}
    assert reports[STORE_HOST]["store_host"] and not reports[1 - STORE_HOST]["store_host"], reports
    wrong = []
    for i, (stage, frozen) in enumerate(CELLS):
        live = reports[1 - frozen]["cells"][i]
        after = reports[frozen]["cells"][i]
        assert (live["stage"], live["frozen"]) == (stage, frozen)
        want = expected(stage, frozen, coordinator)
        got = live["outcome"]
        if want == OK:
            good = got == OK
        else:
            good = bool(re.search(want, got if got.startswith("SaveFailedError") else "", re.S))
        if not good or live["seconds"] >= LEASE + MARGIN or live["resumed"] is None:
            wrong.append(
                f"{stage}/frozen {frozen}: live rank {1 - frozen} wanted /{want}/ got {got[:400]!r} "
                f"after {live['seconds']:.1f} s (resumed {live['resumed']})"
            )
        if live["problems"]:  # committed (by the live coordinator, or by a resumed one after the live rank gave up)
            wrong.append(f"{stage}/frozen {frozen}: step {i + 2} committed but incomplete: {live['problems']}")
        if live["outcome"] == OK and not live["committed"]:
            wrong.append(f"{stage}/frozen {frozen}: the save returned, but step {i + 2} is not committed")
        # the resumed rank ended its save too: success, or a named SaveFailedError (never another error)
        if not (after["outcome"] == OK or after["outcome"].startswith("SaveFailedError")):
            wrong.append(f"{stage}/frozen {frozen}: resumed rank {frozen} ended with {after['outcome'][:600]!r}")
    assert not wrong, "\n".join(wrong) + f"\n{tail}"
    for r in (0, 1):
        final = reports[r]["final"]
        assert isinstance(final, dict) and not final["problems"], (r, final)
        assert final["latest"] == final["steps"][-1], final


def test_freeze_spec_is_parsed(monkeypatch):
    monkeypatch.setenv(fault_storage.ENV, "before_commit:0:2:FREEZE")
    assert fault_storage._spec() == ("before_commit", 0, 2, "FREEZE")
    monkeypatch.setenv(fault_storage.ENV, "after_rename:1:1:FREEZE0")
    assert fault_storage._spec() == ("after_rename", 1, 1, "FREEZE0")
    monkeypatch.setenv(fault_storage.ENV, "after_rename:1:1:FREEZEX")
    with pytest.raises(ValueError, match="not an errno name"):
        fault_storage._spec()
