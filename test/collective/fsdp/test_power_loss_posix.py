"""Power loss at the syscall level (#54): every POSIX-minimal crash state of real one-process saves, replayed and
loaded (posix_crash.py: what a state is, how it is recorded and replayed).

Per state: the checkpoint a resume picks loads bit-exactly as one of the steps saved (never a mix), a save that
had returned is never lost, every directory with a commit record passes ``verify_checkpoint``, and a file of
another tool kept in a checkpoint directory survives. Mutations (a missing fsync, publish before the commit
record) must make some state fail: the test can fail. The seed is printed; PADDLE_FSDP_CRASH_SEED replays one.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import paddle
import paddle.distributed.fsdp.checkpoint as ck
import posix_crash
import pytest
import strace_summary
from paddle.distributed.fsdp.checkpoint import writer
from paddle.distributed.fsdp.checkpoint.format.metadata import COMMIT_FILE
from paddle.distributed.fsdp.checkpoint.io.local import LocalStorage

pytestmark = pytest.mark.power_loss

BUDGET = 1000
LEFTOVER = re.compile(r"^\.trash-|\.old-|\.tmp-")
NOTES = b"notes of another tool\n"


def _state(step: int) -> dict:
    rng = np.random.default_rng(step)
    return {
        "w": paddle.to_tensor(rng.standard_normal(1500).astype("float32")),
        "b": paddle.to_tensor(rng.integers(0, 1 << 30, 64).astype("int64")),
    }


def _join_background_deletes() -> None:
    for th in threading.enumerate():
        if th.name in ("ckpt-rm-old", "ckpt-prune"):
            th.join()


def _record(tmp_path, monkeypatch, scenario, skip_fsync=None, exchange=True) -> posix_crash.Trace:
    base = tmp_path / "fs"
    base.mkdir()
    if scenario not in (_manager, _manager_async):
        (base / "one").mkdir()
        (base / "one" / "notes.txt").write_bytes(NOTES)
    with monkeypatch.context() as mp:
        rec = posix_crash.Recorder(str(base), mp, skip_fsync, exchange)
        scenario(str(base), rec, mp)
    trace = posix_crash.Trace(rec)
    trace.check_complete()
    return trace


def _manager(base: str, rec, mp) -> None:
    """CheckpointManager(keep_last=1) saving steps 1 and 2 into a root that does not exist yet (two levels)."""
    mgr = ck.CheckpointManager(os.path.join(base, "run", "ckpt"), keep_last=1)
    for step in (1, 2):
        mgr.save(step, _state(step))
        _join_background_deletes()
        rec.mark(f"saved{step}")


def _manager_async(base: str, rec, mp) -> None:
    """The same as ``_manager`` with ``async_save=True``: the files are written by the background thread."""
    mgr = ck.CheckpointManager(os.path.join(base, "run", "ckpt"), keep_last=1)
    for step in (1, 2):
        mgr.save(step, _state(step), async_save=True).wait()
        _join_background_deletes()
        rec.mark(f"saved{step}")


def _same_path(base: str, rec, mp) -> None:
    """Two saves to the same path, which holds a file of another tool (adopted by hard link at each publish)."""
    for step in (1, 2):
        ck.save_state_dict(_state(step), os.path.join(base, "one"))
        _join_background_deletes()
        rec.mark(f"saved{step}")


def _loads_as(path: str) -> int:
    """The step whose state ``path`` holds, bit for bit; AssertionError when it is none of them (a mix)."""
    got = {"w": paddle.zeros([1500], "float32"), "b": paddle.zeros([64], "int64")}
    ck.load_state_dict(got, path)
    for step in (1, 2):
        want = _state(step)
        if all(got[k].numpy().tobytes() == want[k].numpy().tobytes() for k in want):
            return step
    raise AssertionError(f"{path} loads as no saved step (a mix or garbage)")


def _check(at_least: int | None, root: str, scenario) -> None:
    """The invariants of one crash state (materialized or mounted at ``root``); ``at_least``: the last save that
    had returned before the crash (None: none)."""
    if scenario in (_manager, _manager_async):
        ckroot = os.path.join(root, "run", "ckpt")
        picked = ck.latest_checkpoint(ckroot) if os.path.isdir(ckroot) else None
        dirs = [os.path.join(ckroot, n) for n in os.listdir(ckroot)] if os.path.isdir(ckroot) else []
    else:
        one = os.path.join(root, "one")
        dirs = [os.path.join(root, n) for n in os.listdir(root)]
        if not os.path.isdir(one):  # between the two renames: the load error names `one.old-*` to rename back
            with pytest.raises(
                ck.CheckpointError, match=r"one\.old-\w+ holds the checkpoint that was being replaced"
            ) as e:
                ck.load_state_dict({}, one)
            one = os.path.join(root, re.search(r"(one\.old-\w+) holds", str(e.value)).group(1))
        picked = one if os.path.isfile(os.path.join(one, COMMIT_FILE)) else None
        if at_least is not None:
            with open(os.path.join(one, "notes.txt"), "rb") as f:
                assert f.read() == NOTES, "the other tool's file changed"
    if at_least is not None:
        assert picked is not None, f"no checkpoint to resume from after save {at_least} returned"
    if picked is not None:
        step = _loads_as(picked)
        assert at_least is None or step >= at_least, f"step {step} picked after save {at_least} returned"
    for d in dirs:
        # a leftover on its way out (.trash-, .old-, or a .tmp- holding the replaced checkpoint) may be half
        # removed with its commit record still there: a resume never picks it and cleanup removes it
        if LEFTOVER.search(os.path.basename(d)) is None and os.path.isfile(os.path.join(d, COMMIT_FILE)):
            problems = ck.verify_checkpoint(d)
            assert not problems, f"{os.path.basename(d)} has a commit record but fails verify: {problems[:3]}"


@pytest.fixture
def states_dir(tmp_path):
    """Where the explorer materializes its crash states: a fresh directory on the tmpfs /dev/shm when there is one.
    Why: a state is a few directories and files written, read back by the checks, then removed; on a journaled disk
    that metadata traffic was a third of a 1,000-state run (rmdir ~2 ms each under load; profile in
    docs/reports/2026-12-07-ci-time-3.md). The states are this model's output, not the file system under test (the
    block-level replay of test_power_loss_block.py is), and reads of files in the page cache take the same path."""
    shm = "/dev/shm"
    if not (os.path.isdir(shm) and os.access(shm, os.W_OK)):
        yield str(tmp_path / "states")
        return
    work = tempfile.mkdtemp(prefix="fsdp-crash-states-", dir=shm)
    try:
        yield os.path.join(work, "states")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def explore(trace: posix_crash.Trace, work, scenario, seed: int, budget: int, stop_at_first: bool) -> tuple:
    """Replay ``budget`` sampled crash states (and the all-lost state at every fsync boundary); returns
    (states checked, [(k, what was lost, error)])."""
    rng = random.Random(seed)
    n = len(trace.ops)
    plan = [(k, 0.0) for k in sorted({pos for pos, _ in trace.fsyncs} | {n})]
    plan += [(rng.randint(0, n), rng.choice((0.0, 0.3, 0.7, 1.0))) for _ in range(max(0, budget - len(plan)))]
    failures = []
    for i, (k, keep) in enumerate(plan):
        model, lost = trace.state(k, rng, keep)
        root = os.path.join(work, f"s{i}")
        model.materialize(root)
        try:
            at_least = 2 if k >= trace.marks["saved2"] else 1 if k >= trace.marks["saved1"] else None
            _check(at_least, root, scenario)
        except Exception as e:  # noqa: BLE001 - every failure of a state is a finding, reported with its state
            failures.append((k, lost, f"{type(e).__name__}: {e}"))
            if stop_at_first:
                return i + 1, failures
        finally:
            writer_rmtree(root)
    return len(plan), failures


def writer_rmtree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _seed() -> int:
    seed = int(os.environ.get("PADDLE_FSDP_CRASH_SEED", random.randrange(1 << 30)))
    print(f"power-loss explorer seed: {seed} (PADDLE_FSDP_CRASH_SEED={seed} replays it)")
    return seed


def _report(failures) -> str:
    k, lost, err = failures[0]
    return f"{len(failures)} failing states; first at op {k}: {err}; lost: {lost[:8]}"


@pytest.mark.parametrize(
    "scenario,exchange",
    [(_manager, True), (_manager_async, True), (_same_path, True), (_same_path, False)],
    ids=["manager_keep_last_1", "manager_async", "same_path_foreign_file", "same_path_two_renames"],
)
def test_every_posix_crash_state_loads(scenario, exchange, tmp_path, monkeypatch, states_dir):
    """Every sampled crash state of the saves (the publish by RENAME_EXCHANGE, and by two renames where the
    kernel refuses it) holds the invariants of ``_check``."""
    trace = _record(tmp_path, monkeypatch, scenario, exchange=exchange)
    if scenario is _same_path:  # the second publish swaps (RENAME_EXCHANGE) or moves the old one aside first
        publishes = [op.what.split()[0] for op in trace.ops if op.what.endswith("-> one")]
        assert publishes == (["exchange", "exchange"] if exchange else ["rename", "rename"]), publishes
        assert exchange != any(op.what.startswith("rename one -> one.old-") for op in trace.ops)
    seed = _seed()
    t0 = time.monotonic()
    checked, failures = explore(trace, states_dir, scenario, seed, BUDGET, stop_at_first=False)
    print(f"{scenario.__name__}: {len(trace.ops)} operations, {len(trace.fsyncs)} fsyncs, {checked} crash states "
          f"checked in {time.monotonic() - t0:.1f} s")  # fmt: skip
    assert checked >= BUDGET
    assert not failures, _report(failures)


def _data_file(path: str) -> bool:
    return path.endswith(".safetensors")


def _committed_staging_dir(path: str) -> bool:
    return ".tmp-" in os.path.basename(path) and os.path.isfile(os.path.join(path, COMMIT_FILE))


def _publish_before_commit_record(base: str, rec, mp) -> None:
    """The toy wrong protocol: the staging is published over the live checkpoint, then its commit record is put."""
    real_put, real_publish = LocalStorage.put, LocalStorage.publish
    pending = {}

    def publish(self, staging, final):
        if staging in pending:
            return  # done already, before the commit record
        real_publish(self, staging, final)

    def put(self, location, name, data, *, durable=True):
        if name == COMMIT_FILE and ".tmp-" in location:
            final = location.rpartition(".tmp-")[0]
            real_publish(self, location, final)
            pending[location] = final
            location = final
        real_put(self, location, name, data, durable=durable)

    mp.setattr(LocalStorage, "publish", publish)
    mp.setattr(LocalStorage, "put", put)
    mp.setattr(LocalStorage, "sync", lambda self, location: writer.fsync_dir(pending.get(location, location)))
    _same_path(base, rec, mp)


@pytest.mark.parametrize(
    "mutation,names",
    [
        ("no_data_fsync", "0_0.safetensors"),
        ("no_commit_dir_fsync", "COMMIT"),
        ("publish_before_commit", "no checkpoint to resume from"),
        ("root_not_fsynced", "mkdir run"),
        ("adopted_not_fsynced", "link one/notes.txt"),
    ],
)
def test_mutations_make_a_state_fail(mutation, names, tmp_path, monkeypatch, states_dir):
    """Each broken protocol must show at least one failing crash state (the explorer can fail), naming what was
    lost."""
    scenario, skip = _manager, None
    if mutation == "no_data_fsync":
        skip = _data_file
    elif mutation == "no_commit_dir_fsync":
        skip = _committed_staging_dir
    elif mutation == "publish_before_commit":
        scenario = _publish_before_commit_record
    elif mutation == "root_not_fsynced":  # gap (c) as it was: the first save's root made by a plain makedirs
        monkeypatch.setattr(writer, "makedirs_durable", lambda p: os.makedirs(p, exist_ok=True))
        monkeypatch.setattr(ck.manager, "makedirs_durable", lambda p: os.makedirs(p, exist_ok=True))
    elif mutation == "adopted_not_fsynced":  # gap (a) as it was: adopted links never fsynced before the swap
        scenario = _same_path
        real = writer.fsync_dir
        monkeypatch.setattr(
            writer, "fsync_dir", lambda p: None if os.path.lexists(os.path.join(p, "notes.txt")) else real(p)
        )
    trace = _record(tmp_path, monkeypatch, scenario, skip)
    check_as = _same_path if scenario is _publish_before_commit_record else scenario
    checked, failures = explore(trace, states_dir, check_as, _seed(), BUDGET, stop_at_first=True)
    assert failures, f"{mutation}: no failing state among {checked}"
    k, lost, err = failures[0]
    assert names in err or any(names in x for x in lost), f"{mutation}: failing for another reason: {_report(failures)}"
    print(f"{mutation}: failing state after {checked} states: {_report(failures)}")


def _index(trace: posix_crash.Trace, start: str, after: int = 0) -> int:
    return next(i for i, op in enumerate(trace.ops) if i >= after and op.what.startswith(start))


def _dir_fsynced(trace: posix_crash.Trace, inode: int, after: int, before: int) -> bool:
    return any(inode == i and after < pos <= before for pos, i in trace.fsyncs)


def test_fsync_order_closes_the_three_gaps(tmp_path, monkeypatch):
    """#54 (a)-(c) at the syscall level: a new root is fsynced in its parent before anything is created in it;
    the data object's name is fsynced (its staging directory) before the rank's next object is created; adopted
    links are fsynced before the swap that makes them the checkpoint's."""
    (tmp_path / "m").mkdir()
    trace = _record(tmp_path / "m", monkeypatch, _manager)
    run, ckpt = _index(trace, "mkdir run"), _index(trace, "mkdir run/ckpt")
    first_step = _index(trace, "mkdir run/ckpt/step_")
    assert _dir_fsynced(trace, trace.ops[run].action[1], run, ckpt), "(c) root's first level not fsynced in base"
    assert _dir_fsynced(trace, trace.ops[ckpt].action[1], ckpt, first_step), "(c) root not fsynced in its parent"
    for step in (1, 2):
        data = _index(trace, f"create run/ckpt/step_0000000{step}.tmp-")
        assert trace.ops[data].what.endswith("/0_0.safetensors")
        sums = _index(trace, "create", after=data + 1)
        assert trace.ops[sums].what.endswith(".part-" + trace.ops[sums].what.rpartition(".part-")[2])
        assert _dir_fsynced(trace, trace.ops[data].action[1], data, sums), f"(b) step {step}: data name not fsynced"

    (tmp_path / "s").mkdir()
    trace = _record(tmp_path / "s", monkeypatch, _same_path)
    links = [i for i, op in enumerate(trace.ops) if op.what.startswith("link one/notes.txt -> one.tmp-")]
    assert len(links) == 2  # one adoption per save
    for i in links:
        swap = _index(trace, "exchange", after=i)
        assert _dir_fsynced(trace, trace.ops[i].action[1], i, swap), "(a) adopted link not fsynced before the swap"


def _fsynced_dirs(tmp_path, monkeypatch, action) -> tuple[posix_crash.Trace, set[str]]:
    base = tmp_path / "fs"
    base.mkdir(parents=True)
    with monkeypatch.context() as mp:
        rec = posix_crash.Recorder(str(base), mp)
        action(str(base))
    paths, synced = {}, set()
    for c in rec.calls:  # descriptors are reused: resolved in call order
        if c[0] == "open":
            paths[c[1]] = c[2]
        elif c[0] == "fsync":
            synced.add(os.path.relpath(paths[c[1]], base))
    return posix_crash.Trace(rec), synced


def test_every_root_creation_is_fsynced_in_its_parent(tmp_path, monkeypatch):
    """(c) for the other doors that create a root: a one-process tool's output (staged_output: flush-memory,
    convert) under new directories, and the Trainer's output_dir (made by PaddleFormers' plain os.makedirs,
    fsynced in its parent by FSDPTrainer)."""
    from paddle.distributed.fsdp.checkpoint.staged_output import staged_output
    from paddle.distributed.fsdp.integrations.paddleformers import checkpoints

    def tool_output(base):
        with staged_output(os.path.join(base, "a", "b", "out")) as staging:
            with open(os.path.join(staging, "x"), "wb") as f:
                f.write(b"x")

    trace, synced = _fsynced_dirs(tmp_path / "t", monkeypatch, tool_output)
    made = [op.what for op in trace.ops if op.what.startswith("mkdir")]
    assert made[:2] == ["mkdir a", "mkdir a/b"] and {".", "a", "a/b"} <= synced, (made, synced)

    def trainer_root(base):
        os.makedirs(os.path.join(base, "run"))  # what PaddleFormers' Trainer.__init__ does
        checkpoints.make_root_durable(os.path.join(base, "run"))

    trace, synced = _fsynced_dirs(tmp_path / "r", monkeypatch, trainer_root)
    assert "." in synced


@pytest.mark.parametrize("leftover", ["one.old-aaaa", "one.old-zzzz"])
def test_missing_path_names_the_old_directory_with_the_checkpoint(leftover, tmp_path):
    """A power loss between the two renames of a save, with an earlier save's half-removed `.old-*` (another
    tool's file only) beside it: the load error names the one holding the checkpoint, whatever the names' order."""
    ck.save_state_dict(_state(1), str(tmp_path / "one"))
    (tmp_path / "one").rename(tmp_path / "one.old-mmmm")
    (tmp_path / leftover).mkdir()
    (tmp_path / leftover / "notes.txt").write_bytes(NOTES)
    with pytest.raises(ck.CheckpointError, match=r"one\.old-mmmm holds the checkpoint that was being replaced"):
        ck.load_state_dict({}, str(tmp_path / "one"))
    assert _loads_as(str(tmp_path / "one.old-mmmm")) == 1


_STRACED = """
import json, sys
sys.path.insert(0, {testdir!r})
import pytest, posix_crash, strace_summary, test_power_loss_posix as t
base, scenario = sys.argv[1], getattr(t, sys.argv[2])
mp = pytest.MonkeyPatch()
rec = posix_crash.Recorder(base, mp)
scenario(base, rec, mp)
mp.undo()
json.dump(sorted(strace_summary.recorder_summary(rec.calls, base).items()), open(sys.argv[3], "w"))
"""


@pytest.mark.skipif(shutil.which("strace") is None, reason="strace is not installed (apt-get install strace)")
@pytest.mark.parametrize("scenario", ["_manager", "_same_path"])
def test_recorder_sees_every_call_strace_sees(scenario, tmp_path):
    """The explorer's input is complete: ``strace -f`` of the same save (a child process) counts the same
    creates, writes (bytes per file), truncates, fsyncs, mkdirs, renames, exchanges, links and unlinks."""
    base, script, out, log = tmp_path / "fs", tmp_path / "s.py", tmp_path / "rec.json", tmp_path / "strace.txt"
    base.mkdir()
    if scenario == "_same_path":  # made here, before the traced child starts
        (base / "one").mkdir()
        (base / "one" / "notes.txt").write_bytes(NOTES)
    script.write_text(_STRACED.format(testdir=os.path.dirname(os.path.abspath(__file__))))
    cmd = ["strace", "-f", "-qq", "-y", "-o", str(log), "-e", f"trace={strace_summary.STRACE_CALLS}"]
    proc = subprocess.run([*cmd, sys.executable, str(script), str(base), scenario, str(out)], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    if proc.returncode != 0 and "ptrace" in proc.stderr:
        pytest.skip(f"strace cannot trace here: {proc.stderr.strip()[-200:]}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    recorded = {tuple(k): v for k, v in json.loads(out.read_text())}
    seen = strace_summary.strace_summary(log.read_text(), str(base))
    assert seen and sum(v for k, v in seen.items() if k[0] == "fsync") >= 40
    diff = {k: (recorded.get(k), seen.get(k)) for k in set(recorded) | set(seen) if recorded.get(k) != seen.get(k)}
    assert not diff, sorted(diff.items(), key=str)[:10]
