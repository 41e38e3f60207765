"""Directory checks and moves that let saves work in directories as users have them.

* ``check_shared_directory``: collective check, right after a save's exchange, that every rank sees the
  coordinator's directory (same path string AND same file system). Ranks given different directories, or
  node-local disks behind one path, fail on every rank within the time of two all-gathers instead of waiting for
  the commit timeout. ``check_shared_directory_once`` skips it for paths the group already checked.
* (the adoption of other tools' files by a save moved to the local storage backend, io/local.py)
"""

from __future__ import annotations

import os
import uuid

from ..coordination import Comm
from .errors import DirectoryMismatchError

PROBE_PREFIX = ".paddle-fsdp-probe-"


_verified: set = set()  # (group, every rank's parent directory, coordinator) that passed check_shared_directory


def check_shared_directory_once(path: str, all_paths: list[str], group: Comm, coordinator: int) -> None:
    """``check_shared_directory``, skipped for a directory whose parent the group already checked.

    ``all_paths`` is every rank's path as the save's exchange gathered it, so every rank takes the same decision:
    different names are refused at once (no collective needed), and the set of checked parents grows only after
    a check that passed on every rank. A training job saving ``root/step_<N>`` again and again then pays the two
    collectives and the probe file of the check once (they cost an async save's caller about 5 ms here)."""
    names = {os.path.basename(p) for p in all_paths}
    if len(names) > 1:
        differ = {r: p for r, p in enumerate(all_paths) if p != all_paths[coordinator]}
        raise DirectoryMismatchError(
            f"save to {all_paths[coordinator]}: ranks were given different directories {differ} (coordinator rank "
            f"{coordinator}: {all_paths[coordinator]}). This engine commits one checkpoint in one directory shared "
            f"by all ranks; give every rank the same path on a shared file system"
        )
    g = group.group
    parents = tuple(os.path.dirname(p) for p in all_paths)
    key = (getattr(g, "id", None), tuple(getattr(g, "ranks", None) or ()), group.world, parents, coordinator)
    if key in _verified:
        return
    check_shared_directory(path, group, coordinator)
    _verified.add(key)


def check_shared_directory(path: str, group: Comm, coordinator: int) -> None:
    """Collective: raise DirectoryMismatchError on every rank unless all ranks see one directory for ``path``."""
    if group.world == 1:
        return
    path = os.path.abspath(os.fspath(path))
    parent = os.path.dirname(path) or "."
    probe = None
    err = None
    if group.rank == coordinator:
        try:
            os.makedirs(parent, exist_ok=True)
            probe = os.path.join(parent, f"{PROBE_PREFIX}{os.path.basename(path)}-{uuid.uuid4().hex}")
            with open(probe, "wb"):
                pass
        except OSError as e:
            err = f"cannot create {probe or parent}: {e}"
    gathered = group.all_gather_object((path, os.path.basename(probe) if probe else None, err))
    try:
        name = gathered[coordinator][1]
        # the probe sits beside the target: the same parent (seen through this rank's path) and the same base name
        same_name = os.path.basename(path) == os.path.basename(gathered[coordinator][0])
        seen = name is not None and same_name and os.path.exists(os.path.join(parent, name))
        answers = group.all_gather_object(seen)
    finally:
        if probe is not None:
            try:
                os.unlink(probe)
            except OSError:
                pass
    if gathered[coordinator][2]:
        raise DirectoryMismatchError(f"save to {path}: coordinator rank {coordinator}: {gathered[coordinator][2]}")
    paths = [g[0] for g in gathered]
    blind = [r for r, ok in enumerate(answers) if not ok]
    if blind:
        differ = {r: p for r, p in enumerate(paths) if p != paths[coordinator]}
        why = (
            f"ranks were given different directories {differ} (coordinator rank {coordinator}: {paths[coordinator]})"
            if differ
            else "the path is on a file system the coordinator's files do not appear on (node-local disks?)"
        )
        raise DirectoryMismatchError(
            f"save to {paths[coordinator]}: ranks {blind} cannot see the coordinator's directory: {why}. This engine "
            f"commits one checkpoint in one directory shared by all ranks; give every rank the same path on a shared "
            f"file system (stock's format, safetensors=False, writes per-rank files and allows node-local "
            f"directories)"
        )
