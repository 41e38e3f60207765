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

Both directions write into ``OUT.tmp-<id>`` and rename it to ``OUT`` only when complete; an existing non-empty
``OUT`` is refused. ``to_hf(from_hf(x))`` reproduces ``x``'s names, dtypes and values; when ``x`` itself came from
``to_hf`` with the same rules/shard size, the files are byte-identical.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..checkpoint.errors import SafetensorsHeaderError
from ..checkpoint.format import safetensors
from ..checkpoint.format.metadata import itemsize
from ..checkpoint.format.reserved import EXTRA_KEY, OPTIMIZER_KEY, RESERVED_PREFIX, RNG_KEY
from ..checkpoint.format.safetensors import SafetensorsEntry, SafetensorsFile
from ..checkpoint.planner import Region
from ..checkpoint.writer import write_all
from . import ckpt_io
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
from .progress import Progress
from .rules import Rules

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
RECORD_KEY = "paddle_fsdp"
RECORD_VERSION = 1
DEFAULT_MAX_SHARD_SIZE = "5GB"
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

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.src_shape)) if self.transpose else self.src_shape

    @property
    def nbytes(self) -> int:
        return _numel(self.src_shape) * itemsize(self.dtype)


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
        if t.name == "__metadata__":
            raise ToolError(f"{t.key!r} would be renamed to the reserved safetensors name '__metadata__'")
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
    progress: bool | None = None,
) -> dict:
    """Convert checkpoint ``ckpt`` into Hugging Face safetensors in ``out`` (see the module docstring).

    Returns a summary: ``{"out", "files", "tensors", "total_size", "transposed"}``.
    """
    rules = rules or Rules()
    max_bytes = parse_size(max_shard_size)
    dtype = parse_dtype(dtype)
    out = os.path.abspath(os.fspath(out))
    ckpt_io.check_output_path(out)
    with CheckpointReader(ckpt) as reader:
        tensors = plan_to_hf(reader.md, rules, dtype, include_optimizer)
        if not tensors:
            raise ToolError(f"checkpoint {reader.path} holds no tensors to export")
        shards = split_shards(tensors, max_bytes)
        total = sum(t.nbytes for t in tensors)
        files = [shard_file_name(i, len(shards)) for i in range(len(shards))]
        logger.info("to-hf: %d tensors, %d bytes, %d shard(s)", len(tensors), total, len(shards))
        with staged_output(out) as staging, Progress(total, "to-hf", enabled=progress) as bar:
            for fname, shard in zip(files, shards):
                _write_hf_shard(os.path.join(staging, fname), shard, reader, bar)
            record: dict[str, Any] = {
                "version": RECORD_VERSION,
                "names": {t.name: t.key for t in tensors},
                "transposed": [t.name for t in tensors if t.transpose],
            }
            opt_value = reader.md.values.get(OPTIMIZER_KEY)
            if opt_value is not None and any(t.key != t.param for t in tensors):
                record["optimizer"] = opt_value
            index = {
                "metadata": {"total_size": total, RECORD_KEY: record},
                "weight_map": {t.name: fname for fname, shard in zip(files, shards) for t in shard},
            }
            _write_small(
                os.path.join(staging, INDEX_FILE), (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
            )
    return {
        "out": out,
        "files": files,
        "tensors": len(tensors),
        "total_size": total,
        "transposed": sum(1 for t in tensors if t.transpose),
    }


def _write_small(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        write_all(fd, [data])
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_hf_shard(path: str, shard: list[HfTensor], reader: CheckpointReader, bar: Progress) -> None:
    entries, pos = [], 0
    for t in shard:
        entries.append((t.name, t.dtype, t.shape, pos, pos + t.nbytes))
        pos += t.nbytes
    header = safetensors.build_header(entries, HF_FILE_METADATA)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        write_all(fd, [header])
        for t in shard:
            arr = reader.read(t.key)
            written = 0
            block = None
            for block in converted_blocks(arr, t.src_dtype, t.dtype, t.transpose):
                write_all(fd, [block])
                written += block.size
                bar.update(block.size, t.name)
            arr = block = None  # release this tensor before reading the next one (peak = one tensor)
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
    """The safetensors files of a Hugging Face checkpoint (in order) and the index's ``paddle_fsdp`` record."""
    hf_path = os.path.abspath(os.fspath(hf_path))
    if os.path.isfile(hf_path):
        if not hf_path.endswith(".safetensors"):
            raise ToolError(f"{hf_path} is not a .safetensors file or a Hugging Face model directory")
        return [read_safetensors_header(hf_path)], None
    if not os.path.isdir(hf_path):
        raise ToolError(f"{hf_path}: no such file or directory")
    names = sorted(os.listdir(hf_path))
    indexes = [n for n in names if n.endswith(".safetensors.index.json")]
    if len(indexes) > 1:
        indexes = [n for n in indexes if n == INDEX_FILE] or indexes
        if len(indexes) > 1:
            raise ToolError(f"{hf_path} holds several safetensors indexes ({', '.join(indexes)}); pass one file")
    if not indexes:
        files = [n for n in names if n.endswith(".safetensors")]
        if not files:
            raise ToolError(f"{hf_path} holds no .safetensors files and no {INDEX_FILE}")
        return [read_safetensors_header(os.path.join(hf_path, n)) for n in files], None
    ipath = os.path.join(hf_path, indexes[0])
    try:
        with open(ipath, "rb") as f:
            index = json.loads(f.read())
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise ToolError(f"cannot read index {ipath}: {e}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ToolError(f"index {ipath} has no weight_map")
    files = sorted(set(weight_map.values()), key=str)
    st_files = []
    for name in files:
        path = _safe_member(hf_path, name, f"index {ipath}")
        if not os.path.isfile(path):
            raise ToolError(f"index {ipath} names {name}, which is missing")
        st = read_safetensors_header(path)
        listed = {k for k, v in weight_map.items() if v == name}
        have = {e.name for e in st.entries}
        if listed != have:
            diff = sorted(listed - have) or sorted(have - listed)
            where = "is not in" if listed - have else "is in"
            raise ToolError(f"index {ipath} and {name} disagree: tensor {diff[0]!r} {where} the file")
        st_files.append(st)
    meta = index.get("metadata") if isinstance(index.get("metadata"), dict) else {}
    record = meta.get(RECORD_KEY)
    if record is not None:
        if (
            not isinstance(record, dict)
            or not isinstance(record.get("names"), dict)
            or not all(isinstance(k, str) and isinstance(v, str) for k, v in record["names"].items())
            or not isinstance(record.get("transposed", []), list)
        ):
            raise ToolError(f"index {ipath}: malformed metadata.{RECORD_KEY} record")
    return st_files, record


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
) -> dict:
    """Convert Hugging Face safetensors at ``hf_path`` into a checkpoint at ``out`` (see the module docstring).

    Returns a summary: ``{"out", "tensors", "total_size", "files", "transposed"}``.
    """
    dtype = parse_dtype(dtype)
    out = os.path.abspath(os.fspath(out))
    ckpt_io.check_output_path(out)
    st_files, record = discover_hf(hf_path)
    plan = plan_from_hf(st_files, record, rules, dtype)
    tensors = [t for _, ts in plan for t in ts]
    if not tensors:
        raise ToolError(f"{hf_path} holds no tensors")
    total = sum(_numel(t.entry.shape) * itemsize(t.dtype) for t in tensors)
    with staged_output(out) as staging, Progress(total, "from-hf", enabled=progress) as bar:
        writer = CheckpointWriter(staging, on_bytes=bar.update)
        for st, ts in plan:
            fd = os.open(st.path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            try:
                writer.write_file([WriteEntry(t.key, t.dtype, t.shape, _producer(fd, st, t)) for t in ts])
            finally:
                os.close(fd)
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
    }


def _producer(fd: int, st: SafetensorsFile, t: CkptTensor):
    def produce() -> np.ndarray:
        e = t.entry
        raw = np.empty(e.nbytes, np.uint8)
        ckpt_io.pread_exact(fd, raw, st.data_start + e.begin, st.path)
        if not t.transpose and t.dtype == e.dtype:
            return raw
        arr = raw.view(ckpt_io.storage_dtype(e.dtype)).reshape(e.shape)
        out = np.empty(_numel(e.shape) * itemsize(t.dtype), np.uint8)
        pos = 0
        for block in converted_blocks(arr, e.dtype, t.dtype, t.transpose):
            out[pos : pos + block.size] = block
            pos += block.size
        return out

    return produce
