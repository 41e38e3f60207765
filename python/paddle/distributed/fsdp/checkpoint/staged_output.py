"""An output directory that appears complete or not at all: ``staged_output`` (one-process writers' outputs).

Who: the tools (``to-hf``, ``from-hf``, stock ``import``) and the memory tier's flush build their output as files
in a staging directory next to the output, renamed into place when complete. For a URL of a storage backend
(``s3://bucket/prefix``) the staging directory is a local temporary one; when it is complete its files are sent
through the storage interface in the engine's commit order (data objects, then ``metadata.json``, then ``COMMIT``
last) into a staging location and published atomically, so the URL shows the whole output or nothing, as a local
output directory does.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import re
import shutil
import socket
import tempfile
import uuid
import zlib
from collections.abc import Iterator

from . import writer
from .errors import ToolError
from .format.metadata import COMMIT_FILE, METADATA_FILE
from .io.backends import backend_for
from .io.storage import Storage
from .paths import local_path, url_scheme

logger = logging.getLogger(__name__)

SMALL = 1 << 20  # files up to this size are sent as one small object (put)
_OWNER_TAG = re.compile(r"[0-9a-f]{16}")  # host name hash (8) + pid (8): who writes a staging or scratch directory
_STAGING_TAG = re.compile(r"[0-9a-f]{28}")  # owner tag (16) + random (12): what staged_output names its staging


def check_remote_output(url: str) -> Storage:
    """The backend of ``url``; ToolError when something is already published there (never overwrite)."""
    storage = backend_for(url)
    if storage.list(url) or storage.children(url):
        raise ToolError(f"output {url} is not empty; refusing to overwrite it (remove it or pick another)")
    return storage


def _order(name: str) -> tuple[int, str]:
    """Commit order: data files, then metadata.json, then COMMIT last."""
    return (2 if name == COMMIT_FILE else 1 if name == METADATA_FILE else 0, name)


def upload_dir(local: str, url: str, storage: Storage) -> None:
    """Send every file of ``local`` (flat) to a staging location of ``url`` in commit order, then publish it."""
    names = sorted(os.listdir(local), key=_order)
    for name in names:
        if not os.path.isfile(os.path.join(local, name)):
            raise ToolError(f"cannot send {name} to {url}: only flat outputs of files go to object storage")
    staging = storage.begin(url, uuid.uuid4().hex)
    try:
        for name in names:
            path = os.path.join(local, name)
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                if size <= SMALL:
                    storage.put(staging, name, f.read())
                    continue
                with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                    view = memoryview(mm)
                    try:
                        storage.write_object(staging, name, b"", [view], size, None)
                    finally:
                        view.release()
        storage.publish(staging, url)
    except BaseException:
        storage.remove(staging)
        raise


class RemoteStaging:
    """A local temporary staging directory whose files are published at ``url`` on success."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.storage = check_remote_output(url)
        self.local = tempfile.mkdtemp(prefix="paddle-fsdp-ckpt-out-")

    def finish(self) -> None:
        upload_dir(self.local, self.url, self.storage)

    def cleanup(self) -> None:
        shutil.rmtree(self.local, ignore_errors=True)


def check_output_path(out: str) -> None:
    """Refuse an output path that exists as a file, a symbolic link or a non-empty directory (never overwrite);
    for a URL of a storage backend, one where something is published."""
    if url_scheme(out) is not None:
        check_remote_output(local_path(out))
        return
    if os.path.lexists(out):
        if os.path.islink(out):  # refused before any work (the final rename cannot replace a link by a directory)
            raise ToolError(f"output {out} is a symbolic link; give the real directory path (nothing is written)")
        if not os.path.isdir(out):
            raise ToolError(f"output {out} exists and is not a directory")
        if os.listdir(out):
            raise ToolError(
                f"output directory {out} is not empty; refusing to overwrite it (remove it or pick another)"
            )


def _host_tag() -> str:
    return f"{zlib.crc32(socket.gethostname().encode()):08x}"


def owner_tag() -> str:
    """16 hex digits naming the staging directory's owner: a hash of this host's name and this process's id (hex
    only, so a flush's ``step_N.tmp-<hex>`` stays what a checkpoint root's rotation removes, directory.py)."""
    return f"{_host_tag()}{os.getpid() & 0xFFFFFFFF:08x}"


def remove_stale_staging(out: str) -> list[str]:
    """Remove the staging directories that killed writers of ``out`` left: ``<out>.tmp-<owner><random>`` whose
    owner was a process of this host that is gone. Why: a killed ``to-hf`` of a 7B model leaves ~14 GB beside its
    output that nothing else would remove; a rerun must not need a manual cleanup. Left alone: a live owner's (a
    concurrent writer), another host's (a shared file system), names of another shape (older versions, not ours)."""
    parent, base = os.path.split(out)
    prefix = f"{base}.tmp-"
    try:
        names = os.listdir(parent or ".")
    except OSError:
        return []
    removed = []
    for name in names:
        tag = name[len(prefix) :] if name.startswith(prefix) else ""
        if not _STAGING_TAG.fullmatch(tag) or not owner_gone(tag[:16]):
            continue
        path = os.path.join(parent, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        logger.info("removed %d staging director(ies) of killed writers of %s: %s", len(removed), out, removed)
    return removed


def owner_gone(tag: str) -> bool:
    """True when ``tag`` (an ``_owner_tag``) names a process of this host that no longer runs: what it left may go.
    False for a live owner, another host's, or a tag of another shape (nothing is removed on a guess)."""
    if not _OWNER_TAG.fullmatch(tag) or tag[:8] != _host_tag():
        return False
    pid = int(tag[8:], 16)
    if pid <= 0 or pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive (another user's)
        return False
    return False


@contextlib.contextmanager
def staged_output(out: str | os.PathLike) -> Iterator[str]:
    """Yield a fresh staging directory next to ``out``; on success it is fsynced and renamed to ``out``.

    On any error (or Ctrl-C) the staging directory is removed, so ``out`` either appears complete or not at all;
    a hard kill leaves only ``<out>.tmp-<id>``, never something at ``out``, and the next ``staged_output`` of the
    same ``out`` removes it (``remove_stale_staging``). ``out`` may be a URL of a storage backend (``s3://``): the
    staging directory is then a local temporary one, published there (RemoteStaging).
    """
    out = local_path(out)
    if url_scheme(out) is not None:
        remote = RemoteStaging(out)
        try:
            yield remote.local
            remote.finish()
        finally:
            remote.cleanup()
        return
    check_output_path(out)
    parent = os.path.dirname(out)
    try:
        writer.makedirs_durable(parent)
    except OSError as e:
        raise ToolError(f"cannot create the parent directory of {out}: {e.strerror or e}") from None
    remove_stale_staging(out)
    staging = f"{out}.tmp-{owner_tag()}{uuid.uuid4().hex[:12]}"
    try:
        os.mkdir(staging)
    except OSError as e:
        raise ToolError(f"cannot create {staging}: {e.strerror or e}") from None
    try:
        yield staging
        writer.fsync_dir(staging)
        try:
            os.rename(staging, out)  # `out` is absent or an empty directory
        except OSError as e:
            raise ToolError(f"cannot move the finished output into {out}: {e.strerror or e}") from None
        writer.fsync_dir(parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
