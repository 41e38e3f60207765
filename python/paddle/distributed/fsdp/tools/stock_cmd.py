"""The CLI on checkpoints this engine did not write: stock paddle's (``<id>.metadata`` + ``.distcp`` or
``.safetensors``, read with the restricted unpickler) and plain Hugging Face safetensors directories.

* ``inspect``: keys, dtypes, global shapes, pieces and bytes from the (stock) metadata alone;
* ``verify``: every element covered exactly once, every referenced file present and every piece readable with
  the size the metadata says (stock checkpoints carry no checksums: said so, not claimed);
* ``import-stock``: convert into this engine's format (streaming one tensor at a time), so the checkpoint gets
  checksums, a commit record and the engine's loader.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..checkpoint.errors import CheckpointError, NotACheckpointError
from ..checkpoint.format.coverage import coverage_problems
from ..checkpoint.format.metadata import itemsize, numel
from ..checkpoint.geometry import Region
from ..checkpoint.one_process import CheckpointWriter, WriteEntry
from ..checkpoint.staged_output import staged_output
from ..checkpoint.stock import classify, index_hf, index_stock
from ..checkpoint.stock.boxes import PieceData, assemble_box
from ..checkpoint.stock.index import PieceIndex
from .ckpt_io import MODEL
from .progress import Progress


def is_foreign(path: str) -> bool:
    """True for a stock paddle or plain safetensors directory (not a checkpoint of this engine)."""
    return os.path.isdir(path) and classify(path, None, True) in ("stock", "hf")


def foreign_index(path: str, unique_id: int | None = None) -> PieceIndex:
    path = os.path.abspath(os.fspath(path))
    kind = classify(path, unique_id, True)
    if kind == "stock":
        return index_stock(path, unique_id)
    if kind == "hf":
        return index_hf(path)
    raise NotACheckpointError(f"{path}: not a stock paddle checkpoint or safetensors directory")


def inspect_foreign(path: str, unique_id: int | None = None) -> dict[str, Any]:
    idx = foreign_index(path, unique_id)
    tensors = {}
    total = 0
    for key, e in sorted(idx.tensors.items()):
        nbytes = numel(e.shape) * itemsize(e.dtype)
        total += nbytes
        tensors[key] = {
            "role": MODEL,
            "dtype": e.dtype,
            "shape": list(e.shape),
            "pieces": len(e.pieces),
            "bytes": nbytes,
        }
    files = sorted(idx.files())
    sizes = {f: os.path.getsize(os.path.join(idx.root, f)) for f in files if os.path.isfile(os.path.join(idx.root, f))}
    return {
        "path": idx.root,
        "format": "stock paddle (pickled index)" if idx.kind == "stock" else "safetensors directory",
        "unique_id": idx.unique_id,
        "files": {f: {"size": sizes.get(f)} for f in files},
        "file_bytes": sum(sizes.values()),
        "num_tensors": len(tensors),
        "total_bytes": total,
        "tensors": tensors,
    }


def format_foreign(info: dict[str, Any]) -> str:
    lines = [
        f"{info['path']}: {info['format']}"
        + (f", unique_id {info['unique_id']}" if info.get("unique_id") is not None else ""),
        f"{info['num_tensors']} tensors, {info['total_bytes']} bytes in {len(info['files'])} file(s)",
    ]
    for key, t in info["tensors"].items():
        lines.append(f"  {key}  {t['dtype']}  {t['shape']}  pieces={t['pieces']}  bytes={t['bytes']}")
    return "\n".join(lines)


def verify_foreign(path: str, unique_id: int | None = None, progress: bool | None = None) -> tuple[list[str], dict]:
    """(problems, summary) of a stock / safetensors directory: coverage, files, and every piece read once."""
    try:
        idx = foreign_index(path, unique_id)
    except NotACheckpointError:
        raise
    except CheckpointError as e:
        return [f"{type(e).__name__}: {e}"], {"path": path}
    problems: list[str] = []
    for key, e in idx.tensors.items():
        regions = [(i, Region(e.shape, p.box_offset, p.box_shape, p.flat_range)) for i, p in enumerate(e.pieces)]
        problems += coverage_problems(key, e.shape, regions)
    data = PieceData(idx)
    total = sum(p.numel * itemsize(e.dtype) for e in idx.tensors.values() for p in e.pieces)
    by_file: dict[str, list] = {}
    for key, e in idx.tensors.items():
        for p in e.pieces:
            by_file.setdefault(p.file, []).append((key, p))
    with Progress(total, "verify", enabled=progress) as bar:
        for file, pieces in sorted(by_file.items()):
            if not data.visible(file):
                problems.append(f"data file {file} is missing")
                continue
            for key, p in pieces:
                try:
                    data.check(key, p)  # bounded memory: blocks, never the declared piece at once
                except CheckpointError as err:
                    problems.append(f"{type(err).__name__}: {err}")
                    break
                bar.update(p.numel * itemsize(idx.tensors[key].dtype))
    data.close()
    summary = {"path": idx.root, "tensors": len(idx.tensors), "files": len(by_file), "checksum": "stock format"}
    return problems, summary


def import_stock(path: str, out: str, unique_id: int | None = None, progress: bool | None = None) -> dict[str, Any]:
    """Write the stock / safetensors checkpoint at ``path`` as a checkpoint of this engine at ``out``."""
    idx = foreign_index(path, unique_id)
    data = PieceData(idx)
    total = sum(numel(e.shape) * itemsize(e.dtype) for e in idx.tensors.values())

    def producer(key: str):
        e = idx.tensors[key]
        return lambda: (
            np.ascontiguousarray(assemble_box(key, idx, (0,) * len(e.shape), e.shape, data.read))
            .reshape(-1)
            .view(np.uint8)
        )

    with Progress(total, "import", enabled=progress) as bar, staged_output(out) as staging:
        writer = CheckpointWriter(staging, on_bytes=bar.update)
        # pieces of one stock file are adjacent, so the one unpickled .distcp file kept by PieceData is reused
        order = sorted(idx.tensors, key=lambda k: (idx.tensors[k].pieces[0].file, k))
        writer.write_file(
            [WriteEntry(k, idx.tensors[k].dtype, tuple(idx.tensors[k].shape), producer(k)) for k in order]
        )
        writer.commit({})
    data.close()
    return {
        "out": os.path.abspath(out),
        "tensors": len(idx.tensors),
        "total_size": total,  # tensor bytes (verify's "tensors (N B)")
        "files": len(writer.files),
        "file_bytes": sum(f.size for f in writer.files.values()),  # on disk, headers included (verify's too)
    }
