"""The memory tier (memtier/): copies in shared memory, peer copies on another node, the restart rule.

* unit: damaged copies (every single flipped byte of a seeded sample, truncation, interrupted writes, another
  job / world size / rank) are refused, never loaded; a memory root too small is MemoryTierFullError before
  anything is mapped (a real small tmpfs when it can be mounted here); the agreement rule against a brute-force
  oracle on seeded random reports; partner maps.
* two simulated nodes (two launchers, ``--nnodes 2``, each with its own memory root): an uninterrupted run
  (with node 1's root too small: every rank falls back to storage together), a run killed with SIGKILL on every
  rank, then restores from: intact memory, node 1's root wiped (peer copies), every root wiped (storage), rank 1
  holding only older copies (the common step), a corrupt copy (its peer copy), rank 1's two copies corrupt
  (found while reading, after rank 0 wrote its tensors from step 6: storage's step 4 for both); each compared bit for bit (every
  record, the RNG, the LR) with the uninterrupted run.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from memtier_util import state_bytes, write_copy
from nodes import launch_nodes, tails
from paddle.distributed.fsdp.checkpoint import verify_checkpoint
from paddle.distributed.fsdp.memtier import (
    InvalidMemoryCopyError,
    MemoryTierFullError,
    NoCommonStepError,
    agreement,
    peers,
)
from paddle.distributed.fsdp.memtier.copies import Copies, read_copy
from paddle.distributed.fsdp.memtier.slot import Slot

EXPECT = {"job": "j1", "world": 2, "rank": 1}


LAYOUT = [["a", "float32", [300], 1200], ["b", "uint8", [5], 5], ["c", "float32", [17, 3], 204]]


def test_damaged_copies_are_refused(tmp_path):
    rng = np.random.default_rng(0)
    path = str(tmp_path / "rank00001.own")
    good = write_copy(path, rng, LAYOUT, dict(EXPECT, step=7, values={"x": [1, 2]}), 1024)
    pristine = open(path, "rb").read()
    slot, header, doff, _n = read_copy(path, EXPECT, LAYOUT)
    assert header["step"] == 7 and header["values"]["x"] == [1, 2]
    slot.close()
    for field, value in [("job", "other-job"), ("world", 4), ("rank", 0)]:  # foreign / mismatched
        with pytest.raises(InvalidMemoryCopyError, match=field):
            read_copy(path, dict(EXPECT, **{field: value}), LAYOUT)
    with pytest.raises(InvalidMemoryCopyError, match="records differ"):
        read_copy(path, EXPECT, [["a", "float32", [300], 1200]])
    for size in (0, 100, 5000, doff + 10, len(pristine) - 1):  # truncated
        with open(path, "wb") as f:
            f.write(pristine[:size])
        with pytest.raises(InvalidMemoryCopyError, match="truncated|malformed|checksum|unreadable"):
            read_copy(path, EXPECT, LAYOUT)
    # a save interrupted after it marked the slot "writing"
    open(path, "wb").write(pristine)
    Slot.open(path, writable=True).mark_writing()
    with pytest.raises(InvalidMemoryCopyError, match="being written"):
        read_copy(path, EXPECT, LAYOUT)
    # any flipped byte: refused, or (padding nobody reads) the same bytes come out
    sample = random.Random(1).sample(range(len(pristine)), 400) + list(range(doff, doff + 1200, 97))
    for pos in sample:
        damaged = bytearray(pristine)
        damaged[pos] ^= 0x10
        open(path, "wb").write(damaged)
        try:
            slot, header, doff2, _n = read_copy(path, EXPECT, LAYOUT)
        except InvalidMemoryCopyError:
            continue
        data = slot.data(doff2, _n)
        got = {r[0]: bytes(data[r[3] : r[3] + r[4]]) for r in header["records"]}
        slot.close()
        assert got == good, f"a flipped byte at {pos} changed the data of a copy taken as valid"


def _mount_tmpfs(where: Path, size: str) -> bool:
    where.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    return done.returncode == 0


def test_too_small_memory_root_is_a_named_error(tmp_path):
    copies = Copies(str(tmp_path / "q"), "job", 0)
    with pytest.raises(MemoryTierFullError, match="quota"):
        copies.allocate([(4096, 1 << 20), (4096, 1 << 20)], 1, quota=1 << 20)
    assert not os.path.exists(copies.own_path())
    small = tmp_path / "tmpfs"
    if not _mount_tmpfs(small, "1m"):
        return  # no mount here: the quota path above is the one this machine can show
    try:
        copies = Copies(str(small), "job", 0)
        with pytest.raises(MemoryTierFullError, match="free"):  # both copies: 1.5 MiB on a 1 MiB tmpfs
            copies.allocate([(4096, 768 << 10), (4096, 768 << 10)], 1, quota=None)
        assert not os.path.exists(copies.own_path()) and not os.path.exists(copies.peer_path())
        copies.unclaim(remove=True)  # its lock file: the tmpfs must unmount
        # the free-space check passed but posix_fallocate cannot reserve the blocks: named error, no file left
        (small / "filler").write_bytes(b"\0" * (700 << 10))
        import paddle.distributed.fsdp.memtier.slot as slot_mod

        real = slot_mod.free_bytes
        slot_mod.free_bytes = lambda root: 1 << 40
        try:
            with pytest.raises(MemoryTierFullError, match="cannot reserve"):
                Slot.allocate(str(small / "job" / "x.own"), 4096, 512 << 10)
        finally:
            slot_mod.free_bytes = real
        assert not (small / "job" / "x.own").exists()
        # fits: allocated in full (st_blocks), usable
        (small / "filler").unlink()
        slot = Slot.allocate(str(small / "job" / "x.own"), 4096, 512 << 10)
        assert os.stat(slot.path).st_blocks * 512 >= slot.size
        slot.unlink()
    finally:
        subprocess.run(["umount", str(small)], check=False)


def _oracle(reports):
    world = len(reports)
    storage = set.intersection(*(set(r["storage"]) for r in reports))
    mem = [set() for _ in range(world)]
    for r, rep in enumerate(reports):
        if rep["own"] is not None:
            mem[r].add(rep["own"])
        if rep["held"] is not None and rep["held"][0] != r:
            mem[rep["held"][0]].add(rep["held"][1])
    everything = storage | set().union(*mem)
    ok = [s for s in everything if s in storage or all(s in m for m in mem)]
    return (None if not everything else max(ok, default="error")), mem, storage


def test_agreement_rule_against_an_oracle():
    rng = random.Random(3)
    for _ in range(3000):
        world = rng.choice([1, 2, 3, 4])
        steps = list(range(rng.randint(1, 6)))
        storage = sorted(rng.sample(steps, rng.randint(0, len(steps))))
        reports = []
        for _r in range(world):
            own = rng.choice(steps + [None])
            held = [rng.randrange(world), rng.choice(steps)] if rng.random() < 0.6 else None
            reports.append({"own": own, "held": held, "storage": storage})
        want, mem, storage_set = _oracle(reports)
        if want == "error":
            with pytest.raises(NoCommonStepError):
                agreement.decide(reports)
            continue
        got = agreement.decide(reports)
        if want is None:
            assert got is None
            continue
        assert got.step == want, (reports, got)
        for r, src in enumerate(got.sources):
            if src == agreement.STORAGE:
                assert want in storage_set
            elif src == agreement.MEMORY:
                assert reports[r]["own"] == want
            else:
                holder = got.holders[r]
                assert reports[holder]["held"] == [r, want] and reports[r]["own"] != want
        if all(want in m for m in mem):  # memory wins whenever every rank has the step there
            assert agreement.STORAGE not in got.sources


def test_partner_maps():
    assert peers.default_partners(4, 2) == {0: 2, 1: 3, 2: 0, 3: 1}
    assert peers.default_partners(6, 2) == {0: 2, 1: 3, 2: 4, 3: 5, 4: 0, 5: 1}
    assert peers.default_partners(2, 2) == {}  # one node: no peer copy
    assert peers.source_of({0: 2, 2: 0}, 2) == 0 and peers.source_of({0: 2}, 1) is None
    for bad in ({0: 0}, {0: 5}, {0: 1, 2: 1}, {"0": 1}, [(0, 1)]):
        with pytest.raises(Exception, match="partners"):
            peers.check_partners(bad, 4)


def test_bad_arguments_are_refused_by_name(tmp_path):
    import paddle
    from paddle.distributed.fsdp import FullyShardFusion
    from paddle.distributed.fsdp.checkpoint import CheckpointError
    from paddle.distributed.fsdp.memtier import MemoryTier, MemoryTierError

    model = paddle.nn.Sequential(paddle.nn.Linear(4, 4), paddle.nn.Linear(4, 2))
    fsdp = FullyShardFusion(model)
    opt = paddle.optimizer.AdamW(0.01, parameters=model.parameters())
    ok = dict(durable_root=str(tmp_path / "d"), memory_root=str(tmp_path / "m"))
    for bad in ({"durable_root": ""}, {"persist_every": 0}, {"quota_bytes": -1}, {"memory_root": 3},
                {"job_id": "a/b"}, {"keep_last": 0}, {"partners": {0: 0}}):  # fmt: skip
        with pytest.raises(CheckpointError):
            MemoryTier(fsdp, opt, **dict(ok, **bad))
    with pytest.raises(CheckpointError, match="checksum"):
        MemoryTier(fsdp, opt, checksum="md5", **ok)
    tier = MemoryTier(fsdp, opt, **ok)
    with pytest.raises(MemoryTierError, match="step"):
        tier.save(-1)
    assert tier.restore() is None and tier.start_step == 0  # nothing stored anywhere: a fresh start
    tier.close()  # a live tier holds its rank lock: flush-memory would refuse its job
    from paddle.distributed.fsdp.memtier.flush import flush_memory

    (tmp_path / "m" / "job-a").mkdir(parents=True)
    for roots, kw, match in [(str(tmp_path), {}, "roots"), ([str(tmp_path / "nope")], {}, "not a directory"),
                             ([str(tmp_path / "m")], {}, "no valid memory copy"),
                             ([str(tmp_path / "m")], {"step": -1}, "step"), ([str(tmp_path / "m")], {"keep_last": 0}, "keep_last")]:  # fmt: skip
        with pytest.raises(MemoryTierError, match=match):
            flush_memory(roots, str(tmp_path / "d"), **kw)


@pytest.mark.parametrize("slots", [1, 2, 3])
def test_persist_writes_the_memory_copy_while_training_moves_on(tmp_path, monkeypatch, slots):
    """The persist of step 2 is held back until training ran three more steps: the checkpoint is still step 2
    bit for bit (written from the memory copy, which the later saves left alone), the engine's snapshot buffer
    is never allocated (no third copy), and the first save after the persist is taken and persisted again.
    Two or three slots: no memory save is skipped (the persist due at step 4 is: the one of step 2 still runs);
    memory holds step 2 (the persist's slot) and step 5, with three slots step 4 too. One slot (the older layout):
    the saves of steps 3-5 are skipped."""
    import threading

    import paddle
    import paddle.distributed.fsdp.memtier.manager as manager_mod
    from paddle.distributed.fsdp import FullyShardFusion
    from paddle.distributed.fsdp.checkpoint import host_memory
    from paddle.distributed.fsdp.memtier import MemoryTier

    def build(seed):
        paddle.seed(seed)
        model = paddle.nn.Sequential(paddle.nn.Linear(16, 16), paddle.nn.ReLU(), paddle.nn.Linear(16, 4))
        fsdp = FullyShardFusion(model)
        lr = paddle.optimizer.lr.StepDecay(0.02, step_size=2, gamma=0.5)
        return model, fsdp, paddle.optimizer.AdamW(lr, parameters=model.parameters())

    def train(model, opt):
        model(paddle.randn([4, 16])).square().mean().backward()
        opt.step()
        opt.clear_grad()
        opt._learning_rate.step()

    gate, real = threading.Event(), manager_mod.persist_copy
    monkeypatch.setattr(manager_mod, "persist_copy", lambda *a: (gate.wait(60), real(*a))[1])
    model, fsdp, opt = build(1)
    root = str(tmp_path / "durable")
    tier = MemoryTier(fsdp, opt, durable_root=root, memory_root=str(tmp_path / "mem"), persist_every=2, keep_last=None,
                      memory_slots=slots)  # fmt: skip
    host_memory.arena.free()
    wants = {}
    for step in range(1, 7):
        train(model, opt)
        tier.save(step, extra_state={"step": step})
        wants[step] = (state_bytes(fsdp, opt), opt.get_lr())
        if step == 5:
            tier.wait()
            assert os.listdir(root) == ["memtier-id"]  # the persist of step 2: held back
            assert tier.skipped == ([3, 4, 5] if slots == 1 else []), tier.skipped
            assert tier.persists_skipped == ([] if slots == 1 else [4]), tier.persists_skipped
            held = sorted(Slot.open(p).header()[0]["step"] for p in tier.copies.own_paths())
            assert held == {1: [2], 2: [2, 5], 3: [2, 4, 5]}[slots], held
            gate.set()
            tier.wait_persisted()
    tier.wait_persisted()
    assert tier.durable_saves == [2, 6] and tier.persist_errors == []
    assert host_memory.arena.capacity == 0
    for step in (2, 6):
        _m, fsdp2, opt2 = build(9)
        got = fsdp2.load_checkpoint(os.path.join(root, f"step_{step:08d}"), optimizer=opt2)
        want, lr = wants[step]
        assert dict(got) == {"step": step} and opt2.get_lr() == lr
        assert [k for k, v in state_bytes(fsdp2, opt2).items() if v != want[k]] == [], step
    assert any(v != wants[2][0][k] for k, v in wants[6][0].items())  # training moved on
    tier.close()


TOTAL, CRASH, KEEP = 8, 6, 5
MODELS = ("tiny", "qwen3")


def _check(launched, log_dir):
    codes, results = launched
    assert codes == [0, 0], f"launchers exited {codes}\n{tails(log_dir)}"
    assert sorted(results) == [0, 1], f"results {results}\n{tails(log_dir)}"
    return results


def _check1(launched, log_dir):
    codes, results = launched
    assert codes == [0] and sorted(results) == [0], f"launcher exited {codes}, results {results}\n{tails(log_dir)}"
    return results


def _flush_and_compare(tmp_path: Path, capsys) -> None:
    from paddle.distributed.fsdp.tools.cli import main as cli

    bak = tmp_path / "bak"
    for m in MODELS:
        durable = str(bak / m / "durable")
        job = "job-" + hashlib.sha256(str(tmp_path / m / "durable").encode()).hexdigest()[:12]
        ref = str(tmp_path / "ref" / m / "durable")
        assert cli(["diff", f"{ref}/step_00000004", f"{durable}/step_00000004"]) == 0, capsys.readouterr().out
        nodes = ["--memory-root", str(bak / "node1")] + ([] if m == "tiny" else ["--memory-root", str(bak / "node0")])
        capsys.readouterr()
        assert cli(["flush-memory", durable, "--job", job, "--step", "5"] + nodes) == 2  # no step 5 in memory
        assert "no step 5 has a valid memory copy of every rank" in capsys.readouterr().err
        assert cli(["flush-memory", durable, "--job", job] + nodes) == 0
        assert f"step {CRASH} (world 2" in capsys.readouterr().out
        assert (bak / m / "durable" / "latest").read_text().strip() == "step_00000006"
        assert cli(["flush-memory", durable, "--job", job] + nodes) == 0  # again: storage has it, nothing written
        assert "nothing written" in capsys.readouterr().out
        assert verify_checkpoint(f"{durable}/step_00000006") == []
        assert cli(["diff", f"{ref}/step_00000006", f"{durable}/step_00000006"]) == 0, capsys.readouterr().out


def test_two_nodes_kill9_peer_storage_agreement(tmp_path, capsys):
    """TinyLM (dropout, AdamW + StepDecay) and PaddleFormers Qwen3 (AdamW, warmup + cosine, clipping) side by side."""
    roots = [Path(f"/dev/shm/fsdp-memtier-test-{os.getpid()}-node{i}") for i in range(2)]
    small = tmp_path / "small-shm"
    mounted = _mount_tmpfs(small, "128k")
    try:
        # 1. the uninterrupted run; node 1's memory root is too small: every rank falls back to storage
        extra = [{}, {} if mounted else {"PADDLE_FSDP_MEMTIER_QUOTA": "65536"}]
        ref_roots = [roots[0], small if mounted else roots[1]]
        ref = _check(
            launch_nodes(tmp_path / "log-ref", "memtier.py", ["run", str(tmp_path / "ref"), str(TOTAL)],
                         ref_roots, extra_env=extra),
            tmp_path / "log-ref",
        )  # fmt: skip
        for r in (0, 1):
            for m in MODELS:
                assert ref[r][m]["disabled"] == "MemoryTierFullError", (m, ref[r][m])
                assert ref[r][m]["durable"] == list(range(1, TOTAL + 1)), (m, ref[r][m])
        # 2. the run killed with SIGKILL on every rank after the saves of step CRASH (storage has step 4)
        codes, _ = launch_nodes(
            tmp_path / "log-crash", "memtier.py", ["run", str(tmp_path), str(TOTAL), "--crash-at", str(CRASH),
                                                   "--keep-at", str(KEEP)], roots,
        )  # fmt: skip
        assert all(c != 0 for c in codes), f"the crash run did not crash: {codes}\n{tails(tmp_path / 'log-crash')}"
        for i, root in enumerate(roots):
            shutil.copytree(root, tmp_path / "bak" / f"node{i}")
        for m in MODELS:
            shutil.copytree(tmp_path / m / "durable", tmp_path / "bak" / m / "durable")
        # 3. the restores, in one launch (each scenario builds the models from another seed)
        scenarios = "memory,node1,both,agree,corrupt2,corrupt,skip"  # corrupt last: its step 6 persist is checked
        got = _check(
            launch_nodes(tmp_path / "log-restore", "memtier.py", ["restore", str(tmp_path), str(TOTAL), scenarios],
                         roots),
            tmp_path / "log-restore",
        )  # fmt: skip
        expect = {
            "memory": (CRASH, ["memory", "memory"], True),
            "node1": (CRASH, ["memory", "peer"], True),
            "both": (4, ["storage", "storage"], False),
            "agree": (KEEP, ["peer", "memory"], True),
            "corrupt": (CRASH, ["memory", "peer"], True),
            "corrupt2": (4, ["storage", "storage"], False),  # rank 0's tensors, read from step 6, overwritten
        }
        for r in (0, 1):
            for name, (step, sources, persisted) in expect.items():
                assert "error" not in got[r].get(name, {}), f"rank {r} {name}:\n{got[r][name]['error']}"
                for m in MODELS:
                    res = got[r][f"{name}/{m}"]
                    assert (res["step"], res["sources"], res["persisted"]) == (step, sources, persisted), (name, m, res)
                    assert res["extra"] == {"data_position": step * 8}, (name, m, res)
                    assert res["differ"] == [], f"rank {r} {name} {m}: records differ from the uninterrupted run"
                    assert (res["rng"], res["lr"]) == (ref[r][m]["rng"], ref[r][m]["lr"]), (name, m, res, ref[r][m])
                    assert res["files_left"] == [], (name, m, res)  # a clean end removes the copies
                    assert res["same_slots"], (name, m, res)  # saves reuse their two slot files, no allocation
                    if name == "node1" and r == 1:  # restored from the peer copy, its root wiped: reserved again
                        assert res["reserved"], (name, m, res)
        for r in (0, 1):  # rank 0's persist held back: rank 1 skips the save of step 3 too (one decision)
            skip = got[r]["skip"]
            assert "error" not in skip, f"rank {r} skip:\n{skip['error']}"
            assert (skip["skipped"], skip["durable"], skip["errors"], skip["differ"]) == ([3], [2, 4], [], []), skip
        # the step restored from memory was persisted as a committed checkpoint (scenario corrupt)
        for m in MODELS:
            assert verify_checkpoint(str(tmp_path / m / "durable" / "step_00000006")) == []
        # 4. the crashed run's step 4 was persisted from its memory copy in the background: the uninterrupted
        # run's step 4, bit for bit; then flush-memory writes step 6 from the crashed run's memory roots (tiny:
        # node 1's root alone, which holds rank 1's copy and rank 0's peer copy)
        _flush_and_compare(tmp_path, capsys)
        # 5. another world size (one rank on node 0's root): its 2-rank copies are refused, storage is loaded:
        # the flushed step 6, every element equal to the uninterrupted run's step 6
        one = _check1(launch_nodes(tmp_path / "log-world1", "memtier.py",
                                   ["restore", str(tmp_path), str(TOTAL), "world1"], roots[:1]),
                      tmp_path / "log-world1")  # fmt: skip
        for m in MODELS:
            assert "error" not in one[0].get("world1", {}), one[0]["world1"]["error"]
            res = one[0][f"world1/{m}"]
            assert (res["step"], res["sources"], res["extra"]) == (CRASH, ["storage"], {"data_position": 48}), res
            assert res["differ"] == [], res
        log = (tmp_path / "log-world1" / "node0" / "workerlog.0").read_text(errors="replace")
        assert "world 2, expected 1" in log, "the refused copies were not logged"
    finally:
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)
        if mounted:
            subprocess.run(["umount", str(small)], check=False)
