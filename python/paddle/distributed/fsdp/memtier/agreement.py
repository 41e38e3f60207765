"""The restart rule: the newest step EVERY rank can restore, and where each rank's state comes from.

Why collective and pure: a memory tier and storage that disagree about the newest step made data-parallel
groups resume from different iterations (DLRover #1233). Every rank gathers every rank's report and applies this
same function to the same list, so all ranks reach the same decision without another exchange.

"Nothing stored" (a fresh start) needs every rank to have positively seen nothing: no memory copy anywhere and
an empty storage listing on every rank. A rank that could not list storage reports an error instead (raised on
every rank by name before this rule runs), and storage some rank sees but another does not is not "nothing".

A rank's report: ``own`` (steps of its own valid memory copies: a list, or one step or None from the
single-slot form), ``held`` (``[source rank, step]`` of the valid peer copy it holds for another rank, or None),
``storage`` (committed steps in durable storage), ``seen`` (optional: the newest step its interrupted slots name as
complete on every rank when they were written: evidence that state existed), ``never`` (optional: the rank has no valid copy and its slots
show a first save interrupted, so no step was ever complete on every rank), ``where`` (optional: host and job
directory of its copies, for the error message).

A first save interrupted on some rank while others completed theirs leaves no common step: when storage is empty
on every rank and each rank without any copy reports ``never``, the ranks resume from the start (``None``):
exactly the newest step complete on every rank (none). Otherwise, with no common step, NoCommonStepError names
each rank's steps, the directories to delete and the job id to change (the restart never needs guessing).
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import NoCommonStepError

MEMORY, PEER, STORAGE, FRESH = "memory", "peer", "storage", "fresh"


@dataclass
class Decision:
    step: int
    sources: list[str]  # per rank: "memory", "peer", "storage" (or every rank "fresh": step -1)
    holders: dict[int, int]  # rank restored from a peer copy -> the rank holding it


def decide(reports: list[dict]) -> Decision | None:
    """The agreed step and sources; None when nothing is stored anywhere (a fresh start), a Decision of step -1
    with every source ``fresh`` after an interrupted first save (see the module docstring); NoCommonStepError when
    state exists but no single step is restorable by every rank. Memory is preferred to storage at equal step; a
    step some rank has only in storage is loaded from storage by every rank (one collective load)."""
    world = len(reports)
    storage = set(reports[0]["storage"]) if reports else set()
    for rep in reports[1:]:
        storage &= set(rep["storage"])
    in_memory: list[dict[int, str]] = [{} for _ in range(world)]
    holder_of: dict[tuple[int, int], int] = {}
    for r, rep in enumerate(reports):
        own = rep["own"]
        for step in own if isinstance(own, list) else [] if own is None else [own]:
            in_memory[r][step] = MEMORY
        held = rep["held"]
        if held is not None:
            src, step = held
            if 0 <= src < world and src != r:
                in_memory[src].setdefault(step, PEER)
                holder_of.setdefault((src, step), r)
    seen_storage = [sorted(rep["storage"]) for rep in reports]
    seen = {r: rep["seen"] for r, rep in enumerate(reports) if rep.get("seen", -1) >= 0}
    if not any(seen_storage) and not any(in_memory) and not seen:
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
    if not any(seen_storage) and all(m or rep.get("never") for m, rep in zip(in_memory, reports)):
        if any(rep.get("never") for rep in reports):
            return Decision(-1, [FRESH] * world, {})  # a first save interrupted: no step was ever common
    have = "; ".join(f"rank {r}: {sorted(m) or 'nothing'}" for r, m in enumerate(in_memory))
    stored = (
        "nothing"
        if not any(seen_storage)
        else "; ".join(f"rank {r}: {s[-5:] or 'nothing'}" for r, s in enumerate(seen_storage))
    )
    lost = f"; interrupted copies name steps complete on every rank before (rank: step) {seen}" if seen else ""
    where = sorted({rep["where"] for rep in reports if rep.get("where")})
    delete = (f"delete the memory copies of this job ({', '.join(where)}; on every node) to resume from storage "
              "or from the start" if where else "delete the job's directory under every node's memory root")  # fmt: skip
    raise NoCommonStepError(
        f"no step is restorable by every rank: in memory (own or peer copy) {have}; in storage (as each rank "
        f"lists it) {stored}{lost}. To restart: {delete}, or pass another job_id (PADDLE_FSDP_JOB_ID) to ignore these "
        "copies (they then stay in memory until deleted)"
    )
