"""``to-hf``: convert a sharded checkpoint into Hugging Face safetensors (shared parts: ``hf_format.py``).

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

With ``preset`` (``presets.py``: a model family's names, transposes and fused-key layouts, as data) and an HF
``config.json``, ``preset_plan`` decides the tensors: to-hf splits a fused key into several HF tensors, each a list
of row ranges of the source in HF orientation (``HfTensor.rows``); the fused source is read once for all its parts
(``LastTensor``), so memory stays at one tensor plus bounded blocks. The config is copied into the export and
recorded (``paddle_fsdp.preset``), so from-hf of a preset export needs no flag. Incomplete conversions are refused
(see ``preset_plan``). Persistable buffers listed in ``__fsdp__.buffers`` are left out of exports unless asked.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..checkpoint.format import safetensors
from ..checkpoint.format.metadata import itemsize
from ..checkpoint.format.reserved import (
    EMA_KEY,
    EMA_SUFFIX,
    FROZEN_BASE_KEY,
    OPTIMIZER_KEY,
    safetensors_name_problem,
)
from ..checkpoint.lossy import logical_tensors
from ..checkpoint.paths import local_path
from ..checkpoint.writer import write_all
from . import ckpt_io
from .arch_check import check_rules_export
from .ckpt_io import MODEL, OPTIMIZER, CheckpointReader, classify_keys, converted_blocks, staged_output
from .errors import ToolError
from .hf_format import (
    CONFIG_FILE,
    DEFAULT_MAX_SHARD_SIZE,
    HF_FILE_METADATA,
    INDEX_FILE,
    RECORD_KEY,
    RECORD_VERSION,
    check_collisions,
    numel,
    parse_dtype,
    parse_size,
    read_config,
    target_dtype,
)
from .progress import Progress
from .rules import Rules

logger = logging.getLogger(__name__)


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
        return numel(self.shape) * itemsize(self.dtype)


def plan_to_hf(md, rules: Rules, dtype: str | None, include_optimizer: bool) -> list[HfTensor]:
    """The output tensors in checkpoint order; raises ToolError for collisions and impossible transposes."""
    roles = classify_keys(md)
    tensors = logical_tensors(md)  # a quantized moment as itself (read dequantized), not its codes and scales
    n_opt = sum(1 for r in roles.values() if r.role == OPTIMIZER)
    if include_optimizer and n_opt == 0:
        logger.warning("--include-optimizer: the checkpoint holds no optimizer state")
    out: list[HfTensor] = []
    param_plan: dict[str, tuple[str, bool]] = {}
    for key, tm in tensors.items():
        if roles[key].role != MODEL:
            continue
        transpose = rules.transposes(key)
        if transpose and len(tm.shape) != 2:
            raise ToolError(
                f"transpose rule matches {key!r} of shape {list(tm.shape)}: only 2-D tensors can be transposed"
            )
        param_plan[key] = (rules.rename_name(key), transpose)
    for key, tm in tensors.items():
        role = roles[key]
        if role.role == MODEL:
            name, transpose = param_plan[key]
        elif include_optimizer:
            pname, ptrans = param_plan.get(role.param, (role.param, False))
            name = f"{pname}.{role.state}"
            transpose = ptrans and tuple(tm.shape) == tuple(tensors[role.param].shape)
        else:
            continue
        out.append(HfTensor(name, key, tm.dtype, target_dtype(tm.dtype, dtype), tuple(tm.shape), transpose, role.param))
    check_collisions([(t.key, t.name) for t in out], "checkpoint key")
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
        base_ref = reader.md.values.get(FROZEN_BASE_KEY)
    if isinstance(base_ref, dict) and not base_ref.get("saved", True):
        return _without_base(ckpt, out, base_ref)
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


def _without_base(ckpt: str, out: str, base_ref: dict) -> dict:
    """A checkpoint that references its frozen base (state/frozen_base.py): its adapter, if it records one, in
    PaddleFormers' and peft's layouts (tools/adapter_export.py); else a ToolError (no whole model to export)."""
    from .adapter_export import export_adapter

    if base_ref.get("adapter") is None:
        source = base_ref.get("source")
        raise ToolError(
            f"checkpoint {ckpt} holds the trainable parameters only: its {base_ref.get('parameters')} frozen "
            f"parameters{f' (from {source})' if source else ''} were not saved (save_checkpoint(..., "
            "save_frozen=True) writes them), and it records no adapter to export instead"
        )
    return export_adapter(ckpt, out)


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
                    target_dtype(tm.dtype, dtype),
                    tuple(tm.shape),
                    item.transpose,
                    item.param,
                    sp.rows,
                    sp.shape if sp.rows is not None else None,
                )
            )
    check_collisions([(t.key, t.name) for t in out], "checkpoint key")
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
    row_bytes = max(numel(view.shape[1:]) * view.itemsize, 1)
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
