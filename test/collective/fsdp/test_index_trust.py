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


# ------------------------------------------------------------------------------------------- named errors


def _with_keys(ckpt: Path, text: bytes, inflated: int | None) -> None:
    """index.keys replaced by ``zlib(text)`` (or, ``text`` None: kept), its size and SHA-256 made to match, and
    ``inflated`` declared (None: not declared, as before row checks)."""
    import hashlib
    import zlib

    from crafted import reseal

    blob = zlib.compress(text)
    (ckpt / "index.keys").write_bytes(blob)
    md = json.loads((ckpt / "metadata.json").read_bytes())
    entry = md["index"]["index.keys"]
    entry.update(bytes=len(blob), sha256=hashlib.sha256(blob).hexdigest())
    entry.pop("inflated", None)
    if inflated is not None:
        entry["inflated"] = inflated
    reseal(ckpt, json.dumps(md).encode())


@pytest.fixture
def small(tmp_path):
    ckpt = tmp_path / "ck"
    values = {"w": np.arange(12, dtype=np.float32).reshape(3, 4)}
    craft(ckpt, values, {"w": [(0, (0, 0), (3, 4), None)]}, values={"rng": [[1, 2]]}, per_rank=("rng",))
    return ckpt


def _named_everywhere(ckpt: Path, match: str, capsys) -> None:
    """read_metadata, load_full_state_dict and load_state_dict raise a named error matching ``match``; verify
    names it; the CLI answers exit 1 or 2, never 3."""
    from paddle.distributed.fsdp.tools.cli import main

    for call in (
        lambda: ck.read_metadata(str(ckpt)),
        lambda: ck.load_full_state_dict(str(ckpt)),
        lambda: ck.load_state_dict({"w": paddle.zeros([3, 4])}, str(ckpt)),
    ):
        with pytest.raises(ck.CheckpointError, match=match):
            call()
    assert any(re_search(match, p) for p in ck.verify_checkpoint(str(ckpt)))
    for cmd in ("inspect", "verify"):
        capsys.readouterr()
        rc = main([cmd, str(ckpt)])
        err = capsys.readouterr().err
        assert rc in (1, 2) and "internal error" not in err, (cmd, rc, err)


def re_search(pattern: str, text: str) -> bool:
    import re

    return re.search(pattern, text) is not None


def test_deeply_nested_index_keys_is_a_named_error(small, capsys):
    _with_keys(small, b'{"keys":' + b"[" * 200_000 + b"]" * 200_000 + b"}", None)
    _named_everywhere(small, "nested deeper", capsys)


def test_non_string_names_are_a_named_error(small, capsys):
    import zlib

    doc = json.loads(zlib.decompress((small / "index.keys").read_bytes()))
    doc["names"] = {"0": ["w"]}
    text = json.dumps(doc).encode()
    _with_keys(small, text, len(text))
    _named_everywhere(small, "names must map row numbers to strings", capsys)


def test_index_keys_inflating_beyond_what_is_declared_is_refused(small, capsys):
    text = b" " * (8 << 20) + b"{}"
    _with_keys(small, text, 100)
    _named_everywhere(small, "inflates beyond 100 bytes", capsys)


BOMB = r"""
import resource, sys, zlib, json, hashlib
from pathlib import Path
import paddle.distributed.fsdp.checkpoint as ck
sys.path.insert(0, sys.argv[3])
from crafted import reseal
ckpt, declared = Path(sys.argv[1]), sys.argv[2] == "declared"
co = zlib.compressobj(9)
parts = [co.compress(b'{"keys":[' + b" " * (1 << 20))]
parts += [co.compress(b" " * (1 << 20)) for _ in range(1023)]  # 1 GiB of blanks inflated
blob = b"".join(parts) + co.flush()
(ckpt / "index.keys").write_bytes(blob)
md = json.loads((ckpt / "metadata.json").read_bytes())
entry = md["index"]["index.keys"]
entry.update(bytes=len(blob), sha256=hashlib.sha256(blob).hexdigest())
if not declared:
    entry.pop("inflated")
reseal(ckpt, json.dumps(md).encode())
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    ck.load_full_state_dict(str(ckpt))
    print("LOADED")
except ck.MetadataError as e:
    print("NAMED", e)
print("GROWN_MB", (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) // 1024)
"""


@pytest.mark.parametrize("declared", ["declared", "legacy"])
def test_a_zip_bomb_in_index_keys_is_refused_before_it_inflates(small, declared):
    """1 GiB inflated from ~1 MB: refused after the declared size (saves since row checks declare it), or, for
    a checkpoint that declares none, at MAX_INFLATED_KEYS_BYTES (256 MiB); the peak memory shows it (it was 2.35
    GiB: the whole GiB inflated, then parsed)."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-c", BOMB, str(small), declared, str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "NAMED" in r.stdout and "inflates beyond" in r.stdout, r.stdout + r.stderr[-3000:]
    grown = int(r.stdout.split("GROWN_MB")[1])
    assert grown < (100 if declared == "declared" else 600), r.stdout


def test_a_missing_values_object_is_a_named_error(small):
    (small / "0.values").unlink()
    with pytest.raises(ck.CorruptCheckpointError, match=r"values object of rank 0 \(0.values\) is missing"):
        list(ck.load_full_state_dict(str(small), ["rng"])["rng"])
    state = {"rng": None}
    ck.load_state_dict(state, str(small))  # (a per-rank value is read by rank when first asked for)
    with pytest.raises(ck.CorruptCheckpointError, match="is missing"):
        list(state["rng"])
    assert any("(0.values) is missing" in p for p in ck.verify_checkpoint(str(small)))


def test_rows_of_a_key_out_of_order_are_refused_by_every_load_and_verify(tmp_path):
    """Two rows of a key split into 20 swapped (checks, directory and hashes made to match): the windowed load
    refused this before, while verify called it sound and a whole-key load loaded it; now all three agree."""
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    ckpt = tmp_path / "ck"
    values = {"long": np.arange(200, dtype=np.float32)}
    cuts = np.linspace(0, 200, 21).astype(int)
    craft(
        ckpt,
        values,
        {"long": [(i % 2, (0,), (200,), (int(a), int(b))) for i, (a, b) in enumerate(zip(cuts, cuts[1:]))]},
    )
    convert_to_format3(ckpt)

    def swap(rows):
        rows[[4, 5]] = rows[[5, 4]]

    rewrite_rows(ckpt, swap)
    with pytest.raises(ck.CorruptCheckpointError, match="not its flat ranges in order"):
        ck.load_full_state_dict(str(ckpt))
    window = ShardedWeight(
        "long", paddle.zeros([30]), [200], [200], [0], is_flattened=True, flattened_range=slice(100, 130)
    )
    with pytest.raises(ck.CorruptCheckpointError):
        ck.load_state_dict({"long": window}, str(ckpt))
    assert any("not its flat ranges in order" in p for p in ck.verify_checkpoint(str(ckpt)))
