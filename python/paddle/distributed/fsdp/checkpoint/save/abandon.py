"""A failed save removes its staging location ``<path>.tmp-<id>``: every rank leaves, then each removes it.

Why: a save that failed with an error (a full disk, most often) must not leave what it wrote behind, or the next
save starts with less space than the failed one had. No rank can remove the staging as soon as it fails: the
other ranks may still be writing into it (they learn of the failure from the channel between slabs) or waiting
for the coordinator's decision. So every rank that gives up a failed save first drops its own data object
(commit.py does), then says so on the channel (``leave``) and waits, bounded, until every rank has; then each
removes the staging it sees (``Storage.remove``: atomic, and a no-op for a location already gone, so on a shared
file system the first rank removes it and on node-local disks each node removes its own). Removal renames
before it deletes, which a full disk allows. A rank that was killed never leaves: the others stop waiting once
its heartbeat is gone, and its staging is removed by the next save to the same path
(``markers.remove_failed_stagings``).
"""

from __future__ import annotations

import logging

from ..errors import SaveFailedError
from ..io.storage import Storage

logger = logging.getLogger(__name__)


def leave_timeout(commit_timeout: float, lease: float) -> float:
    """How long a rank waits for the others to leave a failed save: a live rank leaves within one slab of writing
    (it checks for failures between slabs), a dead one is found by its heartbeat within ``lease``."""
    return min(commit_timeout, 2 * lease)


def leave_failed_save(storage: Storage, staging: str, channel, world: int, timeout: float) -> bool:
    """This rank is done with the failed save in ``staging``; remove the staging once every rank is (at most
    ``timeout`` seconds of waiting). Never raises; True: removed here (or already gone)."""
    try:
        channel.leave()
        channel.wait(
            lambda: channel.left() >= world or channel.is_committed(),
            timeout,
            "every rank to leave the failed save",
            range(world),
        )
        if channel.is_committed():  # failed after its commit (e.g. publishing `latest`): the staging is final now
            return False
    except (SaveFailedError, TimeoutError, OSError) as e:
        logger.warning("failed save: %s; its staging %s is left for the next save to remove", e, staging)
        return False
    except Exception as e:  # noqa: BLE001 - an unreachable store: the same fallback
        logger.warning("failed save: the ranks could not agree on leaving %s (%s); left for the next save", staging, e)
        return False
    try:
        storage.remove(staging, wait=True)
    except Exception as e:  # noqa: BLE001 - best effort; the next save removes it
        logger.warning("failed save: could not remove its staging %s: %s", staging, e)
        return False
    return True
