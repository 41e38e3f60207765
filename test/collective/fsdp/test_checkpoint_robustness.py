"""Named, prompt, harmless failure on bad input of every class, in one process (issue 13).

* strict metadata: every field typed, NaN/Infinity/strings-for-numbers/lists-for-strings refused with
  MetadataError naming the field; size, depth and integer caps checked before or while parsing;
* exact coverage: pieces that overlap and leave a gap (valid checksums) are refused before any data is read,
  by load, load_full_state_dict and verify alike;
* bounded resources: memory bounded by bytes on disk, never by a declared shape; any number of data files under a
  low RLIMIT_NOFILE; FIFOs and devices refused without blocking;
* readers racing a removal say the checkpoint was removed, and CheckpointManager.load_latest retries;
* save failures (injected errno at every stage, a real full tmpfs): SaveFailedError naming the rank and the cause,
  previous checkpoint intact, failed staging removed by the next save, a later save that fits succeeds;
* the CLI answers bad input with exit code 2 (or 1: problems found) and one line, never 3.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import fault_storage
import numpy as np
import paddle
import paddle.distributed.fsdp.checkpoint as ck
import pytest
from crafted import craft, edit_metadata, flat_boxes
from hangs import alarm
from paddle.distributed.fsdp.checkpoint import reader

HERE = Path(__file__).resolve().parent


def bits(t) -> np.ndarray:
    return np.ascontiguousarray(t.numpy()).view(np.uint8).ravel().copy()


@pytest.fixture
def saved(tmp_path):
    paddle.seed(5)
    state = {"w": paddle.rand([4, 8]), "b": paddle.rand([8]), "step": 3}
    path = tmp_path / "ckpt"
    ck.save_state_dict(state, str(path))
    return state, path


def targets():
    return {"w": paddle.full([4, 8], 7.0), "b": paddle.full([8], 7.0), "step": None}


def assert_untouched(t):
    assert np.all(t["w"].numpy() == 7.0) and np.all(t["b"].numpy() == 7.0) and t["step"] is None


# ------------------------------------------------------------------------------------------- strict metadata


def _set(path, value):
    def fn(md):
        obj = md
        for p in path[:-1]:
            obj = obj[p]
        obj[path[-1]] = value

    return fn


FIELD_CASES = [
    (("world_size",), "2", "world_size"),
    (("world_size",), True, "world_size"),
    (("chunk_bytes",), 1048576.0, "chunk_bytes"),
    (("chunk_bytes",), [1048576], "chunk_bytes"),
    (("checksum",), ["xxh3-64"], "checksum"),
    (("created_unix",), "yesterday", "created_unix"),
    (("checkpoint_id",), 12, "checkpoint_id"),
    (("files", "0_0.safetensors", "size"), "123", "files['0_0.safetensors'].size"),
    (("files", "0_0.safetensors", "rank"), -1, "files['0_0.safetensors'].rank"),
    (("tensors", "w", "dtype"), ["float32"], "tensors['w'].dtype"),
    (("tensors", "w", "shape"), [4.0, 8], "tensors['w'].shape[0]"),
    (("tensors", "w", "shape"), "4,8", "tensors['w'].shape"),
    (("tensors", "w", "pieces", 0, "offset"), "64", "tensors['w'].pieces[0].offset"),
    (("tensors", "w", "pieces", 0, "nbytes"), 128.5, "tensors['w'].pieces[0].nbytes"),
    (("tensors", "w", "pieces", 0, "file"), ["0_0.safetensors"], "tensors['w'].pieces[0].file"),
    (("tensors", "w", "pieces", 0, "box_offset"), [0, None], "tensors['w'].pieces[0].box_offset[1]"),
    (("tensors", "w", "pieces", 0, "flat_range"), [0, 1, 2], "tensors['w'].pieces[0].flat_range"),
    (("tensors", "w", "pieces", 0, "checksums"), ["1"], "tensors['w'].pieces[0].checksums"),
    (("tensors", "w", "pieces"), {"0": 1}, "tensors['w'].pieces"),
    (("tensors",), [], "tensors"),
]


@pytest.mark.parametrize("path, value, field", FIELD_CASES, ids=[c[2] + "=" + repr(c[1]) for c in FIELD_CASES])
def test_wrong_field_types_are_refused_naming_the_field(saved, path, value, field):
    _, ckpt = saved
    edit_metadata(ckpt, _set(path, value))
    t = targets()
    with pytest.raises(ck.MetadataError, match=f"field {__import__('re').escape(field)}"):
        ck.load_state_dict(t, str(ckpt))
    assert_untouched(t)
    with pytest.raises(ck.MetadataError):
        ck.load_full_state_dict(str(ckpt))
    assert ck.verify_checkpoint(str(ckpt))


@pytest.mark.parametrize(
    "token, match",
    [
        ("NaN", "NaN is not allowed"),
        ("Infinity", "Infinity is not allowed"),
        ("-Infinity", "Infinity is not allowed"),
        ("1e400", "overflows"),
        ("1" * 60, "digits"),
        ("[" * 5000 + "]" * 5000, "nest"),
        ("[" * 70 + "]" * 70, "nest"),
    ],
)
def test_non_finite_huge_and_deep_json_is_metadata_error(saved, token, match):
    _, ckpt = saved
    md = json.loads((ckpt / "metadata.json").read_bytes())
    md["values"]["step"] = "__X__"
    from crafted import reseal

    reseal(ckpt, json.dumps(md).replace('"__X__"', token).encode())
    t = targets()
    with pytest.raises(ck.MetadataError, match=match):
        ck.load_state_dict(t, str(ckpt))
    assert_untouched(t)
    probs = ck.verify_checkpoint(str(ckpt))
    assert len(probs) == 1 and "MetadataError" in probs[0]


def test_metadata_size_is_capped_before_reading(saved, monkeypatch):
    """A sparse multi-GB metadata.json is refused from its size, without reading it (instant, no memory)."""
    _, ckpt = saved
    with open(ckpt / "metadata.json", "r+b") as f:
        f.truncate(3 << 30)
    tracemalloc.start()
    try:
        with pytest.raises(ck.MetadataError, match="more than the limit"):
            ck.read_metadata(str(ckpt))
        assert tracemalloc.get_traced_memory()[1] < 16 << 20
    finally:
        tracemalloc.stop()


def test_metadata_cap_and_open_file_cap_are_options(saved, monkeypatch):
    _, ckpt = saved
    small = ck.CheckpointOptions(max_metadata_bytes=64)
    with pytest.raises(ck.MetadataError, match="more than the limit of 64 bytes"):
        ck.load_full_state_dict(str(ckpt), options=small)
    monkeypatch.setenv("PADDLE_FSDP_CKPT_MAX_METADATA_BYTES", "64")
    with pytest.raises(ck.MetadataError, match="limit of 64 bytes"):
        ck.read_metadata(str(ckpt))
    assert ck.CheckpointOptions.from_env({"PADDLE_FSDP_CKPT_MAX_OPEN_FILES": "7"}).max_open_files == 7


def test_non_finite_values_are_refused_at_save_naming_the_key(tmp_path):
    with pytest.raises(ck.InvalidStateDictError, match="'loss'.*non-finite"):
        ck.save_state_dict({"x": paddle.zeros([2]), "loss": float("nan")}, str(tmp_path / "c"))
    with pytest.raises(ck.InvalidStateDictError, match="'cfg'.*nesting"):
        deep: list = []
        for _ in range(100):
            deep = [deep]
        ck.save_state_dict({"x": paddle.zeros([2]), "cfg": deep}, str(tmp_path / "c"))
    assert not (tmp_path / "c").exists()


# --------------------------------------------------------------------------------------------- exact coverage


def test_overlap_with_gap_is_refused_before_any_data_is_read(tmp_path, monkeypatch):
    """8 + 8 = 16 of 16 elements with valid checksums, overlapping on [4, 8) and leaving [12, 16) uncovered."""
    full = np.arange(16, dtype=np.float32)
    craft(tmp_path / "c", {"v": full}, {"v": [(0, (0,), (16,), (0, 8)), (1, (0,), (16,), (4, 12))]})
    reads = []
    real = reader.FileSet.pread_into
    monkeypatch.setattr(reader.FileSet, "pread_into", lambda self, *a: (reads.append(a), real(self, *a))[1])
    t = {"v": paddle.full([16], 7.0)}
    with pytest.raises(ck.CorruptCheckpointError, match="overlapping records"):
        ck.load_state_dict(t, str(tmp_path / "c"))
    assert np.all(t["v"].numpy() == 7.0)
    with pytest.raises(ck.CorruptCheckpointError, match="overlapping records"):
        ck.load_full_state_dict(str(tmp_path / "c"))
    assert reads == [], "data was read before the coverage check"
    assert any("overlapping records" in p for p in ck.verify_checkpoint(str(tmp_path / "c")))


def test_gap_alone_is_refused_and_exact_multi_file_layouts_load(tmp_path):
    arr = np.arange(60, dtype=np.float32).reshape(6, 10)
    pieces = [(0, (0, 0), (6, 4), None), (1, (0, 4), (6, 6), None)]
    craft(tmp_path / "ok", {"w": arr}, {"w": pieces})
    t = {"w": paddle.zeros([6, 10])}
    ck.load_state_dict(t, str(tmp_path / "ok"))
    assert np.array_equal(t["w"].numpy(), arr)
    craft(tmp_path / "gap", {"w": arr}, {"w": pieces[:1]})
    with pytest.raises(ck.CorruptCheckpointError, match="cover 24 of 60"):
        ck.load_state_dict({"w": paddle.zeros([6, 10])}, str(tmp_path / "gap"))


def test_declared_huge_column_box_costs_no_memory(tmp_path):
    """A small index declaring a 2**31-row column box: every reader refuses it by name, with memory bounded by the
    bytes on disk (a run-based check or an allocation by declared shape would need gigabytes)."""
    arr = np.arange(8, dtype=np.float32).reshape(4, 2)
    craft(tmp_path / "c", {"w": arr}, {"w": [(0, (0, 0), (4, 1), None), (0, (0, 1), (4, 1), None)]})

    def huge(md):
        rows = 1 << 31
        tm = md["tensors"]["w"]
        tm["shape"] = [rows, 2]
        for p in tm["pieces"]:
            p["box_shape"] = [rows, 1]
            p["nbytes"] = rows * 4
            p["checksums"] = [0] * 0
        md["checksum"] = "none"
        md["files"]["0_0.safetensors"]["size"] = 1 << 40

    edit_metadata(tmp_path / "c", huge)
    tracemalloc.start()
    try:
        with pytest.raises(ck.CheckpointError):
            ck.load_full_state_dict(str(tmp_path / "c"))
        with pytest.raises(ck.CheckpointError):
            ck.load_state_dict({"w": paddle.zeros([4, 2])}, str(tmp_path / "c"))
        assert ck.verify_checkpoint(str(tmp_path / "c"))
        assert tracemalloc.get_traced_memory()[1] < 64 << 20
    finally:
        tracemalloc.stop()


# ------------------------------------------------------------------------------------------ files and kinds


@pytest.mark.parametrize("name", ["0_0.safetensors", "metadata.json", "COMMIT"])
@pytest.mark.parametrize("kind", ["fifo", "dir", "chardev"])
def test_non_regular_files_are_refused_without_blocking(saved, name, kind):
    _, ckpt = saved
    target = ckpt / name
    target.unlink()
    if kind == "fifo":
        os.mkfifo(target)
    elif kind == "dir":
        target.mkdir()
    else:
        try:
            os.mknod(target, 0o600 | __import__("stat").S_IFCHR, os.makedev(1, 5))  # /dev/zero
        except PermissionError:
            pytest.skip("mknod not permitted here")
    t = targets()
    with alarm(30, f"load with a {kind} as {name}"):
        with pytest.raises(ck.CheckpointError):
            ck.load_state_dict(t, str(ckpt))
        with pytest.raises(ck.CheckpointError):
            ck.load_full_state_dict(str(ckpt))
        assert ck.verify_checkpoint(str(ckpt))
    assert_untouched(t)


def test_fifo_as_latest_pointer_does_not_hang(tmp_path):
    mgr = ck.CheckpointManager(tmp_path / "run")
    mgr.save(1, {"x": paddle.ones([3])})
    (tmp_path / "run" / "latest").unlink()
    os.mkfifo(tmp_path / "run" / "latest")
    with alarm(30, "latest() with a FIFO as the pointer"):
        assert mgr.latest_step() == 1  # falls back to the highest committed step


def test_any_number_of_data_files_under_a_low_open_file_limit(tmp_path):
    """1,100 data files read under RLIMIT_NOFILE=256 (in a subprocess): load_full, verify and load succeed."""
    n = 1100
    arr = np.arange(n * 4, dtype=np.float32)
    craft(tmp_path / "c", {"v": arr}, {"v": [(i, (0,), (n * 4,), fr) for i, fr in enumerate(flat_boxes((n * 4,), n))]})
    script = textwrap.dedent(
        f"""
        import resource, sys
        import numpy as np
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        import paddle
        import paddle.distributed.fsdp.checkpoint as ck
        path = {str(tmp_path / "c")!r}
        full = ck.load_full_state_dict(path)
        assert np.array_equal(full["v"].numpy(), np.arange({n * 4}, dtype=np.float32))
        assert ck.verify_checkpoint(path) == []
        t = {{"v": paddle.zeros([{n * 4}])}}
        ck.load_state_dict(t, path)
        assert np.array_equal(t["v"].numpy(), np.arange({n * 4}, dtype=np.float32))
        print("OK")
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


# ----------------------------------------------------------------------------------------- removal races


def _remove_when_first_opened(monkeypatch, ckpt: Path):
    """Make the checkpoint disappear (as keep_last rotation does: rename away, delete) when a reader first
    opens one of its data files."""
    real = reader.FileSet._open
    done = []

    def racing(self, name, flags=0):
        if not done and os.path.isdir(ckpt):
            done.append(1)
            trash = ckpt.parent / f".trash-{ckpt.name}"
            os.rename(ckpt, trash)
            shutil.rmtree(trash)
        return real(self, name, flags)

    monkeypatch.setattr(reader.FileSet, "_open", racing)


@pytest.mark.parametrize("reader", ["load", "load_full", "verify"])
def test_reader_losing_a_race_with_removal_says_removed(saved, monkeypatch, reader):
    _, ckpt = saved
    _remove_when_first_opened(monkeypatch, ckpt)
    t = targets()
    if reader == "verify":
        probs = ck.verify_checkpoint(str(ckpt))
        assert len(probs) == 1 and probs[0].startswith("CheckpointRemovedError") and "removed" in probs[0], probs
        return
    with pytest.raises(ck.CheckpointRemovedError, match="removed"):
        if reader == "load":
            ck.load_state_dict(t, str(ckpt))
        else:
            ck.load_full_state_dict(str(ckpt))
    assert_untouched(t)


def _remove_when_object_first_read(monkeypatch, ckpt: Path, obj: str):
    """Make the checkpoint disappear (as keep_last rotation does) when a reader first opens ``obj`` (an index
    object or a checksum sidecar: read while a load validates, before any data file is opened)."""
    from paddle.distributed.fsdp.checkpoint.io.local import LocalStorage

    real = LocalStorage.open_read
    done = []

    def racing(self, location, name):
        if name == obj and not done and os.path.isdir(ckpt):
            done.append(1)
            trash = ckpt.parent / f".trash-{ckpt.name}"
            os.rename(ckpt, trash)
            shutil.rmtree(trash)
        return real(self, location, name)

    monkeypatch.setattr(LocalStorage, "open_read", racing)
    return done


@pytest.mark.parametrize("obj", ["index.pieces", "0_0.safetensors.sums"])
@pytest.mark.parametrize("reader", ["load", "load_atomic", "load_full", "verify", "cli_verify"])
def test_removal_while_the_index_is_read_says_removed(saved, monkeypatch, capsys, reader, obj):
    """Issue 40: removed by rotation while a load validates (its index rows, its checksums), while verify
    reads the rows, while the CLI prefetches them: CheckpointRemovedError everywhere, never "corrupt"."""
    from paddle.distributed.fsdp.tools.cli import main

    _, ckpt = saved
    done = _remove_when_object_first_read(monkeypatch, ckpt, obj)
    t = targets()
    if reader == "verify":
        probs = ck.verify_checkpoint(str(ckpt))
        assert len(probs) == 1 and probs[0].startswith("CheckpointRemovedError"), probs
    elif reader == "cli_verify":
        rc = main(["verify", str(ckpt)])
        out = capsys.readouterr()
        assert rc == 4 and "removed" in out.err and "NOT sound" not in out.err and "internal" not in out.err, out
    else:
        with pytest.raises(ck.CheckpointRemovedError, match="removed"):
            if reader == "load_full":
                ck.load_full_state_dict(str(ckpt))
            else:
                ck.load_state_dict(t, str(ckpt), atomic=reader == "load_atomic")
        assert_untouched(t)
    assert done


def test_load_latest_retries_with_the_new_latest_after_rotation(tmp_path, monkeypatch):
    mgr = ck.CheckpointManager(tmp_path / "run", keep_last=1)
    mgr.save(1, {"x": paddle.full([4], 1.0)})
    real = reader.FileSet._open
    raced = []

    def racing(self, name, flags=0):
        if not raced:  # a newer save lands and rotation removes the checkpoint being read
            raced.append(1)
            monkeypatch.setattr(reader.FileSet, "_open", real)
            mgr.save(2, {"x": paddle.full([4], 2.0)})
            import threading

            for th in threading.enumerate():
                if th.name == "ckpt-prune":
                    th.join()
        return real(self, name, flags)

    monkeypatch.setattr(reader.FileSet, "_open", racing)
    t = {"x": paddle.zeros([4])}
    mgr.load_latest(t)
    assert raced and np.all(t["x"].numpy() == 2.0)


# --------------------------------------------------------------------------------------------- save failures


def _join_background_deletes() -> None:
    import threading

    for th in threading.enumerate():
        if th.name in ("ckpt-prune", "ckpt-rm-old"):
            th.join()


STAGE_FAULTS = [
    ("before_data", "EROFS"),
    ("mid_data", "ENOSPC"),
    ("after_data", "EIO"),
    ("before_metadata", "EIO"),
    ("before_commit", "ENOSPC"),
    ("before_rename", "EACCES"),
]


# a full disk at every stage of the save protocol that writes (the coordinator's stages included)
STAGE_FAULTS += [(stage, "ENOSPC") for stage in fault_storage.STAGES[:6] if (stage, "ENOSPC") not in STAGE_FAULTS]


@pytest.mark.parametrize("stage, code", STAGE_FAULTS)
def test_injected_io_error_at_each_stage_is_a_named_save_failure(tmp_path, monkeypatch, stage, code):
    """... and the failed save removes everything it wrote (its ``ckpt.tmp-<id>`` staging) before it raises."""
    path = tmp_path / "ckpt"
    first = {"x": paddle.rand([1 << 16]), "step": 1}
    ck.save_state_dict(first, str(path))
    monkeypatch.setenv(fault_storage.ENV, f"{stage}:0:1:{code}")
    strerror = os.strerror(getattr(__import__("errno"), code))
    with fault_storage.installed(), pytest.raises(ck.SaveFailedError, match=f"rank 0 .*Error: .*{strerror}"):
        ck.save_state_dict({"x": paddle.rand([1 << 16]), "step": 2}, str(path))
    monkeypatch.delenv(fault_storage.ENV)
    t = {"x": paddle.zeros([1 << 16]), "step": None}
    ck.load_state_dict(t, str(path))  # the previous checkpoint is intact
    assert np.array_equal(bits(t["x"]), bits(first["x"])) and t["step"] == 1
    leftovers = [p.name for p in tmp_path.iterdir() if p.name != "ckpt"]
    assert not leftovers, f"the failed save left {leftovers} behind"
    ck.save_state_dict({"x": paddle.rand([1 << 16]), "step": 3}, str(path))
    _join_background_deletes()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("ckpt.tmp-")], "failed staging not removed"
    assert ck.verify_checkpoint(str(path)) == []


@pytest.mark.parametrize("detail_written", [True, False])
def test_failure_markers_name_rank_errno_and_strerror_with_or_without_their_detail(tmp_path, detail_written):
    """What a failed save's records say (save/markers.py; read by loads and verify of the staging, and by the cleanup
    of failed stagings; the ranks themselves learn of failures through the channel). The detail file is written
    before the marker
    named by the cause, so a rank that sees a marker sees the full cause; on a full disk only the named (empty)
    marker exists, and it still says the errno and its strerror (once the coordinator's ``ABORT.EIO`` alone read
    as a bare "EIO", which failed an assertion on one rank only and crashed a 2-rank job under load)."""
    import importlib

    markers = importlib.import_module("paddle.distributed.fsdp.checkpoint.save.markers")
    local = importlib.import_module("paddle.distributed.fsdp.checkpoint.io.local").LOCAL
    parts = tmp_path / ".parts"
    parts.mkdir()
    (parts / "1.failed.ENOSPC").touch()
    (parts / "ABORT.EIO").touch()
    if detail_written:
        (parts / "1.failed.json").write_text(json.dumps({"error": "OSError: [Errno 28] No space left on device [x]"}))
        (parts / "ABORT").write_text("OSError: [Errno 5] Input/output error [x]")
    failed, aborted = markers.failures(local, str(tmp_path)), markers.aborted(local, str(tmp_path))
    assert list(failed) == [1]
    for text, code in ((failed[1], "ENOSPC"), (aborted, "EIO")):
        assert os.strerror(getattr(__import__("errno"), code)) in text, text
        assert ("[x]" in text) == detail_written, text
        assert detail_written or code in text, text


@pytest.fixture
def small_tmpfs(tmp_path):
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_full_tmpfs_save_fails_named_and_a_fitting_save_succeeds(small_tmpfs):
    path = small_tmpfs / "ckpt"
    first = {"x": paddle.rand([200_000])}  # 0.8 MB
    ck.save_state_dict(first, str(path), write_stock_metadata=False)
    with alarm(60, "a save into a full tmpfs"):
        with pytest.raises(ck.SaveFailedError, match="rank 0 failed: OSError: .*No space left"):
            ck.save_state_dict({"x": paddle.rand([400_000])}, str(path), write_stock_metadata=False)
    t = {"x": paddle.zeros([200_000])}
    ck.load_state_dict(t, str(path))
    assert np.array_equal(bits(t["x"]), bits(first["x"]))
    second = {"x": paddle.rand([150_000])}
    ck.save_state_dict(second, str(small_tmpfs / "other"), write_stock_metadata=False)  # fits: space was freed
    ck.save_state_dict(second, str(path), write_stock_metadata=False)
    _join_background_deletes()
    assert sorted(p.name for p in small_tmpfs.iterdir()) == ["ckpt", "other"]


@pytest.fixture
def tmpfs_20m(tmp_path):
    mnt = tmp_path / "tmpfs20"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=20m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()} (the injected ENOSPC cases above still run)")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _fill(path: Path) -> None:
    """Take every free byte of the file system at ``path``'s directory (a ballast file)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        for block in (1 << 20, 4096):
            try:
                while True:
                    os.write(fd, b"\0" * block)
            except OSError:
                pass
    finally:
        os.close(fd)


@pytest.mark.parametrize("ballast", [False, True], ids=["fills_while_writing", "already_full"])
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_save_failing_on_a_full_tmpfs_removes_its_staging(tmpfs_20m, ballast, async_save):
    """Issue 29: a 13 MB save onto a 20 MiB tmpfs holding an 8 MB checkpoint fails; it must leave nothing behind
    (once: ``ckpt.tmp-<id>`` stayed), also when the disk is full to the last block while it cleans up (ballast);
    once the space is back, the same save succeeds."""
    path = tmpfs_20m / "ckpt"
    first = {"x": paddle.rand([2_000_000])}
    ck.save_state_dict(first, str(path))
    if ballast:
        _fill(tmpfs_20m / "ballast")
    free_before = os.statvfs(tmpfs_20m).f_bfree
    big = {"x": paddle.rand([3_300_000])}
    with alarm(60, "a save into a full tmpfs"):
        with pytest.raises(ck.SaveFailedError, match="No space left"):
            h = ck.save_state_dict(big, str(path), async_save=async_save)
            if h is not None:
                h.wait()
    assert sorted(p.name for p in tmpfs_20m.iterdir()) == ["ballast", "ckpt"][int(not ballast) :]
    assert os.statvfs(tmpfs_20m).f_bfree == free_before, "the failed save did not give all its space back"
    t = {"x": paddle.zeros([2_000_000])}
    ck.load_state_dict(t, str(path))
    assert np.array_equal(bits(t["x"]), bits(first["x"]))
    if ballast:
        (tmpfs_20m / "ballast").unlink()
    shutil.rmtree(path)  # space for the bigger checkpoint (the replaced one is only deleted after the commit)
    ck.save_state_dict(big, str(path))
    t = {"x": paddle.zeros([3_300_000])}
    ck.load_state_dict(t, str(path))
    assert np.array_equal(bits(t["x"]), bits(big["x"]))
    assert sorted(p.name for p in tmpfs_20m.iterdir()) == ["ckpt"]


def test_read_only_directory_is_a_named_save_failure(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    r = subprocess.run(["mount", "--bind", "-o", "ro", str(ro), str(ro)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot bind-mount read-only here: {r.stderr.strip()}")
    try:
        subprocess.run(["mount", "-o", "remount,ro,bind", str(ro)], capture_output=True)
        with pytest.raises(ck.SaveFailedError, match="rank 0 failed: OSError: .*Read-only"):
            ck.save_state_dict({"x": paddle.zeros([4])}, str(ro / "ckpt"))
    finally:
        subprocess.run(["umount", "-l", str(ro)], capture_output=True)


# --------------------------------------------------------------------------------------------------- the CLI


@pytest.mark.parametrize(
    "damage",
    ["infinity", "deep", "fifo_metadata", "wrong_type", "missing", "huge_header", "not_json_commit", "sparse_metadata"],
)
def test_cli_answers_bad_input_with_one_line_and_never_exit_3(saved, damage, capsys):
    from paddle.distributed.fsdp.tools.cli import main

    _, ckpt = saved
    md = ckpt / "metadata.json"
    if damage == "infinity":
        edit_metadata(ckpt, _set(("created_unix",), "__X__"))
        from crafted import reseal

        reseal(ckpt, md.read_bytes().replace(b'"__X__"', b"Infinity"))
    elif damage == "deep":
        from crafted import reseal

        reseal(ckpt, md.read_bytes().replace(b'"step":3', b'"step":' + b"[" * 5000 + b"]" * 5000))
    elif damage == "fifo_metadata":
        md.unlink()
        os.mkfifo(md)
    elif damage == "wrong_type":
        edit_metadata(ckpt, _set(("tensors", "w", "shape"), ["4", "8"]))
    elif damage == "missing":
        shutil.rmtree(ckpt)
    elif damage == "huge_header":
        f = ckpt / "0_0.safetensors"
        raw = bytearray(f.read_bytes())
        raw[:8] = (1 << 62).to_bytes(8, "little")
        f.write_bytes(bytes(raw))
    elif damage == "not_json_commit":
        (ckpt / "COMMIT").write_bytes(b"\xff\xfe{")
    elif damage == "sparse_metadata":
        with open(md, "r+b") as fh:
            fh.truncate(3 << 30)
    with alarm(60, f"the CLI on {damage}"):
        rc_inspect = main(["inspect", str(ckpt)])
        err_inspect = capsys.readouterr().err
        rc_verify = main(["verify", str(ckpt)])
        err_verify = capsys.readouterr()
    assert rc_inspect in (0, 2) and rc_verify in (1, 2), (rc_inspect, rc_verify, err_inspect, err_verify)
    if rc_inspect == 2:
        assert len(err_inspect.strip().splitlines()) == 1 and "internal error" not in err_inspect, err_inspect
    assert "internal error" not in err_verify.err


# ------------------------------------------------------------------------------- coverage against brute force


def _random_region(rng, shape):
    from paddle.distributed.fsdp.checkpoint import planner

    off = tuple(int(rng.integers(0, s)) for s in shape)
    box = tuple(int(rng.integers(0, s - o + 1)) for o, s in zip(off, shape))
    fr = None
    if rng.random() < 0.5:
        m = int(np.prod(box))
        a = int(rng.integers(0, m + 1))
        fr = (a, int(rng.integers(a, m + 1)))
    return planner.Region(shape, off, box, fr)


def test_box_coverage_and_flat_span_agree_with_the_run_based_brute_force():
    """The bounded (box-based) coverage check gives the run-based verdicts (and its gap messages), and a region's
    flat span from its bounds equals the span of its listed runs, on random regions of 1-3 dimensions."""
    from paddle.distributed.fsdp.checkpoint.format.coverage import (
        coverage_problems,
        flat_range_boxes,
        flat_span,
        runs_coverage_problems,
    )

    rng = np.random.default_rng(11)
    for _ in range(3000):
        shape = tuple(int(x) for x in rng.integers(1, 5, size=int(rng.integers(1, 4))))
        regions = [(i, _random_region(rng, shape)) for i in range(int(rng.integers(0, 5)))]
        got = coverage_problems("k", shape, regions)
        want = runs_coverage_problems("k", int(np.prod(shape)), regions)
        assert bool(got) == bool(want), (shape, regions, got, want)
        if want and "cover" in want[0]:
            assert got == want
        for _o, r in regions:
            st, ln = r.runs()
            assert flat_span(shape, r.box_offset, r.box_shape, r.flat_range) == (
                (0, 0) if len(st) == 0 else (int(st[0]), int(st[-1] + ln[-1]))
            )
            if r.flat_range is not None:
                assert len(flat_range_boxes(r.box_shape, *r.flat_range)) <= 2 * len(shape) + 1


def test_load_checkpoint_of_a_root_retries_after_rotation(tmp_path, monkeypatch):
    """load_checkpoint(root) whose checkpoint is removed by keep_last rotation while it is read loads what
    `latest` names now (one process)."""
    import threading

    from paddle.distributed.fsdp import FullyShardFusion

    paddle.seed(1)
    model = paddle.nn.Linear(4, 4)
    fsdp = FullyShardFusion(model)
    opt = paddle.optimizer.AdamW(0.01, parameters=model.parameters())
    model(paddle.ones([2, 4])).sum().backward()
    opt.step()
    opt.clear_grad()
    root = tmp_path / "run"
    fsdp.save_checkpoint(str(root), optimizer=opt, step=1, keep_last=1, extra_state={"step": 1})
    real = reader.FileSet._open
    raced = []

    def racing(self, name, flags=0):
        if not raced:  # a newer save lands; rotation removes step 1 while it is being read
            raced.append(1)
            monkeypatch.setattr(reader.FileSet, "_open", real)
            with paddle.no_grad():
                model.weight.set_value(paddle.full(model.weight.shape, 2.0))
            fsdp.save_checkpoint(str(root), optimizer=opt, step=2, keep_last=1, extra_state={"step": 2})
            with paddle.no_grad():
                model.weight.set_value(paddle.zeros(model.weight.shape))
            for th in threading.enumerate():
                if th.name in ("ckpt-prune", "ckpt-rm-old"):
                    th.join()
        return real(self, name, flags)

    monkeypatch.setattr(reader.FileSet, "_open", racing)
    result = fsdp.load_checkpoint(str(root), optimizer=opt)
    assert raced and result.step == 2 and result["step"] == 2
    assert np.all(fsdp.full_parameters()["weight"].numpy() == 2.0)
