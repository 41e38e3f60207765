"""A failed save removes its staging directory ``<path>.tmp-<id>``: the last rank to give it up deletes it.

Why: a save that failed with an error (a full disk, most often) must not leave what it wrote behind, or the next
save starts with less space than the failed one had. No rank can delete the staging directory alone as soon as it
fails: the other ranks learn of the failure from the markers inside it (save.py). So every rank that leaves a
failed save first removes its own data file (save.py does), then drops an empty ``<rank>.left`` marker (an empty
file takes no data block, so it can be created on a full disk); the rank that finds every rank's marker there
removes the whole directory. A rank that was killed never leaves: its save's staging directory is then removed by
the next save to the same path (``save.remove_failed_stagings``), as before.
"""

from __future__ import annotations

import logging
import os
import shutil

from .format.metadata import PARTS_DIR

logger = logging.getLogger(__name__)

LEFT_SUFFIX = ".left"


def leave_failed_save(staging: str, rank: int, world: int) -> bool:
    """This rank is done with the failed save in ``staging``; remove it when every rank is. True: removed."""
    parts = os.path.join(staging, PARTS_DIR)
    if not os.path.isdir(parts):  # nothing of the save is there (renamed into place, or never created): no marker
        return False
    try:
        os.close(os.open(os.path.join(parts, f"{rank}{LEFT_SUFFIX}"), os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644))
    except OSError as e:  # the next save's remove_failed_stagings is the fallback
        logger.warning(
            "failed save: could not mark rank %d as gone from %s (%s); left for the next save", rank, staging, e
        )
        return False
    try:
        names = set(os.listdir(parts))
    except OSError:
        return False
    if any(f"{r}{LEFT_SUFFIX}" not in names for r in range(world)):
        return False
    shutil.rmtree(staging, ignore_errors=True)
    if os.path.lexists(staging):
        logger.warning("failed save: could not remove its staging directory %s", staging)
        return False
    return True
