"""Checkpoint metadata: the schema of ``metadata.json`` (dataclasses, JSON (de)serialization, validation) and
the names of the files of a checkpoint directory.

``metadata.json`` (schema version 1) is the only index of a format-1 checkpoint (written before format 2, still
read; every writer builds this form in memory, then writes format 3, format/index.py: the same fields without the
checksums, the pieces in index objects read by key; the versions: versions.py); loading never unpickles anything::

    {
      "format": "paddle-fsdp-checkpoint", "version": 1,
      "checkpoint_id": "<32 hex>", "created_unix": 1760000000.0,
      "world_size": 2,                      # ranks that saved
      "chunk_bytes": 1048576,               # checksum granularity (see below)
      "checksum": "xxh3-64",                # or "crc32", "none" (checksums.py)
      "files": {"0_0.safetensors": {"rank": 0, "size": 123456}, ...},
      "tensors": {
        "<key>": {"dtype": "float32", "shape": [4, 8],           # global shape
                  "pieces": [{"file": "0_0.safetensors",
                              "name": "<key>",                   # tensor name inside the safetensors file
                              "offset": 4096, "nbytes": 64,      # absolute byte range in the file
                              "box_offset": [0, 0], "box_shape": [4, 8],
                              "flat_range": [0, 16],             # or null: the whole box
                              "checksums": [305419896]}]},       # one per chunk_bytes of the piece
      },
      "values": {"<key>": <any JSON value>}
    }

A piece covers the elements of the box ``box_offset``/``box_shape`` of the global tensor (row-major), or, when
``flat_range`` is set, the elements ``[start, stop)`` of that box's row-major flattening. Its bytes are stored
contiguously in row-major order of what it covers. ``checksums[i]`` is the checksum (algorithm: ``checksum``) of
bytes ``[i*chunk_bytes, (i+1)*chunk_bytes)`` of the piece (the last chunk may be shorter); a reader that needs a
sub-range of a piece reads the enclosing chunks, so every byte that reaches a tensor is verified while reading at
most two extra chunks per contiguous range. Checkpoints written before xxh3-64 call the list ``crc32``; it is
read as ``checksums``.

File names in the metadata must be plain base names (letters, digits, ``._-``, not starting with a dot); anything
else, and any name that resolves (through symlinks) outside the checkpoint directory, is refused with
:class:`UnsafePathError`.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import MetadataError, UnsafePathError
from . import algorithms
from .rank_values import plain
from .strict_json import json_value_problem

FORMAT_NAME = "paddle-fsdp-checkpoint"
METADATA_FILE = "metadata.json"
COMMIT_FILE = "COMMIT"
LATEST_FILE = "latest"  # in a CheckpointManager root: the name of the newest committed checkpoint directory
STOCK_METADATA_FILE = "0.metadata"  # stock paddle's pickled index, written for stock readers only (stock_compat.py)
PARTS_DIR = ".parts"  # in a staging directory: per-rank done/failed markers and the coordinator's ABORT
# Bytes per checksummed chunk of new saves (each checkpoint records its own). A load verifies whole chunks, so a
# rank whose range of a piece starts or ends inside a chunk also reads the rest of that chunk: with 1 MiB chunks,
# a 2 -> 3 load of 2 x 504 MiB (16 MiB tensors) read 12.5% more than its share; with 256 KiB, 3%. The price is
# 4x the checksums in metadata.json (~80 bytes of JSON per MiB of state: +1 ms of parsing per GB here).
DEFAULT_CHUNK_BYTES = 256 << 10

# dtype name -> (bytes per element, safetensors dtype code)
DTYPES: dict[str, tuple[int, str]] = {
    "float64": (8, "F64"),
    "float32": (4, "F32"),
    "float16": (2, "F16"),
    "bfloat16": (2, "BF16"),
    "int64": (8, "I64"),
    "int32": (4, "I32"),
    "int16": (2, "I16"),
    "int8": (1, "I8"),
    "uint8": (1, "U8"),
    "bool": (1, "BOOL"),
    "complex64": (8, "C64"),
    "float8_e4m3fn": (1, "F8_E4M3"),
    "float8_e5m2": (1, "F8_E5M2"),
}

#: dtype name -> numpy dtype holding its bits (numpy has no bfloat16 / float8: raw unsigned ints of their size)
NUMPY_STORAGE: dict[str, Any] = {
    "float64": np.float64,
    "float32": np.float32,
    "float16": np.float16,
    "bfloat16": np.uint16,
    "int64": np.int64,
    "int32": np.int32,
    "int16": np.int16,
    "int8": np.int8,
    "uint8": np.uint8,
    "bool": np.bool_,
    "complex64": np.complex64,
    "float8_e4m3fn": np.uint8,
    "float8_e5m2": np.uint8,
}


def storage_dtype(name: str) -> np.dtype:
    """numpy dtype holding the elements of dtype ``name`` (opaque fixed-size bytes for a dtype numpy lacks)."""
    known = NUMPY_STORAGE.get(name)
    return np.dtype(known) if known is not None else np.dtype(f"V{itemsize(name)}")


_SAFE_NAME = re.compile(r"^[A-Za-z0-9_\-][A-Za-z0-9_.\-]*$")


def rank_file_name(rank: int) -> str:
    """Data file of ``rank``: ``<rank>_0.safetensors`` is also the name stock paddle's loader expects (unique_id 0)."""
    return f"{rank}_0.safetensors"


def itemsize(dtype: str) -> int:
    try:
        return DTYPES[dtype][0]
    except KeyError:
        raise MetadataError(f"unsupported dtype {dtype!r}") from None


def numel(shape) -> int:
    return int(math.prod(shape)) if len(shape) else 1


def check_file_name(name: Any) -> str:
    """A file name from metadata must be a plain base name inside the checkpoint directory."""
    if not isinstance(name, str) or not _SAFE_NAME.match(name) or name in (".", "..") or ".." in name.split(os.sep):
        raise UnsafePathError(f"unsafe file name in checkpoint metadata: {name!r}")
    return name


def resolve_member(root: str, name: str) -> str:
    """Join ``root`` and a metadata file name, refusing names or symlinks that escape ``root``."""
    check_file_name(name)
    real_root = os.path.realpath(root)
    real = os.path.realpath(os.path.join(real_root, name))
    if os.path.dirname(real) != real_root:
        raise UnsafePathError(
            f"file {name!r} of checkpoint {root} resolves to {real}, outside the checkpoint directory"
        )
    return real


@dataclass
class PieceMeta:
    file: str
    name: str
    offset: int
    nbytes: int
    box_offset: tuple[int, ...]
    box_shape: tuple[int, ...]
    flat_range: tuple[int, int] | None
    checksums: list[int] = field(default_factory=list)

    @property
    def numel(self) -> int:
        if self.flat_range is not None:
            return self.flat_range[1] - self.flat_range[0]
        return numel(self.box_shape)

    def to_json(self) -> dict:
        return {
            "file": self.file,
            "name": self.name,
            "offset": self.offset,
            "nbytes": self.nbytes,
            "box_offset": list(self.box_offset),
            "box_shape": list(self.box_shape),
            "flat_range": None if self.flat_range is None else list(self.flat_range),
            "checksums": list(self.checksums),
        }

    @classmethod
    def from_json(cls, d: dict) -> PieceMeta:
        fr = d.get("flat_range")
        return cls(
            file=d["file"],
            name=d["name"],
            offset=int(d["offset"]),
            nbytes=int(d["nbytes"]),
            box_offset=tuple(int(x) for x in d["box_offset"]),
            box_shape=tuple(int(x) for x in d["box_shape"]),
            flat_range=None if fr is None else (int(fr[0]), int(fr[1])),
            checksums=[int(x) for x in d.get("checksums", d.get("crc32", []))],
        )


@dataclass
class TensorMeta:
    dtype: str
    shape: tuple[int, ...]
    pieces: list[PieceMeta] = field(default_factory=list)

    def window(self, lo: int, hi: int) -> tuple[list[PieceMeta], bool]:
        """``(pieces, whole)`` among which are those overlapping flat elements ``[lo, hi)``: all of them here (a
        format-2/3 IndexedTensor may read only the rows its directory selects)."""
        return self.pieces, True

    def to_json(self) -> dict:
        return {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "pieces": [p.to_json() for p in self.pieces],
        }

    @classmethod
    def from_json(cls, d: dict) -> TensorMeta:
        return cls(
            dtype=str(d["dtype"]),
            shape=tuple(int(x) for x in d["shape"]),
            pieces=[PieceMeta.from_json(p) for p in d["pieces"]],
        )


@dataclass
class FileMeta:
    rank: int
    size: int

    def to_json(self) -> dict:
        return {"rank": self.rank, "size": self.size}


@dataclass
class CheckpointMetadata:
    checkpoint_id: str
    world_size: int
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    checksum: str = algorithms.CRC32
    created_unix: float = 0.0
    files: dict[str, FileMeta] = field(default_factory=dict)
    tensors: dict[str, TensorMeta] = field(default_factory=dict)
    values: dict[str, Any] = field(default_factory=dict)
    version: int = 1  # format 1, the in-memory form every writer builds (format numbers: versions.py)
    # format 2 (format/index.py): reads piece rows and checksums on demand; None for a format-1 checkpoint
    index: Any = field(default=None, repr=False, compare=False)
    # format 3: the per-rank values read by saving rank (format/rank_values.py); None otherwise
    rank_values: Any = field(default=None, repr=False, compare=False)
    # format 4: key -> derived.Derived, the weights stored as their master weight cast (not as bytes of their own)
    derived: dict = field(default_factory=dict, repr=False, compare=False)
    # format 4: data file -> chunk codec of the files stored through one (format/codecs.py); the others are raw
    codecs: dict[str, str] = field(default_factory=dict)
    # format 4: {key: quant.QuantizedKey} of the keys stored quantized (lossy moments); None: none
    quant: Any = field(default=None, repr=False, compare=False)

    def prefetch(self, keys, spans: dict[str, tuple[int, int]] | None = None) -> None:
        """Read the pieces of ``keys`` now, in as few reads as possible (format 2; nothing to do in format 1);
        with ``spans[key] = (lo, hi)`` only those of its rows that may overlap the global flat elements
        ``[lo, hi)`` (format 3's row directory: ``md.tensors[key].window(lo, hi)`` gives them)."""
        if self.index is not None:
            self.index.load(keys, spans)

    def to_json(self) -> dict:
        return {
            "format": FORMAT_NAME,
            "version": self.version,
            "checkpoint_id": self.checkpoint_id,
            "created_unix": self.created_unix,
            "world_size": self.world_size,
            "chunk_bytes": self.chunk_bytes,
            "checksum": self.checksum,
            "files": {k: v.to_json() for k, v in self.files.items()},
            "tensors": {k: v.to_json() for k, v in self.tensors.items()},
            "values": {k: plain(v) for k, v in self.values.items()},  # per-rank values read whole
        }

    def dumps(self) -> bytes:
        # strict JSON: values are checked at save (records.py), so NaN/Infinity never reach the file
        return json.dumps(self.to_json(), separators=(",", ":"), allow_nan=False).encode()

    def validate(self, where: str = "metadata.json") -> None:
        """Structural checks that need no data files (coverage is checked by the planner)."""
        if self.chunk_bytes <= 0:
            raise MetadataError(f"{where}: chunk_bytes must be positive")
        if self.checksum not in algorithms.KNOWN:
            raise MetadataError(f"{where}: unknown checksum algorithm {self.checksum!r}")
        for name, fm in self.files.items():
            check_file_name(name)
            if fm.size < 0:
                raise MetadataError(f"{where}: file {name} has a negative size")
        for key, tm in self.tensors.items():
            if tm.dtype not in DTYPES:
                raise MetadataError(f"{where}: key {key!r} has unsupported dtype {tm.dtype!r}")
            if any(s < 0 for s in tm.shape):
                raise MetadataError(f"{where}: key {key!r} has a negative dimension")
            if numel(tm.shape) >= 1 << 62:
                raise MetadataError(f"{where}: key {key!r} declares {numel(tm.shape)} elements")
            isz = DTYPES[tm.dtype][0]
            for p in tm.pieces:
                if p.file not in self.files:  # (the listed files' names were checked above)
                    check_file_name(p.file)
                    raise MetadataError(f"{where}: key {key!r} refers to unlisted file {p.file!r}")
                if len(p.box_offset) != len(tm.shape) or len(p.box_shape) != len(tm.shape):
                    raise MetadataError(f"{where}: key {key!r} has a piece of the wrong rank")
                for o, s, g in zip(p.box_offset, p.box_shape, tm.shape):
                    if o < 0 or s < 0 or o + s > g:
                        raise MetadataError(f"{where}: key {key!r} has a piece outside its shape")
                if p.flat_range is not None:
                    a, b = p.flat_range
                    if not (0 <= a <= b <= numel(p.box_shape)):
                        raise MetadataError(f"{where}: key {key!r} has a bad flat_range {p.flat_range}")
                if p.nbytes != p.numel * isz:
                    raise MetadataError(f"{where}: key {key!r} piece byte size does not match its elements")
                if p.offset < 0 or p.offset + p.nbytes > self.files[p.file].size:
                    raise MetadataError(f"{where}: key {key!r} piece lies outside file {p.file}")
                if self.checksum != algorithms.NONE:
                    want = -(-p.nbytes // self.chunk_bytes)
                    if len(p.checksums) != want:
                        raise MetadataError(
                            f"{where}: key {key!r} piece has {len(p.checksums)} checksums, expected {want}"
                        )
        problems = file_overlap_problems(self)
        if problems:
            raise MetadataError(f"{where}: {problems[0]}")
        overlap = set(self.tensors) & set(self.values)
        if overlap:
            raise MetadataError(f"{where}: keys stored both as tensor and value: {sorted(overlap)[:5]}")


def file_overlap_problems(md) -> list[str]:
    """Pieces that share bytes inside one data file, or share a safetensors name in it (each piece must own its
    bytes: otherwise a small file could stand for any number of declared tensors)."""
    by_file: dict[str, list] = {}
    for key, tm in md.tensors.items():
        for p in tm.pieces:
            if p.nbytes:
                by_file.setdefault(p.file, []).append((p.offset, p.offset + p.nbytes, key, p.name))
    problems = []
    for name, spans in by_file.items():
        spans.sort()
        for (_a0, a1, k0, _n0), (b0, _b1, k1, _n1) in zip(spans, spans[1:]):
            if b0 < a1:
                problems.append(f"data file {name}: overlapping pieces of {k0!r} and {k1!r} (they share bytes)")
                break
        seen: set[str] = set()
        for _a, _b, _key, pname in spans:
            if pname in seen:
                problems.append(f"data file {name}: two pieces are named {pname!r}")
                break
            seen.add(pname)
    return problems


def is_json_value(v: Any) -> bool:
    """Values allowed in ``values``: None, bool, int, float, str, and lists/tuples/dicts (str keys) of those,
    finite, nested at most strict_json.MAX_DEPTH deep (what a reader accepts back)."""
    return json_value_problem(v) is None
