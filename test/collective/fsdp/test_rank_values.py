"""Per-rank values in objects of their own (format 3, checkpoint/format/rank_values.py), written by the tools'
one-process writer (the same index code as a collective save) for a world of 3 ranks.

A loading rank reads its own entry only, a damaged or missing entry is named (by verify, and by the rank that
reads it) without failing the ranks whose entries are sound; the RNG decode of resume reads only its rank's
entry, and a world larger than the one that saved keeps its current state (as before).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from paddle.distributed.fsdp.checkpoint import (
    CorruptCheckpointError,
    load_full_state_dict,
    read_metadata,
    verify_checkpoint,
)
from paddle.distributed.fsdp.checkpoint.format.rank_values import RankValueList
from paddle.distributed.fsdp.tools.ckpt_io import CheckpointWriter, WriteEntry

WORLD = 3
ENTRIES = [{"seed": r, "words": list(range(r, r + 50))} for r in range(WORLD)]


def _write(path: str, per_rank=("rng",)) -> None:
    os.makedirs(path)
    w = CheckpointWriter(path, chunk_bytes=64)
    for r in range(WORLD):
        arr = np.arange(10 + r, dtype=np.float32) * (r + 1)
        w.write_file([WriteEntry(f"w{r}", "float32", arr.shape, lambda a=arr: a.view(np.uint8))])
    w.commit({"rng": list(ENTRIES), "step": 9}, write_stock_metadata=False, per_rank_values=per_rank)


@pytest.fixture
def ckpt(tmp_path):
    path = str(tmp_path / "ck")
    _write(path)
    return path


def test_each_rank_reads_its_own_entry_only(ckpt):
    names = set(os.listdir(ckpt))
    assert {"index.ranks", "0.values", "1.values", "2.values", "0_0.safetensors.sums"} <= names
    import json

    meta = json.load(open(os.path.join(ckpt, "metadata.json")))
    assert "rng" not in meta["values"] and meta["rank_values"]["keys"] == ["rng"]
    md = read_metadata(ckpt)
    assert md.version == 3 and isinstance(md.values["rng"], RankValueList) and md.values["step"] == 9
    before = md.index.fetch.bytes
    assert md.values["rng"][1] == ENTRIES[1]
    own = md.index.fetch.bytes - before
    assert md.index.fetch.objects >= {"index.ranks", "1.values"} and "0.values" not in md.index.fetch.objects
    assert own == 40 + os.path.getsize(os.path.join(ckpt, "1.values"))
    assert list(md.values["rng"]) == ENTRIES and md.values["rng"] == ENTRIES
    got = load_full_state_dict(ckpt, ["w0", "w2", "rng", "step"])
    assert list(got["rng"]) == ENTRIES and got["step"] == 9
    assert got["w2"].numpy().tobytes() == (np.arange(12, dtype=np.float32) * 3).tobytes()
    assert verify_checkpoint(ckpt) == []


def _flip(path: str, i: int) -> None:
    b = bytearray(open(path, "rb").read())
    b[i] ^= 0x01
    open(path, "wb").write(bytes(b))


def test_a_damaged_or_missing_entry_is_named_and_the_others_still_load(ckpt):
    _flip(os.path.join(ckpt, "1.values"), 30)
    assert any("values object of rank 1 (1.values)" in m and "damaged" in m for m in verify_checkpoint(ckpt))
    md = read_metadata(ckpt)
    assert md.values["rng"][0] == ENTRIES[0] and md.values["rng"][2] == ENTRIES[2]
    with pytest.raises(CorruptCheckpointError, match="rank 1"):
        md.values["rng"][1]
    os.unlink(os.path.join(ckpt, "1.values"))
    assert any("values object of rank 1 (1.values) is missing" in m for m in verify_checkpoint(ckpt))
    _flip(os.path.join(ckpt, "index.ranks"), 41)  # rank 1's row: its verify names the table
    assert any("index.ranks does not match its SHA-256" in m for m in verify_checkpoint(ckpt))


def test_an_entry_of_another_checkpoint_is_refused(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    _write(a)
    _write(b)
    # b's object in a (its size and SHA-256 made to match a's table): another checkpoint's, refused by its id
    blob = open(os.path.join(b, "2.values"), "rb").read()
    open(os.path.join(a, "2.values"), "wb").write(blob)
    md = read_metadata(a)
    md.rank_values.entries.clear()
    import hashlib

    row = np.array([(len(blob), hashlib.sha256(blob).digest())], md.rank_values.table().dtype)
    with pytest.raises(CorruptCheckpointError, match="another checkpoint"):
        md.rank_values.entry(2, row[0])


def test_rng_decode_reads_only_its_rank_and_keeps_state_beyond_the_saved_world(tmp_path, caplog):
    from paddle.distributed.fsdp.checkpoint.errors import MetadataError
    from paddle.distributed.fsdp.state import rng

    path = str(tmp_path / "ck")
    os.makedirs(path)
    w = CheckpointWriter(path)
    arr = np.zeros(4, np.float32)
    w.write_file([WriteEntry("w", "float32", (4,), lambda: arr.view(np.uint8))])
    w.write_file([])
    states = [rng.capture(), {"format": "fsdp-rng-v2", "cpu": [0, 1, 2, [1, 2, 3]]}]  # rank 1's is damaged
    w.commit({"__fsdp__.rng": states}, write_stock_metadata=False, per_rank_values=("__fsdp__.rng",))
    md = read_metadata(path)
    saved = md.values["__fsdp__.rng"]
    rng.decode(saved, 0, "ck")  # rank 0's own entry: sound
    assert "1.values" not in md.index.fetch.objects
    with pytest.raises(MetadataError, match=r"rng\[1\]"):
        rng.decode(saved, 1, "ck")
    with caplog.at_level("WARNING"):
        rng.decode(saved, 5, "ck")()  # a rank beyond the world that saved: keeps its own state
    assert "holds no random state for rank 5 (saved by 2 ranks)" in caplog.text


def test_a_per_rank_key_of_another_shape_is_refused(tmp_path):
    from paddle.distributed.fsdp.tools.errors import ToolError

    with pytest.raises(ToolError, match="one a rank"):
        _write(str(tmp_path / "ck"), per_rank=("step",))
