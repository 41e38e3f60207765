"""Replaying crash states of a recorded save against any invariant: the POSIX-minimal model (posix_crash.py) and
the block model (block_crash.py), for scenarios other than test_power_loss_posix's (the memory tier's persist and
flush, the Trainer's ``checkpoint-N`` save and rotation).

A scenario is ``fn(base, rec, mp)`` that saves under ``base`` and calls ``rec.mark(label)`` when a save has
returned; ``marks`` maps each label to the step that save made durable. A check is ``check(at_least, root)``:
``at_least`` is the newest step whose save had returned before the crash (None: none), ``root`` the crash state.

Budgets: PADDLE_FSDP_CRASH_STATES scales every budget (states per save kind; the defaults keep CI short),
PADDLE_FSDP_CRASH_SEED replays one seed (printed by every test).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import subprocess
import sys
import threading
import time

import block_crash
import posix_crash

logger = logging.getLogger(__name__)


def budget(default: int) -> int:
    """States to replay: PADDLE_FSDP_CRASH_STATES when set, else ``default``."""
    return int(os.environ.get("PADDLE_FSDP_CRASH_STATES", default))


def seed() -> int:
    value = int(os.environ.get("PADDLE_FSDP_CRASH_SEED", random.randrange(1 << 30)))
    print(f"power-loss explorer seed: {value} (PADDLE_FSDP_CRASH_SEED={value} replays it)")
    return value


def join_background_deletes() -> None:
    """Wait for the deletes the engine runs in background threads (their unlinks are part of the trace)."""
    for th in threading.enumerate():
        if th.name in ("ckpt-rm-old", "ckpt-prune"):
            th.join()


def record(base: str, mp, scenario, skip_fsync=None) -> posix_crash.Trace:
    """Run ``scenario`` under the recorder; the trace is checked complete (every tree change recorded)."""
    with mp.context() as m:
        rec = posix_crash.Recorder(base, m, skip_fsync)
        scenario(base, rec, m)
        join_background_deletes()
    trace = posix_crash.Trace(rec)
    trace.check_complete()
    return trace


def at_least(position: int, marks: dict[str, int], steps: dict[str, int]) -> int | None:
    """The newest step whose save had returned at ``position`` (marks: label -> position)."""
    done = [steps[label] for label, pos in marks.items() if position >= pos]
    return max(done, default=None)


def explore_posix(trace, work: str, check, steps: dict[str, int], seed_: int, budget_: int, stop_at_first: bool):
    """Replay ``budget_`` sampled POSIX crash states (the all-lost state at every fsync boundary first, as many as
    the budget holds, then random points and keep rates); returns (states checked, [(k, lost, error)])."""
    rng = random.Random(seed_)
    n = len(trace.ops)
    boundaries = sorted({pos for pos, _ in trace.fsyncs} | {n})
    if len(boundaries) > budget_ // 2:
        boundaries = sorted(rng.sample(boundaries, budget_ // 2))
    plan = [(k, 0.0) for k in boundaries]
    plan += [(rng.randint(0, n), rng.choice((0.0, 0.3, 0.7, 1.0))) for _ in range(max(0, budget_ - len(plan)))]
    failures = []
    for i, (k, keep) in enumerate(plan):
        model, lost = trace.state(k, rng, keep)
        root = os.path.join(work, f"s{i}")
        model.materialize(root)
        try:
            check(at_least(k, trace.marks, steps), root)
        except Exception as e:  # noqa: BLE001 - every failing state is a finding, reported with its state
            failures.append((k, lost, f"{type(e).__name__}: {e}"))
            if stop_at_first:
                return i + 1, failures
        finally:
            shutil.rmtree(root, ignore_errors=True)
    return len(plan), failures


def report(failures) -> str:
    k, lost, err = failures[0]
    return f"{len(failures)} failing states; first at {k}: {err}; lost: {lost[:8] if isinstance(lost, list) else lost}"


# ---------------------------------------------------------------------------------------------- block level

SIZE = 32 << 20


def block_missing() -> str | None:
    """Why the block-level replay cannot run here (None: it can)."""
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


_SAVER = """
import json, os, sys
sys.path.insert(0, {testdir!r})
import importlib, pytest
base, module, scenario, log = sys.argv[1:5]
fn = getattr(importlib.import_module(module), scenario)
marks = {{}}

class Marks:
    def mark(self, label):
        marks[label] = os.path.getsize(log)  # every block of a returned save is in the log by now

mp = pytest.MonkeyPatch()
fn(base, Marks(), mp)
mp.undo()
print(json.dumps(marks))
"""


def record_block(work: str, module: str, scenario: str) -> tuple[list, int, dict]:
    """Run ``module.scenario`` in a child process on a fresh ext4 over the recording disk: (log, first record of
    the saves, {mark: log position})."""
    mnt = os.path.join(work, "mnt")
    os.makedirs(mnt)
    script = os.path.join(work, "saver.py")
    with open(script, "w") as f:
        f.write(_SAVER.format(testdir=os.path.dirname(os.path.abspath(__file__))))
    with block_crash.recording_disk(work, SIZE) as (dev, log):
        block_crash.run(["mkfs.ext4", "-q", "-F", dev])
        block_crash.run(["mount", dev, mnt])
        try:
            block_crash.run(["sync"])
            start = len(block_crash.read_log(log))
            proc = subprocess.run([sys.executable, script, mnt, module, scenario, log], capture_output=True,
                                  text=True, timeout=300)  # fmt: skip
            if proc.returncode:
                raise RuntimeError(f"the saver failed: {proc.stderr[-2000:]}")
        finally:
            subprocess.run(["umount", mnt], capture_output=True)
        return block_crash.read_log(log), start, json.loads(proc.stdout.splitlines()[-1])


def _images(log: list, start: int, budget_: int, rng: random.Random):
    """(log position, image, writes lost) of ``budget_`` crash states after record ``start``: at sampled flush
    boundaries (nothing after the flush kept) and at random points (any subset of the writes after the last
    flush kept, the last one possibly torn at 512 B) - the block model of block_crash.py, sampled."""
    flushes = [i for i, r in enumerate(log) if r[0] == block_crash.FLUSH and i >= start]
    bounds = flushes if len(flushes) <= budget_ // 2 else rng.sample(flushes, budget_ // 2)
    plan = [(i + 1, 0.0) for i in bounds]
    plan += [(rng.randint(start, len(log)), rng.choice((0.0, 0.5, 1.0))) for _ in range(budget_ - len(plan))]
    base, applied = bytearray(SIZE), 0
    for k, keep in sorted(plan):
        durable_end = max(max((i for i in flushes if i < k), default=start - 1) + 1, start)
        while applied < durable_end:
            kind, off, data, _ = log[applied]
            if kind == block_crash.WRITE:
                base[off : off + len(data)] = data
            applied += 1
        image, lost = bytearray(base), 0
        tail = [r for r in log[durable_end:k] if r[0] == block_crash.WRITE]
        for j, (_, off, data, _) in enumerate(tail):
            if rng.random() >= keep:
                lost += 1
                continue
            if j == len(tail) - 1 and len(data) > 512 and rng.random() < 0.5:
                data = data[: rng.randrange(1, len(data) // 512) * 512]
            image[off : off + len(data)] = data
        yield log[k - 1][3] if k else 0, bytes(image), lost


def explore_block(work: str, recorded, check, steps: dict[str, int], seed_: int, budget_: int, stop_at_first: bool):
    """Mount each sampled crash image (ext4's journal recovery runs; e2fsck when it does not mount) and run
    ``check`` on it: (states checked, [(log position, writes lost, error)], seconds)."""
    log, start, marks = recorded
    img, mnt = f"/dev/shm/pl-{os.getpid()}-{os.path.basename(work)}.img", os.path.join(work, "state")
    os.makedirs(mnt)
    failures, n, fscked, t0 = [], 0, 0, time.monotonic()
    try:
        for pos, image, lost in _images(log, start, budget_, random.Random(seed_)):
            n += 1
            with open(img, "wb") as f:
                f.write(image)
            r, dev = block_crash.mount_image(img, mnt)  # a loop device of its own (never `mount -o loop`)
            if r.returncode:  # e.g. a torn superblock write: the file system's own repair first
                subprocess.run(["e2fsck", "-fy", img], capture_output=True, timeout=120)
                fscked += 1
                r, dev = block_crash.mount_image(img, mnt)
            if r.returncode:
                failures.append((pos, lost, f"unmountable, even after e2fsck: {r.stderr.strip()}"))
                continue
            try:
                check(at_least(pos, marks, steps), mnt)
            except Exception as e:  # noqa: BLE001 - every failing state is a finding, reported with its state
                failures.append((pos, lost, f"{type(e).__name__}: {e}"))
            finally:
                block_crash.unmount_image(mnt, dev)
            if failures and stop_at_first:
                break
    finally:
        if os.path.exists(img):
            os.unlink(img)
    if fscked:
        print(f"{fscked} of {n} states needed e2fsck before they mounted")
    return n, failures, time.monotonic() - t0
