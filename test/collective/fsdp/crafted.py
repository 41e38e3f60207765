"""Building checkpoints by hand, for tests that need layouts one process cannot save (several files, pieces of
any shape, overlaps and gaps with valid checksums) and for re-sealing an edited ``metadata.json``.

Written with the engine's own format module (format/metadata.py, format/safetensors.py, format/commit.py), so a
crafted checkpoint differs from a saved one only where the test says so.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from pathlib import Path

import numpy as np
import xxhash
from paddle.distributed.fsdp.checkpoint import one_process as format_commit
from paddle.distributed.fsdp.checkpoint.format.metadata import CheckpointMetadata, FileMeta, PieceMeta, TensorMeta
from paddle.distributed.fsdp.checkpoint.format.safetensors import build_header

CHUNK = 64  # small checksum chunks: several per piece


def flat_boxes(shape, n_files: int):
    """``n_files`` flat ranges covering a tensor of ``shape`` exactly (some may be empty)."""
    total = int(np.prod(shape)) if shape else 1
    cuts = np.linspace(0, total, n_files + 1).astype(int)
    return [(int(a), int(b)) for a, b in zip(cuts, cuts[1:])]


def craft(
    path: Path, tensors: dict, pieces: dict, values: dict | None = None, chunk: int = CHUNK, per_rank: tuple = ()
) -> None:
    """Write a committed checkpoint at ``path`` (format 1; format 3 with ``per_rank``: the keys of ``values``
    holding one entry per file, each in its rank's values object).

    ``tensors``: key -> numpy array (its global value). ``pieces``: key -> list of ``(file index, box_offset,
    box_shape, flat_range or None)``; each piece stores those elements of the global array, row-major.
    """
    path.mkdir(parents=True, exist_ok=False)
    md = CheckpointMetadata(checkpoint_id="c" * 32, world_size=1, chunk_bytes=chunk, checksum="xxh3-64")
    md.values = dict(values or {})
    by_file: dict[int, list] = {}
    for key, arr in tensors.items():
        md.tensors[key] = TensorMeta(dtype=str(arr.dtype), shape=tuple(arr.shape), pieces=[])
        for fi, off, box, fr in pieces[key]:
            sl = tuple(slice(o, o + s) for o, s in zip(off, box))
            data = np.ascontiguousarray(arr[sl]).reshape(-1)
            if fr is not None:
                data = data[fr[0] : fr[1]]
            by_file.setdefault(fi, []).append((key, off, box, fr, data))
    world = max(by_file) + 1 if by_file else 1
    md.world_size = world
    for fi in range(world):
        name = f"{fi}_0.safetensors"
        entries, pos, blobs = [], 0, []
        for n, (key, _off, _box, _fr, data) in enumerate(by_file.get(fi, [])):
            raw = data.view(np.uint8).tobytes()
            entries.append((f"{key}#{n}", str(data.dtype), (data.size,), pos, pos + len(raw)))
            blobs.append(raw)
            pos += len(raw)
        header = build_header(entries, {"format": "paddle-fsdp-checkpoint"})
        (path / name).write_bytes(header + b"".join(blobs))
        md.files[name] = FileMeta(rank=fi, size=len(header) + pos)
        for (ename, _dt, _shape, b, _e), (key, off, box, fr, _data), raw in zip(entries, by_file.get(fi, []), blobs):
            md.tensors[key].pieces.append(
                PieceMeta(
                    file=name,
                    name=ename,
                    offset=len(header) + b,
                    nbytes=len(raw),
                    box_offset=tuple(off),
                    box_shape=tuple(box),
                    flat_range=None if fr is None else tuple(fr),
                    checksums=[xxhash.xxh3_64_intdigest(raw[j : j + chunk]) for j in range(0, len(raw), chunk)],
                )
            )
    if per_rank:
        data = format_commit.write_format3(str(path), md, False, tuple(per_rank))
    else:
        data = format_commit.write_metadata(str(path), md, write_stock=False)
    format_commit.write_commit(str(path), md.checkpoint_id, data)


def reseal(path: Path, metadata_bytes: bytes) -> None:
    """Replace metadata.json with ``metadata_bytes`` and make COMMIT name its hash (only the edit is wrong)."""
    (path / "metadata.json").write_bytes(metadata_bytes)
    commit = json.loads((path / "COMMIT").read_bytes())
    commit["metadata_sha256"] = hashlib.sha256(metadata_bytes).hexdigest()
    (path / "COMMIT").write_text(json.dumps(commit))


def edit_metadata(path: Path, fn) -> None:
    """Edit metadata.json as a dict with ``fn`` and re-seal it (a format-2 checkpoint becomes format 1 first)."""
    to_format1(path)
    md = json.loads((path / "metadata.json").read_bytes())
    fn(md)
    reseal(path, json.dumps(md).encode())


def snapshot_files(path: Path) -> dict[str, bytes]:
    return {n: (path / n).read_bytes() for n in os.listdir(path) if (path / n).is_file()}


def metadata_json(path: Path) -> dict:
    """The checkpoint's index as format-1 JSON (every piece with its checksums), whatever format it is in."""
    from paddle.distributed.fsdp.checkpoint import read_metadata

    md = read_metadata(str(path))
    if md.version == 1:
        return json.loads((Path(path) / "metadata.json").read_bytes())
    md.prefetch(list(md.tensors))
    d = md.to_json()
    d["version"] = 1
    return d


def to_format1(path: Path) -> None:
    """Rewrite a format-2 checkpoint as format 1 in place (tests that edit metadata.json field by field; the
    format-1 reader is what they exercise). Nothing happens to a format-1 checkpoint."""
    d = metadata_json(path)
    if (Path(path) / "index.keys").exists():
        for name in os.listdir(path):
            if name.startswith("index.") or name.endswith((".sums", ".values")):
                os.unlink(Path(path) / name)
        reseal(Path(path), json.dumps(d, separators=(",", ":")).encode())


def convert_to_format3(path: Path) -> None:
    """A crafted (format-1) checkpoint rewritten as format 3 in place: index objects, sidecars, row checks."""
    from paddle.distributed.fsdp.checkpoint.convert import convert_to_format2

    assert convert_to_format2(str(path))


def rewrite_rows(path: Path, fn, checks: bool = True) -> None:
    """Edit a format-3 checkpoint's ``index.pieces`` rows with ``fn(rows)`` (a PIECE_ROW array, edited in place)
    and make everything around them consistent again, as a crafter would: each row's check (``checks=False``:
    the rows as a build without row checks wrote them), the row directory, the SHA-256s of metadata.json,
    COMMIT. Only what ``fn`` did is wrong."""
    from paddle.distributed.fsdp.checkpoint.format import index, row_directory

    rows = np.frombuffer((path / "index.pieces").read_bytes(), index.PIECE_ROW).copy()
    fn(rows)
    md = json.loads((path / "metadata.json").read_bytes())
    info = md["index"]["index.pieces"]
    rows["pad"] = index.row_checks(rows, 0) if checks else 0
    if not checks:
        info.pop("check", None)
    counts = json.loads(zlib.decompress((path / "index.keys").read_bytes()))["counts"]
    key_rows = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)  # (fn keeps every key's row count)
    starts = np.where(rows["flat_a"] >= 0, rows["flat_a"], 0).astype(np.uint64)
    owner = np.repeat(np.arange(len(counts)), counts)  # the key each row is a row of (whatever its key field)
    boxed = np.zeros(len(counts), bool)
    boxed[owner[rows["box"] >= 0]] = True
    starts[boxed[owner]] = row_directory.NO_START
    fences = row_directory.fences_of(starts, key_rows)
    blobs = {
        "index.pieces": rows.tobytes(),
        "index.starts": starts.astype("<u8").tobytes(),
        "index.fences": fences.astype("<u8").tobytes(),
    }
    for name, blob in blobs.items():
        (path / name).write_bytes(blob)
        md["index"][name]["sha256"] = hashlib.sha256(blob).hexdigest()
    info["rows"] = len(rows)
    reseal(path, json.dumps(md).encode())
