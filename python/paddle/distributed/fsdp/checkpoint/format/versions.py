"""Reading ``metadata.json`` of any format version this build reads: strict JSON, then the reader of its version.

Why a module of its own: format 1 is parsed field by field (schema.py) into the dataclasses of metadata.py,
formats 2 and 3 open their index objects (index.py, index_view.py), and all of those import metadata.py; the
dispatch between them sits above every one.
"""

from __future__ import annotations

from ..errors import MetadataError
from ..gc_pause import gc_paused
from .index import READ_VERSIONS
from .index_view import open_indexed
from .metadata import FORMAT_NAME, FORMAT_VERSION, CheckpointMetadata
from .schema import parse_metadata
from .strict_json import loads_strict

# metadata.json fields schema.py types and bounds value by value (strict_json.loads_strict skips its generic walk)
_SCHEMA_TYPED = frozenset({"files", "tensors"})


@gc_paused()
def loads_metadata(data: bytes, where: str = "metadata.json", fetch=None) -> CheckpointMetadata:
    """Parse and check ``metadata.json``: strict bounded JSON (strict_json.py), every field typed (schema.py),
    then the structure (``CheckpointMetadata.validate``); MetadataError naming the field otherwise. A format-2 or
    -3 ``metadata.json`` (format/index.py) reads its index objects through ``fetch(name, offset, length)``."""
    d = loads_strict(data, where, _SCHEMA_TYPED)
    if type(d) is dict and d.get("format") == FORMAT_NAME and type(d.get("version")) is int and d["version"] > 1:
        if d["version"] not in READ_VERSIONS:
            raise MetadataError(
                f"{where}: unsupported format version {d['version']} (this build reads 1, "
                f"{', '.join(map(str, READ_VERSIONS))}): written by a newer build?"
            )
        return open_indexed(d, where, fetch)
    md = parse_metadata(d, where, FORMAT_NAME, FORMAT_VERSION)
    md.validate(where)
    return md
