"""Every index byte a format-3 load trusts is checked before it is used (issue 40).

A row of ``index.pieces`` carries a check of its fields and position (format/index.py ``row_checks``): one
flipped bit of a row's ``file`` in a checkpoint whose files have the same layout used to load another rank's
bytes with no error. Rows a load reads never share bytes of a file (format 1's rule), so a small crafted
checkpoint cannot make a load allocate a large tensor. A checkpoint written before row checks is still read; a
load that reads every row checks them against the SHA-256 of metadata.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import paddle
import paddle.distributed.fsdp.checkpoint as ck
import pytest
from crafted import convert_to_format3, craft, flat_boxes, rewrite_rows, snapshot_files
from paddle.distributed.fsdp.checkpoint.format.index import PIECE_ROW


def _symmetric(path: Path) -> dict:
    """A format-3 checkpoint of 20 keys, each split into two flat halves of one size, one in each of two
    files of the same layout (as ranks of one FSDP save): a row pointed at the other file finds a piece of
    the same name, size and offset there, with checksums that match it."""
    rng = np.random.default_rng(3)
    values = {f"k{i:02d}": rng.standard_normal((4, 6)).astype(np.float32) for i in range(20)}
    pieces = {k: [(fi, (0, 0), (4, 6), fr) for fi, fr in enumerate(flat_boxes((4, 6), 2))] for k in values}
    craft(path, values, pieces)
    convert_to_format3(path)
    return values


def _restore(path: Path, pristine: dict) -> None:
    for name, data in pristine.items():
        (path / name).write_bytes(data)


def _load_both(path: Path, values: dict):
    """``load_full_state_dict`` and ``load_state_dict`` of every key: (loaded exactly, else the error)."""
    out = []
    try:
        got = ck.load_full_state_dict(str(path))
        out.append(all(got[k].numpy().tobytes() == v.tobytes() for k, v in values.items()))
    except ck.CheckpointError as e:
        out.append(e)
    targets = {k: paddle.zeros(list(v.shape)) for k, v in values.items()}
    try:
        ck.load_state_dict(targets, str(path))
        out.append(all(targets[k].numpy().tobytes() == v.tobytes() for k, v in values.items()))
    except ck.CheckpointError as e:
        out.append(e)
    return out


def test_a_flipped_bit_of_any_rows_file_is_named_by_every_load(tmp_path):
    ckpt = tmp_path / "ck"
    values = _symmetric(ckpt)
    pristine = snapshot_files(ckpt)
    assert _load_both(ckpt, values) == [True, True] and ck.verify_checkpoint(str(ckpt)) == []
    raw = pristine["index.pieces"]
    n = len(raw) // PIECE_ROW.itemsize
    for row in range(n):
        data = bytearray(raw)
        data[row * PIECE_ROW.itemsize + PIECE_ROW.fields["file"][1]] ^= 0x01
        (ckpt / "index.pieces").write_bytes(bytes(data))
        for got in _load_both(ckpt, values):
            assert isinstance(got, ck.CorruptCheckpointError) and f"index.pieces row {row} is damaged" in str(got)
        assert any("index.pieces" in p for p in ck.verify_checkpoint(str(ckpt)))
        _restore(ckpt, pristine)


def test_rows_of_a_build_without_row_checks_are_checked_against_the_sha256_when_read_whole(tmp_path):
    """A format-3 checkpoint written before row checks (no ``check`` field, zero pads) loads; a flipped bit of a
    row's file is named by every load that reads every row (the SHA-256 in metadata.json)."""
    ckpt = tmp_path / "ck"
    values = _symmetric(ckpt)
    rewrite_rows(ckpt, lambda rows: None, checks=False)
    assert "check" not in json.loads((ckpt / "metadata.json").read_bytes())["index"]["index.pieces"]
    assert _load_both(ckpt, values) == [True, True] and ck.verify_checkpoint(str(ckpt)) == []
    data = bytearray((ckpt / "index.pieces").read_bytes())
    data[PIECE_ROW.fields["file"][1]] ^= 0x01
    (ckpt / "index.pieces").write_bytes(bytes(data))
    for got in _load_both(ckpt, values):
        assert isinstance(got, ck.CorruptCheckpointError) and "index.pieces does not match its SHA-256" in str(got)


def test_two_rows_sharing_bytes_are_refused_at_load(tmp_path):
    """w = [0..7, 0..7]: the second half's row points at the first half's bytes (checks and hashes made
    consistent, as a crafter would): refused by both loads and verify, naming the shared bytes."""
    ckpt = tmp_path / "ck"
    values = {"w": np.arange(16, dtype=np.float32)}
    craft(ckpt, values, {"w": [(0, (0,), (16,), (0, 8)), (0, (0,), (16,), (8, 16))]})
    convert_to_format3(ckpt)

    def alias(rows):
        rows[1]["offset"] = rows[0]["offset"]

    rewrite_rows(ckpt, alias)
    for got in _load_both(ckpt, values):
        assert isinstance(got, ck.CorruptCheckpointError) and "share bytes" in str(got), got
    assert any("share bytes" in p for p in ck.verify_checkpoint(str(ckpt)))


def test_a_small_crafted_checkpoint_cannot_make_a_load_allocate_a_large_tensor(tmp_path):
    """A 4 GiB tensor declared, covered by 4096 rows that all point at the one MiB a data file holds: a named
    error before anything is allocated (the shared bytes are seen among the rows, before any target)."""
    import zlib

    ckpt = tmp_path / "ck"
    mib = 1 << 18  # float32 elements in 1 MiB
    craft(ckpt, {"w": np.zeros(mib, np.float32)}, {"w": [(0, (0,), (mib,), None)]}, chunk=1 << 20)
    convert_to_format3(ckpt)
    keys = json.loads(zlib.decompress((ckpt / "index.keys").read_bytes()))
    keys["dims"], keys["counts"] = [4096 * mib], [4096]
    blob = zlib.compress(json.dumps(keys).encode())
    (ckpt / "index.keys").write_bytes(blob)
    md = json.loads((ckpt / "metadata.json").read_bytes())
    import hashlib

    md["index"]["index.keys"].update(bytes=len(blob), sha256=hashlib.sha256(blob).hexdigest())
    md["index"]["index.keys"]["inflated"] = len(zlib.decompress(blob))
    (ckpt / "metadata.json").write_bytes(json.dumps(md).encode())
    row = np.frombuffer((ckpt / "index.pieces").read_bytes(), PIECE_ROW)[0]

    def many(_rows):
        pass

    # 4096 flat rows of one MiB each, all at the file's one piece
    rows = np.repeat(np.array([row]), 4096)
    rows["flat_a"] = np.arange(4096) * mib
    rows["flat_b"] = rows["flat_a"] + mib
    (ckpt / "index.pieces").write_bytes(rows.tobytes())
    rewrite_rows(ckpt, many)
    assert sum(p.stat().st_size for p in ckpt.iterdir()) < 2 << 20
    with pytest.raises(ck.CorruptCheckpointError, match="share bytes"):
        ck.load_full_state_dict(str(ckpt))
    assert any("share bytes" in p for p in ck.verify_checkpoint(str(ckpt)))
