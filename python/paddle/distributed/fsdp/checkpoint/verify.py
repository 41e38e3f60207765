"""Offline soundness check of a committed checkpoint: ``verify_checkpoint``."""

from __future__ import annotations

import os
from typing import Callable

from . import checksums, storage
from .errors import CheckpointError, CheckpointRemovedError, CorruptCheckpointError
from .load import read_metadata
from .metadata import resolve_member
from .planner import coverage_problems, region_of_piece
from .removal import removed_or
from .strict_json import loads_strict, open_regular

_MAX_HEADER_BYTES = 100 << 20


def verify_checkpoint(path: str, on_bytes: Callable[[int], None] | None = None) -> list[str]:
    """Problems found in the checkpoint at ``path`` (empty list == sound).

    Checks the commit record, metadata, that every element of every tensor is covered exactly once, that every
    data file exists with the expected size and a safetensors header that matches the metadata, that pieces do
    not overlap inside a file, and every checksum (reads all data once). ``on_bytes(n)`` is called as data is
    checked (a progress bar's ``update``).
    """
    path = os.path.abspath(os.fspath(path))
    try:
        md = read_metadata(path)
    except CheckpointError as e:
        return [f"{type(e).__name__}: {e}"]
    problems: list[str] = []
    for key, tm in md.tensors.items():
        problems += coverage_problems(
            key, tm.shape, [(md.files[p.file].rank, region_of_piece(tm.shape, p)) for p in tm.pieces]
        )
    by_file: dict[str, list] = {n: [] for n in md.files}
    for key, tm in md.tensors.items():
        for p in tm.pieces:
            by_file[p.file].append((p.offset, p.offset + p.nbytes, key, p))
    usable = set()
    for name, fm in md.files.items():
        try:
            fpath = resolve_member(path, name)
            fd = open_regular(fpath)
        except FileNotFoundError:
            problems.append(f"data file {name} is missing")
            continue
        except (CheckpointError, OSError) as e:
            problems.append(f"data file {name}: {e}")
            continue
        try:
            size = os.fstat(fd).st_size
            if size != fm.size:
                problems.append(f"data file {name} has {size} bytes, expected {fm.size}")
                continue
            usable.add(name)
            problems += _check_header(fd, size, name, by_file[name])
        finally:
            os.close(fd)
    if md.checksum != checksums.NONE:
        try:
            files = storage.FileSet.of(path, md, resolve_member, verify=True)
        except CheckpointError as e:  # e.g. xxh3-64 checksums without the xxhash package
            return problems + [str(e)]
        try:
            for key, tm in md.tensors.items():
                for p in tm.pieces:
                    if p.file not in usable or p.nbytes == 0:
                        continue
                    try:
                        for _pos, window in storage.read_piece_windows(
                            files, key, p, [(0, p.nbytes)], md.chunk_bytes, True
                        ):
                            if on_bytes is not None:
                                on_bytes(len(window))
                    except (CheckpointError, OSError) as e:
                        problems.append(str(e))
        finally:
            files.close()
    if problems:
        # a checkpoint removed (keep_last rotation) or replaced while being verified is not corrupt
        gone = removed_or(path, CorruptCheckpointError(""), md.checkpoint_id)
        if isinstance(gone, CheckpointRemovedError):
            return [f"{type(gone).__name__}: {gone}"]
    return problems


def _check_header(fd: int, size: int, name: str, pieces) -> list[str]:
    """The safetensors header of the open data file ``fd`` must be a JSON object whose entry for each piece has
    the piece's byte range (the header length is bounded by the file size and a cap, checked before reading)."""
    try:
        head = os.pread(fd, 8, 0)
        if len(head) < 8:
            return [f"data file {name}: too short for a safetensors header"]
        n = int.from_bytes(head, "little")
        if n > min(size - 8, _MAX_HEADER_BYTES):
            return [f"data file {name}: implausible safetensors header length {n}"]
        raw = os.pread(fd, n, 8)
        header = loads_strict(raw, f"data file {name} safetensors header")
    except (OSError, CheckpointError) as e:
        return [f"data file {name}: unreadable safetensors header: {e}"]
    if not isinstance(header, dict):
        return [f"data file {name}: safetensors header is not a JSON object"]
    out = []
    base = 8 + n
    for a, b, key, p in pieces:
        ent = header.get(p.name)
        if not isinstance(ent, dict) or ent.get("data_offsets") != [a - base, b - base]:
            out.append(f"data file {name}: safetensors header entry for {key!r} does not match the metadata")
    return out
