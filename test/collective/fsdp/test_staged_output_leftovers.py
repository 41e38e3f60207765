"""A writer of a staged output (to-hf, from-hf, import, adapter export, flush-memory) killed with -9 leaves its
``<out>.tmp-*`` staging directory; the next writer of the same output removes it, and nothing else
(checkpoint/staged_output.py ``remove_stale_staging``). Real processes: the killed writer is a child killed -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

from paddle.distributed.fsdp.checkpoint import staged_output as so

CHILD = textwrap.dedent(
    """
    import os, sys, time
    from paddle.distributed.fsdp.checkpoint.staged_output import staged_output
    with staged_output(sys.argv[1]) as staging:
        with open(os.path.join(staging, "shard.bin"), "wb") as f:
            f.write(b"x" * (1 << 20))
        print(staging, flush=True)
        time.sleep(600)
    """
)


def _killed_writer(out: str) -> str:
    """The staging directory a writer of ``out`` left when it was killed -9 mid-output."""
    child = subprocess.Popen([sys.executable, "-c", CHILD, out], stdout=subprocess.PIPE, text=True)
    try:
        staging = child.stdout.readline().strip()
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    assert os.path.isdir(staging) and os.path.basename(staging).startswith("out.tmp-"), staging
    return staging


def test_a_killed_writers_staging_is_removed_by_the_next_writer_of_that_output(tmp_path):
    out = str(tmp_path / "out")
    killed = _killed_writer(out)
    assert not os.path.exists(out)
    host, dead = so._host_tag(), os.path.basename(killed)[len("out.tmp-") :][8:16]  # the killed writer's pid
    kept = {
        "live owner (a concurrent writer)": f"out.tmp-{so.owner_tag()}{'a' * 12}",
        "another host's (a shared file system)": f"out.tmp-{'0' * 8 if host != '0' * 8 else '1' * 8}{dead}{'b' * 12}",
        "an older writer's name": "out.tmp-0123456789ab",
        "another output's": f"out2.tmp-{os.path.basename(killed)[len('out.tmp-') :]}",
    }
    for name in kept.values():
        os.mkdir(tmp_path / name)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not the writer's")
    link = tmp_path / f"out.tmp-{host}{dead}{'c' * 12}"  # a dead owner's name, but a link: never followed
    link.symlink_to(outside, target_is_directory=True)

    with so.staged_output(out) as staging:
        with open(os.path.join(staging, "shard.bin"), "wb") as f:
            f.write(b"y")

    assert not os.path.exists(killed), "the killed writer's staging was left"
    assert sorted(os.listdir(out)) == ["shard.bin"]
    for what, name in kept.items():
        assert (tmp_path / name).is_dir(), f"{what} was removed"
    assert link.is_symlink() and (outside / "keep.txt").read_text() == "not the writer's"


def test_a_killed_flushs_staging_keeps_the_shape_a_roots_rotation_removes(tmp_path):
    """A flush stages ``step_N.tmp-<hex>``: the owner tag is hex too, so directory.py's rotation still knows it."""
    from paddle.distributed.fsdp.checkpoint.directory import _STAGING_RE

    killed = _killed_writer(str(tmp_path / "out"))
    assert _STAGING_RE.match("step_00000005" + os.path.basename(killed)[len("out") :])
