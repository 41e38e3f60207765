"""The scratch directory of a merge (``to-hf --merge-adapter``), beside its output, and the ones killed runs left.

Why: the merge writes the whole merged model as a checkpoint before converting it (tools/adapter_merge.py), so a
kill leaves a directory the size of the model beside ``OUT`` (about 14 GB for a 7B base) that nothing else would
ever remove. Each scratch directory names its ``OUT`` and records its owner (``staged_output.owner_tag``: a hash
of the host name and the pid, as a staged output's name does); the next merge into the same ``OUT`` removes those
whose owner is gone from this host (``staged_output.owner_gone``). A live owner's, another host's, or one whose owner
cannot be read is left alone (a concurrent merge, a shared filesystem).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator

from ..checkpoint.staged_output import owner_gone, owner_tag

logger = logging.getLogger(__name__)

OWNER_FILE = "owner"


def _prefix(out: str) -> str:
    return f".{os.path.basename(os.path.normpath(out))}.fsdp-merge-"


def _owner_gone(directory: str) -> bool:
    try:
        with open(os.path.join(directory, OWNER_FILE), encoding="utf-8") as f:
            return owner_gone(f.read().strip())
    except OSError:
        return False


def remove_stale(parent: str, out: str) -> list[str]:
    """Remove the scratch directories of merges into ``out`` whose process is gone from this host."""
    prefix = _prefix(out)
    try:
        names = os.listdir(parent)
    except OSError:
        return []
    removed = []
    for name in names:
        path = os.path.join(parent, name)
        if name.startswith(prefix) and os.path.isdir(path) and not os.path.islink(path) and _owner_gone(path):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        logger.info("removed %d scratch director(ies) of killed merges into %s: %s", len(removed), out, removed)
    return removed


@contextlib.contextmanager
def merge_scratch(parent: str, out: str) -> Iterator[str]:
    """A fresh scratch directory in ``parent`` for the merge into ``out``, removed on exit; stale ones first."""
    remove_stale(parent, out)
    with tempfile.TemporaryDirectory(prefix=_prefix(out), dir=parent) as scratch:
        with open(os.path.join(scratch, OWNER_FILE), "w", encoding="utf-8") as f:
            f.write(owner_tag() + "\n")
        yield scratch
