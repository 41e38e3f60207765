"""Power loss during the memory tier's writes to disk (#54): its persist (every ``persist_every``-th save written
as ``durable_root/step_N`` by a background thread, ``keep_last`` pruning) and ``flush-memory`` (after a crash, the
newest step held in host memory written from one process), replayed as POSIX-minimal crash states
(crash_explore.py) and, where root, /dev/fuse and loop devices exist, as ext4 block states.

A power loss also takes host memory (``/dev/shm``): the memory root lives outside the recorded tree, so every
state is resumed as a restarted job would be, by a fresh ``MemoryTier.restore()`` with an empty memory root.
Per state: it restores step N-1 or N bit for bit (model, optimizer, LR, extra state; never older than a save
that had returned), and every directory with a commit record passes ``verify_checkpoint``. Mutations (a data
file not fsynced) must make some state fail.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import time

import crash_explore
import paddle.distributed.fsdp.checkpoint as ck
import pytest
from memtier_util import small_fsdp, state_bytes, train_and_save, train_step
from paddle.distributed.fsdp.checkpoint.format.metadata import COMMIT_FILE
from paddle.distributed.fsdp.memtier import MemoryTier
from paddle.distributed.fsdp.memtier.flush import flush_memory

pytestmark = pytest.mark.power_loss

LEFTOVER = re.compile(r"^\.trash-|\.tmp-")
POSIX_BUDGET, BLOCK_BUDGET = 100, 40


def _memory_root(base: str) -> str:
    """Host memory: outside the recorded tree (lost at a power loss)."""
    return os.path.abspath(base) + "-memory"


def _tier(fsdp, opt, base: str, memory_root: str, persist_every: int, **kw) -> MemoryTier:
    return MemoryTier(fsdp, opt, durable_root=os.path.join(base, "run", "durable"), memory_root=memory_root,
                      persist_every=persist_every, keep_last=1, job_id="j", **kw)  # fmt: skip


def _keep_wants(base: str, wants: dict) -> None:
    with open(os.path.abspath(base) + "-wants.pkl", "wb") as f:
        pickle.dump(wants, f)


def _memtier_persist(base: str, rec, mp) -> None:
    """Two persisted saves (persist_every=1, keep_last=1) into a durable root that does not exist yet."""
    model, fsdp, opt = small_fsdp(1)
    tier = _tier(fsdp, opt, base, _memory_root(base), 1)
    wants = {}
    for step in (1, 2):
        wants.update(train_and_save(model, fsdp, opt, tier, (step,)))
        crash_explore.join_background_deletes()
        rec.mark(f"persisted{step}")
    tier.close(remove=False)
    _keep_wants(base, wants)


def _memtier_flush(base: str, rec, mp) -> None:
    """persist_every=2: step 2 persisted by the tier, step 3 in host memory only; the job dies (its copies stay
    in the memory root) and ``flush_memory`` writes step 3 (keep_last=1: step 2 pruned)."""
    model, fsdp, opt = small_fsdp(1)
    tier = _tier(fsdp, opt, base, _memory_root(base), 2)
    wants = train_and_save(model, fsdp, opt, tier, (1, 2))
    crash_explore.join_background_deletes()
    rec.mark("persisted2")
    train_step(model, opt)
    tier.save(3, extra_state={"step": 3})
    tier.wait()
    wants[3] = (state_bytes(fsdp, opt), opt.get_lr())
    tier.close(remove=False)  # a crashed job: its memory copies stay
    got = flush_memory([_memory_root(base)], os.path.join(base, "run", "durable"), keep_last=1)
    assert got.step == 3 and got.path is not None, got
    crash_explore.join_background_deletes()
    rec.mark("flushed3")
    _keep_wants(base, wants)


STEPS = {_memtier_persist: {"persisted1": 1, "persisted2": 2}, _memtier_flush: {"persisted2": 2, "flushed3": 3}}


def check_state(wants_file: str, at_least: int | None, root: str) -> int | None:
    """The invariants of one crash state at ``root``: a restarted job's restore (empty memory root) gives a saved
    step bit for bit, at least ``at_least``; every directory with a commit record passes verify. Returns the step
    restored (None: a fresh start)."""
    with open(wants_file, "rb") as f:
        wants = pickle.load(f)
    durable = os.path.join(root, "run", "durable")
    _m, fsdp, opt = small_fsdp(7)  # other weights than the run's: a tensor the restore misses shows
    tier = _tier(fsdp, opt, root, root + "-memory-after", 1, persist_on_restore=False)
    try:
        got = tier.restore()
    finally:
        tier.close()
        shutil.rmtree(root + "-memory-after", ignore_errors=True)
    if at_least is not None:
        assert got is not None, f"a fresh start after the save of step {at_least} had returned"
    if got is not None:
        assert got.sources == ["storage"], got.sources
        assert got.step in wants and (at_least is None or got.step >= at_least), (got.step, at_least)
        want, lr = wants[got.step]
        mine = state_bytes(fsdp, opt)
        assert [k for k in want if mine[k] != want[k]] == [], f"step {got.step} restored with other bytes"
        assert opt.get_lr() == lr and dict(got) == {"step": got.step}, (opt.get_lr(), lr, dict(got))
    if os.path.isdir(durable):
        for name in os.listdir(durable):
            d = os.path.join(durable, name)
            if not LEFTOVER.search(name) and os.path.isfile(os.path.join(d, COMMIT_FILE)):
                problems = ck.verify_checkpoint(d)
                assert not problems, f"{name} has a commit record but fails verify: {problems[:3]}"
    return None if got is None else got.step


def _checker(base: str):
    wants_file = os.path.abspath(base) + "-wants.pkl"
    return lambda at_least, root: check_state(wants_file, at_least, root)


@pytest.mark.parametrize("scenario", [_memtier_persist, _memtier_flush], ids=["persist", "flush_memory"])
def test_every_posix_crash_state_of_the_memory_tier_restores(scenario, tmp_path, monkeypatch):
    base = str(tmp_path / "fs")
    os.makedirs(base)
    trace = crash_explore.record(base, monkeypatch, scenario)
    n = crash_explore.budget(POSIX_BUDGET)
    t0 = time.monotonic()
    checked, failures = crash_explore.explore_posix(trace, str(tmp_path / "states"), _checker(base), STEPS[scenario],
                                                    crash_explore.seed(), n, stop_at_first=False)  # fmt: skip
    print(f"{scenario.__name__}: {len(trace.ops)} operations, {len(trace.fsyncs)} fsyncs, {checked} crash states "
          f"in {time.monotonic() - t0:.1f} s")  # fmt: skip
    assert checked >= n
    assert not failures, crash_explore.report(failures)


NEWEST = {_memtier_persist: "step_00000002", _memtier_flush: "step_00000003"}


@pytest.mark.parametrize("scenario", [_memtier_persist, _memtier_flush], ids=["persist", "flush_memory"])
def test_memory_tier_without_the_data_fsync_fails_a_state(scenario, tmp_path, monkeypatch):
    """The last save (the second persist; the flush) with its data file's fsync removed: the old step is pruned
    while the new one's data is not durable, and some state restores nothing or garbage (the test can fail)."""
    base = str(tmp_path / "fs")
    os.makedirs(base)
    newest = NEWEST[scenario]
    skip = lambda path: newest in path and path.endswith("0_0.safetensors")  # noqa: E731
    trace = crash_explore.record(base, monkeypatch, scenario, skip_fsync=skip)
    checked, failures = crash_explore.explore_posix(trace, str(tmp_path / "states"), _checker(base), STEPS[scenario],
                                                    crash_explore.seed(), crash_explore.budget(POSIX_BUDGET),
                                                    stop_at_first=True)  # fmt: skip
    assert failures, f"no failing state among {checked}"
    print(
        f"{scenario.__name__} without the data fsync: failing state after {checked}: {crash_explore.report(failures)}"
    )
    assert any("0_0.safetensors" in x for x in failures[0][1]), crash_explore.report(failures)


@pytest.mark.skipif(crash_explore.block_missing() is not None, reason=str(crash_explore.block_missing()))
@pytest.mark.parametrize("scenario", [_memtier_persist, _memtier_flush], ids=["persist", "flush_memory"])
def test_every_block_crash_state_of_the_memory_tier_restores_on_ext4(scenario, tmp_path):
    """The same saves on ext4 over the recording disk (block_crash.py): each sampled state mounts (journal
    recovery) and holds the invariants of ``check_state``."""
    work = str(tmp_path)
    recorded = crash_explore.record_block(work, __name__, scenario.__name__)
    base = os.path.join(work, "mnt")
    n = crash_explore.budget(BLOCK_BUDGET)
    checked, failures, dt = crash_explore.explore_block(work, recorded, _checker(base), STEPS[scenario],
                                                        crash_explore.seed(), n, stop_at_first=False)  # fmt: skip
    log, start = recorded[0], recorded[1]
    print(f"ext4 {scenario.__name__}: {len(log) - start} block records ({sum(r[0] for r in log[start:])} flushes), "
          f"{checked} crash states in {dt:.0f} s")  # fmt: skip
    assert checked >= n
    assert not failures, crash_explore.report(failures)
