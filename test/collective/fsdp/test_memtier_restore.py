"""A restore from memory reads each copy once (memtier/readback.py) and falls back as one when a copy is corrupt.

* ``read_into``: every flipped byte of a seeded sample of a copy's data is a named error (never silently read);
  an intact copy lands bit for bit, through chunks split across the read's pieces.
* one process, a corrupt own copy found during the read (after part of the tensors were written): the restore
  falls back to the older step in storage, which overwrites every tensor (bit-exact against that step, LR too);
  without storage every rank gets NoCommonStepError, saying the tensors are not a checkpoint's.
"""

from __future__ import annotations

import os
import random
import shutil

import numpy as np
import paddle
import pytest
from memtier_util import small_fsdp, state_bytes, train_and_save, write_copy
from paddle.distributed.fsdp.memtier import InvalidMemoryCopyError, MemoryTier, NoCommonStepError, readback
from paddle.distributed.fsdp.memtier.copies import read_copy
from paddle.distributed.fsdp.memtier.slot import Slot

LAYOUT = [["a", "float32", [3000], 12000], ["b", "uint8", [5], 5], ["c", "float32", [170, 3], 2040]]
EXPECT = {"job": "j", "world": 1, "rank": 0}


def _read(path: str) -> dict:
    tensors = [paddle.zeros(shape, dtype=dtype) for _k, dtype, shape, _n in LAYOUT]
    slot, header, doff, dlen = read_copy(path, EXPECT, LAYOUT, verify=False)
    try:
        readback.read_into(slot, header, doff, dlen, tensors)
    finally:
        slot.close()
    return {key: t.numpy().tobytes() for (key, *_r), t in zip(LAYOUT, tensors)}


def test_read_into_lands_intact_copies_and_refuses_damaged_ones(tmp_path, monkeypatch):
    monkeypatch.setattr(readback, "PIECE_BYTES", 768)  # chunks (1000 bytes) split across pieces
    path = str(tmp_path / "rank00000.own")
    good = write_copy(path, np.random.default_rng(0), LAYOUT, dict(EXPECT, step=3, values={}), 1000)
    assert _read(path) == good
    pristine = open(path, "rb").read()
    slot = Slot.open(path)
    _h, doff, dlen = slot.header()
    slot.close()
    for pos in random.Random(2).sample(range(doff, doff + dlen), 300):
        damaged = bytearray(pristine)
        damaged[pos] ^= 0x04
        open(path, "wb").write(damaged)
        try:
            got = _read(path)
        except InvalidMemoryCopyError as e:
            assert "checksum mismatch" in str(e)
            continue
        assert got == good, f"a flipped byte at {pos} was read into a tensor unnoticed"


def _flip_last_record(path: str) -> None:
    """One flipped bit in the last record: every record before it is read into its tensor before the mismatch."""
    slot = Slot.open(path)
    header, data_off, _len = slot.header()
    slot.close()
    _key, _dtype, _shape, off, nbytes, _sums = header["records"][-1]
    with open(path, "r+b") as f:
        f.seek(data_off + off + nbytes - 1)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x01]))


@pytest.mark.parametrize("slots", [1, 2])
def test_corrupt_copy_found_while_reading_falls_back_and_overwrites(tmp_path, slots):
    """Step 3's copy is corrupt: one slot falls back to storage's step 2, two slots to the other slot's step 2."""
    model, fsdp, opt = small_fsdp(1)
    root, mem = str(tmp_path / "durable"), str(tmp_path / "mem")
    kw = dict(durable_root=root, memory_root=mem, persist_every=2, job_id="j", memory_slots=slots)
    tier = MemoryTier(fsdp, opt, **kw)
    wants = train_and_save(model, fsdp, opt, tier, (1, 2, 3))
    tier.close(remove=False)
    own = tier.copies.own_path()
    _flip_last_record(own)
    _m, fsdp2, opt2 = small_fsdp(9)
    tier2 = MemoryTier(fsdp2, opt2, **kw)
    wrote = []
    real = readback.read_into
    readback_spy = lambda *a: (wrote.append(1), real(*a))[1]  # noqa: E731
    import paddle.distributed.fsdp.memtier.restore as restore_mod

    restore_mod.read_into = readback_spy
    try:
        got = tier2.restore()
        assert wrote, "the corrupt copy was not read"
        assert (got.step, got.sources, dict(got)) == (2, ["storage" if slots == 1 else "memory"], {"step": 2})
        mine, (want, lr) = state_bytes(fsdp2, opt2), wants[2]
        assert [k for k in want if mine[k] != want[k]] == [] and opt2.get_lr() == lr
        # the same corrupt copy, no step in storage (the root keeps its memory-tier id, so the copy is still this
        # root's): a named error that says the tensors are no checkpoint's
        tier2.close(remove=False)
        if slots == 2:  # the slot step 2 came from: corrupt too (step 3's was discarded by the restore of step 2)
            _flip_last_record(tier.copies.own_path(index=1))
        for name in os.listdir(root):
            if name.startswith("step_"):
                shutil.rmtree(os.path.join(root, name))
        _m, fsdp3, opt3 = small_fsdp(9)
        tier3 = MemoryTier(fsdp3, opt3, **kw)
        with pytest.raises(NoCommonStepError) as err:
            tier3.restore()
        assert f"{mem}/j" in str(err.value) and "PADDLE_FSDP_JOB_ID" in str(err.value), err.value  # what to do
        if slots == 2:  # one slot: the restore of step 2 discarded step 3's copy, nothing is read
            assert any("hold no checkpoint's state" in n for n in getattr(err.value, "__notes__", [])), err.value
        tier3.close()
    finally:
        restore_mod.read_into = real
