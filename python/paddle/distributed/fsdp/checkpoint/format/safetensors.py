"""safetensors headers: the one builder (rank files, tools' outputs) and the one parser (verify, from-hf).

A safetensors file is an 8-byte little-endian header length, a JSON header ``{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {str: str}}`` padded with spaces to a multiple of 8, then the data
section (offsets are relative to it). The parser only reads the header, executes nothing, and refuses anything
malformed with :class:`SafetensorsHeaderError` naming the file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import MetadataError, NotARegularFileError, SafetensorsHeaderError
from .metadata import DTYPES, itemsize, numel
from .strict_json import loads_strict, open_regular

MAX_HEADER_BYTES = 100 << 20  # a longer header is refused as implausible (bounded memory for crafted files)

#: safetensors dtype code -> engine dtype name
DTYPE_OF_CODE = {code: name for name, (_, code) in DTYPES.items()}


def build_header(entries: list[tuple[str, str, tuple, int, int]], metadata: dict[str, str]) -> bytes:
    """Header bytes for ``entries`` ``(name, engine dtype, shape, begin, end)`` (offsets relative to the data
    section): 8-byte length + JSON padded with spaces to a multiple of 8 (as the safetensors library writes)."""
    h: dict[str, object] = {"__metadata__": dict(metadata)}
    for name, dtype, shape, begin, end in entries:
        h[name] = {"dtype": DTYPES[dtype][1], "shape": list(shape), "data_offsets": [begin, end]}
    raw = json.dumps(h, separators=(",", ":")).encode()
    raw += b" " * ((-len(raw)) % 8)
    return len(raw).to_bytes(8, "little") + raw


@dataclass
class SafetensorsEntry:
    """One tensor of a safetensors file."""

    name: str
    dtype: str  # engine dtype name
    shape: tuple[int, ...]
    begin: int  # relative to the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass
class SafetensorsFile:
    path: str
    data_start: int  # absolute file offset of the data section
    entries: list[SafetensorsEntry]  # in data order
    metadata: dict


def read_header(path: str) -> SafetensorsFile:
    """Parse and validate the header of the local safetensors file ``path`` (no tensor data is read); see
    ``parse_header``."""
    try:
        fd = open_regular(path)  # a FIFO or device in its place is refused, never blocks
    except NotARegularFileError as e:
        raise SafetensorsHeaderError(str(e)) from None
    except OSError as e:
        raise SafetensorsHeaderError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        return parse_header(os.fstat(fd).st_size, lambda offset, n: os.pread(fd, n, offset), path)
    except OSError as e:
        raise SafetensorsHeaderError(f"cannot read {path}: {e.strerror or e}") from None
    finally:
        os.close(fd)


def parse_header(size: int, read_at: Callable[[int, int], bytes], path: str) -> SafetensorsFile:
    """Parse and validate the header of a safetensors object of ``size`` bytes, whose bytes ``read_at(offset, n)``
    returns (from any storage), named ``path`` in errors.

    Refused (SafetensorsHeaderError): a file too short for its header, an implausible header length, a header
    that is not a JSON object, malformed entries, dtypes this engine cannot hold, entries whose byte size does
    not match shape and dtype, entries outside the file, overlapping entries.
    """
    head = read_at(0, 8) if size >= 8 else b""
    if len(head) < 8:
        raise SafetensorsHeaderError(f"{path} is not a safetensors file (only {size} bytes)")
    n = int.from_bytes(head, "little")
    if n > MAX_HEADER_BYTES or 8 + n > size:
        raise SafetensorsHeaderError(f"{path} is not a safetensors file (header length {n} for a {size}-byte file)")
    raw = read_at(8, n)
    try:
        header = loads_strict(raw, f"{path} header")  # bounded depth, no NaN/Infinity
    except MetadataError as e:
        raise SafetensorsHeaderError(f"{path} is not a safetensors file (header is not strict JSON: {e})") from None
    if not isinstance(header, dict):
        raise SafetensorsHeaderError(f"{path} is not a safetensors file (header is not a JSON object)")
    data_start = 8 + n
    data_len = size - data_start
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or any(type(v) is not str for v in meta.values()):
        raise SafetensorsHeaderError(f"{path}: __metadata__ must map strings to strings")
    entries = []
    for name, info in header.items():
        try:
            code = info["dtype"]
            shape, offsets = info["shape"], info["data_offsets"]
            if type(code) is not str or type(shape) is not list or type(offsets) is not list or len(offsets) != 2:
                raise TypeError("dtype must be a string, shape a list and data_offsets [begin, end]")
            if len(shape) > 64 or any(type(x) is not int for x in (*shape, *offsets)):
                raise TypeError("shape and data_offsets must hold integers (at most 64 dimensions)")
            shape = tuple(shape)
            begin, end = offsets
        except (KeyError, TypeError, ValueError) as e:
            raise SafetensorsHeaderError(f"{path}: malformed header entry for {name!r}: {e}") from None
        dtype = DTYPE_OF_CODE.get(code)
        if dtype is None:
            raise SafetensorsHeaderError(
                f"{path}: tensor {name!r} has dtype {code!r}, which paddle checkpoints cannot hold "
                f"(supported: {', '.join(sorted(DTYPE_OF_CODE))})"
            )
        if any(s < 0 for s in shape) or not 0 <= begin <= end <= data_len:
            raise SafetensorsHeaderError(
                f"{path}: tensor {name!r} has a bad shape or lies outside the file (truncated?)"
            )
        if end - begin != numel(shape) * itemsize(dtype):
            raise SafetensorsHeaderError(
                f"{path}: tensor {name!r}: {end - begin} bytes for shape {list(shape)} of {dtype}"
            )
        entries.append(SafetensorsEntry(name, dtype, shape, begin, end))
    entries.sort(key=lambda e: (e.begin, e.end))
    for a, b in zip(entries, entries[1:]):
        if b.begin < a.end:
            raise SafetensorsHeaderError(f"{path}: tensors {a.name!r} and {b.name!r} overlap")
    return SafetensorsFile(path, data_start, entries, meta if isinstance(meta, dict) else {})
