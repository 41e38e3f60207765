"""Strict typing of ``metadata.json`` and ``COMMIT``: every field checked, every refusal naming the field.

Why: the index of a checkpoint is input from disk. ``int("12")``, ``int(3.7)``, ``str([...])`` or ``float(True)``
would silently accept a damaged or crafted file and fail later (or load wrong bytes). Here an integer field must
be a JSON integer (not a bool, a float or a string), a string field a JSON string, a list a list, within limits
that keep every later computation bounded (dimensions, element counts, list lengths); anything else raises
:class:`MetadataError` naming ``where`` and the field, e.g. ``tensors['w'].pieces[0].offset``.

The structural checks that relate fields to each other (pieces inside their tensor's shape and their file, byte
sizes matching element counts, checksum counts, pieces of one file not overlapping, exact coverage of every
tensor by its pieces: coverage.py) run on the typed result, before any data file is opened.
"""

from __future__ import annotations

import math
import re
from typing import Any

from ..errors import MetadataError, NotACheckpointError
from .metadata import CheckpointMetadata, FileMeta, PieceMeta, TensorMeta

MAX_NDIM = 64
MAX_DIM = 1 << 62
MAX_CHUNK_BYTES = 1 << 40
_HEX = re.compile(r"^[0-9a-f]{1,128}$")


class _Fields:
    """Typed accessors that name the field and ``where`` in every refusal."""

    def __init__(self, where: str):
        self.where = where

    def fail(self, field: str, what: str, value: Any) -> MetadataError:
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        return MetadataError(f"{self.where}: field {field} must be {what}, got {shown} ({type(value).__name__})")

    def obj(self, d: Any, field: str) -> dict:
        if type(d) is not dict:
            raise self.fail(field, "an object", d)
        return d

    def get(self, d: dict, name: str, field: str) -> Any:
        if name not in d:
            raise MetadataError(f"{self.where}: field {field} is missing")
        return d[name]

    def int(self, v: Any, field: str, lo: int = 0, hi: int = MAX_DIM) -> int:
        if type(v) is not int or not lo <= v <= hi:
            raise self.fail(field, f"an integer in [{lo}, {hi}]", v)
        return v

    def str(self, v: Any, field: str, max_len: int = 4096) -> str:
        if type(v) is not str or len(v) > max_len:
            raise self.fail(field, f"a string of at most {max_len} characters", v)
        return v

    def number(self, v: Any, field: str) -> float:
        if type(v) not in (int, float) or not math.isfinite(v):
            raise self.fail(field, "a finite number", v)
        return float(v)

    def list(self, v: Any, field: str) -> list:
        if type(v) is not list:
            raise self.fail(field, "a list", v)
        return v

    def ints(self, v: Any, field: str, lo: int = 0, hi: int = MAX_DIM, max_len: int = MAX_NDIM) -> tuple[int, ...]:
        v = self.list(v, field)
        if len(v) > max_len:
            raise self.fail(field, f"a list of at most {max_len} integers", v)
        if set(map(type, v)) <= {int} and (not v or (lo <= min(v) and max(v) <= hi)):  # the common case, in C
            return tuple(v)
        return tuple(self.int(x, f"{field}[{i}]", lo, hi) for i, x in enumerate(v))


def parse_commit(d: Any, where: str) -> tuple[str, str]:
    """``(checkpoint_id, metadata_sha256)`` of a parsed COMMIT record."""
    f = _Fields(where)
    d = f.obj(d, "(top level)")
    cid = f.str(f.get(d, "checkpoint_id", "checkpoint_id"), "checkpoint_id", 128)
    if "format" in d:  # written by every save; not needed to read one, but never of another type
        f.str(d["format"], "format", 128)
    sha = f.str(f.get(d, "metadata_sha256", "metadata_sha256"), "metadata_sha256", 64)
    if not re.fullmatch(r"[0-9a-f]{64}", sha):
        raise f.fail("metadata_sha256", "64 lowercase hex digits", sha)
    return cid, sha


def parse_lineage(d: Any, where: str) -> tuple[str, str | None, float] | None:
    """``(run, parent, time)`` of a parsed COMMIT record's ``lineage`` (None: the record has none, e.g. written
    before lineages were recorded, or by a one-process tool)."""
    f = _Fields(where)
    d = f.obj(d, "(top level)")
    if "lineage" not in d:
        return None
    lin = f.obj(d["lineage"], "lineage")
    run = f.str(f.get(lin, "run", "lineage.run"), "lineage.run", 128)
    parent = lin.get("parent")
    if parent is not None:
        parent = f.str(parent, "lineage.parent", 128)
    return run, parent, f.number(f.get(lin, "time", "lineage.time"), "lineage.time")


def parse_metadata(d: Any, where: str, format_name: str, version: int):
    """The typed CheckpointMetadata of parsed ``metadata.json`` (structure checked by its ``validate``)."""
    f = _Fields(where)
    if type(d) is not dict or d.get("format") != format_name:
        raise NotACheckpointError(f"{where} is not a {format_name} metadata file")
    if d.get("version") != version or type(d.get("version")) is not int:
        raise MetadataError(
            f"{where}: unsupported format version {d.get('version')!r} (this build reads {version}, 2 and 3)"
        )
    files = {}
    for name, fm in f.obj(f.get(d, "files", "files"), "files").items():
        fd = f.obj(fm, f"files[{name!r}]")
        files[name] = FileMeta(
            rank=f.int(f.get(fd, "rank", f"files[{name!r}].rank"), f"files[{name!r}].rank", 0, 1 << 31),
            size=f.int(f.get(fd, "size", f"files[{name!r}].size"), f"files[{name!r}].size"),
        )
    tensors = {}
    for key, td in f.obj(f.get(d, "tensors", "tensors"), "tensors").items():
        at = f"tensors[{key!r}]"
        td = f.obj(td, at)
        shape = f.ints(f.get(td, "shape", f"{at}.shape"), f"{at}.shape")
        pieces = []
        for i, pd in enumerate(f.list(f.get(td, "pieces", f"{at}.pieces"), f"{at}.pieces")):
            piece = _well_formed_piece(pd, PieceMeta)
            if piece is not None:
                pieces.append(piece)
                continue
            ap = f"{at}.pieces[{i}]"  # something is off: the field by field checks below name it
            pd = f.obj(pd, ap)
            fr = pd.get("flat_range")
            if fr is not None:
                fr = f.ints(fr, f"{ap}.flat_range", max_len=2)
                if len(fr) != 2:
                    raise f.fail(f"{ap}.flat_range", "null or [start, stop]", fr)
            sums_name = "checksums" if "checksums" in pd else "crc32"
            sums = f.list(pd.get(sums_name, []), f"{ap}.{sums_name}")
            if set(map(type, sums)) - {int} or (sums and (min(sums) < 0 or max(sums) >= 1 << 64)):
                bad = next(c for c in sums if type(c) is not int or not 0 <= c < 1 << 64)
                raise f.fail(f"{ap}.{sums_name}", "a list of unsigned 64-bit integers", bad)
            pieces.append(
                PieceMeta(
                    file=f.str(f.get(pd, "file", f"{ap}.file"), f"{ap}.file", 255),
                    name=f.str(f.get(pd, "name", f"{ap}.name"), f"{ap}.name", 1 << 16),
                    offset=f.int(f.get(pd, "offset", f"{ap}.offset"), f"{ap}.offset"),
                    nbytes=f.int(f.get(pd, "nbytes", f"{ap}.nbytes"), f"{ap}.nbytes"),
                    box_offset=f.ints(f.get(pd, "box_offset", f"{ap}.box_offset"), f"{ap}.box_offset"),
                    box_shape=f.ints(f.get(pd, "box_shape", f"{ap}.box_shape"), f"{ap}.box_shape"),
                    flat_range=fr,
                    checksums=sums,
                )
            )
        tensors[key] = TensorMeta(
            dtype=f.str(f.get(td, "dtype", f"{at}.dtype"), f"{at}.dtype", 64), shape=shape, pieces=pieces
        )
    values = d.get("values", {})
    f.obj(values, "values")
    created = d.get("created_unix", 0.0)
    return CheckpointMetadata(
        checkpoint_id=f.str(f.get(d, "checkpoint_id", "checkpoint_id"), "checkpoint_id", 128),
        world_size=f.int(f.get(d, "world_size", "world_size"), "world_size", 1, 1 << 31),
        chunk_bytes=f.int(f.get(d, "chunk_bytes", "chunk_bytes"), "chunk_bytes", 1, MAX_CHUNK_BYTES),
        checksum=f.str(f.get(d, "checksum", "checksum"), "checksum", 64),
        created_unix=f.number(created, "created_unix"),
        files=files,
        tensors=tensors,
        values=values,
    )


def _bounded_ints(v: Any, max_len: int = MAX_NDIM) -> bool:
    """``v`` is a list of at most ``max_len`` JSON integers in ``[0, MAX_DIM]`` (what ``_Fields.ints`` accepts).
    A plain loop: these lists are short (a shape), where it is several times faster than ``min``/``max``."""
    if type(v) is not list or len(v) > max_len:
        return False
    for x in v:
        if type(x) is not int or x < 0 or x > MAX_DIM:
            return False
    return True


def _unsigned_64(v: list) -> bool:
    """Every item of the list ``v`` is a JSON integer in ``[0, 2**64)`` (chunk checksums)."""
    if len(v) > 16:  # long lists: the checks in C
        return set(map(type, v)) <= {int} and min(v) >= 0 and max(v) < 1 << 64
    for x in v:
        if type(x) is not int or x < 0 or x >= 1 << 64:
            return False
    return True


def _well_formed_piece(pd: Any, piece_meta: type):
    """The PieceMeta of a piece entry when every field is present and of its type and bounds (exactly what the
    field by field checks of parse_metadata accept), else None: the caller then checks field by field, and names
    what is wrong. Why: building every field's name for a possible error was most of the parse time of a
    metadata.json of many small tensors (16000 pieces: ~15 us each)."""
    if type(pd) is not dict:
        return None
    file, name, offset, nbytes = pd.get("file"), pd.get("name"), pd.get("offset"), pd.get("nbytes")
    box_offset, box_shape, fr = pd.get("box_offset"), pd.get("box_shape"), pd.get("flat_range")
    sums = pd["checksums"] if "checksums" in pd else pd.get("crc32", [])
    if not (
        type(file) is str
        and len(file) <= 255
        and type(name) is str
        and len(name) <= 1 << 16
        and type(offset) is int
        and 0 <= offset <= MAX_DIM
        and type(nbytes) is int
        and 0 <= nbytes <= MAX_DIM
        and _bounded_ints(box_offset)
        and _bounded_ints(box_shape)
        and (fr is None or (_bounded_ints(fr, 2) and len(fr) == 2))
        and type(sums) is list
        and _unsigned_64(sums)
    ):
        return None
    return piece_meta(
        file=file,
        name=name,
        offset=offset,
        nbytes=nbytes,
        box_offset=tuple(box_offset),
        box_shape=tuple(box_shape),
        flat_range=None if fr is None else tuple(fr),
        checksums=sums,
    )
