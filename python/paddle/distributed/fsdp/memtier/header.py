"""A memory copy's header, checked field by field before anything of it is used, applied or persisted.

Why: a header comes from a file in a shared directory or from a peer's socket. Code that reads ``step``,
``records`` or ``algo`` trusted their types: one crafted copy (``"step": [3]``) made every later restart fail on
every rank with an unnamed TypeError. ``check_fields`` is called by ``slot.parse_header`` (so by every reader: the
restore's scan, a peer transfer, flush-memory) and raises InvalidMemoryCopyError naming the field; a copy that
fails is skipped like a corrupt one.
"""

from __future__ import annotations

import math

from ..checkpoint.format.algorithms import KNOWN, NONE
from ..checkpoint.format.reserved import BUFFERS_KEY, EXTRA_KEY, OPTIMIZER_KEY, RNG_KEY
from .errors import InvalidMemoryCopyError
from .roots import JOB_ID_RE

MAX_INT = (1 << 63) - 1
MAX_CHUNK = 1 << 40
DURABLE_ID_LEN = 32  # hex digits of a durable root's identity (identity.py)


def _int(header: dict, field: str, lo: int, hi: int, where: str) -> int:
    v = header.get(field)
    if type(v) is not int or not lo <= v <= hi:
        raise InvalidMemoryCopyError(f"{where}: header field {field!r} is {v!r}, not an int in [{lo}, {hi}]")
    return v


def is_durable_id(v) -> bool:
    return isinstance(v, str) and len(v) == DURABLE_ID_LEN and all(c in "0123456789abcdef" for c in v)


def check_fields(header, data_len: int, where: str) -> dict:
    """``header`` when every field has its type and range and every record lies, in order, inside the
    ``data_len`` bytes of data; InvalidMemoryCopyError naming the first field that does not."""
    if type(header) is not dict:
        raise InvalidMemoryCopyError(f"{where}: the header is a {type(header).__name__}, not an object")
    job = header.get("job")
    if not isinstance(job, str) or not JOB_ID_RE.match(job):
        raise InvalidMemoryCopyError(f"{where}: header field 'job' is {str(job)[:80]!r}, not a job id")
    if not is_durable_id(header.get("durable_id")):
        raise InvalidMemoryCopyError(f"{where}: header field 'durable_id' is {str(header.get('durable_id'))[:80]!r}")
    world = _int(header, "world", 1, 1 << 24, where)
    _int(header, "rank", 0, world - 1, where)
    _int(header, "step", 0, MAX_INT, where)
    algo = header.get("algo")
    if algo not in KNOWN or not isinstance(algo, str):
        raise InvalidMemoryCopyError(f"{where}: header field 'algo' is {str(algo)[:80]!r}, not one of {KNOWN}")
    chunk = _int(header, "chunk", 1, MAX_CHUNK, where)
    _check_values(header.get("values"), where)
    records = header.get("records")
    if type(records) is not list:
        raise InvalidMemoryCopyError(f"{where}: header field 'records' is not a list")
    descs = header.get("descs")
    if type(descs) is not list or len(descs) != len(records):
        raise InvalidMemoryCopyError(f"{where}: header field 'descs' is not a list of one entry per record")
    end = 0
    for i, rec in enumerate(records):
        _check_record(rec, i, chunk, algo, data_len, end, where)
        if rec[4]:
            end = rec[3] + rec[4]
    return header


def _check_values(values, where: str) -> None:
    """The values every copy carries (state.capture_values): the caller's extra state, the buffer keys, this
    rank's RNG state, and the optimizer's class and global state when there is an optimizer."""
    if type(values) is not dict:
        raise InvalidMemoryCopyError(f"{where}: header field 'values' is not an object")
    missing = [k for k in (EXTRA_KEY, BUFFERS_KEY, RNG_KEY) if k not in values]
    if missing:
        raise InvalidMemoryCopyError(f"{where}: header field 'values' lacks {missing}")
    if type(values[EXTRA_KEY]) is not dict:
        raise InvalidMemoryCopyError(f"{where}: values[{EXTRA_KEY!r}] is not an object")
    buffers = values[BUFFERS_KEY]
    if type(buffers) is not list or not all(isinstance(b, str) for b in buffers):
        raise InvalidMemoryCopyError(f"{where}: values[{BUFFERS_KEY!r}] is not a list of names")
    opt = values.get(OPTIMIZER_KEY)
    if opt is not None and (type(opt) is not dict or not isinstance(opt.get("class"), str)):
        raise InvalidMemoryCopyError(f"{where}: values[{OPTIMIZER_KEY!r}] has no optimizer class")


def _check_record(rec, i: int, chunk: int, algo: str, data_len: int, end: int, where: str) -> None:
    if type(rec) is not list or len(rec) != 6:
        raise InvalidMemoryCopyError(f"{where}: record {i} is not a list of 6 fields")
    key, dtype, shape, off, nbytes, digests = rec
    if not isinstance(key, str) or not isinstance(dtype, str) or not dtype:
        raise InvalidMemoryCopyError(f"{where}: record {i} has no string key and dtype")
    if type(shape) is not list or not all(type(d) is int and 0 <= d <= MAX_INT for d in shape):
        raise InvalidMemoryCopyError(f"{where}: record {key[:80]!r} has shape {str(shape)[:80]}, not a list of sizes")
    if type(off) is not int or type(nbytes) is not int or off < 0 or nbytes < 0:
        raise InvalidMemoryCopyError(f"{where}: record {key[:80]!r} has offset {off!r} and size {nbytes!r}")
    if nbytes and (off < end or off + nbytes > data_len):
        raise InvalidMemoryCopyError(f"{where}: record {key[:80]!r} lies outside the data or overlaps another")
    want = 0 if algo == NONE else math.ceil(nbytes / chunk)
    if (
        type(digests) is not list
        or len(digests) != want
        or not all(type(d) is int and 0 <= d < 1 << 64 for d in digests)
    ):
        raise InvalidMemoryCopyError(f"{where}: record {key[:80]!r} has not {want} chunk digests")


def written_now() -> int:
    """The ``written`` field of a copy saved now: the boot clock in ns (never set back, shared by every process of
    the node, and memory copies do not outlive a reboot)."""
    import time

    return time.clock_gettime_ns(time.CLOCK_BOOTTIME)


def written_at(header: dict) -> int:
    """When a copy of this node was written (``written``), -1 for a copy without it (an older layout's)."""
    value = header.get("written")
    return value if type(value) is int and value >= 0 else -1
