"""What the memory tier trusts, attacked with real things (docs/memory-tier-trust.md).

* the peer link: real stranger processes on a rank's port (silent, trickling, garbage, a forged copy under a wrong
  key, the old unauthenticated protocol) while the partner's copy arrives: it arrives intact, the strangers are
  dropped; a stranger at the partner's address cannot acknowledge a copy (PeerAuthError); a partner (with the
  key) that trickles hits the transfer's total deadline;
* restarts: the durable root's identity (copies of the same root used, of a removed or another root ignored);
  a durable root that cannot be listed is a named error, never "no checkpoint";
* memory roots: a symlink where a copy goes (the target is never touched), a symlinked job directory, a FIFO as
  a copy (restore and flush-memory do not hang), job ids that escape the root, two live tiers on one job id;
* copy headers: seeded fuzz (flipped bytes, fields of every kind replaced or removed, digest recomputed) through
  restore and ``flush-memory``: each names the damage or returns the exact state of a step;
* flush-memory takes any verified copy of a rank from any root, and commits only bytes it verified.
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

import numpy as np
import paddle
import pytest
from memtier_util import small_fsdp, state_bytes, train_and_save, write_copy
from paddle.distributed.fsdp.checkpoint import CheckpointError, verify_checkpoint
from paddle.distributed.fsdp.checkpoint.directory import StorageUnreadableError
from paddle.distributed.fsdp.checkpoint.io.local import LocalStorage
from paddle.distributed.fsdp.memtier import MemoryTier, PeerTransferError, wire
from paddle.distributed.fsdp.memtier.errors import MemoryRootError, MemoryRootInUseError, PeerAuthError
from paddle.distributed.fsdp.memtier.slot import HEADER_OFF, Slot
from paddle.distributed.fsdp.tools.cli import main as cli

STRANGER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "memtier_stranger.py")
KEY = os.urandom(32)


def _tier(fsdp, opt, root, mem, **kw):
    """One own slot (the single-slot layout): these tests damage THE copy file of a step and check what reads it;
    with two slots the other slot's older step would be restored instead (test_memtier_slots.py)."""
    kw.setdefault("memory_slots", 1)
    return MemoryTier(fsdp, opt, durable_root=str(root), memory_root=str(mem), persist_every=2, job_id="j", **kw)


def _trained(tmp_path, steps=(1, 2, 3)):
    """A run saved to memory every step and to storage every 2nd, its tier closed leaving the copies."""
    model, fsdp, opt = small_fsdp(1)
    root, mem = tmp_path / "durable", tmp_path / "mem"
    paddle.seed(5)
    tier = _tier(fsdp, opt, root, mem)
    tier.restore()
    wants = train_and_save(model, fsdp, opt, tier, steps)
    tier.close(remove=False)
    return root, mem, wants


def _restore(root, mem, **kw):
    _m, fsdp, opt = small_fsdp(9)
    tier = _tier(fsdp, opt, root, mem, **kw)
    try:
        got = tier.restore()
        return got, (state_bytes(fsdp, opt), opt.get_lr())
    finally:
        tier.close(remove=False)


def _exact(got, state, wants) -> None:
    assert dict(got) == {"step": got.step}, dict(got)
    mine, lr = state
    want, want_lr = wants[got.step]
    assert [k for k in want if mine[k] != want[k]] == [] and lr == want_lr, got.step


# ---------------------------------------------------------------------------------------------------- peer link
def _stranger(mode, *args):
    p = subprocess.Popen([sys.executable, STRANGER, mode, *map(str, args)], stdout=subprocess.PIPE, text=True)
    return p


def _catch(errors, fn, *args):
    try:
        fn(*args)
    except BaseException as e:  # noqa: BLE001 - checked by the test
        errors.append(e)


def test_strangers_on_the_peer_port_do_not_affect_a_transfer(tmp_path):
    a, b = wire.PeerLink(0, 5.0, KEY), wire.PeerLink(1, 5.0, KEY)
    a.addrs = b.addrs = [a.address, b.address]
    genuine = str(tmp_path / "genuine.own")
    write_copy(genuine, np.random.default_rng(0), [["w", "uint8", [4000], 4000]],
               {"job": "j", "world": 2, "rank": 0, "step": 5, "values": {}}, 1024)  # fmt: skip
    crafted = tmp_path / "crafted.own"
    write_copy(str(crafted), np.random.default_rng(1), [["w", "uint8", [4000], 4000]],
               {"job": "j", "world": 2, "rank": 0, "step": 5, "values": {}}, 1024)  # fmt: skip
    data = np.fromfile(genuine, np.uint8)
    strangers = []
    try:
        for mode in ("idle", "trickle", "garbage", "forged", "old"):
            strangers.append(_stranger(mode, *b.address, crafted))
        assert [p.stdout.readline().strip() for p in strangers] == ["CONNECTED"] * 5
        time.sleep(0.5)  # every stranger is queued before the partner
        slot = Slot.allocate(str(tmp_path / "rank00001.peer"), 8192, data.size - 12288)
        assert slot.size == data.size
        errors: list = []
        sender = threading.Thread(target=_catch, args=(errors, a.send_buffer, 1, data, 5))
        sender.start()
        wire.receive_into_slot(b, slot, 0, 5, {"job": "j", "world": 2, "durable_id": "0" * 32})
        sender.join(30)
        assert errors == [] and bytes(slot.buf) == data.tobytes()  # the partner's copy, byte for byte
        header, _o, _n = slot.header()
        assert header["rank"] == 0 and header["step"] == 5
        slot.close()
    finally:
        for p in strangers:
            p.kill()
            p.wait()
        a.close()
        b.close()


def test_a_flood_of_silent_connections_does_not_keep_the_partner_out(tmp_path):
    a, b = wire.PeerLink(0, 20.0, KEY), wire.PeerLink(1, 20.0, KEY)
    a.addrs = b.addrs = [a.address, b.address]
    flood = _stranger("flood", *b.address)
    try:
        assert flood.stdout.readline().strip() == "CONNECTED"
        data = np.random.default_rng(2).integers(0, 256, 1 << 20, dtype=np.uint8)
        errors: list = []
        sender = threading.Thread(target=_catch, args=(errors, a.send_buffer, 1, data, 8))
        sender.start()
        incoming = b.accept(0, 8)
        got = np.empty(data.size, np.uint8)
        incoming.read_into(got)
        incoming.finish()
        sender.join(30)
        assert errors == [] and (got == data).all()
    finally:
        flood.kill()
        flood.wait()
        a.close()
        b.close()


def test_a_stranger_at_the_partners_address_cannot_take_a_copy():
    fake = _stranger("listen")
    link = wire.PeerLink(0, 5.0, KEY)
    try:
        port = int(fake.stdout.readline().split()[1])
        link.addrs = [link.address, ("127.0.0.1", port)]
        with pytest.raises(PeerAuthError, match="does not carry the job's key"):
            link.send_buffer(1, np.zeros(1 << 20, np.uint8), 3)
    finally:
        fake.kill()
        fake.wait()
        link.close()


def test_a_trickling_partner_hits_the_total_deadline():
    """A rank with the key that sends one byte every 0.2 s: each recv makes progress (a per-recv timeout never
    fires), the transfer's total deadline (timeout_s + size / MIN_RATE) does."""
    recv = wire.PeerLink(1, 1.0, KEY)
    send = wire.PeerLink(0, 1.0, KEY)
    send.addrs = [send.address, recv.address]

    def trickle():
        import socket

        with socket.create_connection(recv.address) as s:
            _m, nonce = wire.CHALLENGE.unpack(s.recv(wire.CHALLENGE.size, socket.MSG_WAITALL))
            hello = wire.HELLO.pack(wire.MAGIC, 0, 9, 64, os.urandom(16))
            s.sendall(hello + wire._mac(KEY, b"hello", nonce, hello, (1).to_bytes(8, "little")))
            for _ in range(64):
                try:
                    s.send(b"\x01")
                except OSError:
                    return
                time.sleep(0.2)

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    incoming = recv.accept(0, 9)
    with pytest.raises(PeerTransferError, match="not complete within the deadline"):
        incoming.read_into(np.empty(64, np.uint8))
    t.join(30)
    recv.close()
    send.close()


# ---------------------------------------------------------------------------------------------------- restarts
def test_durable_root_identity_decides_which_copies_are_used(tmp_path, caplog):
    root, mem, wants = _trained(tmp_path)
    got, state = _restore(root, mem)  # the same durable root: its copies are used
    assert (got.step, got.sources) == (3, ["memory"])
    _exact(got, state, wants)
    shutil.rmtree(root)  # a deliberately fresh run: the old run's copies are ignored, with a warning
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        got, _state = _restore(root, mem)
    assert got is None and "another durable root" in caplog.text
    other = tmp_path / "other"  # another durable root, same job id: ignored too
    got, _state = _restore(other, mem)
    assert got is None
    assert (root / "memtier-id").read_text() != (other / "memtier-id").read_text()


def test_a_fresh_start_needs_every_rank_to_see_nothing():
    from paddle.distributed.fsdp.memtier import NoCommonStepError, agreement

    nothing = {"own": None, "held": None, "storage": []}
    assert agreement.decide([nothing, nothing]) is None
    with pytest.raises(NoCommonStepError, match=r"rank 0: \[4\]; rank 1: nothing"):
        agreement.decide([dict(nothing, storage=[4]), nothing])  # one rank sees storage: never "nothing"
    got = agreement.decide([dict(nothing, storage=[2, 4]), dict(nothing, storage=[2])])
    assert (got.step, got.sources) == (2, ["storage", "storage"])


def test_unreadable_storage_is_a_named_error_never_a_fresh_start(tmp_path, monkeypatch):
    root, mem, _wants = _trained(tmp_path)
    shutil.rmtree(mem)  # /dev/shm wiped: storage is all there is
    real = LocalStorage.children

    def denied(self, parent):
        if os.path.abspath(parent) == str(root):
            raise PermissionError(13, "Permission denied", parent)
        return real(self, parent)

    monkeypatch.setattr(LocalStorage, "children", denied)
    with pytest.raises(StorageUnreadableError, match="cannot list checkpoint root"):
        _restore(root, mem)
    monkeypatch.setattr(LocalStorage, "children", real)
    file_root = tmp_path / "a-file"
    file_root.write_text("x")
    with pytest.raises(CheckpointError):  # a file where the durable root should be: named, never "no steps"
        _restore(file_root, tmp_path / "mem2")


# ---------------------------------------------------------------------------------------------------- roots
def test_memory_root_symlinks_fifos_and_job_ids(tmp_path, monkeypatch):
    victim = tmp_path / "victim"
    victim.write_bytes(b"another job's committed checkpoint")
    mem = tmp_path / "mem"
    (mem / "j").mkdir(parents=True)
    os.symlink(victim, mem / "j" / "rank00000.own")
    model, fsdp, opt = small_fsdp(1)
    tier = _tier(fsdp, opt, tmp_path / "d", mem)
    assert tier.restore() is None  # the symlink is skipped, not followed
    with pytest.raises(MemoryRootError, match="symlink"):
        train_and_save(model, fsdp, opt, tier, (1,))
    tier.close(remove=False)
    assert victim.read_bytes() == b"another job's committed checkpoint"
    # a symlinked job directory
    shutil.rmtree(mem)
    mem.mkdir()
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", mem / "j")
    with pytest.raises(MemoryRootError, match="not a directory"):
        _tier(fsdp, opt, tmp_path / "d", mem).restore()
    # a FIFO as a copy file: restore and flush-memory skip it, never hang
    root, mem2, wants = _trained(tmp_path / "run")
    own = mem2 / "j" / "rank00000.own"
    own.unlink()
    os.mkfifo(own)
    got, state = _restore(root, mem2)
    assert (got.step, got.sources) == (2, ["storage"])
    _exact(got, state, wants)
    assert cli(["flush-memory", str(root), "--memory-root", str(mem2), "--job", "j"]) == 2
    # job ids that escape the root
    for bad in ("a/b", "..", "../x", ".hidden", "", "x" * 200):
        with pytest.raises(MemoryRootError):
            MemoryTier(fsdp, opt, durable_root=str(tmp_path / "d"), memory_root=str(mem), job_id=bad)
    monkeypatch.setenv("PADDLE_FSDP_JOB_ID", "../../etc")
    with pytest.raises(MemoryRootError):
        MemoryTier(fsdp, opt, durable_root=str(tmp_path / "d"), memory_root=str(mem))


def test_memory_root_owner_and_mode(tmp_path):
    model, fsdp, opt = small_fsdp(1)
    open_root = tmp_path / "open"
    open_root.mkdir()
    os.chmod(open_root, 0o777)  # anyone may write, no sticky bit: refused, and left as it is
    with pytest.raises(MemoryRootError, match="writable by others"):
        _tier(fsdp, opt, tmp_path / "d", open_root).restore()
    assert os.stat(open_root).st_mode & 0o777 == 0o777
    sticky = tmp_path / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)  # like /dev/shm: accepted, never changed; the job directory is made 0700
    (sticky / "j").mkdir(mode=0o755)
    tier = _tier(fsdp, opt, tmp_path / "d", sticky)
    assert tier.restore() is None
    assert os.stat(sticky).st_mode & 0o7777 == 0o1777 and os.stat(sticky / "j").st_mode & 0o777 == 0o700
    tier.close()
    link = tmp_path / "link"
    os.symlink(sticky, link)  # a symlinked memory root
    with pytest.raises(MemoryRootError, match="not a directory"):
        _tier(fsdp, opt, tmp_path / "d", link).restore()


_SECOND_JOB = """
import sys
sys.path.insert(0, sys.argv[3])
from memtier_util import small_fsdp
from paddle.distributed.fsdp.memtier import MemoryTier
_m, fsdp, opt = small_fsdp(3)
try:
    MemoryTier(fsdp, opt, durable_root=sys.argv[1], memory_root=sys.argv[2], job_id="j").restore()
    print("restored")
except Exception as e:
    print(type(e).__name__)
"""


def test_two_live_tiers_on_one_job_id_are_refused_by_name(tmp_path):
    model, fsdp, opt = small_fsdp(1)
    first = _tier(fsdp, opt, tmp_path / "d1", tmp_path / "mem")
    first.restore()
    train_and_save(model, fsdp, opt, first, (1,))
    _m2, fsdp2, opt2 = small_fsdp(2)
    second = _tier(fsdp2, opt2, tmp_path / "d2", tmp_path / "mem")
    with pytest.raises(MemoryRootInUseError, match="in use by another live process"):
        second.restore()
    other = subprocess.run(  # another process, as a second job with the same job id would be
        [sys.executable, "-c", _SECOND_JOB, str(tmp_path / "d3"), str(tmp_path / "mem"), os.path.dirname(__file__)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert other.stdout.strip().endswith("MemoryRootInUseError"), other.stdout + other.stderr
    assert cli(["flush-memory", str(tmp_path / "d1"), "--memory-root", str(tmp_path / "mem")]) == 2  # live
    first.close()
    assert second.restore() is None  # the first job ended: the root is free (its copies were of another root)
    second.close()


# ---------------------------------------------------------------------------------------------------- fuzz
_ODD = [None, [3], "x", -1, 2**70, 1.5, {}, [], True, {"a": [1]}, "xxh3-64", [[1, 2]], "0" * 33]


def _mutations(header: dict, rng: random.Random):
    """(name, mutated header) of every kind: a top-level field replaced or removed, a record's field, a desc."""
    out = []
    for field in sorted(header):
        out.append((f"-{field}", {k: v for k, v in header.items() if k != field}))
        for odd in rng.sample(_ODD, 4):
            out.append((f"{field}={odd!r}", dict(header, **{field: odd})))
    for _ in range(24):
        i, j = rng.randrange(len(header["records"])), rng.randrange(6)
        recs = json.loads(json.dumps(header["records"]))
        recs[i][j] = rng.choice(_ODD)
        out.append((f"records[{i}][{j}]", dict(header, records=recs)))
    for _ in range(3):
        descs = json.loads(json.dumps(header["descs"]))
        descs[rng.randrange(len(descs))] = rng.choice(_ODD)
        out.append(("descs", dict(header, descs=descs)))
    return out


def test_copy_header_fuzz_restore_and_flush_name_the_damage_or_return_exact_state(tmp_path):
    base, mem, wants = _trained(tmp_path)
    own = mem / "j" / "rank00000.own"
    pristine = own.read_bytes()
    slot = Slot.open(str(own))
    header, doff, dlen = slot.header()
    slot.close()
    hlen = int.from_bytes(pristine[12:20], "little")
    rng = random.Random(40)
    cases = _mutations(header, rng)
    assert len(cases) >= 70, len(cases)
    for pos in rng.sample(range(HEADER_OFF, HEADER_OFF + hlen), 30):  # flipped header bytes, digest as it was
        cases.append((f"byte {pos}", pos))
    cases.append(("pristine (the control: memory and flush-memory take it)", None))
    outcomes = {"memory": 0, "storage": 0, "flushed": 0, "refused": 0}
    for n, (name, mutation) in enumerate(cases):
        own.write_bytes(pristine)
        if mutation is None:
            pass
        elif isinstance(mutation, int):
            raw = bytearray(pristine)
            raw[mutation] ^= 1 << rng.randrange(8)
            own.write_bytes(bytes(raw))
        else:
            s = Slot.open(str(own), writable=True)
            try:
                s.write_header(mutation, doff, dlen)  # a crafted header: its digest is right
            finally:
                s.close()
        root = tmp_path / f"d{n}"
        shutil.copytree(base, root)
        try:
            got, state = _restore(root, mem)
        except CheckpointError:  # named (any other exception fails the test)
            outcomes["refused"] += 1
        else:
            assert got is not None, name
            _exact(got, state, wants)
            outcomes[got.sources[0]] += 1
        root2 = tmp_path / f"f{n}"
        shutil.copytree(base, root2)
        code = cli(["flush-memory", str(root2), "--memory-root", str(mem), "--job", "j"])
        assert code in (0, 2), (name, code)
        if code == 0:
            outcomes["flushed"] += 1
            assert verify_checkpoint(str(root2 / "step_00000003")) == []
            _m, fsdp, opt = small_fsdp(7)
            loaded = fsdp.load_checkpoint(str(root2 / "step_00000003"), optimizer=opt)
            assert dict(loaded) == {"step": 3}
            assert state_bytes(fsdp, opt) == wants[3][0], name
        shutil.rmtree(root)
        shutil.rmtree(root2)
    assert outcomes["storage"] > 0, outcomes  # damaged copies were skipped, the older stored step restored
    assert outcomes["memory"] > 0 and outcomes["flushed"] > 0, outcomes


# ---------------------------------------------------------------------------------------------------- flush
def test_flush_takes_any_verified_copy_and_commits_what_it_verified(tmp_path, monkeypatch):
    root, mem, wants = _trained(tmp_path)
    # root A: the rank's copy with a flipped bit in its header's "algo"; root B: a good copy of the same rank
    good = tmp_path / "memB"
    shutil.copytree(mem, good)
    own = mem / "j" / "rank00000.own"
    raw = bytearray(own.read_bytes())
    at = raw.index(b'"algo":"') + 9
    raw[at] ^= 0x01
    own.write_bytes(bytes(raw))
    bad_only = tmp_path / "d-bad"
    shutil.copytree(root, bad_only)
    assert cli(["flush-memory", str(bad_only), "--memory-root", str(mem), "--job", "j"]) == 2
    got, state = _restore(bad_only, mem)  # restore skips that copy too: storage's step 2
    assert (got.step, got.sources) == (2, ["storage"])
    _exact(got, state, wants)
    both = tmp_path / "d-both"
    shutil.copytree(root, both)
    assert cli(["flush-memory", str(both), "--memory-root", str(mem), "--memory-root", str(good), "--job", "j"]) == 0
    _m, fsdp, opt = small_fsdp(7)
    fsdp.load_checkpoint(str(both / "step_00000003"), optimizer=opt)
    assert state_bytes(fsdp, opt) == wants[3][0]
    # a copy that changes after flush-memory verified it: nothing committed (verify would pass otherwise)
    import paddle.distributed.fsdp.memtier.flush as flush_mod

    real = flush_mod._choose

    def choose_then_change(*a):
        chosen = real(*a)
        slot, header, doff, _n = chosen[2][0]
        rec = header["records"][-1]
        with open(slot.path, "r+b") as f:
            f.seek(doff + rec[3])
            b = f.read(1)
            f.seek(doff + rec[3])
            f.write(bytes([b[0] ^ 0x40]))
        return chosen

    monkeypatch.setattr(flush_mod, "_choose", choose_then_change)
    changed = tmp_path / "d-changed"
    shutil.copytree(root, changed)
    assert cli(["flush-memory", str(changed), "--memory-root", str(good), "--job", "j"]) == 2
    assert not (changed / "step_00000003").exists()


# ---------------------------------------------------------------------------------------------------- two nodes
def test_two_nodes_strangers_at_save_and_a_rank_that_cannot_list_storage(tmp_path):
    """Two launchers (one rank each, own memory roots): real strangers on rank 1's port during every save, then
    node 0's memory lost (restored from rank 1's peer copy, bit for bit); rank 1's job directory a symlink: both
    ranks raise MemoryRootError; then rank 1 cannot list storage after the memory roots were wiped: both ranks
    raise StorageUnreadableError, neither starts over."""
    from nodes import launch_nodes, tails

    codes, results = launch_nodes(tmp_path / "log", "memtier_trust.py", [str(tmp_path)],
                                  [tmp_path / "node0", tmp_path / "node1"])  # fmt: skip
    assert codes == [0, 0] and sorted(results) == [0, 1], f"{codes} {results}\n{tails(tmp_path / 'log')}"
    for r in (0, 1):
        got = results[r]["strangers"]
        assert got == {"step": 3, "sources": ["peer", "memory"], "differ": []}, (r, got)
        unsafe = results[r]["unsafe_root"]
        assert unsafe.get("error") == "MemoryRootError" and "rank 1 failed" in unsafe["message"], (r, unsafe)
        bad = results[r]["unreadable"]
        assert bad.get("error") == "StorageUnreadableError", (r, bad)
        assert "rank 1 failed: cannot list checkpoint root" in bad["message"], (r, bad)
