"""What a memory copy holds for a FullyShardFusion model: exactly what ``save_checkpoint`` saves, as built by the
owner of the resume state (state/resume_state.py), as tensor records plus JSON values, and how it is applied.

Why the same state: a resume from memory must be bit-exact like one from storage, and a memory copy persisted
after a crash must become the same committed checkpoint a direct save would have written. A copy holds this
rank's entry of each per-rank value (RNG, stateful objects); a persist or a flush writes every rank's.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..checkpoint import host_memory
from ..checkpoint.errors import InvalidStateDictError, OptimizerMismatchError
from ..checkpoint.records import TensorRecord, collect
from ..state import resume_state
from ..state.resume_state import ResumeObjects
from .errors import InvalidMemoryCopyError


@dataclass
class TierState:
    records: list[TensorRecord]  # tensors, in a fixed order
    deferred: set[str]  # keys whose tensors change only through an optimizer step (copied in the background)
    layout: list[list]  # [key, dtype, shape, nbytes] per record: what a memory copy must match to be used
    descs: list  # per record its description in the engine's wire form (region, replicated): a copy is persisted
    # as the committed checkpoint a direct save would write (persist.py, flush.py)

    @property
    def nbytes(self) -> int:
        return sum(item[3] for item in self.layout)


def _nbytes(t) -> int:
    return host_memory.numel_of(t) * t.element_size()


def _tier_state(tensors: dict, deferred: set) -> TierState:
    records, values = collect(dict(tensors))
    if values:
        raise InvalidStateDictError(f"unexpected non-tensor entries in the model state: {sorted(values)[:5]}")
    layout = [[r.key, r.dtype, list(map(int, r.tensor.shape)), _nbytes(r.tensor)] for r in records]
    return TierState(records, deferred, layout, [r.desc().to_wire() for r in records])


def capture(objs: ResumeObjects) -> tuple[TierState, dict]:
    """A save's tensors and its JSON values, captured at the call (the values change right after it); only
    this rank's entry of a per-rank value (a persist gathers every rank's)."""
    built = resume_state.build(objs)
    return _tier_state(built.tensors, built.deferred), built.values


def tensor_state(objs: ResumeObjects) -> TierState:
    """The tensors a restore reads into, in the order a save writes them."""
    return _tier_state(resume_state.load_targets(objs), set())


def decode_values(objs: ResumeObjects, values: dict, where: str):
    """Check the JSON values of a copy before anything is written; returns the function applying them. A copy
    of another optimizer class is not used (InvalidMemoryCopyError: the restore takes another source)."""
    saved = resume_state.Saved(values, objs.fsdp.rank, objs.fsdp.world_size, own_only=True)
    try:
        return resume_state.decode(objs, saved, True, where)
    except OptimizerMismatchError as e:
        raise InvalidMemoryCopyError(str(e)) from None
