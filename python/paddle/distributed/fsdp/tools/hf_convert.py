"""Conversion between sharded checkpoints and Hugging Face safetensors (``to-hf`` / ``from-hf``).

to-hf
-----
Reads the checkpoint one full tensor at a time (checksums verified) and writes Hugging Face's sharded layout::

    OUT/model-00001-of-0000N.safetensors ...
    OUT/model.safetensors.index.json   {"metadata": {"total_size": N, "paddle_fsdp": {...}}, "weight_map": {...}}

* Model weights only, unless ``include_optimizer`` (optimizer state then keeps its checkpoint suffix:
  ``<hf name of the param>.<state>``; it is transposed with its param when it has the param's shape). Which keys
  are optimizer state is decided as documented in ``ckpt_io``.
* ``max_shard_size``: Hugging Face's rule -- tensors are added to a shard in checkpoint order until the next one
  would exceed the limit; a tensor larger than the limit gets a shard of its own. Sizes count tensor bytes.
* ``dtype``: casts every floating tensor (fp64/fp32/fp16/bf16; integer and float8 tensors are kept) with
  round-to-nearest-even, as torch does (NaN -> canonical NaN). Without it, dtypes are kept.
* Each shard file's header (names, dtypes, shapes, offsets) is computed from the checkpoint metadata before any
  data is read, so tensors stream straight into the file: peak memory is about the largest tensor (plus 2 MB
  conversion blocks), whatever the model or shard size. Shard header metadata is ``{"format": "pt"}`` (what
  ``transformers`` expects).
* The index records the exact mapping under ``metadata.paddle_fsdp``: ``names`` (HF name -> checkpoint key),
  ``transposed`` (HF names) and, with ``include_optimizer``, the ``__fsdp__.optimizer`` value. It carries nothing
  run-specific, so converting the same weights twice gives byte-identical output.

from-hf
-------
Reads ``model.safetensors.index.json`` (or every ``*.safetensors`` file of the directory when there is no index)
and writes a committed checkpoint (``ckpt_io.CheckpointWriter``): one data file per input file, each tensor stored
whole. ``load_checkpoint`` / ``dist.load_state_dict`` then read only each rank's slice, at any world size.

Names: with ``rules`` (HF name -> checkpoint key, transposes matched on HF names) those rules decide; otherwise the
``paddle_fsdp`` record of a ``to-hf`` output is inverted exactly; otherwise names are kept and nothing is
transposed. Values written: ``__fsdp__.rng = []`` (no saved random state: ``load_checkpoint`` keeps each rank's
own), ``__fsdp__.extra_state = {}``, and ``__fsdp__.optimizer`` when the record carries it and optimizer tensors
are present. ``dtype`` casts floating tensors as in to-hf (e.g. ``fp32`` for a float32 model from bf16 weights).

Presets
-------
With ``preset`` (``presets.py``: a model family's names, transposes and fused-key layouts, as data) and an HF
``config.json``, ``preset_plan`` decides the tensors: to-hf splits a fused key into several HF tensors, each a list
of row ranges of the source in HF orientation (``HfTensor.rows``); the fused source is read once for all its parts
(``LastTensor``), so memory stays at one tensor plus bounded blocks. from-hf merges the parts back, reading each
part's rows in bounded blocks straight into the fused tensor. The config is copied into the export and recorded
(``paddle_fsdp.preset``), so from-hf of a preset export needs no flag. Incomplete conversions are refused (see
``preset_plan``). Persistable buffers listed in ``__fsdp__.buffers`` are left out of exports unless asked.

Both directions write into ``OUT.tmp-<id>`` and rename it to ``OUT`` only when complete; an existing non-empty
``OUT`` is refused. ``to_hf(from_hf(x))`` reproduces ``x``'s names, dtypes and values; when ``x`` itself came from
``to_hf`` with the same rules/shard size, the files are byte-identical.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..checkpoint.errors import CheckpointError, SafetensorsHeaderError
from ..checkpoint.format import safetensors
from ..checkpoint.format.metadata import itemsize, storage_dtype
from ..checkpoint.format.reserved import (
    EMA_KEY,
    EMA_SUFFIX,
    EXTRA_KEY,
    OPTIMIZER_KEY,
    RESERVED_PREFIX,
    RNG_KEY,
    safetensors_name_problem,
)
from ..checkpoint.format.safetensors import SafetensorsEntry, SafetensorsFile
from ..checkpoint.paths import local_path
from ..checkpoint.planner import Region
from ..checkpoint.writer import write_all
from . import ckpt_io, json_schema
from .arch_check import check_rules_export
from .ckpt_io import (
    FLOAT_DTYPES,
    MODEL,
    OPTIMIZER,
    CheckpointReader,
    CheckpointWriter,
    WriteEntry,
    classify_keys,
    converted_blocks,
    staged_output,
)
from .errors import ToolError
from .hf_source import open_reader, read_small_file, split_input
from .progress import Progress
from .rules import Rules

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
RECORD_KEY = "paddle_fsdp"
RECORD_VERSION = 1
DEFAULT_MAX_SHARD_SIZE = "5GB"
CONFIG_FILE = "config.json"
MAX_CONFIG_BYTES = 16 << 20
HF_FILE_METADATA = {"format": "pt"}

DTYPE_ALIASES = {
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
    "half": "float16",
    "fp32": "float32",
    "float32": "float32",
    "float": "float32",
}
DTYPE_CHOICES = ("bf16", "fp16", "fp32")

_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"500MiB"`` -> 524_288_000, ``"1234"`` -> 1234 (Hugging Face's convention)."""
    if isinstance(text, int):
        size = text
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([A-Za-z]*)\s*", str(text))
        unit = m.group(2).upper() if m else None
        if not m or unit not in _SIZE_UNITS:
            raise ToolError(f"invalid size {text!r} (examples: 5GB, 500MB, 2GiB, 1000000)")
        size = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if size <= 0:
        raise ToolError(f"size must be positive, got {text!r}")
    return size


def parse_dtype(text: str | None) -> str | None:
    """``"bf16"`` -> ``"bfloat16"``; None stays None (keep dtypes)."""
    if text is None:
        return None
    try:
        return DTYPE_ALIASES[str(text).strip().lower()]
    except KeyError:
        raise ToolError(f"unknown dtype {text!r} (choose from {', '.join(DTYPE_CHOICES)})") from None


def _target_dtype(src: str, dtype: str | None) -> str:
    return dtype if dtype is not None and src in FLOAT_DTYPES else src


def _numel(shape) -> int:
    return Region.full(shape).numel


# ------------------------------------------------------------------------------------------------ safetensors


def read_safetensors_header(path: str) -> SafetensorsFile:
    """The engine's safetensors header parser, its refusals reported as ToolError (a bad input, exit code 2)."""
    try:
        return safetensors.read_header(path)
    except SafetensorsHeaderError as e:
        raise ToolError(str(e)) from None


# ------------------------------------------------------------------------------------------------ to-hf


@dataclass
class HfTensor:
    """One output tensor of to-hf: where it comes from and what it becomes."""

    name: str  # Hugging Face name
    key: str  # checkpoint key
    src_dtype: str
    dtype: str
    src_shape: tuple[int, ...]
    transpose: bool
    param: str  # the parameter key (== key for model weights)
    # a part of a fused source: row ranges of the source in HF orientation (transposed if ``transpose``), in
    # output order, and the resulting shape; None: the whole source
    rows: tuple[tuple[int, int], ...] | None = None
    part_shape: tuple[int, ...] | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        if self.part_shape is not None:
            return self.part_shape
        return tuple(reversed(self.src_shape)) if self.transpose else self.src_shape

    @property
    def nbytes(self) -> int:
        return _numel(self.shape) * itemsize(self.dtype)


def plan_to_hf(md, rules: Rules, dtype: str | None, include_optimizer: bool) -> list[HfTensor]:
    """The output tensors in checkpoint order; raises ToolError for collisions and impossible transposes."""
    roles = classify_keys(md)
    n_opt = sum(1 for r in roles.values() if r.role == OPTIMIZER)
    if include_optimizer and n_opt == 0:
        logger.warning("--include-optimizer: the checkpoint holds no optimizer state")
    out: list[HfTensor] = []
    param_plan: dict[str, tuple[str, bool]] = {}
    for key, tm in md.tensors.items():
        if roles[key].role != MODEL:
            continue
        transpose = rules.transposes(key)
        if transpose and len(tm.shape) != 2:
            raise ToolError(
                f"transpose rule matches {key!r} of shape {list(tm.shape)}: only 2-D tensors can be transposed"
            )
        param_plan[key] = (rules.rename_name(key), transpose)
    for key, tm in md.tensors.items():
        role = roles[key]
        if role.role == MODEL:
            name, transpose = param_plan[key]
        elif include_optimizer:
            pname, ptrans = param_plan.get(role.param, (role.param, False))
            name = f"{pname}.{role.state}"
            transpose = ptrans and tuple(tm.shape) == tuple(md.tensors[role.param].shape)
        else:
            continue
        out.append(
            HfTensor(name, key, tm.dtype, _target_dtype(tm.dtype, dtype), tuple(tm.shape), transpose, role.param)
        )
    _check_collisions([(t.key, t.name) for t in out], "checkpoint key")
    for t in out:
        problem = safetensors_name_problem(t.name)
        if problem is not None:
            raise ToolError(
                f"{t.key!r} would be renamed to {t.name!r:.200}, which a safetensors file cannot hold: {problem}"
            )
    return out


def ema_as_weights(md, tensors: list[HfTensor]) -> list[HfTensor]:
    """The plan with every model weight that has an EMA record (``<key>.ema``) read from it instead, cast to
    the dtype planned for the weight; ToolError when the checkpoint holds no EMA."""
    if md.values.get(EMA_KEY) is None:
        raise ToolError("--ema: the checkpoint holds no EMA of the weights (saved without ema=)")
    out = []
    for t in tensors:
        source = md.tensors.get(t.key + EMA_SUFFIX)
        if t.key == t.param and source is not None:
            t = dataclasses.replace(t, key=t.key + EMA_SUFFIX, src_dtype=source.dtype)
        out.append(t)
    return out


def _check_collisions(pairs: list[tuple[str, str]], what: str) -> None:
    seen: dict[str, str] = {}
    for src, dst in pairs:
        if dst in seen:
            raise ToolError(f"name collision after renaming: {what}s {seen[dst]!r} and {src!r} both become {dst!r}")
        seen[dst] = src


def split_shards(tensors: list[HfTensor], max_bytes: int) -> list[list[HfTensor]]:
    shards: list[list[HfTensor]] = []
    current: list[HfTensor] = []
    size = 0
    for t in tensors:
        if current and size + t.nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(t)
        size += t.nbytes
    if current:
        shards.append(current)
    return shards


def shard_file_name(i: int, n: int) -> str:
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


def to_hf(
    ckpt: str,
    out: str,
    *,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    dtype: str | None = None,
    rules: Rules | None = None,
    include_optimizer: bool = False,
    include_buffers: bool = False,
    progress: bool | None = None,
    preset: str | None = None,
    config: str | os.PathLike | None = None,
    allow_unmapped: bool = False,
    ema: bool = False,
) -> dict:
    """Convert checkpoint ``ckpt`` into Hugging Face safetensors in ``out`` (see the module docstring).

    Persistable buffers that ``save_checkpoint`` listed (``__fsdp__.buffers``) are left out unless
    ``include_buffers``: Hugging Face weights hold parameters, and a loader would report them as unexpected.
    ``preset`` (needs ``config``, an HF ``config.json``): the family's names, transposes and fused-key splits,
    with the export refused unless complete (``allow_unmapped`` skips what cannot be mapped). ``config`` is copied
    into the export as ``config.json``. ``ema``: export the EMA of the weights (``save_checkpoint(..., ema=)``,
    state/ema.py) as the model's weights, in the weights' dtype unless ``dtype``; weights without an EMA (frozen
    ones) are exported as they are. Returns a summary: ``{"out", "files", "tensors", "total_size",
    "transposed", "split"}``.
    """
    if preset is not None and rules is not None and not rules.is_identity:
        raise ToolError("give either a preset or rules, not both")
    rules = rules or Rules()
    max_bytes = parse_size(max_shard_size)
    dtype = parse_dtype(dtype)
    out = local_path(out)  # a local directory, or a URL of a storage backend (s3://)
    ckpt_io.check_output_path(out)
    config_bytes, config_dict = read_config(config) if config is not None else (None, None)
    if preset is not None and config_dict is None:
        raise ToolError(f"--preset {preset} needs --config (the Hugging Face config.json: sizes for the splits)")
    unchecked = None  # why the export was not checked against an architecture (logged once it is written)
    with CheckpointReader(ckpt) as reader:
        buffers = set() if include_buffers else ckpt_io.buffer_keys(reader.md)
        if buffers:
            logger.info("to-hf: leaving out %d buffer(s) (--include-buffers to export them)", len(buffers))
        if preset is not None:
            tensors = plan_to_hf_with_preset(
                reader.md, preset, config_dict, config, dtype, include_optimizer, allow_unmapped, buffers
            )
        else:
            tensors = plan_to_hf(ckpt_io.without_keys(reader.md, buffers), rules, dtype, include_optimizer)
            unchecked = check_rules_export(tensors, config_dict, config, allow_unmapped)
        names = {t.name: t.key for t in tensors}  # what each HF name is in the checkpoint (its EMA: the weight)
        has_optimizer_state = any(t.key != t.param for t in tensors)
        if ema:
            tensors = ema_as_weights(reader.md, tensors)
        if not tensors:
            raise ToolError(f"checkpoint {reader.path} holds no tensors to export")
        shards = split_shards(tensors, max_bytes)
        total = sum(t.nbytes for t in tensors)
        files = [shard_file_name(i, len(shards)) for i in range(len(shards))]
        logger.info("to-hf: %d tensors, %d bytes, %d shard(s)", len(tensors), total, len(shards))
        with staged_output(out) as staging, Progress(total, "to-hf", enabled=progress) as bar:
            source = LastTensor(reader)
            for fname, shard in zip(files, shards):
                _write_hf_shard(os.path.join(staging, fname), shard, source, bar)
            source.release()
            record: dict[str, Any] = {
                "version": RECORD_VERSION,
                "names": names,
                "transposed": [t.name for t in tensors if t.transpose],
            }
            if preset is not None:
                record["preset"] = preset
            if ema:
                record["ema"] = reader.md.values.get(EMA_KEY)
            if config_bytes is not None:
                _write_small(os.path.join(staging, CONFIG_FILE), config_bytes)
            opt_value = reader.md.values.get(OPTIMIZER_KEY)
            if opt_value is not None and has_optimizer_state:
                record["optimizer"] = opt_value
            index = {
                "metadata": {"total_size": total, RECORD_KEY: record},
                "weight_map": {t.name: fname for fname, shard in zip(files, shards) for t in shard},
            }
            _write_small(
                os.path.join(staging, INDEX_FILE), (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
            )
    if unchecked:
        logger.warning("%s", unchecked)
    return {
        "out": out,
        "files": files,
        "tensors": len(tensors),
        "total_size": total,
        "transposed": sum(1 for t in tensors if t.transpose),
        "split": sum(1 for t in tensors if t.rows is not None),
    }


def read_config(path: str | os.PathLike) -> tuple[bytes, dict]:
    """The bytes and the parsed object of a Hugging Face ``config.json``."""
    path = os.fspath(path)
    raw = read_small_file(path, MAX_CONFIG_BYTES, "config")  # bounded; a local one only if a regular file
    try:
        cfg = json.loads(raw)  # lenient like transformers (NaN allowed; every field used is type-checked)
    except RecursionError:
        raise ToolError(f"config {path} is nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ToolError(f"config {path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ToolError(f"config {path} is not a JSON object")
    json_schema.check(cfg, json_schema.CONFIG, f"config {path}")  # the fields the presets read
    return raw, cfg


def plan_to_hf_with_preset(md, preset_name, config_dict, config_path, dtype, include_optimizer, allow_unmapped, skip):
    """HfTensors for ``to-hf --preset`` (see ``preset_plan``): parts of fused keys carry their row ranges."""
    from .preset_plan import plan_to_hf_preset
    from .presets import check_model_type, get_preset, model_dims

    preset = get_preset(preset_name)
    dims = model_dims(config_dict, f"config {config_path}")
    check_model_type(preset, dims, f"config {config_path}")
    out = []
    for item in plan_to_hf_preset(md, preset, dims, include_optimizer, allow_unmapped, skip):
        tm = md.tensors[item.key]
        for sp in item.splits:
            out.append(
                HfTensor(
                    sp.name,
                    item.key,
                    tm.dtype,
                    _target_dtype(tm.dtype, dtype),
                    tuple(tm.shape),
                    item.transpose,
                    item.param,
                    sp.rows,
                    sp.shape if sp.rows is not None else None,
                )
            )
    _check_collisions([(t.key, t.name) for t in out], "checkpoint key")
    return out


class LastTensor:
    """Reads checkpoint tensors, keeping only the last one: the parts of a fused key are written one after the
    other, so the fused tensor is read once and memory stays at one tensor."""

    def __init__(self, reader: CheckpointReader) -> None:
        self.reader = reader
        self.key: str | None = None
        self.arr: np.ndarray | None = None

    def get(self, key: str) -> np.ndarray:
        if key != self.key:
            self.arr = None  # release the previous tensor before reading the next
            self.arr = self.reader.read(key)
            self.key = key
        return self.arr

    def release(self) -> None:
        self.key, self.arr = None, None


def row_blocks(view: np.ndarray, start: int, stop: int, block_bytes: int = 2 << 20):
    """Rows ``[start, stop)`` of ``view`` (any strides) as C-contiguous arrays of about ``block_bytes``."""
    row_bytes = max(_numel(view.shape[1:]) * view.itemsize, 1)
    step = max(1, block_bytes // row_bytes)
    for r in range(start, stop, step):
        yield np.ascontiguousarray(view[r : min(r + step, stop)])


def _write_small(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        write_all(fd, [data])
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_hf_shard(path: str, shard: list[HfTensor], source: LastTensor, bar: Progress) -> None:
    entries, pos = [], 0
    for t in shard:
        entries.append((t.name, t.dtype, t.shape, pos, pos + t.nbytes))
        pos += t.nbytes
    header = safetensors.build_header(entries, HF_FILE_METADATA)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        write_all(fd, [header])
        for t in shard:
            arr = source.get(t.key)
            written = 0
            block = None
            if t.rows is None:
                blocks = converted_blocks(arr, t.src_dtype, t.dtype, t.transpose)
                source.release()  # not needed again (only the parts of a split key are read twice)
            else:
                view = arr.T if t.transpose else arr
                blocks = (
                    np.ascontiguousarray(ckpt_io.cast_array(rows, t.src_dtype, t.dtype)).view(np.uint8).reshape(-1)
                    for a, b in t.rows
                    for rows in row_blocks(view, a, b)
                )
            for block in blocks:
                write_all(fd, [block])
                written += block.size
                bar.update(block.size, t.name)
            arr = block = blocks = None  # release this tensor before reading the next one (peak = one tensor)
            if written != t.nbytes:  # pragma: no cover - internal consistency
                raise ToolError(f"{t.key!r}: wrote {written} bytes, expected {t.nbytes}")
        os.fsync(fd)
    finally:
        os.close(fd)


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
            tensors.append(CkptTensor(key, e, _target_dtype(e.dtype, dtype), t))
            pairs.append((e.name, key))
        plan.append((st, tensors))
    _check_collisions(pairs, "Hugging Face tensor")
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
    total = sum(_numel(t.entry.shape) * itemsize(t.dtype) for t in tensors)
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
    total = sum(_numel(m.shape) * itemsize(_target_dtype(m.src_dtype, dtype)) for m in merged)
    fds = _FdCache()
    try:
        with staged_output(out) as staging, Progress(total, "from-hf", enabled=progress) as bar:
            writer = CheckpointWriter(staging, on_bytes=bar.update)
            for _i, ms in sorted(by_file.items()):
                entries = []
                for m in ms:
                    dst = _target_dtype(m.src_dtype, dtype)
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
        out = np.empty(_numel(m.shape), storage_dtype(dst)).reshape(m.shape)
        # HF orientation: parts are row ranges along axis 0 (a 0-d tensor is one row of one element)
        view = out.T if m.transpose else out if m.shape else out.reshape(1)
        for part in m.parts:
            st, e = part.source
            rd = fds.get(st.path)
            row_elems = _numel(e.shape[1:])
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
        out = np.empty(_numel(e.shape) * itemsize(t.dtype), np.uint8)
        pos = 0
        for block in converted_blocks(arr, e.dtype, t.dtype, t.transpose):
            out[pos : pos + block.size] = block
            pos += block.size
        return out

    return produce
