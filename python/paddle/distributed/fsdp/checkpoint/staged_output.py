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
import mmap
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator

from . import writer
from .errors import ToolError
from .format.metadata import COMMIT_FILE, METADATA_FILE
from .io.backends import backend_for
from .io.storage import Storage
from .paths import local_path, url_scheme

SMALL = 1 << 20  # files up to this size are sent as one small object (put)


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


@contextlib.contextmanager
def staged_output(out: str | os.PathLike) -> Iterator[str]:
    """Yield a fresh staging directory next to ``out``; on success it is fsynced and renamed to ``out``.

    On any error (or Ctrl-C) the staging directory is removed, so ``out`` either appears complete or not at all;
    a hard kill leaves only ``<out>.tmp-<id>``, never something at ``out``. ``out`` may be a URL of a storage
    backend (``s3://``): the staging directory is then a local temporary one, published there (RemoteStaging).
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
    staging = f"{out}.tmp-{uuid.uuid4().hex[:12]}"
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
