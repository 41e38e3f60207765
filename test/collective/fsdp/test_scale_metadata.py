"""What one loading rank reads of a checkpoint's index does not grow with the world that saved it (format 2).

The scale simulation of the benchmark (tools/ckpt_bench/scale.py) runs the engine's own save planner, the
coordinator's index writer, ``read_metadata`` and the load planner for one rank of a virtual world in this
process (no data bytes). Here: a small mixture-of-experts model of the benchmark's structure (FSDP unit per
decoder layer, fp32 master + AdamW moments), saved by 4 and by 64 ranks and loaded by the same worlds.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))
from ckpt_bench import scale  # noqa: E402

MODEL = "tiny-moe"
PER_FILE = 40  # bytes of metadata.json per data file: its size and checksum count as JSON numbers


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = {}
    for world in (4, 64):
        d = tmp_path_factory.mktemp(f"w{world}")
        out[world] = (d, scale.save_side(MODEL, world, str(d), 256))
    return out


def _reads(saved, world: int) -> list[dict]:
    d, _save = saved[world]
    return [scale.load_rank(str(d), MODEL, world, r) for r in sorted({0, 1, world // 2, world - 1})]


def test_index_bytes_a_rank_reads_do_not_grow_with_the_world(saved):
    small, large = _reads(saved, 4), _reads(saved, 64)
    grown = max(x["index_bytes"] for x in large) - max(x["index_bytes"] for x in small)
    assert grown <= (64 - 4) * PER_FILE, (small, large)  # the files table only
    # the index files themselves (metadata.json, index.keys, index.fences, index.starts, index.pieces) are the
    # only index objects read, plus the checksum sidecars of the files the rank reads (its own ranges)
    assert max(x["index_objects"] for x in large) == 5
    assert max(x["objects"] for x in large) <= 5 + 2 + 4  # + index.ranks and its own values object
    # its own checksums shrink with its share
    assert max(x["sums_bytes"] for x in large) < max(x["sums_bytes"] for x in small)


def test_rows_a_rank_reads_do_not_grow_with_the_ranks_a_key_is_split_over(saved):
    """The row directory (index.starts): at 64 ranks the embedding and head of the tiny model are split over ~32
    ranks each; a rank reads their starts (8 bytes a row) and only the rows overlapping its share, so the rows
    and starts it reads are no more than at 4 ranks, where it reads every row of its few-row keys. (Without the
    directory: 7.7 KB of rows at 64 ranks against 4.4 KB at 4.)"""

    def rows(world: int) -> int:
        return max(
            sum(x["index_by_object"][n] for n in ("index.fences", "index.starts", "index.pieces"))
            for x in _reads(saved, world)
        )

    assert 0 < rows(64) <= rows(4), (rows(4), rows(64))


def test_the_measure_sees_a_reader_that_reads_every_piece(saved):
    """Control: the rows of every key (what a format-1 reader parses whole) grow with the world, and the measure
    shows it: reading them all costs more at 64 ranks than at 4 by far more than the files table."""
    from paddle.distributed.fsdp.checkpoint import read_metadata

    def all_rows(world):
        md = read_metadata(str(saved[world][0]))
        md.prefetch(list(md.tensors))
        return md.index.fetch.bytes

    assert all_rows(64) - all_rows(4) > 10 * (64 - 4) * PER_FILE
    assert saved[64][1]["pieces"] > 2 * saved[4][1]["pieces"]


def test_checksum_chunk_follows_the_pieces_of_large_worlds():
    """Below 256 ranks saves keep 256 KiB chunks; from there the chunk is about 1/16 of the mean piece (within
    16-256 KiB), so a resharded verified load reads at most two small chunks beyond each of its ranges."""
    from paddle.distributed.fsdp.checkpoint.planner import WriteAssignment, chunk_for

    def assignment(world: int, piece_bytes: int) -> WriteAssignment:
        n = piece_bytes // 4 * world
        return WriteAssignment([("w", "float32", (n,))], {r: [("w", None)] for r in range(world)})

    assert chunk_for(assignment(8, 1 << 20)) == 256 << 10
    assert chunk_for(assignment(256, 1 << 20)) == 64 << 10
    assert chunk_for(assignment(512, 2 << 20)) == 128 << 10
    assert chunk_for(assignment(8192, 64 << 20)) == 256 << 10
    assert chunk_for(assignment(8192, 1 << 10)) == 16 << 10
    assert chunk_for(assignment(8192, 300 << 10)) == 16 << 10  # Qwen3-30B-A3B's pieces at 8192 ranks


def test_per_rank_values_a_rank_reads_do_not_grow_with_the_world(saved):
    """Each saving rank's RNG state (~19 KB, the one-call API's per-rank value) is an object of its own: a
    loading rank reads its row of index.ranks and its own object, at 4 ranks as at 64 (the rank's number in the
    object is the only difference: a digit)."""
    small, large = _reads(saved, 4), _reads(saved, 64)
    entry = saved[4][1]["rank_values_bytes_per_rank"]
    assert entry > 10_000  # a real RNG state (state/rng.py capture)
    for x in small + large:
        assert entry - 2 <= x["rank_values_bytes"] - 40 <= entry + 2, x  # its row (40 bytes) and its object
        assert x["rank_values_objects"] == 2, x
    assert max(x["rank_values_bytes"] for x in large) - min(x["rank_values_bytes"] for x in small) <= 2


def test_the_measure_sees_every_ranks_values_read(saved):
    """Control: reading every rank's entry (what a format-2 metadata.json made every rank parse) grows with the
    world, and the count shows it."""
    from paddle.distributed.fsdp.checkpoint import read_metadata

    def all_entries(world):
        md = read_metadata(str(saved[world][0]))
        before = md.index.fetch.bytes
        assert len(list(md.values[scale.RNG_KEY])) == world
        return md.index.fetch.bytes - before

    assert all_entries(64) > 15 * all_entries(4) > 15 * 4 * 10_000


def test_a_damaged_row_directory_is_named_by_the_ranks_it_misleads(saved, tmp_path):
    """One start of the embedding's row directory moved by one element (still ascending): the ranks whose
    window holds that row refuse the load naming index.starts (never a wrong piece list); the other ranks load."""
    import shutil

    import numpy as np
    from paddle.distributed.fsdp.checkpoint import CorruptCheckpointError, read_metadata

    d = tmp_path / "w64"
    shutil.copytree(saved[64][0], d)
    md = read_metadata(str(d))
    rows = md.index.table["rows"]
    k = md.tensors["model.embed_tokens.weight"].key_id
    assert rows[k + 1] - rows[k] > 16  # split over many ranks: the directory is used for it
    starts = np.fromfile(d / "index.starts", "<u8")
    starts[rows[k] + 5] += 1
    starts.tofile(d / "index.starts")
    failed = []
    for r in range(64):
        try:
            scale.load_rank(str(d), MODEL, 64, r)
        except CorruptCheckpointError as e:
            assert "index.starts does not match the rows of key 'model.embed_tokens.weight'" in str(e), e
            failed.append(r)
    assert 1 <= len(failed) <= 3, failed
