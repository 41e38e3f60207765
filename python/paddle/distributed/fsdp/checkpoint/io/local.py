"""The local POSIX backend: checkpoints as directories of files on a (shared or node-local) file system.

Every fast path of the engine lives here or below: data objects are written by ``writer.write_rank_file``
(O_DIRECT through bounce buffers where the file system allows it, checksums in the bounce buffer, one fsync);
small objects are tmp + fsync + rename; ``publish`` is ``renameat2(RENAME_EXCHANGE)`` (two renames where the
kernel refuses it) with the old directory removed in the background; read handles expose their descriptor and
path so the readers keep preadv, O_DIRECT and page-cache residency (reader.py, streamed.py, load/inplace.py).

A location is an absolute directory path; its staging is the sibling ``<final>.tmp-<checkpoint_id>``, so the
rename that publishes it stays on one file system.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import threading
import uuid
from collections.abc import Callable, Sequence

from .. import writer
from ..format.metadata import COMMIT_FILE, METADATA_FILE, STOCK_METADATA_FILE, resolve_member
from ..format.strict_json import open_regular, read_capped
from .storage import DigestFn, Piece, Storage, StorageError

_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
TRASH_PREFIX = ".trash-"  # a removed location on its way out (never a checkpoint, never listed as one)


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not name or "/" in name or name in (".", ".."):
        raise StorageError(f"object name {name!r} must be a non-empty name without '/'")


class LocalReadHandle:
    """Ranged reads of one file; ``fileno()`` and ``path`` let the engine's readers use their POSIX fast paths."""

    def __init__(self, path: str):
        self.path = path
        self._fd = open_regular(path)  # regular files only: a FIFO or device in its place is refused
        self.size = os.fstat(self._fd).st_size

    def fileno(self) -> int:
        return self._fd

    def read_into(self, offset: int, buf) -> int:
        mv = memoryview(buf).cast("B")
        done = 0
        while done < len(mv):
            n = os.preadv(self._fd, [mv[done:]], offset + done)
            if n <= 0:
                break
            done += n
        return done

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class LocalStorage(Storage):
    """Directories on a POSIX file system. ``odirect``: write data objects with O_DIRECT (buffered where the file
    system refuses it); ``background_delete``: remove a replaced checkpoint in a non-daemon thread."""

    def __init__(self, odirect: bool = True, background_delete: bool = True):
        self.odirect = odirect
        self.background_delete = background_delete

    # names
    def child(self, parent: str, name: str) -> str:
        _check_name(name)
        return os.path.join(parent, name)

    def parent(self, location: str) -> str:
        return os.path.dirname(os.path.abspath(location))

    def children(self, parent: str) -> list[str]:
        try:
            return sorted(e.name for e in os.scandir(parent) if e.is_dir(follow_symlinks=False))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def list(self, location: str) -> list[str]:
        try:
            return sorted(e.name for e in os.scandir(location) if not e.is_dir(follow_symlinks=False))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def exists(self, location: str) -> bool:
        return os.path.isdir(location)

    # writes
    def begin(self, final: str, checkpoint_id: str) -> str:
        staging = f"{os.path.abspath(final)}.tmp-{checkpoint_id}"
        writer.makedirs_durable(os.path.dirname(staging))  # a new root survives a power loss
        os.makedirs(staging, exist_ok=True)  # made durable by the publish (rename + fsync of the parent)
        return staging

    def write_object(
        self,
        location: str,
        name: str,
        header: bytes,
        pieces: Sequence[Piece],
        chunk_bytes: int,
        digest: DigestFn | None,
        *,
        should_stop: Callable[[], None] | None = None,
    ) -> tuple[int, list[list[int]]]:
        _check_name(name)
        result = writer.write_rank_file(
            os.path.join(location, name),
            header,
            pieces,
            chunk_bytes,
            digest,
            should_stop=should_stop,
            direct=self.odirect,
        )
        # "durable on return" includes the object's name: POSIX makes a new name durable only through an fsync of
        # its directory. Done here, explicitly, rather than relying on a later put's fsync of the same directory
        # (which would stop covering it the day data moves to a subdirectory); one directory fsync per rank.
        writer.fsync_dir(location)
        return result

    def put(self, location: str, name: str, data: bytes, *, durable: bool = True) -> None:
        """A small file: tmp + rename (+ fsync of file and directory when ``durable``); creates ``location``."""
        _check_name(name)
        writer.makedirs_durable(location)
        target = os.path.join(location, name)
        if durable:
            writer.write_file_durable(target, data)
        else:
            writer.write_file(target, data, fsync=False, atomic=True)

    def delete(self, location: str, name: str) -> None:
        _check_name(name)
        try:
            os.unlink(os.path.join(location, name))
        except FileNotFoundError:
            pass

    def publish(self, staging: str, final: str) -> None:
        final = os.path.abspath(final)
        old = f"{final}.old-{os.path.basename(staging).rpartition('.tmp-')[2] or 'x'}"
        # entries of other tools in the target directory are kept (hard links), made durable (the commit record's
        # fsync of the staging came before them), then the directory is swapped and the old one removed
        if adopt_foreign_entries(final, staging, own_entry_names(final)):
            writer.fsync_dir(staging)
        writer.replace_dir(staging, final, old, background_delete=self.background_delete)

    def remove(self, location: str, wait: bool = False) -> None:
        """Rename to a hidden ``.trash-*`` sibling first (atomic: the location stops existing whole, never half
        deleted under its own name), then delete it (in a non-daemon thread when ``background_delete``)."""
        location = os.path.abspath(location)
        parent, base = os.path.split(location)
        trash = os.path.join(parent, f"{TRASH_PREFIX}{base}-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(location, trash)
        except FileNotFoundError:
            return
        writer.fsync_dir(parent)
        if self.background_delete and not wait:
            threading.Thread(target=shutil.rmtree, args=(trash, True), name="ckpt-prune", daemon=False).start()
        else:
            shutil.rmtree(trash, ignore_errors=True)

    def sync(self, location: str) -> None:
        writer.fsync_dir(location)

    # reads
    def get(self, location: str, name: str, limit: int | None = None) -> bytes | None:
        _check_name(name)
        target = os.path.join(location, name)
        try:  # regular files only (a FIFO in its place is refused, never blocks)
            return read_capped(target, (1 << 62) if limit is None else limit, name)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def open_read(self, location: str, name: str) -> LocalReadHandle:
        """A regular file inside ``location`` (a symlink out of it is refused; a FIFO never blocks the open)."""
        _check_name(name)
        return LocalReadHandle(resolve_member(location, name))


LOCAL = LocalStorage()


# ------------------------------------------------------------------------------------------ foreign entries
# A save into a directory that holds files of other tools (a trainer's output directory) keeps them: right
# before the atomic swap they are hard-linked (recreated for directories) into the staging directory, so the
# committed directory holds them as well and the old one can be dropped.


def adopt_foreign_entries(final: str, staging: str, ours: set[str]) -> list[str]:
    """Hard-link every entry of ``final`` whose name is not in ``ours`` (and not already in ``staging``) into
    ``staging``; returns the names adopted. Falls back to copying across file systems. A recreated directory is
    fsynced once filled; the caller fsyncs ``staging`` when anything was adopted."""
    try:
        names = os.listdir(final)
    except FileNotFoundError:
        return []
    adopted = []
    for name in names:
        if name in ours or os.path.lexists(os.path.join(staging, name)):
            continue
        _link_tree(os.path.join(final, name), os.path.join(staging, name))
        adopted.append(name)
    return adopted


def _link_tree(src: str, dst: str) -> None:
    if os.path.isdir(src) and not os.path.islink(src):
        os.mkdir(dst)
        shutil.copystat(src, dst, follow_symlinks=False)
        for name in os.listdir(src):
            _link_tree(os.path.join(src, name), os.path.join(dst, name))
        writer.fsync_dir(dst)  # its links survive a power loss once the old directory is gone
        return
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
        if os.path.islink(src):
            os.symlink(os.readlink(src), dst)
        else:
            shutil.copy2(src, dst)


def own_entry_names(final: str) -> set[str]:
    """Names in ``final`` that belong to a checkpoint of this engine (replaced by the new one, not kept)."""
    ours = {COMMIT_FILE, METADATA_FILE, STOCK_METADATA_FILE}
    try:
        names = os.listdir(final)
    except FileNotFoundError:
        return ours
    if COMMIT_FILE not in names and METADATA_FILE not in names:
        return ours  # no checkpoint of ours there: everything else is foreign
    data = re.compile(r"^\d+_0\.safetensors$")
    return ours | {n for n in names if data.match(n)}
