"""What a memory copy holds for a FullyShardFusion model and its optimizer: the same state as ``save_checkpoint``
(parameters, optimizer state, persistable buffers, optimizer global state with the LR scheduler, this rank's RNG,
the caller's ``extra_state``), as tensor records plus JSON values, and how it is written back.

Why the same state: a resume from memory must be bit-exact like one from storage, and a memory copy persisted
after a crash must become the same committed checkpoint a direct save would have written.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..checkpoint import host_memory
from ..checkpoint.errors import InvalidStateDictError
from ..checkpoint.format.reserved import BUFFERS_KEY, EXTRA_KEY, OPTIMIZER_KEY, RNG_KEY
from ..checkpoint.records import TensorRecord, collect
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


def tensor_state(fsdp, optimizer) -> TierState:
    model = fsdp.sharded_state_dict()
    opt_state = fsdp.optimizer_sharded_state_dict(optimizer) if optimizer is not None else {}
    trainable = {key for key, _p, buffer, _i in fsdp.managed_parameters() if buffer.layout.trainable}
    deferred = {k for k in model if k in trainable} | set(opt_state)
    state = dict(model)
    state.update(opt_state)
    records, values = collect(state)
    if values:
        raise InvalidStateDictError(f"unexpected non-tensor entries in the model state: {sorted(values)[:5]}")
    layout = [[r.key, r.dtype, list(map(int, r.tensor.shape)), _nbytes(r.tensor)] for r in records]
    return TierState(records, deferred, layout, [r.desc().to_wire() for r in records])


def buffer_keys(fsdp) -> list[str]:
    """The model's persistable buffer keys (saved as ``BUFFERS_KEY``, like ``save_checkpoint`` does)."""
    from ..state.buffers import persistable_buffers

    return list(persistable_buffers(fsdp.model))


def capture_values(fsdp, optimizer, extra_state: dict | None, buffers: list[str]) -> dict:
    """The JSON values of a save, captured at the call (they change right after it): the same values
    ``save_checkpoint`` writes, with only this rank's RNG state (a persist gathers every rank's)."""
    from ..state import optimizer_states as names
    from ..state import rng

    values = {EXTRA_KEY: dict(extra_state or {}), RNG_KEY: rng.capture(), BUFFERS_KEY: list(buffers)}
    if optimizer is not None:
        inner = names.unwrap_optimizer(optimizer)
        values[OPTIMIZER_KEY] = {"class": type(inner).__name__, "global_state": names.optimizer_global_state(inner)}
    return values


def decode_values(fsdp, optimizer, values: dict, where: str):
    """Check the JSON values of a copy before anything is written; returns the function applying them."""
    from ..state import optimizer_states as names
    from ..state import rng

    apply_opt = None
    if optimizer is not None:
        saved = values.get(OPTIMIZER_KEY)
        inner = names.unwrap_optimizer(optimizer)
        if type(saved) is not dict or saved.get("class") != type(inner).__name__:
            raise InvalidMemoryCopyError(f"{where}: optimizer state of another class ({saved and saved.get('class')})")
        apply_opt = names.decode_optimizer_global_state(inner, saved.get("global_state"))
    mine = values.get(RNG_KEY)
    apply_rng = rng.decode([[]] * fsdp.rank + [mine], fsdp.rank, where) if mine is not None else (lambda: None)

    def apply() -> None:
        if apply_opt is not None:
            apply_opt()
        apply_rng()

    return apply
