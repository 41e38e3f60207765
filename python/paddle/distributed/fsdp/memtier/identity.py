"""The durable root's identity: which run's memory copies belong to this durable root.

Why: memory copies outlive the run that wrote them (``/dev/shm``), and the job id alone does not tell runs
apart. After ``rm -rf durable_root`` a deliberately fresh run silently resumed the old run's copies (step,
weights, LR). Now the tier's first start on a durable root writes a random id into it (the object
``memtier-id``), every copy's header records that id (``durable_id``), and a copy is used (restore,
flush-memory) only when its id is the durable root's: copies of another durable root, or of one that was
removed and started afresh, are ignored with a warning naming both ids.

Collective (``agree``): every rank reads the id through its storage; a rank that cannot read it raises, on every
rank, the same named error; ranks that see different ids raise MemoryTierError; when no rank sees one, rank 0's
new id is written by every rank that lacks it (a shared root gets the same bytes from each: ``put`` is atomic).
"""

from __future__ import annotations

import secrets

from ..checkpoint.directory import StorageUnreadableError  # noqa: F401 - registered for rebuild_remote_error
from ..checkpoint.errors import CheckpointError, rebuild_remote_error
from ..checkpoint.io.backends import backend_for
from .errors import MemoryTierError
from .header import is_durable_id

ID_OBJECT = "memtier-id"


def read_id(root: str, storage=None) -> str | None:
    """The id stored in ``root`` (None: no id there); MemoryTierError for one that is not an id."""
    raw = (storage or backend_for(root)).get(root, ID_OBJECT, 256)
    if raw is None:
        return None
    value = raw.decode("ascii", errors="replace").strip()
    if not is_durable_id(value):
        raise MemoryTierError(f"{root}/{ID_OBJECT} holds {value[:80]!r}, not a memory-tier durable root id")
    return value


def _status(fn):
    try:
        return fn(), None
    except CheckpointError as e:
        return None, (type(e).__name__, f"durable root: {e}")
    except OSError as e:  # never taken for "no id": the root could not be read
        return None, ("StorageUnreadableError", f"durable root: cannot read {ID_OBJECT}: {e}")


def _raise_first(statuses: list) -> None:
    for r, (_v, err) in enumerate(statuses):
        if err is not None:
            raise rebuild_remote_error(*err, r)


def agree(root: str, rank: int, all_gather_object) -> str:
    """The durable root's id, the same on every rank (see the module docstring). Collective."""
    storage = backend_for(root)
    seen = all_gather_object(_status(lambda: read_id(root, storage)))
    _raise_first(seen)
    ids = {v for v, _e in seen if v is not None}
    if len(ids) > 1:
        raise MemoryTierError(f"durable root {root}: ranks see different memory-tier ids {sorted(ids)} (is it "
                              "the same storage on every node?)")  # fmt: skip
    if ids:
        value = ids.pop()
    else:
        value = all_gather_object(secrets.token_hex(16) if rank == 0 else None)[0]
    mine = seen[rank][0]
    written = all_gather_object(
        _status(lambda: None if mine == value else storage.put(root, ID_OBJECT, value.encode()))
    )
    _raise_first(written)
    return value
