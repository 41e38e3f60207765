"""Streaming access to checkpoints for the tools: key roles, one-tensor-at-a-time reads, a one-process writer.

Built only on the engine's public pieces (``read_metadata``, the metadata dataclasses, the coverage check every
load runs (``load.check_coverage``), ``regions.read_region`` with its checksummed reads, ``reader``'s read
loop, ``writer``'s rank-file writer and ``format.commit``), so the format has one implementation and the tools
never hold more than one full tensor of a checkpoint in memory.

Which keys are model weights and which are optimizer state
----------------------------------------------------------
A checkpoint key ``K`` is optimizer state iff ``K == P + "." + S`` where ``P`` is another tensor key of the same
checkpoint and ``S`` contains no dot; ``P`` is then the parameter and ``S`` the state name
(``blocks.0.mix.weight.moment1`` -> ``blocks.0.mix.weight`` / ``moment1``). Every other tensor key is a model
weight. This is sound for checkpoints written from a paddle ``Layer`` (``FullyShardFusion.sharded_state_dict``
plus ``optimizer_sharded_state_dict``, or ``save_checkpoint``): in a structured name every component but the last
is a sublayer and the last is a parameter/buffer, and a ``Layer`` attribute is never both (``Layer.__setattr__``
removes a name from the other registries), so no model key is another model key plus ``"." + something``;
optimizer keys are exactly ``<param key>.<state name>`` with state names free of dots (the per-class table in
``state.optimizer_states``, plus ``master_weight``). Checked on every checkpoint written by
``test/collective/fsdp/workers/resume.py`` (18 optimizer configurations x 2 save forms). When the checkpoint
carries ``__fsdp__.optimizer`` (``save_checkpoint`` with an optimizer), each state name is also checked against
that optimizer class's table and a mismatch is logged. Limits: a hand-made state dict whose keys break the
``Layer`` naming (e.g. both ``a`` and ``a.b`` as model tensors) is misclassified; optimizer state saved without its
parameter (``P`` absent) is classified as model weights.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..checkpoint import CheckpointOptions, read_metadata, reader
from ..checkpoint.errors import DerivedKeyError
from ..checkpoint.format import derived
from ..checkpoint.format.metadata import (
    NUMPY_STORAGE,
    CheckpointMetadata,
    itemsize,
    storage_dtype,
)
from ..checkpoint.format.reserved import BUFFERS_KEY, EMA_SUFFIX, OPTIMIZER_KEY
from ..checkpoint.geometry import Region
from ..checkpoint.load import load as engine_load
from ..checkpoint.lossy import logical_tensors, read_dequantized
from ..checkpoint.one_process import CheckpointWriter, Producer, WriteEntry  # noqa: F401 (the tools import them here)
from ..checkpoint.paths import local_path
from ..checkpoint.regions import read_region
from ..checkpoint.staged_output import check_output_path, staged_output  # noqa: F401 (the tools import them here)
from .errors import ToolError

logger = logging.getLogger(__name__)

MODEL = "model"
OPTIMIZER = "optimizer"
BUFFER = "buffer"  # a persistable buffer (model state, not a parameter); classified MODEL by classify_keys

FLOAT_DTYPES = ("float64", "float32", "float16", "bfloat16")


# ------------------------------------------------------------------------------------------------ key roles


@dataclass(frozen=True)
class KeyRole:
    role: str  # MODEL or OPTIMIZER
    param: str  # the parameter key (the key itself for model weights)
    state: str | None = None  # optimizer state name


def _known_state_names(optimizer_class: str) -> set[str] | None:
    """Canonical state names of a paddle optimizer class (None if unknown or the table is unavailable)."""
    try:
        from ..state.optimizer_states import state_names_of_class
    except Exception:  # noqa: BLE001 - the cross-check is advisory only
        return None
    return state_names_of_class(optimizer_class)


def classify_keys(md: CheckpointMetadata) -> dict[str, KeyRole]:
    """Role of every tensor key (see the module docstring for the rule and why it is sound)."""
    tensors = logical_tensors(md)  # a quantized moment as itself, not its stored codes and scales
    keys = set(tensors)
    roles: dict[str, KeyRole] = {}
    for key in tensors:
        head, dot, tail = key.rpartition(".")
        if dot and tail and head in keys:
            roles[key] = KeyRole(OPTIMIZER, head, tail)
        else:
            roles[key] = KeyRole(MODEL, key)
    for key, r in roles.items():
        if r.role == OPTIMIZER and roles[r.param].role != MODEL:
            logger.warning("key %r is state of %r, which is itself optimizer state", key, r.param)
    opt = md.values.get(OPTIMIZER_KEY)
    if isinstance(opt, dict) and isinstance(opt.get("class"), str):
        known = _known_state_names(opt["class"])
        if known is not None:
            odd = sorted({r.state for r in roles.values() if r.role == OPTIMIZER} - known - {EMA_SUFFIX[1:]})
            if odd:
                logger.warning(
                    "checkpoint holds %s state, but state names %s are not in that optimizer's table",
                    opt["class"],
                    odd,
                )
    return roles


def buffer_keys(md: CheckpointMetadata) -> set[str]:
    """Tensor keys that ``save_checkpoint`` recorded as persistable buffers (``__fsdp__.buffers``); a checkpoint
    written by the low-level API carries no such list, and its buffers count as model weights."""
    listed = md.values.get(BUFFERS_KEY)
    if not isinstance(listed, list):
        return set()
    return {key for key in listed if isinstance(key, str) and key in md.tensors}


def without_keys(md: CheckpointMetadata, keys: set[str]) -> CheckpointMetadata:
    """A shallow copy of ``md`` whose tensor table leaves ``keys`` out (for planning exports)."""
    if not keys:
        return md
    return dataclasses.replace(md, tensors={k: v for k, v in md.tensors.items() if k not in keys})


# ------------------------------------------------------------------------------------------------ reading


def resolve_checkpoint_path(path: str | os.PathLike) -> str:
    """``path`` itself for a checkpoint directory; its latest committed checkpoint for a CheckpointManager root.

    Uses the engine's ``resolve_checkpoint`` when this build has it (else returns ``path`` unchanged).
    """
    path = local_path(path)  # a local path, or a URL of a served scheme (s3://)
    try:
        from ..checkpoint import resolve_checkpoint
    except ImportError:  # an engine without numbered checkpoints
        return path
    resolved = resolve_checkpoint(path)
    if resolved != path:
        logger.info("%s is a checkpoint root: using its latest checkpoint %s", path, resolved)
    return resolved


class CheckpointReader:
    """Reads full tensors of a committed checkpoint one at a time, verifying every checksum on the way.

    Memory: the returned tensor (allocated per call) plus, only for pieces stored as boxes with partial rows, a
    bounded read window. Raises the engine's ``CheckpointError`` family for damaged checkpoints.
    """

    WINDOW_BYTES = 16 << 20

    def __init__(self, path: str | os.PathLike, verify: bool = True, options: CheckpointOptions | None = None) -> None:
        self.path = resolve_checkpoint_path(path)
        opts = CheckpointOptions.from_env() if options is None else options
        storage = opts.storage_for(self.path)
        md = read_metadata(self.path, opts, storage)
        self.quant = md.quant or {}  # quantized moments: read_flat dequantizes them
        self._files = reader.FileSet.of(self.path, md, verify, opts, storage)
        # derived weights (format 4) listed with the stored tensors, read as their master weight cast
        self.md = dataclasses.replace(md, tensors=derived.WithDerived(md.tensors, md.derived)) if md.derived else md
        if md.derived:
            self.md.derived = md.derived
        self.verify = self._files.verifies
        self._covered: set[str] = set()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._files.close()

    @property
    def bytes_read(self) -> int:
        return self._files.bytes_read

    def nbytes(self, key: str) -> int:
        tm = self.md.tensors[key] if key not in self.quant else logical_tensors(self.md)[key]
        return Region.full(tm.shape).numel * itemsize(tm.dtype)

    def read(self, key: str) -> np.ndarray:
        """The full tensor ``key`` as a new C-contiguous numpy array (numpy storage dtype, see NUMPY_STORAGE); a
        quantized moment dequantized (``read_flat``)."""
        q = self.quant.get(key)
        if q is not None:
            return self.read_flat(key, 0, q.numel).reshape(q.shape)
        raw = self.read_raw(key)
        tm = self.md.tensors[key]
        return raw.view(storage_dtype(tm.dtype)).reshape(tm.shape)

    def read_raw(self, key: str) -> np.ndarray:
        """The bytes of the full tensor ``key`` in row-major order (uint8)."""
        tm = self.md.tensors[key]
        return self.read_region_raw(key, Region.full(tm.shape))

    def read_flat(self, key: str, start: int, stop: int) -> np.ndarray:
        """Elements ``[start, stop)`` of tensor ``key``'s row-major flattening, as a new 1-D numpy array.

        Only the byte ranges holding them are read (plus checksum-chunk alignment), whatever the saved layout.
        A quantized moment (checkpoint/lossy.py) is read from its codes and scales, dequantized.
        """
        q = self.quant.get(key)
        if q is not None:
            if not 0 <= start <= stop <= q.numel:
                raise ValueError(f"key {key!r}: flat range [{start}, {stop}) outside its {q.numel} elements")
            return cast_array(read_dequantized(self.read_flat, q, start, stop), "float32", q.dtype)
        tm = self.md.tensors[key]
        full = Region.full(tm.shape)
        if not 0 <= start <= stop <= full.numel:
            raise ValueError(f"key {key!r}: flat range [{start}, {stop}) outside its {full.numel} elements")
        region = Region(full.shape, full.box_offset, full.box_shape, (start, stop))
        return self.read_region_raw(key, region).view(storage_dtype(tm.dtype))

    def check_coverage(self, key: str) -> None:
        """Raise ``CorruptCheckpointError`` unless the pieces of ``key`` cover every element exactly once."""
        if key in self.md.derived:
            key = self.md.derived[key].source
        if key in self._covered:
            return
        engine_load.check_coverage(self.path, self.md, [key])  # the check every load runs
        self._covered.add(key)

    def read_region_raw(self, key: str, region: Region) -> np.ndarray:
        """The bytes of ``region`` of tensor ``key`` in the region's storage order (uint8)."""
        tm = self.md.tensors[key]
        if region.numel == 0:
            return np.empty(0, np.uint8)
        d = self.md.derived.get(key)
        if d is not None:  # a derived weight: its master's elements, cast (DerivedKeyError: no master)
            if d.source not in self.md.tensors:
                raise DerivedKeyError(f"key {key!r} is derived from {d.source!r}, which {self.path} does not hold")
            out = np.empty(region.numel * itemsize(tm.dtype), np.uint8)
            derived.cast_into(self.read_region_raw(d.source, region).view(np.float32), d.dtype, out)
            return out
        self.check_coverage(key)
        for name in sorted({p.file for p in tm.pieces if p.nbytes}):
            self._files.handle(name)  # real regular files of the declared sizes, before allocating by the shape
        out = np.empty(region.numel * itemsize(tm.dtype), np.uint8)
        read_region(self._files, self.md, key, region, out, self.verify, window_bytes=self.WINDOW_BYTES)
        return out


# ------------------------------------------------------------------------------------------------ dtype casts


def _f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bfloat16 bits (as torch does); NaN -> 0x7FC0."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    out = ((u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        out[nan] = np.uint16(0x7FC0)
    return out


def _bf16_bits_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << np.uint32(16)).view(np.float32)


def cast_array(arr: np.ndarray, src: str, dst: str) -> np.ndarray:
    """Cast ``arr`` (numpy storage of engine dtype ``src``) to engine dtype ``dst`` (floating dtypes only)."""
    if src == dst:
        return arr
    if src not in FLOAT_DTYPES or dst not in FLOAT_DTYPES:
        raise ToolError(f"cannot cast {src} to {dst}")
    values = _bf16_bits_to_f32(arr) if src == "bfloat16" else arr
    if dst == "bfloat16":
        if values.dtype != np.float32:
            values = values.astype(np.float32)
        return _f32_to_bf16_bits(values)
    return values.astype(NUMPY_STORAGE[dst])


def converted_blocks(
    arr: np.ndarray, src: str, dst: str, transpose: bool, block_bytes: int = 2 << 20
) -> Iterator[np.ndarray]:
    """The bytes of ``arr`` (transposed if asked, cast to ``dst``) as uint8 blocks, row-major, bounded size.

    Only one block of converted data exists at a time, so converting costs no second full-size copy.
    """
    if transpose:
        if arr.ndim != 2:
            raise ToolError(f"cannot transpose a tensor of shape {list(arr.shape)} (only 2-D)")
        rows_out, cols_out = arr.shape[1], arr.shape[0]
        isz = max(arr.itemsize, 1)
        step = max(1, block_bytes // max(cols_out * isz, 1))
        for r in range(0, rows_out, step):
            block = np.ascontiguousarray(arr[:, r : r + step].T)
            yield np.ascontiguousarray(cast_array(block, src, dst)).view(np.uint8).reshape(-1)
        return
    flat = arr.reshape(-1)
    step = max(1, block_bytes // max(arr.itemsize, 1))
    if src == dst:
        raw = flat.view(np.uint8)
        yield raw
        return
    for i in range(0, flat.size, step):
        yield np.ascontiguousarray(cast_array(flat[i : i + step], src, dst)).view(np.uint8).reshape(-1)


def pread_exact(fd: int, buf: np.ndarray, offset: int, what: str) -> None:
    """Fill ``buf`` from ``fd`` at ``offset`` through the engine's read loop; ToolError naming ``what`` (a file
    of the tool's input) when the file ends first."""
    want = memoryview(buf).nbytes
    done = reader.pread_full(fd, buf, offset)
    if done < want:
        raise ToolError(f"{what} ends at byte {offset + done}, expected at least {offset + want} (truncated)")
