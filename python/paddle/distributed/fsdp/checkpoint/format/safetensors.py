"""safetensors headers: the one builder (rank files, tools' outputs) and the one parser (verify, from-hf).

A safetensors file is an 8-byte little-endian header length, a JSON header ``{name: {"dtype", "shape",
"data_offsets": [begin, end]}, "__metadata__": {str: str}}`` padded with spaces to a multiple of 8, then the data
section (offsets are relative to it). The parser only reads the header, executes nothing, and refuses anything
malformed with :class:`SafetensorsHeaderError` naming the file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from ..errors import SafetensorsHeaderError
from .metadata import DTYPES, itemsize, numel

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
    """Parse and validate the header of the safetensors file ``path`` (no tensor data is read).

    Refused (SafetensorsHeaderError): a file too short for its header, an implausible header length, a header
    that is not a JSON object, malformed entries, dtypes this engine cannot hold, entries whose byte size does
    not match shape and dtype, entries outside the file, overlapping entries.
    """
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise SafetensorsHeaderError(f"{path} is not a safetensors file (only {size} bytes)")
            n = int.from_bytes(head, "little")
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise SafetensorsHeaderError(
                    f"{path} is not a safetensors file (header length {n} for a {size}-byte file)"
                )
            raw = f.read(n)
    except OSError as e:
        raise SafetensorsHeaderError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise SafetensorsHeaderError(f"{path} is not a safetensors file (header is not JSON: {e})") from None
    if not isinstance(header, dict):
        raise SafetensorsHeaderError(f"{path} is not a safetensors file (header is not a JSON object)")
    data_start = 8 + n
    data_len = size - data_start
    meta = header.pop("__metadata__", None) or {}
    entries = []
    for name, info in header.items():
        try:
            code = info["dtype"]
            shape = tuple(int(s) for s in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
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
