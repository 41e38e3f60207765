"""Memory-bounded loads: the engine's own host-memory account stays within the budget, for whole pieces (same
world), partial ranges and boxes (changed world) and staged (device-like) targets; corrupt data found mid-load
raises PartiallyLoadedError on every rank, and ``load_checkpoint(root)`` falls back to the older checkpoint."""

from __future__ import annotations

import os

import numpy as np
import paddle
import paddle.distributed.fsdp.checkpoint as ck
import pytest
from _results import assert_case_ok
from launch_util import run_launch
from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight
from paddle.distributed.fsdp.checkpoint import host_memory
from paddle.distributed.fsdp.checkpoint.load import job as load_job
from paddle.distributed.fsdp.checkpoint.load import load as ck_load

KIB = 1 << 10
CHUNK = 64 * KIB
BUDGET = 512 * KIB
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "bounded_load.py")


def bits(t) -> np.ndarray:
    return np.ascontiguousarray(t.numpy()).view(np.uint8).ravel().copy()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """~12 MiB in tensors of many checksum chunks (64 KiB), saved as whole pieces."""
    paddle.seed(5)
    sd = {f"t{i}": paddle.rand([300 + 37 * i, 1500]) for i in range(6)}
    sd["vec"] = paddle.rand([1_000_003])
    path = tmp_path_factory.mktemp("bounded") / "ckpt"
    ck.save_state_dict(sd, str(path), chunk_bytes=CHUNK)
    full = {k: v.numpy() for k, v in sd.items()}
    return path, full


def test_default_budget_is_64_mib_or_2_percent():
    assert ck_load.default_load_budget(0) == 64 << 20
    assert ck_load.default_load_budget(1 << 30) == 64 << 20
    assert ck_load.default_load_budget(100 << 30) == int(0.02 * (100 << 30))


@pytest.fixture(params=["cached", "uncached"])
def page_cache(request, monkeypatch):
    """Both read paths: chunks checked inline right after each copy (file in the page cache), or slabs checked
    on the helper threads (file on disk)."""
    from paddle.distributed.fsdp.checkpoint import reader

    monkeypatch.setattr(reader.FileSet, "mostly_cached", lambda self, name: request.param == "cached")
    return request.param


def test_same_world_load_reads_into_the_targets_within_the_budget(saved, page_cache):
    path, full = saved
    targets = {k: paddle.full(list(v.shape), -1.0) for k, v in full.items()}
    ptrs = {k: t.data_ptr() for k, t in targets.items()}
    report = ck.load_state_dict(targets, str(path), max_host_bytes=BUDGET)
    assert report.host_budget == BUDGET and report.peak_host_bytes <= BUDGET
    for k, t in targets.items():
        assert t.data_ptr() == ptrs[k] and np.array_equal(t.numpy(), full[k]), k
    # the account is real: an atomic load of the same state holds a copy of it
    atomic = ck.load_state_dict(targets, str(path), atomic=True)
    state_bytes = sum(v.nbytes for v in full.values())
    assert atomic.atomic and atomic.peak_host_bytes >= state_bytes > 10 * BUDGET


def _changed_world_targets(full: dict, rank: int, world: int) -> tuple[dict, dict]:
    """Rank ``rank`` of ``world``: flattened ranges not aligned to chunks, and boxes of column ranges (rows of
    small scattered reads), as a load into another world size asks."""
    targets, want = {}, {}
    for k, v in full.items():
        n = v.size
        a, b = n * rank // world + 3, n * (rank + 1) // world - 5
        if k.startswith("t") and int(k[1:]) % 2:
            rows, cols = v.shape
            c0, c1 = cols * rank // world + 1, cols * (rank + 1) // world
            targets[k] = ShardedWeight(k, paddle.full([rows, c1 - c0], -1.0), [rows, c1 - c0], [rows, cols], [0, c0])
            want[k] = v[:, c0:c1]
        else:
            local = paddle.full([b - a], -1.0)
            targets[k] = ShardedWeight(
                k, local, list(v.shape), list(v.shape), [0] * v.ndim, is_flattened=True, flattened_range=slice(a, b)
            )
            want[k] = v.reshape(-1)[a:b]
    return targets, want


@pytest.mark.parametrize("rank", [0, 1, 2])
def test_changed_world_load_stays_within_the_budget(saved, rank, page_cache):
    path, full = saved
    targets, want = _changed_world_targets(full, rank, 3)
    report = ck.load_state_dict(targets, str(path), max_host_bytes=BUDGET)
    assert report.peak_host_bytes <= BUDGET, report.peak_host_bytes
    assert report.peak_host_bytes > 0  # bounce chunks and read windows were used, and counted
    for k, sw in targets.items():
        assert np.array_equal(sw.local_tensor.numpy(), want[k]), k


@pytest.mark.parametrize("seed", range(4))
def test_one_chunk_steps_of_cached_reads_agree_with_the_running_digest_path(tmp_path, monkeypatch, seed):
    """A cached read whose steps are exactly one chunk (the default) hashes each step in one shot: it loads the
    same bytes as the running-digest path (steps of half a chunk) and, for a flipped byte anywhere in a piece,
    raises the same error naming the same chunk."""
    from paddle.distributed.fsdp.checkpoint import ranges, reader

    monkeypatch.setattr(reader.FileSet, "mostly_cached", lambda self, name: True)
    C = reader.CACHE_STEP
    rng = np.random.default_rng(seed)
    sizes = [C // 4 * int(rng.integers(9, 17)) + int(rng.integers(0, 4)), 2 * C // 4, C // 4 * 5]  # float32s
    sd = {f"p{i}": paddle.to_tensor(rng.random(n, dtype=np.float32)) for i, n in enumerate(sizes)}
    full = {k: v.numpy() for k, v in sd.items()}
    path = tmp_path / "ckpt"
    ck.save_state_dict(sd, str(path), chunk_bytes=C)

    def load_with(step: int, where):
        monkeypatch.setattr(ranges, "CACHE_STEP", step)
        whole = {k: paddle.full(list(v.shape), -1.0) for k, v in full.items()}
        parts, want = _changed_world_targets(full, int(rng.integers(0, 3)), 3)  # unaligned heads and tails
        try:
            ck.load_state_dict(whole, str(where))
            ck.load_state_dict(parts, str(where))
        except ck.PartiallyLoadedError as e:
            return str(e)
        for k, t in whole.items():
            assert np.array_equal(t.numpy(), full[k]), k
        for k, sw in parts.items():
            assert np.array_equal(sw.local_tensor.numpy(), want[k]), k
        return None

    assert load_with(C, path) is None and load_with(C // 2, path) is None
    data = next(p for p in path.iterdir() if p.name.endswith(".safetensors"))
    raw = data.read_bytes()
    md = ck.read_metadata(str(path))
    for _ in range(3):
        key = f"p{int(rng.integers(0, len(sizes)))}"
        piece = md.tensors[key].pieces[0]
        at = int(rng.integers(0, piece.nbytes))
        bad = bytearray(raw)
        bad[piece.offset + at] ^= 0x10
        data.write_bytes(bytes(bad))
        one_shot, running = load_with(C, path), load_with(C // 2, path)
        assert one_shot is not None and one_shot == running, (one_shot, running)
        assert f"for key {key!r} (chunk {at // C}," in one_shot
    data.write_bytes(raw)


def test_staged_targets_go_through_row_windows_within_the_budget(saved, monkeypatch):
    """Targets that cannot be read into directly (device tensors; here host tensors on the same path) are
    filled through a staging window of rows and copied with ``Tensor.copy_`` into the same memory."""
    path, full = saved
    monkeypatch.setattr(host_memory, "is_host_contiguous", lambda t: False)  # every target takes the device path
    staged = ck.CheckpointOptions()
    targets = {k: paddle.full(list(v.shape), -1.0) for k, v in full.items()}
    ptrs = {k: t.data_ptr() for k, t in targets.items()}
    report = ck.load_state_dict(targets, str(path), max_host_bytes=BUDGET, options=staged)
    assert 0 < report.peak_host_bytes <= BUDGET
    for k, t in targets.items():
        assert t.data_ptr() == ptrs[k] and np.array_equal(t.numpy(), full[k]), k
    targets, want = _changed_world_targets(full, 1, 3)
    report = ck.load_state_dict(targets, str(path), max_host_bytes=BUDGET, options=staged)
    assert report.peak_host_bytes <= BUDGET
    for k, sw in targets.items():
        assert np.array_equal(sw.local_tensor.numpy(), want[k]), k


def test_checks_before_writing_leave_targets_identical_and_corrupt_data_is_named(saved, tmp_path, page_cache):
    """A missing key is refused before any byte is written; a flipped byte is found mid-load and reported as
    PartiallyLoadedError (the targets were written in part)."""
    path, full = saved
    targets = {k: paddle.full(list(v.shape), -1.0) for k, v in full.items()}
    targets["absent"] = paddle.zeros([3])
    with pytest.raises(ck.MissingKeyError, match="absent"):
        ck.load_state_dict(targets, str(path))
    assert all(bool((t.numpy() == -1.0).all()) for k, t in targets.items() if k != "absent")
    del targets["absent"]
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    data = next(p for p in bad.iterdir() if p.name.endswith(".safetensors"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) - 1000] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(ck.PartiallyLoadedError, match="checksum mismatch.*mix of their previous"):
        ck.load_state_dict(targets, str(bad))


def test_corrupt_byte_on_one_rank_fails_every_rank_and_the_root_falls_back(tmp_path):
    result = run_launch(WORKER, 2, [str(tmp_path)], log_dir=tmp_path / "logs")
    for case in ("partial", "atomic", "fallback", "bounded"):
        assert_case_ok(result, case, 2)


def test_reads_go_in_file_order_with_tiny_reads_last(tmp_path, monkeypatch):
    """One sequential pass per file, whatever order the targets come in: tiny reads (scalars) interleaved with
    large pieces in the file are done after it (ahead of it they broke the kernel's readahead: 2x the I/O
    requests of a cold load here)."""
    from paddle.distributed.fsdp.checkpoint import reader, regions

    sd = {}
    for i in range(5):
        sd[f"b{i}.big"] = paddle.rand([64, 1024])  # 256 KiB: read straight into the target
        sd[f"b{i}.scalar"] = paddle.rand([1])  # 4 bytes, stored right after it
    path = tmp_path / "ckpt"
    # written through the page cache, so the load reads it with buffered reads at the pieces' own offsets
    ck.save_state_dict(sd, str(path), chunk_bytes=CHUNK, options=ck.CheckpointOptions(odirect=False))
    md = ck.read_metadata(str(path))
    assert len(md.files) == 1
    offsets = {p.offset: (k, p.nbytes) for k, tm in md.tensors.items() for p in tm.pieces}
    seen = []
    real = os.preadv

    def recording(fd, buffers, offset, *flags):
        seen.append(offset)
        return real(fd, buffers, offset, *flags)

    monkeypatch.setattr(reader.os, "preadv", recording)  # every read of the engine, buffered or O_DIRECT
    targets = {k: paddle.zeros(v.shape) for k, v in reversed(list(sd.items()))}  # the reverse of file order
    ck.load_state_dict(targets, str(path))
    for k, v in sd.items():
        np.testing.assert_array_equal(targets[k].numpy(), v.numpy(), err_msg=k)
    kinds = [offsets[o][1] >= regions.TINY_READ for o in seen if o in offsets]
    assert sum(kinds) == 5 and len(kinds) == 10, seen
    assert kinds == sorted(kinds, reverse=True), f"a tiny read came before a large one: {seen}"
    large = [o for o in seen if o in offsets and offsets[o][1] >= regions.TINY_READ]
    tiny = [o for o in seen if o in offsets and offsets[o][1] < regions.TINY_READ]
    assert large == sorted(large) and tiny == sorted(tiny), seen


def test_load_checkpoint_parses_the_metadata_once_and_still_checks_it(tmp_path, monkeypatch):
    """load_checkpoint reads metadata.json once (its checks and the engine share it); a changed optimizer class
    is still refused by name, and a load after it restores the saved values."""
    from paddle.distributed.fsdp import FullyShardFusion
    from paddle.distributed.fsdp.checkpoint import directory as commit

    def build(seed):
        paddle.seed(seed)
        model = paddle.nn.Sequential(paddle.nn.Linear(8, 16), paddle.nn.Linear(16, 4))
        fsdp = FullyShardFusion(model)
        opt = paddle.optimizer.AdamW(learning_rate=1e-3, parameters=model.parameters())
        fsdp.init_optimizer_state(opt)
        return model, fsdp, opt

    model, fsdp, opt = build(1)
    fsdp.save_checkpoint(str(tmp_path / "c"), optimizer=opt)
    want = {k: v.numpy() for k, v in fsdp.full_parameters().items()}
    model2, fsdp2, opt2 = build(2)
    calls = []
    real = commit.read_metadata
    # load_checkpoint opens the checkpoint through directory.open_checkpoint, which reads it with read_metadata
    monkeypatch.setattr(commit, "read_metadata", lambda *a, **k: (calls.append(a), real(*a, **k))[1])
    monkeypatch.setattr(load_job, "read_metadata", lambda *a, **k: (calls.append(a), real(*a, **k))[1])
    fsdp2.load_checkpoint(str(tmp_path / "c"), optimizer=opt2)
    assert len(calls) == 1, calls
    for k, v in fsdp2.full_parameters().items():
        np.testing.assert_array_equal(v.numpy(), want[k], err_msg=k)
    sgd = paddle.optimizer.SGD(learning_rate=1e-3, parameters=model2.parameters())
    with pytest.raises(ck.OptimizerMismatchError, match="AdamW"):
        fsdp2.load_checkpoint(str(tmp_path / "c"), optimizer=sgd)
