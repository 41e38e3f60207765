"""Offline soundness check of a committed checkpoint: ``verify_checkpoint``, every byte read through the storage
interface (a local directory or any registered URL scheme, e.g. ``s3://``)."""

from __future__ import annotations

from typing import Callable

import numpy as np

from . import checksums
from .commit_record import removed_or
from .directory import read_metadata
from .errors import CheckpointError, CheckpointRemovedError, CorruptCheckpointError, SafetensorsHeaderError
from .format import safetensors
from .format.coverage import coverage_problems
from .format.metadata import check_file_name
from .geometry import region_of_piece
from .io.storage import Storage
from .options import CheckpointOptions
from .paths import local_path
from .reader import FileSet
from .regions import iter_piece


def verify_checkpoint(
    path: str, on_bytes: Callable[[int], None] | None = None, *, options: CheckpointOptions | None = None
) -> list[str]:
    """Problems found in the checkpoint at ``path`` (empty list == sound).

    Checks the commit record, metadata, that every element of every tensor is covered exactly once, that every
    data file exists with the expected size and a safetensors header that matches the metadata, that pieces do
    not overlap inside a file, and every checksum (reads all data once). ``on_bytes(n)`` is called as data is
    checked (a progress bar's ``update``). ``options.storage`` picks the backend (None: by the path's scheme).
    """
    opts = options if options is not None else CheckpointOptions()
    path = local_path(path, opts.storage)
    storage = opts.storage_for(path)
    try:
        md = read_metadata(path, opts, storage)
    except CheckpointError as e:
        return [f"{type(e).__name__}: {e}"]
    problems = _problems(path, md, storage, opts, on_bytes)
    if problems:
        # a checkpoint removed (keep_last rotation) or replaced while being verified is not corrupt
        gone = removed_or(path, CorruptCheckpointError(""), md.checkpoint_id, storage)
        if isinstance(gone, CheckpointRemovedError):
            return [f"{type(gone).__name__}: {gone}"]
    return problems


def _problems(path: str, md, storage: Storage, opts: CheckpointOptions, on_bytes) -> list[str]:
    problems: list[str] = []
    if md.index is not None:  # format 2: every row, its hash, every sidecar's size, pieces owning their bytes
        problems += index_problems(md)
        if md.rank_values is not None:  # format 3: the table of per-rank values objects, and each object
            problems += md.rank_values.problems()
        if problems:
            return problems
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
        if name in md.codecs:  # a stored file: its chunk table, then the header through decoded reads
            problems += _check_stored(path, md, storage, opts, name, by_file[name], usable)
            continue
        try:
            handle = storage.open_read(path, check_file_name(name))
        except FileNotFoundError:
            problems.append(f"data file {name} is missing")
            continue
        except (CheckpointError, OSError) as e:
            problems.append(f"data file {name}: {e}")
            continue
        try:
            if handle.size != fm.size:
                problems.append(f"data file {name} has {handle.size} bytes, expected {fm.size}")
                continue
            usable.add(name)
            problems += _check_header(handle, f"{path}/{name}", name, by_file[name])
        finally:
            handle.close()
    if md.checksum != checksums.NONE:
        problems += _check_chunks(path, md, storage, opts, usable, on_bytes)
    return problems


def _check_stored(path: str, md, storage: Storage, opts, name: str, pieces, usable: set) -> list[str]:
    """A stored file (format/codecs.py): its chunk table sound and of the stored size, one row per chunk of the
    header and of each piece (so that the piece reads of _check_chunks decode every stored chunk), and its
    safetensors header, decoded, holding each piece's range."""
    files = FileSet.of(path, md, verify=md.checksum != checksums.NONE, options=opts, storage=storage)
    try:
        try:
            table = files.table(name)
        except FileNotFoundError:
            return [f"data file {name} is missing"]
        except (CheckpointError, OSError) as e:
            return [f"data file {name}: {e}"]
        C = md.chunk_bytes
        header_end = min((a for a, _b, _k, _p in pieces), default=md.files[name].size)
        want = -(-header_end // C) + sum(-(-p.nbytes // C) for _a, _b, _k, p in pieces)
        if len(table.rows) != want:
            return [f"data file {name}: chunk table has {len(table.rows)} rows, the header and pieces need {want}"]
        usable.add(name)

        class _Decoded:
            size = md.files[name].size

            def read_into(self, offset: int, buf) -> int:
                n = max(0, min(len(buf), self.size - offset))
                files.pread_into(name, memoryview(buf)[:n], offset)
                return n

        try:
            return _check_header(_Decoded(), f"{path}/{name}", name, pieces)
        except (CheckpointError, OSError) as e:
            return [f"data file {name}: {e}"]
    finally:
        files.close()


def _check_chunks(path: str, md, storage: Storage, opts, usable: set, on_bytes) -> list[str]:
    """Every checksum of every piece in a usable data object (all data read once)."""
    try:
        files = FileSet.of(path, md, verify=True, options=opts, storage=storage)
    except CheckpointError as e:  # e.g. xxh3-64 checksums without the xxhash package
        return [str(e)]
    problems = []
    try:
        for key, tm in md.tensors.items():
            for p in tm.pieces:
                if p.file not in usable or p.nbytes == 0:
                    continue
                try:
                    for window in iter_piece(files, md, key, p, True):
                        if on_bytes is not None:
                            on_bytes(len(window))
                except (CheckpointError, OSError) as e:
                    problems.append(str(e))
    finally:
        files.close()
    return problems


def _check_header(handle, where: str, name: str, pieces) -> list[str]:
    """The safetensors header of the data object (format/safetensors.py: bounded, strict) must hold each piece's
    byte range."""

    def read_at(offset: int, n: int) -> bytes:
        buf = bytearray(n)
        got = handle.read_into(offset, buf)
        return bytes(buf[:got])

    try:
        st = safetensors.parse_header(handle.size, read_at, where)
    except SafetensorsHeaderError as e:
        return [f"data file {name}: unreadable safetensors header: {e}"]
    except OSError as e:
        return [f"data file {name}: unreadable safetensors header: cannot read it: {e}"]
    entries = {e.name: e for e in st.entries}
    out = []
    for a, b, key, p in pieces:
        ent = entries.get(p.name)
        if ent is None or (ent.begin, ent.end) != (a - st.data_start, b - st.data_start):
            out.append(f"data file {name}: safetensors header entry for {key!r} does not match the metadata")
    return out


def index_problems(md) -> list[str]:
    """Format 2 (format/index.py): index.pieces whole and matching its SHA-256, every piece row sound, every
    checksum sidecar of the size its rows need, no two pieces sharing bytes of a file."""
    import hashlib

    from .format import row_directory
    from .format.index import PIECES_FILE, sums_name
    from .format.metadata import file_overlap_problems

    src = md.index
    try:
        rows = src.all_rows()
        if hashlib.sha256(rows.tobytes()).hexdigest() != src.pieces_sha256:
            return [f"{PIECES_FILE} does not match its SHA-256 in metadata.json (damaged)"]
        key_rows = np.asarray(src.table["rows"], dtype=np.int64)
        owner = np.repeat(np.arange(len(key_rows) - 1), np.diff(key_rows))
        stray = np.nonzero(rows["key"].astype(np.int64) != owner)[0]
        if len(stray):
            return [f"{PIECES_FILE} row {int(stray[0])} does not belong to the key index.keys gives it"]
        if src.starts_sha256 is not None:  # format 3: the row directory, whole, and as the rows imply it
            problem = row_directory.problem(src.fetch, rows, src.table["rows"], src.starts_sha256, src.fences_sha256)
            if problem:
                return [problem]
        md.prefetch(list(md.tensors))
    except (CheckpointError, OSError) as e:
        return [f"{type(e).__name__}: {e}"]
    problems = []
    for fi, name in enumerate(src.names):
        want = src.sums_counts[fi] * 8
        try:
            got = len(src.fetch(sums_name(name), 0, want + 1)) if want else want
        except (CheckpointError, OSError) as e:
            if not isinstance(e.__cause__, FileNotFoundError):
                problems.append(f"checksum sidecar {sums_name(name)}: {e}")
                continue
            got = None
        if got != want:
            problems.append(
                f"checksum sidecar {sums_name(name)} is missing"
                if got is None
                else f"checksum sidecar {sums_name(name)} has {got} bytes, expected {want}"
            )
    return problems + file_overlap_problems(md)
