"""``inspect CKPT``: what a checkpoint holds, from its metadata alone (no tensor data is read).
A CheckpointManager root (``step_*`` directories + ``latest``) is inspected through its latest checkpoint.

Per tensor key: role (model weight or optimizer state, see ``ckpt_io``), dtype, global shape, number of pieces
(records) and bytes; plus the checkpoint's id, saving world size, files and JSON values.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from typing import Any

from ..checkpoint import read_metadata
from ..checkpoint.format import derived
from ..checkpoint.format.metadata import itemsize
from ..checkpoint.format.rank_values import plain
from ..checkpoint.format.reserved import OPTIMIZER_KEY, RNG_KEY
from ..checkpoint.geometry import Region
from .ckpt_io import BUFFER, MODEL, OPTIMIZER, buffer_keys, classify_keys, resolve_checkpoint_path
from .progress import human_bytes


def inspect_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """A JSON-serialisable description of the checkpoint at ``path`` (raises the engine's CheckpointError)."""
    path = resolve_checkpoint_path(path)
    md = read_metadata(path)
    md.prefetch(list(md.tensors))  # every key's pieces are listed: read the rows at once (format 2)
    # roles over the keys as the writer saw them: a derived weight's (format 4) master and moments are its state
    seen = dataclasses.replace(md, tensors=derived.WithDerived(md.tensors, md.derived)) if md.derived else md
    roles = classify_keys(seen)
    for key, q in (md.quant or {}).items():  # a quantized moment's stored codes and scales: the moment's role
        roles[q.codes] = roles[q.scales] = roles[key]
    buffers = buffer_keys(md)
    tensors: dict[str, Any] = {}
    totals = {MODEL: [0, 0], OPTIMIZER: [0, 0], BUFFER: [0, 0]}
    for key, tm in md.tensors.items():
        nbytes = Region.full(tm.shape).numel * itemsize(tm.dtype)
        r = roles[key]
        role = BUFFER if key in buffers else r.role
        entry: dict[str, Any] = {
            "role": role,
            "dtype": tm.dtype,
            "shape": list(tm.shape),
            "pieces": len(tm.pieces),
            "bytes": nbytes,
        }
        if r.role == OPTIMIZER:
            entry["param"] = r.param
            entry["state"] = r.state
        tensors[key] = entry
        totals[role][0] += 1
        totals[role][1] += nbytes
    opt = md.values.get(OPTIMIZER_KEY)
    return {
        "path": path,
        "format_version": md.version,
        "checkpoint_id": md.checkpoint_id,
        "created_unix": md.created_unix,
        "world_size": md.world_size,
        "checksum": md.checksum,
        "chunk_bytes": md.chunk_bytes,
        "files": {name: {"rank": f.rank, "size": f.size} for name, f in sorted(md.files.items())},
        "file_bytes": sum(f.size for f in md.files.values()),
        "num_tensors": len(tensors),
        "total_bytes": totals[MODEL][1] + totals[OPTIMIZER][1] + totals[BUFFER][1],
        "model_tensors": totals[MODEL][0],
        "model_bytes": totals[MODEL][1],
        "buffer_tensors": totals[BUFFER][0],
        "buffer_bytes": totals[BUFFER][1],
        "optimizer_tensors": totals[OPTIMIZER][0],
        "optimizer_bytes": totals[OPTIMIZER][1],
        "optimizer_class": opt.get("class") if isinstance(opt, dict) else None,
        "tensors": tensors,
        "values": {k: plain(v) for k, v in md.values.items()},  # (per-rank values: every rank's read)
    }


def _short_value(key: str, value: Any, limit: int = 70) -> str:
    if key == RNG_KEY and isinstance(value, list):
        return f"<random generator states of {len(value)} rank(s)>"
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def format_text(info: dict[str, Any]) -> str:
    created = ""
    if info.get("created_unix"):
        created = ", " + datetime.datetime.fromtimestamp(info["created_unix"]).strftime("%Y-%m-%d %H:%M:%S")
    opt = f" ({info['optimizer_class']})" if info.get("optimizer_class") else ""
    lines = [
        f"checkpoint  {info['path']}",
        f"id          {info['checkpoint_id']} (format v{info['format_version']}, saved by "
        f"{info['world_size']} rank(s){created})",
        f"files       {len(info['files'])} data file(s), {human_bytes(info['file_bytes'])}, checksums: {info['checksum']}",
        f"tensors     {info['num_tensors']}: {info['model_tensors']} model ({human_bytes(info['model_bytes'])}), "
        f"{info['buffer_tensors']} buffer ({human_bytes(info['buffer_bytes'])}), "
        f"{info['optimizer_tensors']} optimizer state{opt} ({human_bytes(info['optimizer_bytes'])})",
    ]
    for key in sorted(info["values"]):
        lines.append(f"value       {key} = {_short_value(key, info['values'][key])}")
    rows = [("KEY", "ROLE", "DTYPE", "SHAPE", "PIECES", "BYTES")]
    for key, t in info["tensors"].items():
        rows.append(
            (key, t["role"], t["dtype"], "[" + ", ".join(map(str, t["shape"])) + "]", str(t["pieces"]), str(t["bytes"]))
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines.append("")
    for r in rows:
        cells = [r[i].ljust(widths[i]) if i < 4 else r[i].rjust(widths[i]) for i in range(len(r))]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)
