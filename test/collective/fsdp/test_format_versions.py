"""Checkpoints of every format version this build reads: the format-1 fixture (written by the engine before
format 2, fixtures/make_v1_checkpoint.py) and the format-2 fixture (written before per-rank values had objects
of their own, format 3) load bit-exactly and verify; a damaged byte in them is still caught."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
from paddle.distributed.fsdp.checkpoint import load_full_state_dict, read_metadata, verify_checkpoint
from paddle.distributed.fsdp.checkpoint.errors import CorruptCheckpointError, RngStateMismatchError

FIXTURES = Path(__file__).parent / "fixtures"
V1 = FIXTURES / "v1_two_ranks"
V2 = FIXTURES / "v2_two_ranks"
sys.path.insert(0, str(FIXTURES))
from make_v1_checkpoint import VALUES, fixture_arrays  # noqa: E402


def _expect_fixture(got: dict) -> None:
    want = fixture_arrays()
    for key, arr in want.items():
        t = got[key].numpy()
        assert t.dtype == arr.dtype and t.shape == arr.shape, key
        assert t.tobytes() == arr.tobytes(), key  # bit-exact
    for key, v in VALUES.items():
        assert got[key] == v
    assert got["rng"] == [[0, 0], [1, 3]]


def test_v1_fixture_loads_bit_exactly_and_verifies():
    md = read_metadata(str(V1))
    assert md.version == 1 and md.world_size == 2
    keys = list(fixture_arrays()) + list(VALUES) + ["rng"]
    _expect_fixture(load_full_state_dict(str(V1), keys))
    assert verify_checkpoint(str(V1)) == []


def test_v2_fixture_loads_bit_exactly_and_verifies(tmp_path):
    """Format 2 as first written: the per-rank values are a list in metadata.json; loads, verifies, resumes the
    RNG entry of each rank (rng.decode reads the list as before), and a damaged data byte is caught."""
    from paddle.distributed.fsdp.state import rng

    md = read_metadata(str(V2))
    assert md.version == 2 and md.world_size == 2 and md.rank_values is None
    assert md.values["rng"] == [[0, 0], [1, 3]] and type(md.values["rng"]) is list
    keys = list(fixture_arrays()) + list(VALUES) + ["rng"]
    _expect_fixture(load_full_state_dict(str(V2), keys))
    assert verify_checkpoint(str(V2)) == []
    with pytest.raises(RngStateMismatchError, match=r"rng\[1\] holds 2 generator state"):
        rng.decode(md.values["rng"], 1, "v2")  # the entry of rank 1 is read (a legacy list of two "states")
    ck = tmp_path / "ck"
    shutil.copytree(V2, ck)
    p = read_metadata(str(ck)).tensors["m.fp32"].pieces[-1]
    data = bytearray((ck / p.file).read_bytes())
    data[p.offset] ^= 0x04
    (ck / p.file).write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError):
        load_full_state_dict(str(ck), ["m.fp32"])
    assert any("checksum mismatch" in m for m in verify_checkpoint(str(ck)))


def test_v1_fixture_damage_is_caught(tmp_path):
    ck = tmp_path / "ck"
    shutil.copytree(V1, ck)
    md = read_metadata(str(ck))
    p = md.tensors["w.fp32"].pieces[0]
    data = bytearray((ck / p.file).read_bytes())
    data[p.offset + 5] ^= 0x10
    (ck / p.file).write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError):
        load_full_state_dict(str(ck), ["w.fp32"])
    assert verify_checkpoint(str(ck))


def test_v1_fixture_converts_to_format2(tmp_path):
    """Converted: format 2 on disk (index objects, one sidecar per data file), the same bytes and values load,
    verify passes, and a flipped data byte is still caught through the converted checksums."""
    from paddle.distributed.fsdp.checkpoint.convert import convert_to_format2

    ck = tmp_path / "ck"
    shutil.copytree(V1, ck)
    assert convert_to_format2(str(ck)) is True
    assert convert_to_format2(str(ck)) is False
    names = set(os.listdir(ck))
    assert {"index.keys", "index.pieces", "0_0.safetensors.sums", "1_0.safetensors.sums"} <= names
    md = read_metadata(str(ck))
    assert md.version == 3 and md.checkpoint_id == read_metadata(str(V1)).checkpoint_id
    keys = list(fixture_arrays()) + list(VALUES) + ["rng"]
    _expect_fixture(load_full_state_dict(str(ck), keys))
    assert verify_checkpoint(str(ck)) == []
    p = read_metadata(str(ck)).tensors["b.fp64"].pieces[0]
    data = bytearray((ck / p.file).read_bytes())
    data[p.offset + p.nbytes - 1] ^= 0x01
    (ck / p.file).write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError):
        load_full_state_dict(str(ck), ["b.fp64"])
    assert any("checksum mismatch" in m for m in verify_checkpoint(str(ck)))


@pytest.fixture
def saved_v2(tmp_path):
    import paddle
    from paddle.distributed.fsdp.checkpoint import save_state_dict

    arrays = fixture_arrays()
    save_state_dict({k: paddle.to_tensor(v) for k, v in arrays.items()}, str(tmp_path / "ck"), chunk_bytes=16)
    return tmp_path / "ck", arrays


def test_format2_damage_is_named(saved_v2):
    """Each object of format 2 damaged: verify names it, a load refuses with a named error (never wrong bytes)."""
    from paddle.distributed.fsdp.checkpoint.errors import CheckpointError, MetadataError
    from paddle.distributed.fsdp.checkpoint.format.index import PIECE_ROW

    ck, arrays = saved_v2
    assert read_metadata(str(ck)).version == 3 and verify_checkpoint(str(ck)) == []
    keys = sorted(arrays)
    clean = {n: (ck / n).read_bytes() for n in os.listdir(ck)}

    def damaged(name, fn):
        for n, b in clean.items():
            (ck / n).write_bytes(b)
        if fn is None:
            (ck / name).unlink()
        else:
            (ck / name).write_bytes(fn(bytearray(clean[name])))

    def flip(i):
        def fn(b):
            b[i] ^= 0x01
            return bytes(b)

        return fn

    damaged("0_0.safetensors.sums", None)
    assert any("sidecar 0_0.safetensors.sums is missing" in m for m in verify_checkpoint(str(ck)))
    with pytest.raises(CheckpointError):
        load_full_state_dict(str(ck), keys)
    damaged("0_0.safetensors.sums", flip(9))  # the second checksum of the file's first piece
    assert any("checksum mismatch" in m for m in verify_checkpoint(str(ck)))
    with pytest.raises(CorruptCheckpointError):
        load_full_state_dict(str(ck), keys)
    damaged("index.pieces", flip(PIECE_ROW.fields["key"][1]))  # row 0 claims another key
    assert any("index.pieces does not match its SHA-256" in m for m in verify_checkpoint(str(ck)))
    with pytest.raises(CorruptCheckpointError, match="index.pieces row 0 is damaged"):  # its row check
        load_full_state_dict(str(ck), keys)
    damaged("index.starts", flip(0))  # the row directory: whole-key loads do not need it, verify names it
    assert any("index.starts does not match its SHA-256" in m for m in verify_checkpoint(str(ck)))
    got = load_full_state_dict(str(ck), keys)
    assert all(got[k].numpy().tobytes() == arrays[k].tobytes() for k in keys)
    damaged("index.keys", flip(10))
    assert any("index.keys does not match" in m for m in verify_checkpoint(str(ck)))
    with pytest.raises(MetadataError):
        read_metadata(str(ck))
    damaged("index.pieces", lambda b: bytes(b[:-3]))
    assert verify_checkpoint(str(ck))
    with pytest.raises(CheckpointError):
        load_full_state_dict(str(ck), keys)
    damaged("index.pieces", lambda b: bytes(b))
    got = load_full_state_dict(str(ck), keys)
    assert all(got[k].numpy().tobytes() == arrays[k].tobytes() for k in keys)


def test_one_registry_names_every_version_and_the_one_written(tmp_path):
    """format/versions.py registers formats 1 to 4 (each with its reader); a save, the converter and the
    fixtures agree with it: a new checkpoint without format 4's fields declares WRITE_VERSION (3), the fixtures
    their own versions (format 4: derived weights, test_derived_weights.py; quantized moments, test_lossy_moments.py)."""
    import paddle
    from paddle.distributed.fsdp.checkpoint import save_state_dict
    from paddle.distributed.fsdp.checkpoint.convert import convert_to_format2, convert_to_format3
    from paddle.distributed.fsdp.checkpoint.format import versions

    assert sorted(versions.FORMATS) == [1, 2, 3, 4] and versions.EXTENDED_VERSION == 4
    assert versions.WRITE_VERSION == versions.RANK_VALUES_VERSION == 3
    assert versions.EXTENDED_VERSION == 4 and versions.write_version({"codecs": {"0_0.safetensors": "raw"}}) == 4
    assert versions.write_version({"codecs": None, "values": {}}) == 3
    assert (versions.SINGLE_FILE_VERSION, versions.INDEXED_VERSION) == (1, 2)
    assert all(v.version == n and callable(v.read) for n, v in versions.FORMATS.items())
    assert convert_to_format2 is convert_to_format3
    save_state_dict({"w": paddle.ones([3])}, str(tmp_path / "new"))
    assert read_metadata(str(tmp_path / "new")).version == versions.WRITE_VERSION
    assert (read_metadata(str(V1)).version, read_metadata(str(V2)).version) == (1, 2)
