"""The registry of on-disk format versions: one entry per version of ``metadata.json``, what it holds and its
reader, and the version saves write; ``loads_metadata`` reads any version this build reads through it.

Why one registry: the version numbers were spread over metadata.py (format 1), index.py (the version written and
the ones read) and this module's dispatch, under names that did not say which format they were. Formats 2 and 3
share their reader (index_view.py); format 1 is parsed field by field (schema.py). Every module here imports
metadata.py, so the registry sits above all of them: the writer takes ``WRITE_VERSION`` from here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..errors import MetadataError
from ..gc_pause import gc_paused
from . import derived, quant
from .index_view import open_indexed
from .metadata import FORMAT_NAME, CheckpointMetadata
from .schema import parse_metadata
from .strict_json import loads_strict

SINGLE_FILE_VERSION = 1  # format 1: metadata.json holds every piece and its chunk checksums
INDEXED_VERSION = 2  # format 2: index objects and checksum sidecars; per-rank values as lists in "values"
RANK_VALUES_VERSION = 3  # format 3: format 2 with per-rank values in objects of their own
EXTENDED_VERSION = 4  # format 4: format 3 plus optional top-level metadata.json fields (EXTENDED_FIELDS)
WRITE_VERSION = RANK_VALUES_VERSION  # what saves, the tools and the converter write when no format-4 field is used
# format 4's optional fields: a save writes version 4 only when it uses one, so plain checkpoints stay format 3
# and older builds keep reading them. "derived": weights stored as their master cast (derived.py); "codecs":
# {data file: codec name} of the stored (compressed) data files (codecs.py); "quant": lossy moments (quant.py)
EXTENDED_FIELDS = (derived.FIELD, "codecs", quant.QUANT_FIELD)


@dataclass(frozen=True)
class FormatVersion:
    """One on-disk version: its number, what its ``metadata.json`` and objects hold, and its reader
    ``read(parsed metadata.json, where, fetch)``."""

    version: int
    holds: str
    read: Callable[..., CheckpointMetadata]


def _read_single_file(d: dict, where: str, fetch=None) -> CheckpointMetadata:
    md = parse_metadata(d, where, FORMAT_NAME, SINGLE_FILE_VERSION)
    md.validate(where)
    return md


def write_version(header: dict) -> int:
    """The version a save of index ``header`` declares: 4 when it uses a format-4 field, else 3."""
    return EXTENDED_VERSION if any(header.get(f) for f in EXTENDED_FIELDS) else WRITE_VERSION


def _read_extended(d: dict, where: str, fetch=None) -> CheckpointMetadata:
    """Format 4: format 3's reader, then its optional fields, each checked (MetadataError naming it)."""
    md = open_indexed(d, where, fetch)
    if quant.QUANT_FIELD in d:  # lossy moments: the quantized keys, checked against the tensors they are stored as
        md.quant = quant.parse_field(d[quant.QUANT_FIELD], where)
        quant.check_against(md.quant, md.tensors, where)
    md.derived = derived.parse_field(d.get(derived.FIELD), md.tensors, md.values, where)
    return md


FORMATS: dict[int, FormatVersion] = {
    SINGLE_FILE_VERSION: FormatVersion(
        SINGLE_FILE_VERSION, "metadata.json alone: every piece and its checksums (schema.py)", _read_single_file
    ),
    INDEXED_VERSION: FormatVersion(
        INDEXED_VERSION,
        "metadata.json + index.keys/index.pieces (+ row directory) + <data file>.sums (index.py)",
        open_indexed,
    ),
    RANK_VALUES_VERSION: FormatVersion(
        RANK_VALUES_VERSION, "format 2 + index.ranks and <rank>.values (rank_values.py)", open_indexed
    ),
    EXTENDED_VERSION: FormatVersion(
        EXTENDED_VERSION,
        "format 3 + optional fields: derived (derived weights: format/derived.py), codecs (stored files and their"
        " <file>.chunks tables: codecs.py), quant (quantized moments: quant.py)",
        _read_extended,
    ),
}


# metadata.json fields schema.py types and bounds value by value (strict_json.loads_strict skips its generic walk)
_SCHEMA_TYPED = frozenset({"files", "tensors"})


@gc_paused()
def loads_metadata(data: bytes, where: str = "metadata.json", fetch=None) -> CheckpointMetadata:
    """Parse and check ``metadata.json``: strict bounded JSON (strict_json.py), then the reader of its version
    (``FORMATS``): format 1 every field typed (schema.py) and the structure checked (``CheckpointMetadata.validate``),
    formats 2 and 3 their index objects read through ``fetch(name, offset, length)``; MetadataError naming the
    field otherwise. Anything that is not a later version is read as format 1, whose checks name what is wrong."""
    d = loads_strict(data, where, _SCHEMA_TYPED)
    version = d.get("version") if type(d) is dict and d.get("format") == FORMAT_NAME else None
    if type(version) is int and version > SINGLE_FILE_VERSION:
        if version not in FORMATS:
            raise MetadataError(
                f"{where}: unsupported format version {version} (this build reads "
                f"{', '.join(map(str, sorted(FORMATS)))}): written by a newer build?"
            )
        return FORMATS[version].read(d, where, fetch)
    return FORMATS[SINGLE_FILE_VERSION].read(d, where, fetch)
