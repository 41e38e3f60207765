"""``from-hf``: convert Hugging Face safetensors into a sharded checkpoint (shared parts: ``hf_format.py``).

Reads ``model.safetensors.index.json`` (or every ``*.safetensors`` file of the directory when there is no index)
and writes a committed checkpoint (``ckpt_io.CheckpointWriter``): one data file per input file, each tensor stored
whole. ``load_checkpoint`` / ``dist.load_state_dict`` then read only each rank's slice, at any world size.

Names: with ``rules`` (HF name -> checkpoint key, transposes matched on HF names) those rules decide; otherwise the
``paddle_fsdp`` record of a ``to-hf`` output is inverted exactly; otherwise names are kept and nothing is
transposed. Values written: ``__fsdp__.rng = []`` (no saved random state: ``load_checkpoint`` keeps each rank's
own), ``__fsdp__.extra_state = {}``, and ``__fsdp__.optimizer`` when the record carries it and optimizer tensors
are present. ``dtype`` casts floating tensors as in to-hf (e.g. ``fp32`` for a float32 model from bf16 weights).

With ``preset`` (``presets.py``) and the model's ``config.json``, ``preset_plan`` decides the tensors: from-hf
merges the parts of a fused key back, reading each part's rows in bounded blocks straight into the fused tensor.
An export made by to-hf with a preset records it (``paddle_fsdp.preset``), so it needs no flag.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..checkpoint.errors import CheckpointError
from ..checkpoint.format.metadata import itemsize, storage_dtype
from ..checkpoint.format.reserved import EXTRA_KEY, OPTIMIZER_KEY, RESERVED_PREFIX, RNG_KEY
from ..checkpoint.format.safetensors import SafetensorsEntry, SafetensorsFile
from ..checkpoint.paths import local_path
from . import ckpt_io, json_schema
from .ckpt_io import CheckpointWriter, WriteEntry, converted_blocks, staged_output
from .errors import ToolError
from .hf_format import (
    CONFIG_FILE,
    INDEX_FILE,
    RECORD_KEY,
    check_collisions,
    numel,
    parse_dtype,
    read_config,
    target_dtype,
)
from .hf_source import open_reader, split_input
from .progress import Progress
from .rules import Rules

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------ from-hf


def _safe_member(directory: str, name: Any, where: str) -> str:
    if (
        not isinstance(name, str)
        or not name
        or os.path.basename(name) != name
        or name in (".", "..")
        or name.startswith(".")
    ):
        raise ToolError(f"{where}: file name {name!r} is not a plain file name inside {directory}")
    return os.path.join(directory, name)


def discover_hf(hf_path: str) -> tuple[list[SafetensorsFile], dict | None]:
    """The safetensors files of a Hugging Face checkpoint (in order) and the index's ``paddle_fsdp`` record;
    ``hf_path`` is a local directory or file, or a URL of a storage backend (hf_source.py: ranged reads)."""
    src, single = split_input(hf_path)
    if single is not None:
        if not single.endswith(".safetensors"):
            raise ToolError(f"{src.where(single)} is not a .safetensors file or a Hugging Face model directory")
        return [src.header(single)], None
    if not src.exists():
        raise ToolError(f"{src.root}: no such file or directory")
    names = src.names()
    indexes = [n for n in names if n.endswith(".safetensors.index.json")]
    if len(indexes) > 1:
        indexes = [n for n in indexes if n == INDEX_FILE] or indexes
        if len(indexes) > 1:
            raise ToolError(f"{src.root} holds several safetensors indexes ({', '.join(indexes)}); pass one file")
    if not indexes:
        files = [n for n in names if n.endswith(".safetensors")]
        if not files:
            raise ToolError(f"{src.root} holds no .safetensors files and no {INDEX_FILE}")
        return [src.header(n) for n in files], None
    ipath = src.where(indexes[0])
    from ..checkpoint.format.strict_json import SMALL_FILE_BYTES, loads_strict

    raw = src.read_small(indexes[0], 64 * SMALL_FILE_BYTES, "index")  # bounded, strict, never blocking on a FIFO
    try:
        index = loads_strict(raw, f"index {ipath}")
    except CheckpointError as e:
        raise ToolError(f"cannot read index {ipath}: {e}") from None
    if not isinstance(index, dict) or not index.get("weight_map"):
        raise ToolError(f"index {ipath} has no weight_map")
    json_schema.check(index, json_schema.index_schema(RECORD_KEY), f"index {ipath}")  # every field read below
    weight_map = index["weight_map"]
    for tensor, name in weight_map.items():  # every value a plain file name of the directory, before any use
        _safe_member(src.root, name, f"index {ipath}: weight_map[{tensor!r}]")
    st_files = []
    for name in sorted(set(weight_map.values())):
        if not src.has(name):
            raise ToolError(f"index {ipath} names {name}, which is missing")
        st = src.header(name)
        listed = {k for k, v in weight_map.items() if v == name}
        have = {e.name for e in st.entries}
        if listed != have:
            diff = sorted(listed - have) or sorted(have - listed)
            where = "is not in" if listed - have else "is in"
            raise ToolError(f"index {ipath} and {name} disagree: tensor {diff[0]!r} {where} the file")
        st_files.append(st)
    return st_files, index.get("metadata", {}).get(RECORD_KEY)


@dataclass
class CkptTensor:
    """One output tensor of from-hf."""

    key: str
    entry: SafetensorsEntry
    dtype: str
    transpose: bool

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.entry.shape)) if self.transpose else self.entry.shape


def plan_from_hf(st_files: list[SafetensorsFile], record: dict | None, rules: Rules | None, dtype: str | None):
    """Per input file, the output tensors (in data order); raises ToolError for collisions etc."""
    if rules is not None:
        name_of: Callable[[str], str] = rules.rename_name
        transposes: Callable[[str], bool] = rules.transposes
        if record is not None:
            logger.info("from-hf: --rules given, ignoring the name map recorded by to-hf")
    elif record is not None:
        names, transposed = record["names"], set(record.get("transposed", []))

        def name_of(hf_name: str) -> str:
            if hf_name not in names:
                raise ToolError(f"tensor {hf_name!r} is not in the name map recorded by to-hf (pass --rules)")
            return names[hf_name]

        transposes = transposed.__contains__
    else:
        name_of, transposes = (lambda n: n), (lambda n: False)
    plan = []
    pairs = []
    for st in st_files:
        tensors = []
        for e in st.entries:
            key = name_of(e.name)
            t = transposes(e.name)
            if t and len(e.shape) != 2:
                raise ToolError(
                    f"transpose rule matches {e.name!r} of shape {list(e.shape)}: only 2-D tensors can be transposed"
                )
            if key.startswith(RESERVED_PREFIX):
                raise ToolError(
                    f"{e.name!r} would become {key!r}: names starting with {RESERVED_PREFIX!r} are reserved"
                )
            tensors.append(CkptTensor(key, e, target_dtype(e.dtype, dtype), t))
            pairs.append((e.name, key))
        plan.append((st, tensors))
    check_collisions(pairs, "Hugging Face tensor")
    return plan


def from_hf(
    hf_path: str,
    out: str,
    *,
    rules: Rules | None = None,
    dtype: str | None = None,
    progress: bool | None = None,
    write_stock_metadata: bool = True,
    preset: str | None = None,
    config: str | os.PathLike | None = None,
    allow_unmapped: bool = False,
) -> dict:
    """Convert Hugging Face safetensors at ``hf_path`` into a checkpoint at ``out`` (see the module docstring).

    ``preset``: the family's names, transposes and merges of fused keys (sizes from ``config``, by default the
    input directory's ``config.json``); refused unless every parameter of the architecture is present and every
    input tensor mapped (``allow_unmapped`` skips). Without ``preset`` and ``rules``, a preset recorded by to-hf is
    used. Returns a summary: ``{"out", "tensors", "total_size", "files", "transposed", "merged"}``.
    """
    if preset is not None and rules is not None:
        raise ToolError("give either a preset or rules, not both")
    dtype = parse_dtype(dtype)
    out = local_path(out)  # a local directory, or a URL of a storage backend (s3://)
    ckpt_io.check_output_path(out)
    st_files, record = discover_hf(hf_path)
    if preset is None and rules is None and record is not None and isinstance(record.get("preset"), str):
        preset = record["preset"]
        logger.info("from-hf: using preset %s recorded by to-hf", preset)
    if preset is not None:
        return _from_hf_preset(
            hf_path, out, st_files, record, preset, config, dtype, allow_unmapped, progress, write_stock_metadata
        )
    plan = plan_from_hf(st_files, record, rules, dtype)
    tensors = [t for _, ts in plan for t in ts]
    if not tensors:
        raise ToolError(f"{hf_path} holds no tensors")
    total = sum(numel(t.entry.shape) * itemsize(t.dtype) for t in tensors)
    with staged_output(out) as staging, Progress(total, "from-hf", enabled=progress) as bar:
        writer = CheckpointWriter(staging, on_bytes=bar.update)
        for st, ts in plan:
            rd = open_reader(st.path)  # local: never blocks on a FIFO swapped in since the header was read
            try:
                writer.write_file([WriteEntry(t.key, t.dtype, t.shape, _producer(rd, st, t)) for t in ts])
            finally:
                rd.close()
        keys = {t.key for t in tensors}
        values: dict[str, Any] = {RNG_KEY: [], EXTRA_KEY: {}}
        if record is not None and rules is None and record.get("optimizer") is not None:
            if any(k.rpartition(".")[0] in keys for k in keys):
                values[OPTIMIZER_KEY] = record["optimizer"]
        writer.commit(values, write_stock_metadata=write_stock_metadata)
        n_files = len(writer.files)
    return {
        "out": out,
        "tensors": len(tensors),
        "total_size": total,
        "files": n_files,
        "transposed": sum(1 for t in tensors if t.transpose),
        "merged": 0,
    }


def _from_hf_preset(
    hf_path, out, st_files, record, preset_name, config, dtype, allow_unmapped, progress, stock_md
) -> dict:
    """from-hf with a preset: HF tensors grouped, shape-checked and merged into checkpoint tensors."""
    from .preset_plan import plan_from_hf_preset
    from .presets import check_model_type, get_preset, model_dims

    preset = get_preset(preset_name)
    if config is None:
        src = split_input(hf_path)[0]
        config = src.where(CONFIG_FILE)
        if not src.has(CONFIG_FILE):
            raise ToolError(f"--preset {preset.name} needs the model's config.json: none in {src.root}, pass --config")
    _raw, cfg = read_config(config)
    dims = model_dims(cfg, f"config {config}")
    check_model_type(preset, dims, f"config {config}")
    sources: dict[str, tuple[SafetensorsFile, SafetensorsEntry]] = {}
    for st in st_files:
        for e in st.entries:
            if e.name in sources:
                raise ToolError(f"tensor {e.name!r} is in both {sources[e.name][0].path} and {st.path}")
            sources[e.name] = (st, e)
    merged = plan_from_hf_preset(sources, preset, dims, allow_unmapped)
    if not merged:
        raise ToolError(f"{hf_path} holds no tensors preset {preset.name} maps")
    for m in merged:
        if m.key.startswith(RESERVED_PREFIX):  # pragma: no cover - preset templates never produce these
            raise ToolError(f"{m.key!r}: names starting with {RESERVED_PREFIX!r} are reserved")
    order = {st.path: i for i, st in enumerate(st_files)}
    # one data file per input file (by a tensor's first part), tensors in input order: reads stay sequential
    by_file: dict[int, list] = {}
    for m in sorted(merged, key=lambda m: (order[m.parts[0].source[0].path], m.parts[0].source[1].begin)):
        by_file.setdefault(order[m.parts[0].source[0].path], []).append(m)
    total = sum(numel(m.shape) * itemsize(target_dtype(m.src_dtype, dtype)) for m in merged)
    fds = _FdCache()
    try:
        with staged_output(out) as staging, Progress(total, "from-hf", enabled=progress) as bar:
            writer = CheckpointWriter(staging, on_bytes=bar.update)
            for _i, ms in sorted(by_file.items()):
                entries = []
                for m in ms:
                    dst = target_dtype(m.src_dtype, dtype)
                    entries.append(WriteEntry(m.key, dst, m.shape, _merge_producer(fds, m, dst)))
                writer.write_file(entries)
            values: dict[str, Any] = {RNG_KEY: [], EXTRA_KEY: {}}
            if record is not None and record.get("optimizer") is not None and any(m.state for m in merged):
                values[OPTIMIZER_KEY] = record["optimizer"]
            writer.commit(values, write_stock_metadata=stock_md)
            n_files = len(writer.files)
    finally:
        fds.close()
    return {
        "out": out,
        "tensors": len(merged),
        "total_size": total,
        "files": n_files,
        "transposed": sum(1 for m in merged if m.transpose),
        "merged": sum(1 for m in merged if len(m.hf_names) > 1),
    }


class _FdCache:
    """Open input files by path (a merged tensor reads parts from several input files), at most ``MAX_OPEN`` at
    once whatever the number of input files (least recently used closed first)."""

    MAX_OPEN = 32

    def __init__(self) -> None:
        self.fds: dict[str, Any] = {}  # insertion order = use order

    def get(self, path: str):
        rd = self.fds.pop(path, None)
        if rd is None:
            while len(self.fds) >= self.MAX_OPEN:
                self.fds.pop(next(iter(self.fds))).close()
            rd = open_reader(path)  # local: never blocks on a FIFO swapped in since the header was read
        self.fds[path] = rd
        return rd

    def close(self) -> None:
        for rd in self.fds.values():
            rd.close()
        self.fds.clear()


def _merge_producer(fds: _FdCache, m, dst: str, block_bytes: int = 2 << 20):
    """Assemble checkpoint tensor ``m`` from its HF parts, reading each part's rows in bounded blocks."""

    def produce() -> np.ndarray:
        out = np.empty(numel(m.shape), storage_dtype(dst)).reshape(m.shape)
        # HF orientation: parts are row ranges along axis 0 (a 0-d tensor is one row of one element)
        view = out.T if m.transpose else out if m.shape else out.reshape(1)
        for part in m.parts:
            st, e = part.source
            rd = fds.get(st.path)
            row_elems = numel(e.shape[1:])
            row_bytes = row_elems * itemsize(e.dtype)
            step = max(1, block_bytes // max(row_bytes, 1))
            for r in range(part.row_start, part.row_stop, step):
                n = min(step, part.row_stop - r)
                raw = np.empty(n * row_bytes, np.uint8)
                rd.read_exact(raw, st.data_start + e.begin + r * row_bytes)
                rows = raw.view(storage_dtype(e.dtype)).reshape((n,) + tuple(e.shape[1:]) if e.shape else (n,))
                pos = part.fused_pos + (r - part.row_start)
                view[pos : pos + n] = ckpt_io.cast_array(rows, e.dtype, dst)
        return out.reshape(-1).view(np.uint8)

    return produce


def _producer(rd, st: SafetensorsFile, t: CkptTensor):
    def produce() -> np.ndarray:
        e = t.entry
        raw = np.empty(e.nbytes, np.uint8)
        rd.read_exact(raw, st.data_start + e.begin)
        if not t.transpose and t.dtype == e.dtype:
            return raw
        arr = raw.view(storage_dtype(e.dtype)).reshape(e.shape)
        out = np.empty(numel(e.shape) * itemsize(t.dtype), np.uint8)
        pos = 0
        for block in converted_blocks(arr, e.dtype, t.dtype, t.transpose):
            out[pos : pos + block.size] = block
            pos += block.size
        return out

    return produce
