"""metadata.json and the COMMIT record: writing them (last, in this order) and reading a committed checkpoint.

A checkpoint directory is committed when its ``COMMIT`` record exists and names the checkpoint id and the
SHA-256 of ``metadata.json``: ``{"format", "checkpoint_id", "metadata_sha256"}``. Writers (the collective save,
the tools' one-process writer) write the data files, then ``metadata.json`` (``write_metadata``), then
``COMMIT`` (``write_commit``), each fsynced; readers (``read_metadata``) trust nothing that is not committed, and
explain what a directory that is not a committed checkpoint is (never committed, a checkpoint root, stock
paddle, foreign) so the error names the problem.
"""

from __future__ import annotations

import hashlib
import json
import os
import re

from .. import writer
from ..errors import (
    CheckpointError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    MetadataError,
    NotACheckpointError,
)
from .metadata import COMMIT_FILE, FORMAT_NAME, LATEST_FILE, METADATA_FILE, PARTS_DIR, CheckpointMetadata
from .schema import parse_commit
from .strict_json import SMALL_FILE_BYTES, loads_strict, read_capped


def write_metadata(directory: str, md: CheckpointMetadata, write_stock: bool) -> bytes:
    """Write and fsync ``metadata.json`` (and stock paddle's ``0.metadata`` when ``write_stock``) into the
    (not yet visible) ``directory``; returns the bytes written, which ``write_commit`` seals."""
    data = md.dumps()
    writer.write_file(os.path.join(directory, METADATA_FILE), data, fsync=True, atomic=False)
    if write_stock:
        from ..stock_compat import write_stock_metadata

        write_stock_metadata(directory, md)
    return data


def commit_record(checkpoint_id: str, metadata_bytes: bytes) -> bytes:
    return json.dumps(
        {
            "format": FORMAT_NAME,
            "checkpoint_id": checkpoint_id,
            "metadata_sha256": hashlib.sha256(metadata_bytes).hexdigest(),
        }
    ).encode()


def write_commit(directory: str, checkpoint_id: str, metadata_bytes: bytes) -> None:
    """Write and fsync the ``COMMIT`` record (after every data file and ``metadata.json`` are durable)."""
    writer.write_file(
        os.path.join(directory, COMMIT_FILE), commit_record(checkpoint_id, metadata_bytes), fsync=True, atomic=False
    )


def read_metadata(path: str, options=None) -> CheckpointMetadata:
    """Metadata of a committed checkpoint; raises NotACheckpointError / IncompleteCheckpointError / MetadataError
    (CorruptCheckpointError for an I/O error such as EACCES or EIO: never a bare OSError)."""
    path = os.path.abspath(os.fspath(path))
    if options is None:
        from ..options import resolve

        options = resolve(None)
    try:
        return _read_metadata(path, options.max_metadata_bytes)
    except FileNotFoundError as e:  # the directory went away under the reader (keep_last rotation)
        raise _removed_or(path, CorruptCheckpointError(f"checkpoint {path}: {e}")) from e
    except OSError as e:
        raise CorruptCheckpointError(f"checkpoint {path}: cannot read it: {type(e).__name__}: {e}") from e


def _read_metadata(path: str, max_metadata_bytes: int) -> CheckpointMetadata:
    if not os.path.isdir(path):
        parent = os.path.dirname(path)
        base = os.path.basename(path)
        try:
            near = sorted(n for n in os.listdir(parent) if n.startswith((base + ".old-", base + ".tmp-")))
        except OSError:
            near = []
        staging = [n for n in near if n.startswith(base + ".tmp-")]
        old = [n for n in near if n.startswith(base + ".old-")]
        old_hint = (
            (f"; {old[0]} holds the checkpoint that was being replaced (rename it back to {base})") if old else ""
        )
        if staging:
            raise IncompleteCheckpointError(
                f"checkpoint {path} is incomplete: it was never committed; "
                f"{_describe_staging(_newest(parent, staging))} left {staging[:3]} next to it{old_hint}"
            )
        raise NotACheckpointError(f"{path} is not a checkpoint: no such directory{old_hint}")
    mpath = os.path.join(path, METADATA_FILE)
    cpath = os.path.join(path, COMMIT_FILE)
    has_m, has_c = os.path.isfile(mpath), os.path.isfile(cpath)
    if not has_c:
        names = os.listdir(path)
        looks_partial = has_m or PARTS_DIR in names or any(n.endswith("_0.safetensors") for n in names)
        if looks_partial:
            missing = "the commit record COMMIT" + ("" if has_m else " and metadata.json")
            raise IncompleteCheckpointError(
                f"checkpoint {path} is incomplete: {missing} is missing (the save did not finish)"
            )
        if LATEST_FILE in names:
            raise NotACheckpointError(
                f"{path} is a checkpoint root ({LATEST_FILE} -> {_peek_latest(path)}), not a checkpoint: pass one "
                f"of its checkpoint directories, or pass the root to load_checkpoint / CheckpointManager"
            )
        stock = any(n.endswith(".metadata") for n in names)
        raise NotACheckpointError(
            f"{path} is not a {FORMAT_NAME} checkpoint: no {METADATA_FILE} and no {COMMIT_FILE} "
            f"({'looks like a stock paddle checkpoint; ' if stock else ''}contents: {_describe_dir(path)})"
        )
    try:
        cid, want_sha = parse_commit(
            loads_strict(read_capped(cpath, SMALL_FILE_BYTES, COMMIT_FILE), f"{path}/{COMMIT_FILE}"),
            f"{path}/{COMMIT_FILE}",
        )
    except MetadataError as e:
        raise MetadataError(f"checkpoint {path}: commit record {COMMIT_FILE} is damaged: {e}") from None
    except FileNotFoundError:
        raise _removed_or(path, CorruptCheckpointError(f"checkpoint {path}: {COMMIT_FILE} vanished")) from None
    missing = CorruptCheckpointError(f"checkpoint {path}: {METADATA_FILE} is missing although it was committed")
    if not has_m:
        raise _removed_or(path, missing)
    try:
        data = read_capped(mpath, max_metadata_bytes, METADATA_FILE)
    except FileNotFoundError:
        raise _removed_or(path, missing) from None
    if hashlib.sha256(data).hexdigest() != want_sha:
        raise MetadataError(
            f"checkpoint {path}: {METADATA_FILE} does not match the checksum in the commit record (damaged)"
        )
    md = CheckpointMetadata.loads(data, where=f"{path}/{METADATA_FILE}")
    if md.checkpoint_id != cid:
        raise MetadataError(f"checkpoint {path}: commit record and metadata name different checkpoints")
    return md


def _removed_or(path: str, error):
    from ..directory import removed_or

    return removed_or(path, error)


def _describe_dir(path: str) -> str:
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return "unreadable"
    if len(names) > 8:
        names = names[:8] + ["..."]
    return ", ".join(names) or "empty"


def _newest(parent: str, names: list[str]) -> str:
    def mtime(n: str) -> float:
        try:
            return os.path.getmtime(os.path.join(parent, n))
        except OSError:
            return 0.0

    return os.path.join(parent, max(names, key=mtime))


def _describe_staging(staging: str) -> str:
    """Why a staging directory is there: a save that failed with an error, or one that was killed (or runs)."""
    parts = os.path.join(staging, PARTS_DIR)
    try:
        names = sorted(os.listdir(parts))
    except OSError:
        names = []
    errors = [n for n in names if _FAILURE_MARKER.match(n)]
    if errors:
        errors.sort(key=lambda n: (not n.endswith(".json") and n != "ABORT", n))  # details first, then tags
        n = errors[0]
        try:
            raw = read_capped(os.path.join(parts, n), SMALL_FILE_BYTES, n)[:500]
            if n.endswith(".json"):
                why = loads_strict(raw, n).get("error")
            else:
                why = raw.decode(errors="replace") or n.split(".", 2)[-1]
        except (OSError, CheckpointError, AttributeError):
            why = "unknown error"
        return f"a save that failed ({why})"
    return "a save that was interrupted (or is still running)"


# failure markers of a save (save.py): details in <rank>.failed.json / ABORT, the cause in the name otherwise
_FAILURE_MARKER = re.compile(r"^(\d+\.failed(\.json|\.[A-Za-z0-9_]+)?|ABORT(\.[A-Za-z0-9_]+)?)$")


def _peek_latest(root: str) -> str:
    try:
        raw = read_capped(os.path.join(root, LATEST_FILE), SMALL_FILE_BYTES, LATEST_FILE)
        return raw[:256].decode(errors="replace").strip() or "empty"
    except (OSError, CheckpointError):
        return "unreadable"
