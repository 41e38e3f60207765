"""Which own slot a memory save writes: never the one holding the newest step complete on every rank, never the
one a persist still reads.

Why: with one slot a save overwrote the only copy in place, so a crash mid-copy left no complete step, and a save
during a persist (which reads the copy) had to be skipped. With N slots used in turn a save writes a third slot:

* ``common``: the slot of the newest step every rank completed (known from the exchange at the start of each save:
  every rank's previous save finished without error, manager._save_status), or of the restored step;
* ``persist``: the slot a persist still reads (every rank alike: the same exchange says whether one runs).

With two slots both can be taken (a persist that lasts longer than one save interval): the save then overwrites
the ``common`` slot and the persisting step becomes the kept one (complete on every rank, on its way to storage),
so a crash during such a copy resumes from the persisting step; three slots keep the previous step then too
(docs/memory-tier.md, "Memory used"). With one slot a save during a persist is skipped (``None``).

Every rank makes the same choice from the same facts; a rank's slots may still differ in content (a restart
from a peer copy), which is why the restore agrees on steps, never on slot indices.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class SlotChooser:
    """The state of one rank's own slots as the saves see it; ``choose`` gives the next slot to write."""

    def __init__(self, n: int):
        self.n = n
        self.common_slot: int | None = None
        self.common_step = -1  # the newest step complete on every rank (-1: none known)
        self.pending: tuple[int, int] | None = None  # (slot, step) of the save started last
        self.persist_slot: int | None = None
        self.persist_step = -1
        self.overwrites = 0  # saves that overwrote the common slot (two slots, a long persist)

    def previous_done(self, every_rank_ok: bool) -> None:
        """The exchange at a save's start: every rank completed the previous save (its step is kept from now)."""
        if every_rank_ok and self.pending is not None:
            self.common_slot, self.common_step = self.pending
        self.pending = None

    def choose(self, persist_busy: bool) -> int | None:
        """The slot the next save writes; None: one slot, read by a persist (the save is skipped)."""
        taken = {self.common_slot}
        if persist_busy:
            taken.add(self.persist_slot)
        start = 0 if self.common_slot is None else self.common_slot + 1
        for i in range(self.n):
            index = (start + i) % self.n
            if index not in taken:
                return index
        if persist_busy and self.persist_slot is not None:
            if self.n == 1:  # the persist reads the only slot
                return None
            index = self.common_slot  # two slots: keep the persisting step, overwrite the newer one
            self.common_slot, self.common_step = self.persist_slot, self.persist_step
            self.overwrites += 1
            logger.info("memory tier: a persist still reads the slot of step %d: this save overwrites the slot of "
                        "the previous step (a crash during it resumes from step %d; memory_slots=3 keeps both)",
                        self.persist_step, self.persist_step)  # fmt: skip
            return index
        index = 0  # one slot, no persist: overwritten in place (no step kept while it copies)
        self.common_slot, self.common_step = None, -1
        return index

    def started(self, index: int, step: int) -> None:
        self.pending = (index, step)

    def persist_started(self, index: int, step: int) -> None:
        self.persist_slot, self.persist_step = index, step

    def persist_done(self) -> None:
        self.persist_slot, self.persist_step = None, -1

    def restored(self, index: int | None, step: int) -> None:
        """After a restore: the slot holding the restored ``step`` (None: read from a peer or storage) is kept."""
        self.common_slot, self.common_step = index, step
        self.pending = None
        self.persist_done()
