"""The restart rule: the newest step EVERY rank can restore, and where each rank's state comes from.

Why collective and pure: a memory tier and storage that disagree about the newest step made data-parallel
groups resume from different iterations (DLRover #1233). Every rank gathers every rank's report and applies this
same function to the same list, so all ranks reach the same decision without another exchange.

"Nothing stored" (a fresh start) needs every rank to have positively seen nothing: no memory copy anywhere and
an empty storage listing on every rank. A rank that could not list storage reports an error instead (raised on
every rank by name before this rule runs), and storage some rank sees but another does not is not "nothing".

A rank's report: ``own`` (step of its own valid memory copy or None), ``held`` (``[source rank, step]`` of the
valid peer copy it holds for another rank, or None), ``storage`` (committed steps in durable storage).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import NoCommonStepError

MEMORY, PEER, STORAGE = "memory", "peer", "storage"


@dataclass
class Decision:
    step: int
    sources: list[str]  # per rank: "memory", "peer" or "storage"
    holders: dict[int, int]  # rank restored from a peer copy -> the rank holding it


def decide(reports: list[dict]) -> Decision | None:
    """The agreed step and sources; None when nothing is stored anywhere (a fresh start); NoCommonStepError when
    state exists but no single step is restorable by every rank. Memory is preferred to storage at equal step; a
    step some rank has only in storage is loaded from storage by every rank (one collective load)."""
    world = len(reports)
    storage = set(reports[0]["storage"]) if reports else set()
    for rep in reports[1:]:
        storage &= set(rep["storage"])
    in_memory: list[dict[int, str]] = [{} for _ in range(world)]
    holder_of: dict[tuple[int, int], int] = {}
    for r, rep in enumerate(reports):
        if rep["own"] is not None:
            in_memory[r][rep["own"]] = MEMORY
        held = rep["held"]
        if held is not None:
            src, step = held
            if 0 <= src < world and src != r:
                in_memory[src].setdefault(step, PEER)
                holder_of.setdefault((src, step), r)
    seen_storage = [sorted(rep["storage"]) for rep in reports]
    if not any(seen_storage) and not any(in_memory):
        return None
    common_memory = set.intersection(*(set(m) for m in in_memory)) if world else set()
    best_memory = max(common_memory, default=None)
    best_storage = max(storage, default=None)
    if best_memory is not None and (best_storage is None or best_memory >= best_storage):
        sources = [in_memory[r][best_memory] for r in range(world)]
        holders = {r: holder_of[(r, best_memory)] for r in range(world) if sources[r] == PEER}
        return Decision(best_memory, sources, holders)
    if best_storage is not None:
        return Decision(best_storage, [STORAGE] * world, {})
    have = "; ".join(f"rank {r}: {sorted(m) or 'nothing'}" for r, m in enumerate(in_memory))
    stored = (
        "nothing"
        if not any(seen_storage)
        else "; ".join(f"rank {r}: {s[-5:] or 'nothing'}" for r, s in enumerate(seen_storage))
    )
    raise NoCommonStepError(
        f"no step is restorable by every rank: in memory (own or peer copy) {have}; in storage (as each rank "
        f"lists it) {stored}"
    )
