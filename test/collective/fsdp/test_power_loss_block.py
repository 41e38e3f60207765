"""Power loss at the block level (#54): the block writes and flushes of real saves on ext4 (block_crash.py),
replayed into crash states that are mounted (the journal recovery of ext4 runs) and loaded with the same
invariants as the POSIX-minimal explorer (test_power_loss_posix._check).

Needs root, /dev/fuse, loop devices, mkfs.ext4, fusepy and libfuse 2 (``apt-get install libfuse2``); skips
elsewhere, saying which is missing. The seed is printed; PADDLE_FSDP_CRASH_SEED replays one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time

import block_crash
import pytest
from test_power_loss_posix import _check, _manager, _same_path, _seed

pytestmark = pytest.mark.power_loss

SIZE = 32 << 20
BUDGET = 300


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (loop devices, mount)"
    for dev in ("/dev/fuse", "/dev/loop-control"):
        if not os.path.exists(dev):
            return f"{dev} is missing"
    for tool in ("losetup", "mkfs.ext4", "e2fsck", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    try:
        import fuse  # noqa: F401
    except (ImportError, OSError) as e:
        return f"fusepy or libfuse 2 is missing ({e}; pip install fusepy, apt-get install libfuse2)"
    return None


if _missing():
    pytest.skip(_missing(), allow_module_level=True)

_SAVER = """
import json, os, sys
sys.path.insert(0, {testdir!r})
import pytest, test_power_loss_posix as t
base, scenario, log = sys.argv[1], getattr(t, sys.argv[2]), sys.argv[3]
marks = {{}}

class Marks:
    def mark(self, label):
        marks[label] = os.path.getsize(log)  # every block of a returned save is in the log by now

mp = pytest.MonkeyPatch()
scenario(base, Marks(), mp)
mp.undo()
print(json.dumps(marks))
"""


def _record(tmp_path, scenario: str) -> tuple[list, int, dict]:
    """Record ``scenario`` (a function name of test_power_loss_posix) on a fresh ext4: (log, first record of the
    saves, {mark: log position})."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = tmp_path / "saver.py"
    script.write_text(_SAVER.format(testdir=os.path.dirname(os.path.abspath(__file__))))
    with block_crash.recording_disk(str(tmp_path), SIZE) as (dev, log):
        block_crash.run(["mkfs.ext4", "-q", "-F", dev])
        block_crash.run(["mount", dev, str(mnt)])
        try:
            if scenario != "_manager":  # the other tool's file, on disk before the saves
                (mnt / "one").mkdir()
                (mnt / "one" / "notes.txt").write_bytes(b"notes of another tool\n")
            block_crash.run(["sync"])
            start = len(block_crash.read_log(log))
            out = block_crash.run([sys.executable, str(script), str(mnt), scenario, log])
        finally:
            subprocess.run(["umount", str(mnt)], capture_output=True)
        return block_crash.read_log(log), start, json.loads(out.splitlines()[-1])


def _explore(tmp_path, scenario, recorded, seed: int, budget: int, stop_at_first: bool, after=None) -> tuple:
    """(states checked, [(log position, writes lost, error)]); ``after``: only crash points after that mark (the
    records before it all kept: one of the states the model allows there, so still sound)."""
    log, start, marks = recorded
    if after is not None:
        start = next(i for i, r in enumerate(log) if r[3] > marks[after])
    img, mnt = "/dev/shm/" + f"pl-{os.getpid()}-{tmp_path.name}.img", tmp_path / "state"
    mnt.mkdir()
    failures, fscked, n = [], [], 0
    try:
        for pos, image, lost in block_crash.crash_images(log, start, SIZE, budget, random.Random(seed)):
            n += 1
            with open(img, "wb") as f:
                f.write(image)
            r = _mount(img, mnt)
            if r.returncode:  # e.g. a torn superblock write (its checksum): the file system's own repair, e2fsck
                fsck = subprocess.run(["e2fsck", "-fy", img], capture_output=True, text=True, timeout=120)
                fscked.append((pos, fsck.returncode))
                r = _mount(img, mnt)
            if r.returncode:
                failures.append((pos, lost, f"unmountable, even after e2fsck: {r.stderr.strip()}"))
                continue
            try:
                at_least = 2 if pos >= marks["saved2"] else 1 if pos >= marks["saved1"] else None
                _check(at_least, str(mnt), scenario)
            except Exception as e:  # noqa: BLE001 - every failing state is a finding, reported with its state
                failures.append((pos, lost, f"{type(e).__name__}: {e}"))
            finally:
                subprocess.run(["umount", str(mnt)], check=True, capture_output=True, timeout=60)
            if failures and stop_at_first:
                break
    finally:
        if os.path.exists(img):
            os.unlink(img)
    if fscked:
        print(
            f"{len(fscked)} of {n} states needed e2fsck before they mounted (log position, e2fsck status): {fscked[:5]}"
        )
    return n, failures


def _mount(img: str, mnt) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", "-o", "loop", img, str(mnt)], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("scenario", [_manager, _same_path], ids=["manager_keep_last_1", "same_path_foreign_file"])
def test_every_block_crash_state_on_ext4_loads(scenario, tmp_path):
    """Every flush boundary and sampled states between them (the writes after the last flush any subset, the
    last torn): mountable after the journal recovery, and the invariants of the POSIX explorer hold."""
    t0 = time.monotonic()
    recorded = _record(tmp_path, scenario.__name__)
    n, failures = _explore(tmp_path, scenario, recorded, _seed(), BUDGET, stop_at_first=False)
    log, start = recorded[0], recorded[1]
    print(f"ext4 {scenario.__name__}: {len(log) - start} block records "
          f"({sum(r[0] for r in log[start:])} flushes), {n} crash states in {time.monotonic() - t0:.0f} s")  # fmt: skip
    assert n >= BUDGET
    assert not failures, f"{len(failures)} failing states; first: {failures[0]}"


def test_publish_before_commit_record_fails_at_block_level(tmp_path):
    """The wrong protocol (the staging published over the live checkpoint before its commit record) leaves a
    crash state ext4's recovery does not rescue: the test can fail."""
    recorded = _record(tmp_path, "_publish_before_commit_record")
    n, failures = _explore(tmp_path, _same_path, recorded, _seed(), 300, stop_at_first=True, after="saved1")
    assert failures, f"no failing state among {n}"
    print(f"publish before the commit record: failing state after {n} states: {failures[0]}")
    assert "no checkpoint to resume from" in failures[0][2], failures[0]
