"""A uniform index of the pieces of checkpoints this engine did not write in its own format.

Three kinds of directory are indexed into :class:`PieceIndex` (key -> global dtype/shape and the saved pieces):

* ``stock``: stock paddle's ``save_state_dict`` output: ``<id>.metadata`` (pickle, read with the restricted
  unpickler) plus ``<rank>_<id>.distcp`` (pickles) or ``<rank>_<id>.safetensors``; ``unique_id`` picks the version.
* ``hf``: a plain directory of ``*.safetensors`` files (every tensor whole), as stock loads with ``safetensors=True``.
* ``fork``: this engine's own checkpoint (``metadata.json``), for the paths the engine itself does not serve
  (``aoa_config``).

The loader (``loader.py``) reads boxes of any key from any mix of pieces; nothing here reads tensor data.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from ..errors import MetadataError, NotACheckpointError
from ..format.metadata import DTYPES, check_file_name, numel
from ..format.safetensors import read_header
from .errors import StockVersionNotFoundError
from .unpickler import load_stock_metadata

STOCK_METADATA_RE = re.compile(r"^(\d+)\.metadata$")
STOCK_DATA_RE = re.compile(r"^(\d+)_(\d+)\.(distcp|safetensors)$")


@dataclass(frozen=True)
class Piece:
    """Elements of one key saved in one file: a box, or ``flat_range`` of the box's row-major flattening."""

    file: str
    name: str  # tensor name inside the file
    box_offset: tuple[int, ...]
    box_shape: tuple[int, ...]
    flat_range: tuple[int, int] | None = None
    byte_offset: int | None = None  # absolute offset of the data in a safetensors file; None for pickles

    @property
    def numel(self) -> int:
        if self.flat_range is not None:
            return self.flat_range[1] - self.flat_range[0]
        return numel(self.box_shape)


@dataclass
class TensorEntry:
    dtype: str
    shape: tuple[int, ...]
    pieces: list[Piece] = field(default_factory=list)


@dataclass
class PieceIndex:
    root: str
    kind: str  # "stock" | "hf" | "fork"
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    unique_id: int | None = None
    # our format 4's derived weights: key -> the stored dtype of its pieces (its master's), cast when read
    derived_from: dict[str, str] = field(default_factory=dict)
    # our format 4's quantized moments (lossy.py): keys stored only as codes and scales, which this reader cannot
    # dequantize (aoa.py names them instead of reporting them as never assigned)
    quantized: frozenset[str] = frozenset()

    def files(self) -> set[str]:
        return {p.file for t in self.tensors.values() for p in t.pieces}


def _ints(v, what: str, where: str) -> tuple[int, ...]:
    if not isinstance(v, (tuple, list)) or not all(isinstance(x, int) and x >= 0 for x in v):
        raise MetadataError(f"{where}: {what} must be a tuple of non-negative ints, got {v!r}")
    return tuple(int(x) for x in v)


def _dtype(v, where: str) -> str:
    if v not in DTYPES:
        raise MetadataError(f"{where}: unsupported dtype {v!r}")
    return v


# ------------------------------------------------------------------------------------------------ versions


def stock_versions(root: str) -> dict[int, dict[str, list[str]]]:
    """``unique_id`` -> {"metadata": [...], "distcp": [...], "safetensors": [...]} of a stock directory."""
    out: dict[int, dict[str, list[str]]] = {}
    try:
        names = os.listdir(root)
    except OSError:
        return out
    for name in sorted(names):
        m = STOCK_METADATA_RE.match(name)
        if m:
            out.setdefault(int(m.group(1)), {"metadata": [], "distcp": [], "safetensors": []})["metadata"].append(name)
            continue
        m = STOCK_DATA_RE.match(name)
        if m:
            out.setdefault(int(m.group(2)), {"metadata": [], "distcp": [], "safetensors": []})[m.group(3)].append(name)
    return out


def resolve_unique_id(root: str, unique_id: int | None) -> int:
    """The version stock would load: ``unique_id``, else the newest version that has a metadata file."""
    versions = stock_versions(root)
    with_md = sorted(v for v, d in versions.items() if d["metadata"])
    if unique_id is not None:
        if not isinstance(unique_id, int) or unique_id < 0:
            raise ValueError(f"unique_id must be an int >= 0, got {unique_id!r}")
        if unique_id not in with_md:
            raise StockVersionNotFoundError(
                f"{root}: no checkpoint version unique_id={unique_id} (no {unique_id}.metadata); versions present: "
                f"{with_md or 'none'}"
            )
        return unique_id
    if not with_md:
        raise NotACheckpointError(f"{root}: no stock paddle metadata file (<id>.metadata)")
    return with_md[-1]


# ------------------------------------------------------------------------------------------------ builders


def index_stock(root: str, unique_id: int | None) -> PieceIndex:
    """Index version ``unique_id`` (default: newest) of a stock paddle checkpoint, without executing pickles."""
    uid = resolve_unique_id(root, unique_id)
    md_path = os.path.join(root, f"{uid}.metadata")
    md = load_stock_metadata(md_path)
    sdm = md.state_dict_metadata or {}
    stm = md.storage_metadata or {}
    if not isinstance(sdm, dict) or not isinstance(stm, dict):
        raise MetadataError(f"{md_path}: malformed stock metadata")
    idx = PieceIndex(root=root, kind="stock", unique_id=uid)
    for key, metas in sdm.items():
        if not isinstance(key, str) or not isinstance(metas, list) or not metas:
            raise MetadataError(f"{md_path}: malformed entry for key {key!r}")
        dtypes = {_dtype(getattr(m, "dtype", None), f"{md_path} key {key!r}") for m in metas}
        if len(dtypes) != 1:
            raise MetadataError(f"{md_path}: key {key!r} saved with several dtypes {sorted(dtypes)}")
        shapes = {m.global_shape for m in metas if getattr(m, "global_shape", None) is not None}
        if len(shapes) > 1:
            raise MetadataError(f"{md_path}: key {key!r} saved with several global shapes {sorted(shapes)}")
        if shapes:
            shape = _ints(shapes.pop(), "global_shape", f"{md_path} key {key!r}")
        else:  # metadata of older stock versions: the extent of the pieces
            boxes = [(m.global_offset, m.local_shape) for m in metas]
            shape = tuple(max(o[d] + s[d] for o, s in boxes) for d in range(len(boxes[0][0])))
        idx.tensors[key] = TensorEntry(dtype=dtypes.pop(), shape=shape)
    for lti, file in stm.items():
        where = f"{md_path} storage entry {getattr(lti, 'tensor_key', '?')!r}"
        if getattr(lti, "replica_id", None) not in (None, 0):
            continue  # extra copies written with save_replicas=True; replica 0 is the primary
        key = lti.tensor_key
        entry = idx.tensors.get(key)
        if entry is None:
            raise MetadataError(f"{where}: key not in the metadata's tensor list")
        check_file_name(file)
        offset = _ints(lti.global_offset, "global_offset", where)
        box = lti.local_shape
        if box is None:  # older stock: the shape lives only in the tensor metadata
            match = [m for m in sdm[key] if tuple(m.global_offset) == offset]
            if not match:
                raise MetadataError(f"{where}: no local shape for offset {offset}")
            box = match[0].local_shape
        box = _ints(box, "local_shape", where)
        fr = None
        if lti.is_flattened or lti.flattened_range is not None:
            fr = _ints(lti.flattened_range, "flattened_range", where)
            if len(fr) != 2 or not fr[0] <= fr[1] <= numel(box):
                raise MetadataError(f"{where}: flattened_range {fr} outside its box of {numel(box)} elements")
        if len(offset) != len(entry.shape) or len(box) != len(entry.shape):
            raise MetadataError(f"{where}: box {offset}/{box} does not match the rank of {entry.shape}")
        if any(o + s > g for o, s, g in zip(offset, box, entry.shape)):
            raise MetadataError(f"{where}: box {offset}/{box} lies outside global shape {entry.shape}")
        entry.pieces.append(Piece(file=file, name=key, box_offset=offset, box_shape=box, flat_range=fr))
    for key, entry in idx.tensors.items():
        if not entry.pieces:
            raise MetadataError(f"{md_path}: key {key!r} has no stored piece")
    _attach_safetensors_offsets(idx)
    return idx


def _attach_safetensors_offsets(idx: PieceIndex) -> None:
    """Give every piece stored in a visible safetensors file its byte offset (checked against the header)."""
    headers: dict[str, dict] = {}
    for entry in idx.tensors.values():
        for i, p in enumerate(entry.pieces):
            if not p.file.endswith(".safetensors"):
                continue
            path = os.path.join(idx.root, p.file)
            if not os.path.isfile(path):
                continue  # on another node: read there (loader exchange)
            if p.file not in headers:
                st = read_header(path)
                headers[p.file] = {e.name: (e, st.data_start) for e in st.entries}
            found = headers[p.file].get(p.name)
            if found is None:
                raise MetadataError(f"{path}: has no tensor {p.name!r} that the metadata places there")
            h, start = found
            if h.dtype != entry.dtype:
                raise MetadataError(f"{path}: tensor {p.name!r} is {h.dtype}, the metadata says {entry.dtype}")
            if numel(h.shape) != p.numel:
                raise MetadataError(f"{path}: tensor {p.name!r} has {numel(h.shape)} elements, the metadata {p.numel}")
            entry.pieces[i] = Piece(p.file, p.name, p.box_offset, p.box_shape, p.flat_range, start + h.begin)


def index_hf(root: str) -> PieceIndex:
    """Index a directory of plain safetensors files (each tensor whole), as stock's ``safetensors=True`` does."""
    idx = PieceIndex(root=root, kind="hf")
    try:
        names = sorted(n for n in os.listdir(root) if n.endswith(".safetensors"))
    except OSError as e:
        raise NotACheckpointError(f"{root}: cannot list the directory ({e})") from None
    if not names:
        raise NotACheckpointError(f"{root}: no metadata and no *.safetensors files")
    for name in names:
        check_file_name(name)
        st = read_header(os.path.join(root, name))
        for e in st.entries:
            if e.name in idx.tensors:
                first = idx.tensors[e.name].pieces[0].file
                raise MetadataError(f"{root}: tensor {e.name!r} is in two files ({first}, {name})")
            zero = (0,) * len(e.shape)
            piece = Piece(name, e.name, zero, e.shape, None, st.data_start + e.begin)
            idx.tensors[e.name] = TensorEntry(e.dtype, e.shape, [piece])
    return idx


def index_fork(root: str) -> PieceIndex:
    """Index this engine's own checkpoint (metadata.json, COMMIT-checked by ``read_metadata``)."""
    from ..directory import read_metadata

    md = read_metadata(root)
    idx = PieceIndex(root=md_root(root), kind="fork")
    for key, d in md.derived.items():  # format 4: a derived weight reads its master's pieces (boxes.py casts)
        idx.derived_from[key] = md.tensors[d.source].dtype
    idx.quantized = frozenset(md.quant or {})
    for key in [*md.tensors, *md.derived]:
        tm = md.tensors[md.derived[key].source if key in md.derived else key]
        dtype = md.derived[key].dtype if key in md.derived else tm.dtype
        pieces = [
            Piece(
                p.file,
                p.name,
                tuple(p.box_offset),
                tuple(p.box_shape),
                tuple(p.flat_range) if p.flat_range is not None else None,
                p.offset,
            )
            for p in tm.pieces
        ]
        idx.tensors[key] = TensorEntry(dtype, tuple(tm.shape), pieces)
    return idx


def md_root(root: str) -> str:
    return os.path.abspath(os.fspath(root))
