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

import contextlib
import dataclasses
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..checkpoint import CheckpointOptions, checksums, one_process, read_metadata, reader, writer
from ..checkpoint import load as engine_load
from ..checkpoint.format.metadata import (
    DEFAULT_CHUNK_BYTES,
    DTYPES,
    FORMAT_NAME,
    METADATA_FILE,
    NUMPY_STORAGE,
    CheckpointMetadata,
    FileMeta,
    PieceMeta,
    TensorMeta,
    itemsize,
    rank_file_name,
    storage_dtype,
)
from ..checkpoint.format.reserved import BUFFERS_KEY, EMA_SUFFIX, OPTIMIZER_KEY, key_problem
from ..checkpoint.format.safetensors import build_header
from ..checkpoint.geometry import Region
from ..checkpoint.paths import local_path, url_scheme
from ..checkpoint.regions import read_region
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
    keys = set(md.tensors)
    roles: dict[str, KeyRole] = {}
    for key in md.tensors:
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
        self.md = read_metadata(self.path, opts, storage)
        self._files = reader.FileSet.of(self.path, self.md, verify, opts, storage)
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
        tm = self.md.tensors[key]
        return Region.full(tm.shape).numel * itemsize(tm.dtype)

    def read(self, key: str) -> np.ndarray:
        """The full tensor ``key`` as a new C-contiguous numpy array (numpy storage dtype, see NUMPY_STORAGE)."""
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
        """
        tm = self.md.tensors[key]
        full = Region.full(tm.shape)
        if not 0 <= start <= stop <= full.numel:
            raise ValueError(f"key {key!r}: flat range [{start}, {stop}) outside its {full.numel} elements")
        region = Region(full.shape, full.box_offset, full.box_shape, (start, stop))
        return self.read_region_raw(key, region).view(storage_dtype(tm.dtype))

    def check_coverage(self, key: str) -> None:
        """Raise ``CorruptCheckpointError`` unless the pieces of ``key`` cover every element exactly once."""
        if key in self._covered:
            return
        engine_load.check_coverage(self.path, self.md, [key])  # the check every load runs
        self._covered.add(key)

    def read_region_raw(self, key: str, region: Region) -> np.ndarray:
        """The bytes of ``region`` of tensor ``key`` in the region's storage order (uint8)."""
        tm = self.md.tensors[key]
        if region.numel == 0:
            return np.empty(0, np.uint8)
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


# ------------------------------------------------------------------------------------------------ output dirs


def check_output_path(out: str) -> None:
    """Refuse an output path that exists as a file, a symbolic link or a non-empty directory (never overwrite);
    for a URL of a storage backend, one where something is published."""
    if url_scheme(out) is not None:
        from .remote_output import check_remote_output

        check_remote_output(local_path(out))
        return
    if os.path.lexists(out):
        if os.path.islink(out):  # refused before any work (the final rename cannot replace a link by a directory)
            raise ToolError(f"output {out} is a symbolic link; give the real directory path (nothing is written)")
        if not os.path.isdir(out):
            raise ToolError(f"output {out} exists and is not a directory")
        if os.listdir(out):
            raise ToolError(
                f"output directory {out} is not empty; refusing to overwrite it (remove it or pick another)"
            )


@contextlib.contextmanager
def staged_output(out: str | os.PathLike) -> Iterator[str]:
    """Yield a fresh staging directory next to ``out``; on success it is fsynced and renamed to ``out``.

    On any error (or Ctrl-C) the staging directory is removed, so ``out`` either appears complete or not at all;
    a hard kill leaves only ``<out>.tmp-<id>``, never something at ``out``. ``out`` may be a URL of a storage
    backend (``s3://``): the staging directory is then a local temporary one, published there (remote_output.py).
    """
    out = local_path(out)
    if url_scheme(out) is not None:
        from .remote_output import RemoteStaging

        remote = RemoteStaging(out)
        try:
            yield remote.local
            remote.finish()
        finally:
            remote.cleanup()
        return
    check_output_path(out)
    parent = os.path.dirname(out)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise ToolError(f"cannot create the parent directory of {out}: {e.strerror or e}") from None
    staging = f"{out}.tmp-{uuid.uuid4().hex[:12]}"
    try:
        os.mkdir(staging)
    except OSError as e:
        raise ToolError(f"cannot create {staging}: {e.strerror or e}") from None
    try:
        yield staging
        writer.fsync_dir(staging)
        try:
            os.rename(staging, out)  # `out` is absent or an empty directory
        except OSError as e:
            raise ToolError(f"cannot move the finished output into {out}: {e.strerror or e}") from None
        writer.fsync_dir(parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def pread_exact(fd: int, buf: np.ndarray, offset: int, what: str) -> None:
    """Fill ``buf`` from ``fd`` at ``offset`` through the engine's read loop; ToolError naming ``what`` (a file
    of the tool's input) when the file ends first."""
    want = memoryview(buf).nbytes
    done = reader.pread_full(fd, buf, offset)
    if done < want:
        raise ToolError(f"{what} ends at byte {offset + done}, expected at least {offset + want} (truncated)")


# ------------------------------------------------------------------------------------------------ writing


Producer = Callable[[], np.ndarray]  # returns the tensor's bytes (uint8, row-major), called when written


@dataclass
class WriteEntry:
    key: str
    dtype: str  # engine dtype name
    shape: tuple[int, ...]
    produce: Producer

    @property
    def nbytes(self) -> int:
        return Region.full(self.shape).numel * itemsize(self.dtype)


class CheckpointWriter:
    """Writes a checkpoint of the engine's format from ONE process, one data file at a time, one tensor in memory.

    Every tensor is stored whole (one box piece covering it), so any world size can load any slice of it. Each
    data file is ``<i>_0.safetensors`` with file rank ``i`` (as if rank ``i`` had saved it); ``commit`` writes
    the index (format 3: checksum sidecars, ``index.keys``, ``index.pieces``, ``metadata.json``), the stock-paddle
    index ``0.metadata`` and the ``COMMIT`` record last, exactly like a collective save. Write into a staging directory (see :func:`staged_output`).
    """

    def __init__(
        self,
        directory: str,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        on_bytes: Callable[[int], None] | None = None,
        options: CheckpointOptions | None = None,
    ):
        self.directory = directory
        self.chunk_bytes = chunk_bytes
        self.checksum = (
            CheckpointOptions.from_env().checksum_algorithm() if options is None else options.checksum_algorithm()
        )
        self._digest = checksums.digest_function(self.checksum) if self.checksum != checksums.NONE else None
        self.checkpoint_id = uuid.uuid4().hex
        self.created = time.time()
        self.files: dict[str, FileMeta] = {}
        self.tensors: dict[str, TensorMeta] = {}
        self.on_bytes = on_bytes

    def write_file(self, entries: list[WriteEntry]) -> str:
        rank = len(self.files)
        name = rank_file_name(rank)
        header_entries, stored, pos = [], [], 0
        seen: set[str] = set()
        for e in entries:
            if e.key in self.tensors or e.key in seen:
                raise ToolError(f"key {e.key!r} is written twice")
            seen.add(e.key)
            problem = key_problem(e.key, tensor=True)
            if problem is not None:
                raise ToolError(f"key {e.key!r:.200} cannot be stored in a checkpoint: {problem}")
            if e.dtype not in DTYPES:
                raise ToolError(f"key {e.key!r}: dtype {e.dtype} is not supported by the checkpoint format")
            if e.nbytes == 0:
                continue
            header_entries.append((e.key, e.dtype, tuple(e.shape), pos, pos + e.nbytes))
            stored.append(e)
            pos += e.nbytes
        header = build_header(
            header_entries, {"format": FORMAT_NAME, "checkpoint_id": self.checkpoint_id, "rank": str(rank)}
        )
        # one tensor in memory at a time: produced, checksummed and written by the engine's rank-file writer
        size, sums = writer.write_rank_file(
            os.path.join(self.directory, name),
            header,
            [self._provider(e) for e in stored],
            self.chunk_bytes,
            self._digest,
            batch_bytes=0,
        )
        if size != len(header) + pos:
            raise ToolError(f"{name}: wrote {size} bytes, expected {len(header) + pos}")
        self.files[name] = FileMeta(rank=rank, size=size)
        for e in entries:
            self.tensors[e.key] = TensorMeta(dtype=e.dtype, shape=tuple(e.shape), pieces=[])
        for (key, _dtype, shape, begin, end), piece_sums in zip(header_entries, sums):
            self.tensors[key].pieces.append(
                PieceMeta(
                    file=name,
                    name=key,
                    offset=len(header) + begin,
                    nbytes=end - begin,
                    box_offset=(0,) * len(shape),
                    box_shape=tuple(shape),
                    flat_range=None,
                    checksums=[int(c) for c in piece_sums],
                )
            )
        return name

    def _provider(self, e: WriteEntry) -> Callable[[], tuple[np.ndarray, None]]:
        def produce() -> tuple[np.ndarray, None]:
            data = e.produce()
            if data.dtype != np.uint8 or data.ndim != 1 or data.size != e.nbytes:
                raise ToolError(f"key {e.key!r}: produced {data.size} bytes, expected {e.nbytes}")
            if self.on_bytes is not None:
                self.on_bytes(e.nbytes)
            return data, None

        return produce

    def commit(
        self, values: dict[str, Any], write_stock_metadata: bool = True, per_rank_values: tuple[str, ...] = ()
    ) -> CheckpointMetadata:
        """Write the index (format 3, the one collective saves write) and the commit record. ``per_rank_values``:
        keys of ``values`` holding a list with one entry per data file (as if each file's rank had saved its
        own, e.g. its RNG state): each entry goes into that rank's values object."""
        md = CheckpointMetadata(
            checkpoint_id=self.checkpoint_id,
            world_size=max(len(self.files), 1),
            chunk_bytes=self.chunk_bytes,
            checksum=self.checksum,
            created_unix=self.created,
            files=dict(self.files),
            tensors=dict(self.tensors),
            values=dict(values),
        )
        md.validate(f"{self.directory}/{METADATA_FILE}")
        try:
            data = one_process.write_format3(self.directory, md, write_stock_metadata, tuple(per_rank_values))
        except ValueError as e:
            raise ToolError(str(e)) from None
        one_process.write_commit(self.directory, self.checkpoint_id, data)
        return md
