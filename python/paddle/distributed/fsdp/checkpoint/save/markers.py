"""Failure records a failed save leaves in its staging location, and the cleanup of failed stagings.

Why: after a save failed, the staging it leaves must say why (a load of the path reports "never committed:
a save that failed (cause)", format/commit.py) and must be recognisable as safe to delete by the next save. The
ranks do NOT learn of each other's failures from these records (channel.py carries that through the TCP
store); they are written for the humans and tools that look at the directory later.

The details (the full cause) go first into an object written atomically, when the storage still takes it; then
an empty object whose *name* carries the cause (errno name; an empty file needs no data block, so it can be
created on a full disk). Records live in the child location ``.parts`` of the staging.
"""

from __future__ import annotations

import errno
import json
import os
import re

from ..coordination import message_of
from ..format.metadata import PARTS_DIR
from ..io.storage import Storage

_FAILED_RE = re.compile(r"^(\d+)\.failed(?:\.([A-Za-z0-9_]+))?$")
_ABORT_RE = re.compile(r"^ABORT(?:\.([A-Za-z0-9_]+))?$")


def cause(e: BaseException) -> str:
    """``Class: message``, the form every rank's error quotes (a message user code cannot print: a stand-in)."""
    return f"{type(e).__name__}: {message_of(e)}"


def tag(e: BaseException) -> str:
    """The record-name form of a cause: the errno name of an OSError, else the exception class name."""
    if isinstance(e, OSError) and e.errno is not None:
        return errno.errorcode.get(e.errno, type(e).__name__)
    return re.sub(r"[^A-Za-z0-9_]", "_", type(e).__name__)[:64]


def _put_quietly(storage: Storage, location: str, name: str, data: bytes) -> None:
    try:
        storage.put(location, name, data, durable=False)
    except OSError:
        pass


def mark_failed(storage: Storage, staging: str, rank: int, e: BaseException) -> None:
    """Record that ``rank`` failed with ``e`` (best effort, never raises)."""
    parts = storage.child(staging, PARTS_DIR)
    _put_quietly(storage, parts, f"{rank}.failed.json", json.dumps({"error": cause(e)}).encode())
    _put_quietly(storage, parts, f"{rank}.failed.{tag(e)}", b"")


def mark_aborted(storage: Storage, staging: str, rank: int, e: BaseException) -> None:
    """Record that the coordinator (``rank``) gave the save up because of ``e`` (best effort)."""
    parts = storage.child(staging, PARTS_DIR)
    _put_quietly(storage, parts, "ABORT", cause(e).encode())
    _put_quietly(storage, parts, f"ABORT.{tag(e)}", b"")


def _describe_tag(t: str) -> str:
    """The cause a record name carries, as a message: ``EIO`` -> ``OSError EIO (Input/output error)``."""
    code = getattr(errno, t, None)
    return f"OSError {t} ({os.strerror(code)})" if isinstance(code, int) else t


def _get_quietly(storage: Storage, location: str, name: str) -> bytes | None:
    try:
        return storage.get(location, name, 1 << 16)
    except Exception:  # noqa: BLE001 - a damaged record is no record
        return None


def failures(storage: Storage, staging: str) -> dict[int, str]:
    """Ranks that recorded a failure in ``staging`` and their causes."""
    parts = storage.child(staging, PARTS_DIR)
    out: dict[int, str] = {}
    for n in storage.list(parts):
        m = _FAILED_RE.match(n)
        if m is None:
            continue
        r = int(m.group(1))
        if m.group(2) is None and r in out:
            continue
        raw = _get_quietly(storage, parts, f"{r}.failed.json")
        try:
            detail = json.loads(raw) if raw else None
        except ValueError:
            detail = None
        if isinstance(detail, dict) and isinstance(detail.get("error"), str):
            out[r] = detail["error"]
        elif m.group(2) is not None and m.group(2) != "json":
            out[r] = _describe_tag(m.group(2))
    return out


def aborted(storage: Storage, staging: str) -> str | None:
    """The coordinator's recorded reason when it gave up the save in ``staging`` (None: it did not)."""
    parts = storage.child(staging, PARTS_DIR)
    tags = [m.group(1) for m in map(_ABORT_RE.match, storage.list(parts)) if m is not None]
    if not tags:
        return None
    reason = _get_quietly(storage, parts, "ABORT")
    if reason:
        return reason[:4096].decode(errors="replace")
    t = next((t for t in tags if t), None)
    return _describe_tag(t) if t else "unknown reason"


def remove_failed_stagings(storage: Storage, path: str) -> list[str]:
    """Remove the staging locations of earlier saves to ``path`` that failed with an error (they carry failure
    or abort records; a save still running, or killed, has none and is left alone). Best effort."""
    removed = []
    for staging in storage.stagings(path):
        if failures(storage, staging) or aborted(storage, staging) is not None:
            storage.remove(staging, wait=True)
            removed.append(staging.rstrip("/").rpartition("/")[2])
    return removed
