"""Lossy, opt-in storage of Adam-style moments: int8/int4 codes with one fp32 scale per block of elements, and
the ``"quant"`` field of ``metadata.json`` (format 4) that names them. Pure numpy: the save transform
(checkpoint/lossy.py) and every reader call these.

Why blocks of the GLOBAL flat index: a piece of a tensor saved by one rank is read back by any rank at any world
size; with block ``b`` = elements ``[b*B, (b+1)*B)`` of the tensor's row-major flattening, a reader of elements
``[a, b)`` needs only the codes of ``[a, b)`` and the scales of the blocks they touch, whoever saved them.

Schemes (``B`` = block, ``m`` = the block's max of ``|x|`` resp. ``sqrt(v)``, stored as the block's scale):

* ``int8-absmax`` (moment1, signed): ``code = round(x / m * 127)`` in ``[-127, 127]``; error <= ``m / 254``.
* ``uint8-sqrt`` (moment2, >= 0): ``code = round(sqrt(v) / m * 255)``, at least 1 for ``v > 0``;
  ``v' = (code * m / 255) ** 2``; the error of ``sqrt(v')`` is <= ``m / 510`` (<= ``m / 255`` where ``v > 0``
  rounds up to the smallest code: a ``v'`` of 0 would turn Adam's step into ``m / eps``, measured as a relative
  update error of 424 with 4-bit codes on TinyLM's moments). Quantizing ``v`` itself loses the small ``v`` of a block whose maximum is
  large, and Adam divides by ``sqrt(v)``: issue 52 measured a loss spike of 0.197 at the first step after
  resume that way; through the square root, 1.7e-4 at most.
* ``int4-absmax`` / ``uint4-sqrt``: the same with 7 resp. 15 levels, two codes a byte (element ``2j`` in the low
  nibble of byte ``j``, ``2j + 1`` in the high one; int4 codes stored as ``code + 8``).

A block holding NaN or infinity cannot be scaled: ``NonFiniteError``, and the saver stores that tensor exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import MetadataError

DEFAULT_BLOCK = 128
MAX_BLOCK = 1 << 16
MODES = ("int8", "int4")  # save_checkpoint(quantize_moments=...)
QUANT_FIELD = "quant"  # the metadata.json field (format 4)
CODES_SUFFIX = "@qcodes"  # stored keys of a quantized key K: K@qcodes (codes), K@qscales (per-block scales)
SCALES_SUFFIX = "@qscales"


@dataclass(frozen=True)
class Scheme:
    name: str
    signed: bool  # int codes of x (moment1) or uint codes of sqrt(v) (moment2)
    levels: int  # largest code magnitude
    bits: int

    @property
    def codes_dtype(self) -> str:
        return "int8" if self.bits == 8 and self.signed else "uint8"

    def codes_len(self, n: int) -> int:
        """Stored code elements (bytes) of a tensor of ``n`` elements."""
        return n if self.bits == 8 else (n + 1) // 2


SCHEMES: dict[str, Scheme] = {
    "int8-absmax": Scheme("int8-absmax", True, 127, 8),
    "uint8-sqrt": Scheme("uint8-sqrt", False, 255, 8),
    "int4-absmax": Scheme("int4-absmax", True, 7, 4),
    "uint4-sqrt": Scheme("uint4-sqrt", False, 15, 4),
}
# moment name -> scheme per mode: moment1 is signed, moment2 is non-negative (Adam's second moment)
MOMENT_SCHEMES: dict[str, dict[str, str]] = {
    "moment1": {"int8": "int8-absmax", "int4": "int4-absmax"},
    "moment2": {"int8": "uint8-sqrt", "int4": "uint4-sqrt"},
}


class NonFiniteError(ValueError):
    """A moment holds NaN/infinity (or, for moment2, a negative value): no scale represents it."""


def nblocks(n: int, block: int) -> int:
    return -(-n // block)


def _magnitude(x: np.ndarray, scheme: Scheme) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    if not np.isfinite(x).all():
        raise NonFiniteError("a moment holds NaN or infinity")
    if scheme.signed:
        return np.abs(x)
    if (x < 0).any():
        raise NonFiniteError("a second moment holds a negative value")
    return np.sqrt(x)


def _blocked(v: np.ndarray, lo: int, block: int) -> tuple[np.ndarray, int]:
    """``v`` (elements ``[lo, lo + n)``) zero-padded into whole global blocks: ``(rows x block, offset of v)``."""
    front = lo - (lo // block) * block
    buf = np.zeros(nblocks(front + v.size, block) * block, np.float32)
    buf[front : front + v.size] = v
    return buf.reshape(-1, block), front


def block_maxima(x: np.ndarray, lo: int, block: int, scheme: Scheme) -> np.ndarray:
    """Max of ``|x|`` (``sqrt(x)``) of elements ``[lo, lo + len(x))`` per global block they touch (blocks
    ``lo // block`` ...); a block only partly inside holds the maximum of its part here."""
    mag = _magnitude(x, scheme)
    if mag.size == 0:
        return np.zeros(0, np.float32)
    return _blocked(mag, lo, block)[0].max(axis=1)


def element_codes(
    x: np.ndarray, lo: int, scales: np.ndarray, first_block: int, block: int, scheme: Scheme
) -> np.ndarray:
    """Integer codes (int16) of elements ``[lo, lo + len(x))`` given the scales of blocks ``first_block`` ... .
    Block by block (rows x block, one scale a row): ~3x faster than a scale gathered per element."""
    x = np.asarray(x, np.float32)
    mag = _magnitude(x, scheme)
    if mag.size == 0:
        return np.zeros(0, np.int16)
    rows, front = _blocked(mag, lo, block)
    m = scales[lo // block - first_block :][: rows.shape[0]].astype(np.float32)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        inv = np.where(m > 0, np.float32(scheme.levels) / m, np.float32(0))
    q = np.minimum(np.rint(rows * inv), scheme.levels).reshape(-1)[front : front + mag.size].astype(np.int16)
    if scheme.signed:
        return np.where(x < 0, -q, q).astype(np.int16)
    # a second moment > 0 never becomes 0: Adam divides by sqrt(v) + eps, and m / eps explodes (the smallest code
    # keeps |m| / sqrt(v') <~ 1, since |m| <~ sqrt(v) < one step there)
    return np.where(mag > 0, np.maximum(q, 1), q).astype(np.int16)


def pack(codes: np.ndarray, lo: int, scheme: Scheme, next_code: int = 0) -> np.ndarray:
    """Stored bytes of element codes ``[lo, lo + n)``: int8/uint8 as they are; 4-bit codes two a byte, bytes
    ``[ceil(lo / 2), ceil(hi / 2))`` (the byte holding an odd ``lo`` belongs to the piece before; a last byte
    holding element ``hi`` takes ``next_code``, the next piece's first code, 0 past the tensor's end)."""
    if scheme.bits == 8:
        return codes.astype(scheme.codes_dtype)
    off = 8 if scheme.signed else 0
    c = codes.astype(np.int16) + off
    if lo % 2:
        c = c[1:]
    if c.size % 2:
        c = np.concatenate([c, np.asarray([next_code + off], np.int16)])
    c = c.astype(np.uint8)
    return (c[0::2] | (c[1::2] << 4)).astype(np.uint8)


def unpack(stored: np.ndarray, byte_lo: int, scheme: Scheme) -> np.ndarray:
    """Element codes (int16) of stored bytes starting at stored index ``byte_lo`` (elements from
    ``2 * byte_lo`` for 4-bit schemes)."""
    if scheme.bits == 8:
        return stored.astype(np.int16)
    s = stored.astype(np.uint8)
    out = np.empty(s.size * 2, np.int16)
    out[0::2] = s & 0x0F
    out[1::2] = s >> 4
    return out - (8 if scheme.signed else 0)


def dequantize(
    codes: np.ndarray, lo: int, scales: np.ndarray, first_block: int, block: int, scheme: Scheme
) -> np.ndarray:
    """fp32 values of element codes ``[lo, lo + len(codes))`` given the scales of blocks ``first_block`` ... ."""
    if codes.size == 0:
        return np.zeros(0, np.float32)
    rows, front = _blocked(codes.astype(np.float32), lo, block)
    m = scales[lo // block - first_block :][: rows.shape[0]].astype(np.float32)[:, None]
    y = (rows * (m / np.float32(scheme.levels))).reshape(-1)[front : front + codes.size]
    return y if scheme.signed else y * y


def quantize_whole(x: np.ndarray, scheme: Scheme, block: int = DEFAULT_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """``(stored codes, scales)`` of a whole flat tensor (one process: tests, tools)."""
    flat = np.asarray(x, np.float32).reshape(-1)
    scales = block_maxima(flat, 0, block, scheme)
    return pack(element_codes(flat, 0, scales, 0, block, scheme), 0, scheme), scales


def dequantize_range(stored: np.ndarray, byte_lo: int, scales: np.ndarray, first_block: int, a: int, b: int,
                     block: int, scheme: Scheme) -> np.ndarray:  # fmt: skip
    """fp32 elements ``[a, b)`` from the stored codes starting at stored index ``byte_lo`` and the scales
    starting at block ``first_block`` (what a resharding reader read: ``read_spans`` says which)."""
    elem_lo = byte_lo if scheme.bits == 8 else 2 * byte_lo
    codes = unpack(stored, byte_lo, scheme)[a - elem_lo : b - elem_lo]
    return dequantize(codes, a, scales, first_block, block, scheme)


def read_spans(a: int, b: int, block: int, scheme: Scheme) -> tuple[tuple[int, int], tuple[int, int]]:
    """What a reader of elements ``[a, b)`` reads: stored code range and block range."""
    codes = (a, b) if scheme.bits == 8 else (a // 2, (b + 1) // 2)
    return codes, (a // block, nblocks(b, block) if b > a else a // block)


def scale_span(lo: int, hi: int, block: int) -> tuple[int, int]:
    """Blocks whose scale the saver of elements ``[lo, hi)`` stores: those whose first element it holds."""
    return nblocks(lo, block), nblocks(hi, block)


def code_span(lo: int, hi: int, scheme: Scheme) -> tuple[int, int]:
    """Stored code range the saver of elements ``[lo, hi)`` writes (``pack``)."""
    return (lo, hi) if scheme.bits == 8 else ((lo + 1) // 2, (hi + 1) // 2)


# ----------------------------------------------------------------------------------------- the metadata field


@dataclass(frozen=True)
class QuantizedKey:
    """One quantized key of a checkpoint: it is stored as ``codes`` + ``scales`` and read back as ``dtype`` of
    ``shape``."""

    key: str
    scheme: Scheme
    block: int
    shape: tuple[int, ...]
    dtype: str
    codes: str
    scales: str

    @property
    def numel(self) -> int:
        return int(math.prod(self.shape))

    def to_json(self) -> dict:
        return {
            "scheme": self.scheme.name,
            "block": self.block,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "codes": self.codes,
            "scales": self.scales,
        }


def field_json(keys: dict[str, QuantizedKey]) -> dict:
    return {"keys": {k: q.to_json() for k, q in sorted(keys.items())}}


def _bad(where: str, what: str) -> MetadataError:
    return MetadataError(f"{where}: field {QUANT_FIELD!r}: {what}")


def parse_field(d: Any, where: str) -> dict[str, QuantizedKey]:
    """The checked ``"quant"`` field (types, bounds, known schemes); MetadataError naming what is wrong.
    ``check_against`` then checks it against the checkpoint's tensors."""
    if type(d) is not dict or set(d) != {"keys"} or type(d["keys"]) is not dict:
        raise _bad(where, 'must be {"keys": {key: {...}}}')
    out = {}
    for key, e in d["keys"].items():
        if type(e) is not dict or set(e) != {"scheme", "block", "shape", "dtype", "codes", "scales"}:
            raise _bad(where, f"key {key!r:.100}: must hold exactly scheme, block, shape, dtype, codes, scales")
        scheme = SCHEMES.get(e["scheme"]) if type(e["scheme"]) is str else None
        if scheme is None:
            raise _bad(where, f"key {key!r:.100}: unknown scheme {e['scheme']!r:.60} (known: {', '.join(SCHEMES)})")
        block = e["block"]
        if type(block) is not int or not 2 <= block <= MAX_BLOCK or block % 2:
            raise _bad(where, f"key {key!r:.100}: block {block!r:.40} is not an even int in [2, {MAX_BLOCK}]")
        shape = e["shape"]
        if type(shape) is not list or len(shape) > 64 or not all(type(s) is int and 0 <= s < 1 << 62 for s in shape):
            raise _bad(where, f"key {key!r:.100}: bad shape {shape!r:.80}")
        if math.prod(shape) >= 1 << 62:
            raise _bad(where, f"key {key!r:.100}: shape {shape!r:.80} declares too many elements")
        if e["dtype"] not in ("float32", "bfloat16", "float16"):
            raise _bad(where, f"key {key!r:.100}: dtype {e['dtype']!r:.40} is not a float dtype")
        for f in ("codes", "scales"):
            if type(e[f]) is not str or e[f] == key:
                raise _bad(where, f"key {key!r:.100}: {f} must name another key")
        if e["codes"] == e["scales"]:
            raise _bad(where, f"key {key!r:.100}: codes and scales name the same key")
        out[key] = QuantizedKey(key, scheme, block, tuple(shape), e["dtype"], e["codes"], e["scales"])
    stored = [q.codes for q in out.values()] + [q.scales for q in out.values()]
    if len(set(stored)) != len(stored) or set(stored) & set(out):
        raise _bad(where, "two quantized keys share a stored key, or a stored key is itself quantized")
    return out


def check_against(quant: dict[str, QuantizedKey], tensors, where: str) -> None:
    """Each quantized key against the tensors the checkpoint holds: absent itself, its codes and scales present
    with the dtype and length its scheme and shape make."""
    for key, q in quant.items():
        if key in tensors:
            raise _bad(where, f"key {key!r:.100} is stored both quantized and as a tensor")
        for f, dtype, n in (
            ("codes", q.scheme.codes_dtype, q.scheme.codes_len(q.numel)),
            ("scales", "float32", nblocks(q.numel, q.block)),
        ):
            name = getattr(q, f)
            if name not in tensors:
                raise _bad(where, f"key {key!r:.100}: its {f} {name!r:.100} are not in the checkpoint")
            tm = tensors[name]
            if tm.dtype != dtype or tuple(tm.shape) != (n,):
                raise _bad(
                    where,
                    f"key {key!r:.100}: its {f} {name!r:.100} are {tm.dtype} {list(tm.shape)}, expected {dtype} [{n}]",
                )
