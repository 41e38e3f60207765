"""Tool outputs (``to-hf``, ``from-hf``, stock ``import``) at a URL of a storage backend (``s3://bucket/prefix``).

Why: the tools build their output as files in a staging directory. For a URL the staging directory is a local
temporary one; when it is complete its files are sent through the storage interface in the engine's commit
order (data objects, then ``metadata.json``, then ``COMMIT`` last) into a staging location and published
atomically, so the URL shows the whole output or nothing, as a local output directory does.
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
import uuid

from ..checkpoint.format.metadata import COMMIT_FILE, METADATA_FILE
from ..checkpoint.io.backends import backend_for
from ..checkpoint.io.storage import Storage
from .errors import ToolError

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
