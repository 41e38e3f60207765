"""Bounded, strict reading of the small JSON files of a checkpoint (``metadata.json``, ``COMMIT``, markers).

Why: these files come from disk, and a checkpoint directory can be crafted or damaged. Reading one must cost
memory bounded by a cap checked *before* anything is read, never block (a FIFO or a device in place of the
file), and turn every malformed input into a named error (:class:`MetadataError`) instead of
``RecursionError`` / ``OverflowError`` / ``MemoryError``. Strict JSON means: no ``NaN`` / ``Infinity``
literals, no float that overflows to infinity (``1e400``), no integer longer than ``MAX_INT_DIGITS`` digits,
nesting at most ``MAX_DEPTH`` deep.

* ``open_regular(path)``: an ``O_RDONLY | O_NONBLOCK`` descriptor that is known to be a regular file.
* ``read_capped(path, cap)``: the bytes of a regular file of at most ``cap`` bytes.
* ``loads_strict(data, where)``: parse; every failure is a MetadataError naming ``where``.
* ``check_json_value(value, where)``: the writer's side of the same rules (what is saved can be read back).
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
import sys
from typing import Any

from ..errors import MetadataError, NotARegularFileError

MAX_DEPTH = 64  # nesting of JSON containers in any checkpoint JSON (values included)
MAX_INT_DIGITS = 40  # longest integer literal accepted (uint64 checksums and RNG words need 20)
# metadata.json larger than this is refused before reading (a real 30B-MoE index measured 246 MB; parsing costs
# about 10x its size in memory); CheckpointOptions.max_metadata_bytes
DEFAULT_MAX_METADATA_BYTES = 512 << 20
SMALL_FILE_BYTES = 1 << 20  # COMMIT, markers, latest


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def open_regular(path: str, flags: int = 0) -> int:
    """Open ``path`` read-only without blocking and make sure it is a regular file (closed otherwise).

    ``O_NONBLOCK`` makes opening a FIFO return at once (reads of a regular file ignore the flag); the ``fstat``
    on the descriptor (not on the path, which could be swapped in between) refuses anything but a regular file.
    Raises FileNotFoundError when absent, NotARegularFileError for other kinds, OSError otherwise.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | flags)
    try:
        mode = os.fstat(fd).st_mode
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotARegularFileError(f"{path} is {_kind(mode)}, not a regular file")
    return fd


def read_capped(path: str, cap: int, what: str = "file") -> bytes:
    """All bytes of the regular file ``path``; MetadataError when it is larger than ``cap`` (checked from
    ``fstat`` before reading, and again while reading in case it grows)."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > cap:
            raise MetadataError(f"{what} {path} has {size} bytes, more than the limit of {cap} bytes")
        chunks, total = [], 0
        while True:
            b = os.read(fd, min(max(size - total, 0) + 1, 64 << 20) or 1)
            if not b:
                break
            total += len(b)
            if total > cap:
                raise MetadataError(f"{what} {path} grew past the limit of {cap} bytes while being read")
            chunks.append(b)
        return b"".join(chunks)
    except OSError as e:
        if e.errno == errno.EISDIR:
            raise NotARegularFileError(f"{path} is a directory, not a regular file") from None
        raise
    finally:
        os.close(fd)


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not allowed (strict JSON)")


def _parse_float(s: str) -> float:
    v = float(s)
    if not math.isfinite(v):
        raise ValueError(f"number {s[:40]} overflows a float")
    return v


def _parse_int(s: str) -> int:
    if len(s.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"integer of {len(s)} digits (limit {MAX_INT_DIGITS})")
    return int(s)


def loads_strict(data: bytes, where: str, typed_fields: frozenset = frozenset()) -> Any:
    """Parse ``data`` as strict JSON within the caps above; MetadataError naming ``where`` otherwise.

    ``typed_fields``: top-level fields the caller checks field by field afterwards (schema.py types and bounds
    every value of metadata.json's ``files`` and ``tensors``): the generic walk skips them (it was two thirds of
    the parse time of a checksum-heavy metadata.json). Their nesting is still bounded by the parser."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MetadataError(f"{where} is not UTF-8: {e}") from None
    # integers: the interpreter's own digit limit (sys.get_int_max_str_digits, 4300 by default) refuses a huge
    # literal before any quadratic conversion, and json_value_problem checks MAX_INT_DIGITS afterwards; the
    # per-integer hook (5x the parse time of a checksum-heavy metadata.json) is only needed without that limit
    limited = 0 < getattr(sys, "get_int_max_str_digits", lambda: 0)() <= 100_000
    try:
        value = json.loads(
            text,
            parse_constant=_refuse_constant,
            parse_float=_parse_float,
            parse_int=None if limited else _parse_int,
        )
    except RecursionError:
        raise MetadataError(f"{where} is nested deeper than the limit of {MAX_DEPTH}") from None
    except (ValueError, OverflowError) as e:
        raise MetadataError(f"{where} is not valid JSON: {e}") from None
    walked = value
    if typed_fields and type(value) is dict:
        walked = {k: v for k, v in value.items() if k not in typed_fields}
    problem = json_value_problem(walked, MAX_DEPTH)
    if problem is not None:
        raise MetadataError(f"{where}: {problem}")
    return value


def json_value_problem(value: Any, max_depth: int = MAX_DEPTH) -> str | None:
    """Why ``value`` is not a JSON value this engine reads back (None when it is): a non-finite float, a
    non-string key, an integer beyond ``MAX_INT_DIGITS`` digits, nesting deeper than ``max_depth``, or a type
    JSON cannot hold. Iterative (no recursion limit)."""
    stack = [(value, 0, "")]
    while stack:
        v, depth, path = stack.pop()
        t = type(v)
        if v is None or t is bool or t is str:
            continue
        if t is int or isinstance(v, int) and not isinstance(v, bool):
            if abs(v) >= _INT_LIMIT:
                return f"integer at {path or 'top level'} has more than {MAX_INT_DIGITS} digits"
            continue
        if t is float or isinstance(v, float):
            if not math.isfinite(v):
                return f"non-finite number {v!r} at {path or 'top level'} (JSON cannot hold it)"
            continue
        if isinstance(v, (list, tuple, dict)):
            if depth >= max_depth:
                return f"nesting deeper than {max_depth} at {path or 'top level'}"
            if isinstance(v, dict):
                for k, x in v.items():
                    if not isinstance(k, str):
                        return f"non-string key {k!r} at {path or 'top level'}"
                    stack.append((x, depth + 1, f"{path}[{k!r}]" if len(path) < 200 else path))
            else:
                kinds = set(map(type, v))
                if kinds <= _INT:  # flat lists of integers (checksums, RNG words): bounds at C speed
                    if v and (max(v) >= _INT_LIMIT or min(v) <= -_INT_LIMIT):
                        return f"integer in the list at {path or 'top level'} has more than {MAX_INT_DIGITS} digits"
                    continue
                if kinds <= _PLAIN:  # flat lists of scalars: one pass, no stack
                    bad = next((x for x in v if type(x) is float and not math.isfinite(x)), None)
                    if bad is not None:
                        return f"non-finite number {bad!r} in the list at {path or 'top level'}"
                    big = next((x for x in v if type(x) is int and abs(x) >= _INT_LIMIT), None)
                    if big is not None:
                        return f"integer in the list at {path or 'top level'} has more than {MAX_INT_DIGITS} digits"
                    continue
                for i, x in enumerate(v):
                    stack.append((x, depth + 1, f"{path}[{i}]" if len(path) < 200 else path))
            continue
        return f"value of type {t.__name__} at {path or 'top level'} is not JSON"
    return None


_PLAIN = {type(None), bool, int, float, str}
_INT = {int}
_INT_LIMIT = 10**MAX_INT_DIGITS
