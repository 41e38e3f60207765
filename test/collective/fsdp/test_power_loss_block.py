"""Power loss at the block level (#54): the block writes and flushes of real saves on ext4, xfs and ext4 without
a journal (block_crash.py), replayed into crash states that are mounted (the file system's own recovery: ext4's
journal replay or xfs's log recovery at mount; e2fsck first where there is no journal) and loaded with the
invariants of the POSIX-minimal explorer (test_power_loss_posix._check), plus: the ``latest`` pointer never names
a checkpoint that is missing or not committed, and no state is unmountable.

Saves: one process (CheckpointManager keep_last=1: sync, async, and with buffered data writes; two saves to one
path holding another tool's file, published by RENAME_EXCHANGE and by two renames where the exchange is refused,
forced through the POSIX explorer's recorder), 2 ranks (workers/power_loss_ranks.py under
paddle.distributed.launch, sync and async), and three broken protocols that must each fail a state.

PADDLE_FSDP_CRASH_STATES: crash states replayed per test (default 20: the file in 2-4 minutes on a loaded
2-core machine); PADDLE_FSDP_CRASH_SEED replays one seed (printed and logged). Needs root, /dev/fuse, loop
devices, mkfs.ext4, mkfs.xfs (xfsprogs; its tests skip without it), fusepy and libfuse 2; skips elsewhere, saying
which is missing.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import random
import shutil
import subprocess
import sys
import time

import block_crash
import numpy as np
import paddle.distributed.fsdp.checkpoint as ck
import pytest
from block_crash import EXT4, EXT4_NO_JOURNAL, XFS
from launch_util import run_launch
from paddle.distributed.fsdp.checkpoint.format.metadata import COMMIT_FILE, LATEST_FILE
from test_power_loss_posix import LEFTOVER, _check, _manager, _manager_async, _same_path, _seed

pytestmark = pytest.mark.power_loss
logger = logging.getLogger(__name__)

STATES = int(os.environ.get("PADDLE_FSDP_CRASH_STATES", "20"))
HERE = os.path.dirname(os.path.abspath(__file__))


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (loop devices, mount)"
    for dev in ("/dev/fuse", "/dev/loop-control"):
        if not os.path.exists(dev):
            return f"{dev} is missing"
    for tool in ("losetup", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    try:
        import fuse  # noqa: F401
    except (ImportError, OSError) as e:
        return f"fusepy or libfuse 2 is missing ({e}; pip install fusepy, apt-get install libfuse2)"
    return EXT4.missing()


if _missing():
    pytest.skip(_missing(), allow_module_level=True)

# one-process saves: (scenario of test_power_loss_posix, RENAME_EXCHANGE allowed, the explorer's fsync-skipping
# mutation hook, PADDLE_FSDP_CKPT_ODIRECT of the save)
SCENARIOS = {
    "manager_keep_last_1": ("_manager", True, None, "auto"),
    "manager_buffered": ("_manager", True, None, "off"),
    "manager_async": ("_manager_async", True, None, "auto"),
    "same_path_exchange": ("_same_path", True, None, "auto"),
    "same_path_two_renames": ("_same_path", False, None, "auto"),
    # O_DIRECT data is on the device when write returns and the next flush (any later fsync) makes it durable, so
    # the data fsync is only needed, and its removal only visible, for buffered writes (O_DIRECT refused)
    "no_data_fsync": ("_manager", True, "_data_file", "off"),
    "no_commit_dir_fsync": ("_manager", True, "_committed_staging_dir", "auto"),
    "publish_before_commit": ("_publish_before_commit_record", True, None, "auto"),
}
SOUND = ["manager_keep_last_1", "manager_buffered", "manager_async", "same_path_exchange", "same_path_two_renames"]
# a journal (ext4) or log (xfs) makes the commit record's name durable with the record's own fsync, which commits
# the transaction holding its directory entry: only ext4 without a journal shows the missing directory fsync
MUTATIONS = [("no_data_fsync", EXT4), ("no_data_fsync", XFS), ("no_commit_dir_fsync", EXT4_NO_JOURNAL),
             ("publish_before_commit", EXT4), ("publish_before_commit", XFS)]  # fmt: skip
ONE_PROCESS = [(fs, name) for fs in (EXT4, XFS) for name in SOUND] + [(EXT4_NO_JOURNAL, "manager_keep_last_1")]
ONE_PROCESS += [(fs, name) for name, fs in MUTATIONS]
CHECK_AS = {"_manager": _manager, "_manager_async": _manager_async, "_same_path": _same_path,
            "_publish_before_commit_record": _same_path}  # fmt: skip

_SAVER = """
import json, os, sys
sys.path.insert(0, {testdir!r})
import pytest, posix_crash, test_power_loss_posix as t
for job in json.load(open(sys.argv[1])):
    marks = {{}}
    mp = pytest.MonkeyPatch()
    skip = getattr(t, job["skip"]) if job["skip"] else None
    os.environ["PADDLE_FSDP_CKPT_ODIRECT"] = job["odirect"]
    rec = posix_crash.Recorder(job["base"], mp, skip, job["exchange"])  # the explorer's mutation hooks
    rec.mark = lambda label: marks.__setitem__(label, os.path.getsize(job["log"]))  # blocks of a returned save
    getattr(t, job["scenario"])(job["base"], rec, mp)
    mp.undo()
    published = [c[0] for c in rec.calls if c[0] in ("rename", "exchange") and str(c[2]).endswith("/one")]
    job.update(marks=marks, published=published)
    print(json.dumps(job))
"""


class Recorded:
    """The block log of one file system's saves: (log, first record of the saves, {mark: log position})."""

    def __init__(self, fs, log: list, start: int, marks: dict, published=()):
        self.fs, self.log, self.start, self.marks, self.published = fs, log, start, marks, list(published)

    def at_least(self, pos: int) -> int | None:
        """The last save that had returned when the crash came at log position ``pos``."""
        return 2 if pos >= self.marks["saved2"] else 1 if pos >= self.marks["saved1"] else None


def _available(fs) -> bool:
    return fs.missing() is None


@contextlib.contextmanager
def _disks(work: str, specs: dict):
    """{key: fs} -> {key: (mountpoint, log path, [first record of the saves])}: every fs made and mounted (the
    first record: as the block started, or where ``_starts`` put it); the logs are complete after the block."""
    out = {}
    with contextlib.ExitStack() as stack:
        for key, fs in specs.items():
            d = os.path.join(work, key)
            mnt = os.path.join(d, "mnt")
            os.makedirs(mnt)
            log = stack.enter_context(block_crash.recorded_fs(d, fs, mnt))
            out[key] = (mnt, log, [])
        _starts(out)
        yield out


def _starts(disks: dict) -> None:
    """Note each disk's log length as the first record of its saves (what is before it is on disk)."""
    block_crash.run(["sync"])
    for _mnt, log, start in disks.values():
        start[:] = [block_crash.log_length(log)]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> dict:
    """Every one-process save of SCENARIOS on every available file system, recorded in one saver process."""
    work = str(tmp_path_factory.mktemp("block"))
    specs = {f"{fs.name}-{name}": fs for fs, name in ONE_PROCESS if _available(fs)}
    jobs = []
    with _disks(work, specs) as disks:
        for key, (mnt, log, _) in disks.items():
            scenario, exchange, skip, odirect = SCENARIOS[key.split("-", 1)[1]]
            if scenario != "_manager":  # the other tool's file, on disk before the saves
                os.makedirs(os.path.join(mnt, "one"), exist_ok=True)
                with open(os.path.join(mnt, "one", "notes.txt"), "wb") as f:
                    f.write(b"notes of another tool\n")
            jobs.append({"key": key, "base": mnt, "log": log, "scenario": scenario, "exchange": exchange, "skip": skip,
                         "odirect": odirect})  # fmt: skip
        _starts(disks)
        script, jobs_file = os.path.join(work, "saver.py"), os.path.join(work, "jobs.json")
        with open(script, "w") as f:
            f.write(_SAVER.format(testdir=HERE))
        with open(jobs_file, "w") as f:
            json.dump(jobs, f)
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, script, jobs_file], capture_output=True, text=True, timeout=900)
        assert out.returncode == 0, out.stderr[-3000:]
        logger.info("one-process saves on %d file systems recorded in %.0f s", len(jobs), time.monotonic() - t0)
    done = {j["key"]: j for j in map(json.loads, out.stdout.splitlines()[-len(jobs) :])}
    return {
        key: Recorded(specs[key], block_crash.read_log(log), start[0], done[key]["marks"], done[key]["published"])
        for key, (_mnt, log, start) in disks.items()
    }


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    """2-rank saves (sync and async) on ext4 and xfs, recorded in one launch; {key: (Recorded, refs dir)}."""
    work = str(tmp_path_factory.mktemp("ranks"))
    specs = {f"{fs.name}-{mode}": fs for fs in (EXT4, XFS) if _available(fs) for mode in ("sync", "async")}
    jobs, refs = [], {}
    with _disks(work, specs) as disks:
        for key, (mnt, log, _) in disks.items():
            refs[key] = os.path.join(work, key, "refs")
            os.makedirs(refs[key])
            jobs.append({"root": os.path.join(mnt, "ckpt"), "log": log, "refs": refs[key], "async": "async" in key})
        with open(os.path.join(work, "jobs.json"), "w") as f:
            json.dump(jobs, f)
        result = run_launch(os.path.join(HERE, "workers", "power_loss_ranks.py"), 2, [os.path.join(work, "jobs.json")],
                            timeout=600, log_dir=os.path.join(work, "launch"))  # fmt: skip
        marks = result.result(0)
    return {
        key: (Recorded(specs[key], block_crash.read_log(log), start[0], marks[os.path.join(mnt, "ckpt")]), refs[key])
        for key, (mnt, log, start) in disks.items()
    }


# ------------------------------------------------------------------------------------------------ replay


def _mount(fs, img: str, mnt: str) -> tuple[subprocess.CompletedProcess, str]:
    """Mount ``img`` on a loop device of its own (block_crash.mount_image: never ``mount -o loop``)."""
    opts = ("-o", "nouuid") if fs is XFS else ()  # nouuid: every image of one recording has the same uuid
    return block_crash.mount_image(img, mnt, opts)


_umount = block_crash.unmount_image


def _latest_ok(ckroot: str, verify=ck.verify_checkpoint) -> None:
    """``latest``, where it exists, names a directory that is there, committed, and passes verify."""
    path = os.path.join(ckroot, LATEST_FILE)
    if not os.path.lexists(path):
        return
    with open(path, "rb") as f:
        raw = f.read()
    name = raw.decode(errors="replace").strip()
    assert raw.endswith(b"\n") and name.startswith("step_"), f"latest holds {raw[:80]!r}: torn or garbage"
    target = os.path.join(ckroot, name)
    assert os.path.isfile(os.path.join(target, COMMIT_FILE)), f"latest names {name}, which is missing or uncommitted"
    problems = verify(target)
    assert not problems, f"latest names {name}, which fails verify: {problems[:3]}"


def _check_one_process(scenario, rec: Recorded, pos: int, mnt: str) -> None:
    _check(rec.at_least(pos), mnt, scenario)
    if scenario in (_manager, _manager_async):
        _latest_ok(os.path.join(mnt, "run", "ckpt"))


def _load_refs(refs: str) -> dict:
    out = {}
    for step in (1, 2):
        with open(os.path.join(refs, f"step{step}.pkl"), "rb") as f:
            out[step] = pickle.load(f)
    return out


def _digest(path: str) -> tuple:
    """Names, sizes and bytes of the files under ``path``: what a load and verify of it depend on."""
    out = []
    for dirpath, dirnames, filenames in os.walk(path):
        dirnames.sort()
        for n in sorted(filenames):
            with open(os.path.join(dirpath, n), "rb") as f:
                out.append((os.path.relpath(os.path.join(dirpath, n), path), hash(f.read())))
    return tuple(out)


class RankCheck:
    """The invariants of a 2-rank crash state. A load and a verify are functions of a directory's bytes, and most
    states hold the same few directories: their outcomes are kept per digest (the selection runs every time)."""

    def __init__(self, want: dict):
        self.want, self.loads, self.verified = want, {}, {}

    def _step(self, picked: str) -> list[int]:
        got = {k: np.array(v.numpy()) for k, v in ck.load_full_state_dict(picked).items()}
        return [s for s, ref in self.want.items() if ref.keys() == got.keys() and
                all(ref[k].tobytes() == got[k].tobytes() for k in ref)]  # fmt: skip

    def _verify(self, d: str) -> list:
        key = (os.path.basename(d), _digest(d))
        if key not in self.verified:
            self.verified[key] = ck.verify_checkpoint(d)
        return self.verified[key]

    def __call__(self, rec: Recorded, pos: int, mnt: str) -> None:
        """The checkpoint a resume picks (the project's own selection) loads as step 1 or 2 bit for bit; every
        committed directory verifies; ``latest`` is sound."""
        at_least, ckroot = rec.at_least(pos), os.path.join(mnt, "ckpt")
        picked = ck.latest_checkpoint(ckroot) if os.path.isdir(ckroot) else None
        if at_least is not None:
            assert picked is not None, f"no checkpoint to resume from after save {at_least} returned"
        if picked is not None:
            key = (os.path.basename(picked), _digest(picked))
            if key not in self.loads:
                self.loads[key] = self._step(picked)
            steps = self.loads[key]
            assert steps, f"{os.path.basename(picked)} loads as no saved step (a mix or garbage)"
            assert at_least is None or steps[0] >= at_least, f"step {steps[0]} picked after save {at_least} returned"
        for name in os.listdir(ckroot) if os.path.isdir(ckroot) else []:
            d = os.path.join(ckroot, name)
            if LEFTOVER.search(name) is None and os.path.isfile(os.path.join(d, COMMIT_FILE)):
                problems = self._verify(d)
                assert not problems, f"{name} has a commit record but fails verify: {problems[:3]}"
        _latest_ok(ckroot, self._verify)


def explore(rec: Recorded, check, work: str, seed: int, budget: int, stop_at_first: bool, after=None) -> dict:
    """Replay ``budget`` crash states of ``rec`` (at least every flush boundary) through ``check(rec, pos, mnt)``.
    ``after``: only crash points after that mark (everything before it kept: one state the model allows).
    Returns figures: states, failures [(log position, writes lost, error)], repaired, fsck-less failures."""
    fs, start = rec.fs, rec.start
    if after is not None:
        start = next(i for i, r in enumerate(rec.log) if r[3] > rec.marks[after])
    img, mnt = f"/dev/shm/pl-{os.getpid()}-{os.path.basename(work)}.img", os.path.join(work, "state")
    os.makedirs(mnt, exist_ok=True)
    out = {"states": 0, "failures": [], "repaired": [], "fsckless_failures": []}
    try:
        for pos, lost in block_crash.crash_states(rec.log, start, fs.size, budget, random.Random(seed), img, fs.atomic):
            out["states"] += 1
            if fs.fsck_first:  # what a mount without the fsck gives: measured, not asserted
                r, dev = _mount(fs, img, mnt)
                if r.returncode:
                    out["fsckless_failures"].append((pos, "unmountable"))
                else:
                    try:
                        check(rec, pos, mnt)
                    except Exception as e:  # noqa: BLE001 - a figure of the report
                        out["fsckless_failures"].append((pos, f"{type(e).__name__}: {e}"))
                    finally:
                        _umount(mnt, dev)
                subprocess.run([*fs.repair, img], capture_output=True, timeout=300)
            r, dev = _mount(fs, img, mnt)
            if r.returncode:  # e.g. a torn ext4 superblock (its checksum): the file system's own repair
                fix = subprocess.run([*fs.repair, img], capture_output=True, text=True, timeout=300)
                out["repaired"].append((pos, fix.returncode))
                r, dev = _mount(fs, img, mnt)
            if r.returncode:
                out["failures"].append((pos, lost, f"unmountable, even after {fs.repair[0]}: {r.stderr.strip()}"))
            else:
                try:
                    check(rec, pos, mnt)
                except Exception as e:  # noqa: BLE001 - every failing state is a finding, reported with its state
                    out["failures"].append((pos, lost, f"{type(e).__name__}: {e}"))
                    _keep(img, pos)
                finally:
                    _umount(mnt, dev)
            if out["failures"] and stop_at_first:
                break
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(img)
    return out


def _keep(img: str, pos: int) -> None:
    """PADDLE_FSDP_CRASH_KEEP=DIR: a failing state's image is kept there for inspection (debugfs, xfs_db)."""
    keep = os.environ.get("PADDLE_FSDP_CRASH_KEEP")
    if keep:
        os.makedirs(keep, exist_ok=True)
        shutil.copy(img, os.path.join(keep, f"state-{os.getpid()}-{pos}.img"))


def _summary(what: str, rec: Recorded, out: dict, seconds: float) -> str:
    log = rec.log[rec.start :]
    text = (f"{what}: {len(log)} block records (from record {rec.start}; saves returned at {rec.marks}) ({sum(r[0] == block_crash.FLUSH for r in log)} flushes), "
            f"{out['states']} crash states in {seconds:.0f} s, {len(out['failures'])} failing, "
            f"{len(out['repaired'])} needed {rec.fs.repair[0]} before they mounted {out['repaired'][:3]}")  # fmt: skip
    for pos, lost, err in out["failures"][:3]:
        text += f"\n  failing state at log position {pos} ({lost} writes after the last flush lost): {err}"
    if rec.fs.fsck_first:
        text += f"; mounted without fsck: {len(out['fsckless_failures'])} failing {out['fsckless_failures'][:2]}"
    logger.info(text)
    print(text)
    return text


def _fs_params(*file_systems):
    return [pytest.param(fs, id=fs.name, marks=pytest.mark.skipif(not _available(fs), reason=fs.missing() or ""))
            for fs in file_systems]  # fmt: skip


# ------------------------------------------------------------------------------------------------ tests


@pytest.mark.parametrize("fs,name", [pytest.param(*p, id=f"{p[0].name}-{p[1]}") for p in ONE_PROCESS if p[1] in SOUND])
def test_every_block_crash_state_loads(fs, name, one_process, tmp_path):
    """Every flush boundary and sampled states between them (the writes after the last flush any subset, the
    last torn): mountable after the file system's own recovery, and the invariants of the POSIX explorer hold,
    with ``latest`` sound. The one-path saves publish by RENAME_EXCHANGE and, refused, by two renames."""
    if not _available(fs):
        pytest.skip(fs.missing())
    rec = one_process[f"{fs.name}-{name}"]
    scenario = CHECK_AS[SCENARIOS[name][0]]
    if scenario is _same_path:  # the second publish swaps, or moves the old one aside and renames
        assert rec.published == (["exchange", "exchange"] if SCENARIOS[name][1] else ["rename", "rename"])
    seed, t0 = _seed(), time.monotonic()
    logger.info("power-loss block replay seed %d", seed)
    out = explore(rec, lambda r, p, m: _check_one_process(scenario, r, p, m), str(tmp_path), seed, STATES, False)
    _summary(f"{fs.name} {name} (seed {seed})", rec, out, time.monotonic() - t0)
    assert out["states"] >= STATES
    assert not out["failures"], f"{len(out['failures'])} failing states; first: {out['failures'][0]}"


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("fs", _fs_params(EXT4, XFS))
def test_two_rank_save_every_block_crash_state_loads(fs, mode, two_ranks, tmp_path):
    """A real 2-rank CheckpointManager(keep_last=1) save of steps 1 and 2 (FSDP model and AdamW, gloo): in every
    crash state the checkpoint a resume picks loads bit-exactly as step 1 or 2 (never a mix, never older than a
    returned save), committed directories verify, ``latest`` is sound, and every state mounts."""
    rec, refs = two_ranks[f"{fs.name}-{mode}"]
    want = _load_refs(refs)
    assert want[1].keys() == want[2].keys() and any(want[1][k].tobytes() != want[2][k].tobytes() for k in want[1])
    seed, t0 = _seed(), time.monotonic()
    logger.info("power-loss block replay seed %d", seed)
    out = explore(rec, RankCheck(want), str(tmp_path), seed, STATES, False)
    _summary(f"{fs.name} 2 ranks {mode} (seed {seed})", rec, out, time.monotonic() - t0)
    assert out["states"] >= STATES
    assert not out["failures"], f"{len(out['failures'])} failing states; first: {out['failures'][0]}"


@pytest.mark.parametrize("mutation,fs", [pytest.param(m, fs, id=f"{m}-{fs.name}") for m, fs in MUTATIONS])
def test_broken_protocols_fail_at_block_level(mutation, fs, one_process, tmp_path):
    """A broken protocol leaves a crash state the file system's recovery does not rescue: the test can fail.
    The data fsync removed (buffered data); the commit record's directory fsync removed (ext4 without a journal:
    see MUTATIONS); publish before the commit record."""
    if not _available(fs):
        pytest.skip(fs.missing())
    rec = one_process[f"{fs.name}-{mutation}"]
    scenario = CHECK_AS[SCENARIOS[mutation][0]]
    seed = _seed()
    out = explore(rec, lambda r, p, m: _check_one_process(scenario, r, p, m), str(tmp_path), seed,
                  max(STATES, 300), stop_at_first=True, after="saved1")  # fmt: skip
    assert out["failures"], f"{mutation} on {fs.name}: no failing state among {out['states']} (seed {seed})"
    print(f"{mutation} on {fs.name}: failing state after {out['states']} states: {out['failures'][0]}")
