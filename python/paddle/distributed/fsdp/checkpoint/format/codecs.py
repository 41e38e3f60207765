"""Chunk codecs: how one checksum chunk of a data file is stored, and the chunk table that finds it.

Why per chunk: a load reads whole checksum chunks already (chunks.py), so a windowed or resharding read of a
compressed file decodes only the chunks it needs, the same ones it would have read raw. Why byte planes: the
elements of a bf16/fp32 tensor have one compressible byte (sign + exponent) and mantissa bytes that look random;
zstd on the interleaved bytes finds little (1.08-1.30x), on the split planes 1.19-1.48x (issue 52).

A data file written with a codec other than ``raw`` is a *stored* file: the stored chunks back to back, and its
chunk table ``<file>.chunks`` (``TABLE_ROW`` rows, little-endian, in file order) maps the bytes the raw file would
have (its *decoded* bytes: header, then the pieces at the offsets the index records) to them. The index, sizes and
piece checks are those of the raw file; ``metadata.json`` names the codec of each stored file in ``"codecs"``
(format 4, versions.py). A row's checksum is over the stored bytes; its decoded size is declared, and decoding
never produces (nor allocates) more: a chunk that would is a ``CodecDataError``.

Stored chunk of ``byteplane-zstd`` (``width`` w bytes per element, the piece's itemsize): w little-endian u32,
the stored length of each plane (bit 31: the plane is stored raw, it did not shrink), then the planes; plane j
holds byte j of every element. A chunk whose planes do not shrink at all is stored raw (codec id 0).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..errors import CorruptCheckpointError, MetadataError
from . import plane_zstd

RAW = "raw"
BYTEPLANE_ZSTD = "byteplane-zstd"
SAMPLE_BYTES = 1024  # bytes of a plane compressed to decide whether the plane is worth compressing
SAMPLE_SPOTS = 2  # places of the chunk the sample is taken from
SAMPLE_KEEP = 0.9  # the plane is compressed when its sample shrinks to at most this fraction
TABLE_SUFFIX = ".chunks"
_RAW_PLANE = 1 << 31
WIDTHS = (1, 2, 4, 8)
MIN_STORED_PER_PLANE = 4  # a byte-plane chunk stores at least its planes' lengths (so every row stores bytes)

TABLE_ROW = np.dtype(
    [
        ("doff", "<u8"),  # offset in the decoded (raw) file
        ("soff", "<u8"),  # offset in the stored file
        ("sum", "<u8"),  # checksum of the stored bytes (0 when the checkpoint has none)
        ("dlen", "<u4"),  # decoded length (at most chunk_bytes)
        ("slen", "<u4"),  # stored length
        ("codec", "u1"),  # CODEC_IDS
        ("width", "u1"),  # bytes per element of the byte planes (1: no split)
        ("pad", "<u2"),
        ("pad2", "<u4"),
    ]
)


class UnknownCodecError(MetadataError):
    """A checkpoint names a codec this build does not know (written by a newer build?)."""


class CodecDataError(CorruptCheckpointError):
    """A stored chunk that does not decode to exactly its declared size (damaged or crafted)."""


def table_name(file: str) -> str:
    return file + TABLE_SUFFIX


_local = threading.local()


def _zstd():
    try:
        import zstandard
    except ImportError:  # pragma: no cover - a dependency of the package (setup.py)
        from ..errors import MissingDependencyError

        raise MissingDependencyError(
            "this checkpoint is compressed with zstd: pip install zstandard (a dependency of paddle-fsdp-fork)"
        ) from None
    return zstandard


def _decompressor():
    d = getattr(_local, "d", None)
    if d is None:
        d = _local.d = _zstd().ZstdDecompressor()
    return d


def _plane_into(words: np.ndarray, j: int, tmp: np.ndarray | None, dst: np.ndarray) -> np.ndarray:
    """Byte ``j`` of every little-endian word of ``words`` into ``dst`` (a shift, then a narrowing copy: 2-4x
    faster than a strided copy in numpy here); returns ``dst``."""
    if j == 0 or tmp is None:
        dst[:] = words  # (the low byte)
    else:
        np.right_shift(words, 8 * j, out=tmp[: len(words)])
        dst[:] = tmp[: len(words)]
    return dst


def plane_choices(words: np.ndarray, width: int, coder) -> list[bool]:
    """Per plane: whether it is worth compressing, from a sample of it (``SAMPLE_BYTES`` in ``SAMPLE_SPOTS``
    slices spread over the chunk, so a chunk is not judged by its start alone) that shrinks to at most
    ``SAMPLE_KEEP``. Mantissa planes of float data never shrink (issue 52: 1.00x); they are stored raw without
    running zstd over them."""
    n = len(words)
    if n <= SAMPLE_BYTES:
        picked = words
    else:
        per, step = SAMPLE_BYTES // SAMPLE_SPOTS, n // SAMPLE_SPOTS
        picked = np.concatenate([words[k * step : k * step + per] for k in range(SAMPLE_SPOTS)])
    tmp = np.empty_like(picked) if width > 1 else None
    sample = np.empty(len(picked), np.uint8)
    room = np.empty(int(len(picked) * SAMPLE_KEEP), np.uint8)
    return [coder.compress_into(_plane_into(picked, j, tmp, sample), room) > 0 for j in range(width)]


def encode_byteplanes(chunk: memoryview, width: int) -> memoryview | None:
    """The stored form of ``chunk`` (w planes, each zstd or raw), or None when nothing shrinks.

    Planes whose sample does not shrink (``plane_choices``) are split straight into their place in the stored
    chunk, raw (bit 31 of their length); the others are compressed by plane_zstd.py's entropy coder, and stored
    raw after all when they do not shrink. A chunk where no plane is worth it is not split at all."""
    n = len(chunk)
    if width not in WIDTHS or n % width:
        width = 1
    a = np.frombuffer(chunk, np.uint8)
    words = a.view(f"<u{width}") if width > 1 else a
    coder = plane_zstd.coder(_zstd())
    keep = plane_choices(words, width, coder)
    if not any(keep):
        return None
    plen = n // width
    out = np.empty(4 * width + n, np.uint8)  # no plane is stored larger than raw: this holds any stored form
    lens = out[: 4 * width].view("<u4")
    tmp = np.empty_like(words) if width > 1 else None
    plane = np.empty(plen, np.uint8) if width > 1 else a
    pos = 4 * width
    for j in range(width):
        dst = out[pos : pos + plen]
        if keep[j]:
            src = plane if width == 1 else _plane_into(words, j, tmp, plane)
            z = coder.compress_into(src, dst[: plen - 1])  # shorter than raw, or 0
            if z:
                lens[j] = z
                pos += z
                continue
            dst[:] = src
        else:
            _plane_into(words, j, tmp, dst)
        lens[j] = plen | _RAW_PLANE
        pos += plen
    if pos >= n:
        return None
    return memoryview(out)[:pos]


def decode_byteplanes(stored: memoryview, width: int, out: memoryview, where: Callable[[], str]) -> None:
    """Decode ``stored`` into ``out`` (exactly ``len(out)`` bytes, allocated by the caller: nothing larger)."""
    n = len(out)
    if width not in WIDTHS or n % width or len(stored) < 4 * width:
        raise CodecDataError(f"{where()}: chunk does not hold {width} byte planes of {n} bytes")
    plen = n // width
    lens = np.frombuffer(stored[: 4 * width], "<u4")
    dst = np.frombuffer(out, np.uint8)
    words = dst.view(f"<u{width}") if width > 1 else dst  # planes are or-ed into little-endian words
    tmp = np.empty_like(words) if width > 1 else None
    pos = 4 * width
    zstd = None
    for j in range(width):
        raw = bool(lens[j] & _RAW_PLANE)
        ln = int(lens[j] & ~np.uint32(_RAW_PLANE))
        data = stored[pos : pos + ln]
        if len(data) != ln:
            raise CodecDataError(f"{where()}: plane {j} runs past the stored chunk")
        pos += ln
        if raw:
            if ln != plen:
                raise CodecDataError(f"{where()}: raw plane {j} has {ln} bytes, expected {plen}")
            plane = np.frombuffer(data, np.uint8)
        else:
            zstd = zstd or _zstd()
            try:
                declared = zstd.frame_content_size(data)
            except zstd.ZstdError as e:
                raise CodecDataError(f"{where()}: plane {j} is not a zstd frame: {e}") from None
            if declared != plen:  # checked first: the decompressor allocates what the frame declares
                raise CodecDataError(f"{where()}: plane {j} declares {declared} bytes, expected {plen}")
            dobj = _decompressor().decompressobj(write_size=plen)
            try:
                got = dobj.decompress(data)
            except zstd.ZstdError as e:
                raise CodecDataError(f"{where()}: plane {j} does not decode: {e}") from None
            if len(got) != plen or not dobj.eof or dobj.unused_data:
                raise CodecDataError(f"{where()}: plane {j} decodes to {len(got)} bytes, expected {plen}")
            plane = np.frombuffer(got, np.uint8)
        if j == 0:
            words[:] = plane
        else:
            np.left_shift(plane, 8 * j, out=tmp, dtype=tmp.dtype)
            words |= tmp
    if pos != len(stored):
        raise CodecDataError(f"{where()}: {len(stored) - pos} bytes after the last plane")


@dataclass(frozen=True)
class Codec:
    """One registered codec: its id in the chunk table and its chunk encoder (None: the chunk is stored raw)."""

    name: str
    id: int
    encode: Callable[[memoryview, int], bytes | None] | None


CODECS: dict[str, Codec] = {
    RAW: Codec(RAW, 0, None),
    BYTEPLANE_ZSTD: Codec(BYTEPLANE_ZSTD, 1, encode_byteplanes),
}
_BY_ID = {c.id: c for c in CODECS.values()}


def codec_named(name) -> Codec:
    """The registered codec ``name``; UnknownCodecError otherwise."""
    c = CODECS.get(name) if isinstance(name, str) else None
    if c is None:
        raise UnknownCodecError(f"unknown chunk codec {name!r:.80} (this build knows {', '.join(CODECS)})")
    return c


def decode_chunk(codec_id: int, width: int, stored: memoryview, out: memoryview, where: Callable[[], str]) -> None:
    """Decode one stored chunk into ``out`` (its declared size)."""
    if codec_id == 0:
        if len(stored) != len(out):
            raise CodecDataError(f"{where()}: raw chunk has {len(stored)} bytes, declared {len(out)}")
        out[:] = stored
    elif codec_id == 1:
        decode_byteplanes(stored, width, out, where)
    else:
        raise UnknownCodecError(f"{where()}: unknown codec id {codec_id} in the chunk table")


def parse_codecs_field(v, files, where: str) -> dict[str, str]:
    """``metadata.json``'s ``"codecs"``: ``{data file: codec name}`` for the stored files (others are raw)."""
    if type(v) is not dict:
        raise MetadataError(f"{where}: field codecs must be an object of data file -> codec name")
    out = {}
    for name, codec in v.items():
        if name not in files:
            raise MetadataError(f"{where}: field codecs names {name!r:.80}, not a data file of the checkpoint")
        out[name] = codec_named(codec).name
    return out


class ChunkTable:
    """The checked chunk table of one stored file: decoded ranges -> stored ranges."""

    def __init__(self, blob: bytes, name: str, decoded_size: int, stored_size: int, chunk_bytes: int, codec: str):
        where = f"chunk table {table_name(name)}"
        if len(blob) % TABLE_ROW.itemsize:
            raise CorruptCheckpointError(f"{where}: {len(blob)} bytes is not a whole number of rows")
        rows = np.frombuffer(blob, TABLE_ROW)
        allowed = {0, codec_named(codec).id}
        ids = set(np.unique(rows["codec"]).tolist())
        if ids - allowed:
            raise UnknownCodecError(f"{where}: codec ids {sorted(ids - allowed)} are not those of {codec!r}")
        dlen, slen = rows["dlen"].astype(np.int64), rows["slen"].astype(np.int64)
        doff, soff = rows["doff"].astype(np.int64), rows["soff"].astype(np.int64)
        if len(rows) and int(doff[-1] + dlen[-1]) != decoded_size:
            raise CorruptCheckpointError(
                f"{where}: its chunks decode to {int(doff[-1] + dlen[-1])} bytes, the metadata says {decoded_size}"
            )
        ok = (
            len(rows) > 0
            and bool(np.all(dlen > 0))
            and bool(np.all(dlen <= max(chunk_bytes, 1)))
            and int(soff[0]) == 0
            and bool(np.all(soff[1:] == soff[:-1] + slen[:-1]))
            and int(soff[-1] + slen[-1]) == stored_size
            and bool(np.all(doff[1:] >= doff[:-1] + dlen[:-1]))
            and bool(np.all(np.isin(rows["width"], WIDTHS)))
            and bool(np.all(dlen % rows["width"] == 0))
            and bool(np.all((rows["codec"] != 0) | (slen == dlen)))
            and bool(np.all((rows["codec"] == 0) | (slen >= MIN_STORED_PER_PLANE * rows["width"])))
        )
        if not ok:
            raise CorruptCheckpointError(f"{where}: rows are not ordered, bounded chunks covering the stored file")
        self.name, self.rows, self.doff, self.dlen, self.soff, self.slen = name, rows, doff, dlen, soff, slen
        self.stored_size = stored_size

    def span(self, offset: int, n: int) -> tuple[int, int]:
        """Rows ``[i0, i1)`` that hold decoded bytes ``[offset, offset + n)``; an error when a byte is in none."""
        i0 = int(np.searchsorted(self.doff, offset, "right")) - 1
        i1 = int(np.searchsorted(self.doff, offset + n, "left"))
        if i0 < 0 or i1 <= i0:
            raise CorruptCheckpointError(f"{self.name}: decoded bytes {offset}.. are in no stored chunk")
        if np.any(self.doff[i0 + 1 : i1] != self.doff[i0 : i1 - 1] + self.dlen[i0 : i1 - 1]) or (
            self.doff[i1 - 1] + self.dlen[i1 - 1] < offset + n or self.doff[i0] + self.dlen[i0] <= offset
        ):
            raise CorruptCheckpointError(f"{self.name}: decoded bytes {offset}..{offset + n} are in no stored chunk")
        return i0, i1
