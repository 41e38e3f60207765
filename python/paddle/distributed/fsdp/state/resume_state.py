"""What a resume holds, owned in one place: every item a checkpoint saves, how it is built, how it is applied.

Why one owner: the disk save (``save_checkpoint``), the disk/S3 load (``load_checkpoint``) and the memory tier
(save, restore, the persist of a copy, ``flush-memory``) each used to assemble the state themselves, and the
copies drifted (the memory tier never saved the GradScaler). Now every door calls :func:`build` to capture the
state and :func:`decode` to check it and get the function that applies it; adding a state item is one entry in
:data:`ITEMS`. docs/resume-state.md has the table of what a checkpoint holds and which door restores what.

An item yields tensors (records loaded in place by the engine or the memory copy's one-pass read) and/or one
JSON value under a reserved key (``checkpoint/format/reserved.py``). A per-rank value (RNG, stateful objects) is
saved by every rank as its own entry (``per_rank_values``). :func:`decode` runs before anything is written and
raises the named error of the first problem; the function it returns applies the non-tensor state after the
tensors landed and every rank's check passed. Only user code can still fail there (a stateful object's setter):
every other item is applied all the same and the failures are named (state/apply.py, NotAppliedError).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from ..checkpoint.errors import MetadataError, MissingKeyError, OptimizerMismatchError, ReservedKeyError
from ..checkpoint.format.reserved import (
    BUFFERS_KEY,
    EMA_KEY,
    EXTRA_KEY,
    FROZEN_BASE_KEY,
    GRAD_SCALER_KEY,
    OPTIMIZER_KEY,
    RESERVED_PREFIX,
    RNG_KEY,
    STATEFUL_KEY,
)
from . import frozen_base, rng
from . import grad_scaler as scaler_state
from . import optimizer_states as names
from . import stateful as stateful_state
from .apply import apply_all
from .buffers import persistable_buffers
from .ema import ShardedEMA
from .optimizer_json_state import decode_optimizer_global_state, optimizer_global_state
from .records import optimizer_sharded_state_dict, parameter_records

logger = logging.getLogger(__name__)


@dataclass
class ResumeObjects:
    """What a door saves from and restores into. Only ``fsdp`` is required; ``extra_state`` is the caller's
    JSON dict (returned by a load, not applied). ``with_frozen_base``: a save writes the frozen base's tensors
    too, a load reads them (the checkpoint holds them); else only its reference; None: as
    ``frozen_base.writes_base_by_default`` decides (state/frozen_base.py)."""

    fsdp: Any
    optimizer: Any = None
    grad_scaler: Any = None
    stateful: dict | None = None
    ema: ShardedEMA | None = None
    extra_state: dict | None = None
    with_frozen_base: bool | None = None  # None: frozen_base.writes_base_by_default

    def __post_init__(self) -> None:
        if self.grad_scaler is not None:
            scaler_state.check_scaler(self.grad_scaler)
        self.stateful = stateful_state.check_stateful(self.stateful)
        if self.ema is not None and not isinstance(self.ema, ShardedEMA):
            raise TypeError(f"ema must be a ShardedEMA (fsdp.ema(coef)), got {type(self.ema).__name__}")
        if self.ema is not None and self.ema.fsdp is not self.fsdp:
            raise ValueError("ema was made for another FullyShardFusion model")

    @cached_property
    def buffers(self) -> dict:
        return persistable_buffers(self.fsdp.model)

    @cached_property
    def frozen_base_keys(self) -> list[str]:
        return frozen_base.frozen_keys(self.fsdp)

    @property
    def writes_frozen_base(self) -> bool:
        if self.with_frozen_base is None:
            self.with_frozen_base = frozen_base.writes_base_by_default(self.fsdp)
        return self.with_frozen_base

    @property
    def references_frozen_base(self) -> bool:
        """The frozen parameters are referenced, not written: the state holds their reference instead."""
        return bool(self.frozen_base_keys) and not self.writes_frozen_base

    @property
    def records_frozen_base(self) -> bool:
        """The state holds a FROZEN_BASE_KEY value: a reference, or (an adapter model whose base is written) the
        adapter description the tools' exports need."""
        return self.references_frozen_base or (
            bool(self.frozen_base_keys) and frozen_base.adapter_info(self.fsdp) is not None
        )


class Saved:
    """The JSON values a door read back, as this rank sees them: a checkpoint's values (a per-rank key holds
    every saving rank's entry) or a memory copy's (``own_only``: a per-rank key holds this rank's entry)."""

    def __init__(self, values: dict, rank: int, world: int, own_only: bool = False) -> None:
        self.values, self.rank, self.world, self.own_only = values, rank, world, own_only

    def __contains__(self, key: str) -> bool:
        return key in self.values

    def get(self, key: str) -> Any:
        return self.values.get(key)

    def per_rank(self, key: str) -> Sequence | None:
        """Every saving rank's entry (None: none saved); a memory copy's own entry stands at this rank's index."""
        value = self.values.get(key)
        if value is None or not self.own_only:
            return value
        return [[]] * self.rank + [value] + [[]] * (self.world - self.rank - 1)  # others: an empty entry


@dataclass(frozen=True)
class Item:
    """One kind of state a resume holds. ``tensors(objs)`` -> (records, keys only a step changes);
    ``value(objs)`` -> its JSON value; ``decode(objs, saved, strict, where)`` -> apply. None of them
    is called when the object the item ``needs`` was not given."""

    name: str
    key: str | None = None  # its JSON value's reserved key
    per_rank: bool = False  # every rank saves its own value
    tensors: Callable[[ResumeObjects], tuple[dict, set]] | None = None
    value: Callable[[ResumeObjects], Any] | None = None
    decode: Callable[[ResumeObjects, Saved, bool, str], Callable[[], None]] | None = None
    needs: str | None = None  # the ResumeObjects field it is about: without that object, the item holds nothing
    checked_only: bool = False  # a reference a load checks and never writes (the frozen base), not restored state

    def given(self, objs: ResumeObjects) -> bool:
        return self.needs is None or bool(getattr(objs, self.needs))


def _nothing() -> None:
    return None


# ---------------------------------------------------------------------------------------------- the items
def _parameter_tensors(objs: ResumeObjects) -> tuple[dict, set]:
    records = parameter_records(objs.fsdp)
    if not objs.writes_frozen_base:  # the frozen base is referenced, not written (state/frozen_base.py)
        for key in objs.frozen_base_keys:
            records.pop(key, None)
    trainable = {key for key, _p, buffer, _i in objs.fsdp.managed_parameters() if buffer.layout.trainable}
    return records, {key for key in records if key in trainable}


def _buffer_tensors(objs: ResumeObjects) -> tuple[dict, set]:
    return dict(objs.buffers), set()


def _buffer_value(objs: ResumeObjects) -> list:
    return list(objs.buffers)  # the tools' list (to-hf); the buffers are tensors


def _opt_tensors(objs: ResumeObjects) -> tuple[dict, set]:
    records = optimizer_sharded_state_dict(objs.fsdp, objs.optimizer)
    return records, set(records)


def _opt_value(objs: ResumeObjects) -> Any:
    inner = names.unwrap_optimizer(objs.optimizer)
    return {"class": type(inner).__name__, "global_state": optimizer_global_state(inner)}


def _opt_decode(objs: ResumeObjects, saved: Saved, strict: bool, where: str) -> Callable[[], None]:
    """The optimizer's class must match; its global state (LR scheduler included) is decoded with field types."""
    inner = names.unwrap_optimizer(objs.optimizer)
    given, value = type(inner).__name__, saved.get(OPTIMIZER_KEY)
    if value is None:
        raise OptimizerMismatchError(
            f"{where} has no optimizer state, but an optimizer ({given}) was given: load it without optimizer="
        )
    if type(value) is not dict or type(value.get("class")) is not str:
        raise MetadataError(f"{where}: {OPTIMIZER_KEY} must be an object with a 'class' string")
    if value["class"] != given:
        raise OptimizerMismatchError(f"{where} holds {value['class']} state, but the optimizer given is {given}")
    try:
        return decode_optimizer_global_state(inner, value.get("global_state"))
    except MetadataError as e:
        raise MetadataError(f"{where}: {e}") from None


def _rng_decode(objs: ResumeObjects, saved: Saved, strict: bool, where: str) -> Callable[[], None]:
    return rng.decode(saved.per_rank(RNG_KEY), saved.rank, where)


def _scaler_value(objs: ResumeObjects) -> Any:
    return scaler_state.capture(objs.grad_scaler)


def _scaler_decode(objs: ResumeObjects, saved: Saved, strict: bool, where: str) -> Callable[[], None]:
    present = GRAD_SCALER_KEY in saved
    return scaler_state.decode(objs.grad_scaler, saved.get(GRAD_SCALER_KEY), present, strict, where)


def decode_extra_state(value: Any, where: str) -> dict:
    if value is None:
        return {}
    if type(value) is not dict:
        raise MetadataError(f"{where} must be an object, got {type(value).__name__}")
    return value


def _extra_decode(objs: ResumeObjects, saved: Saved, strict: bool, where: str) -> Callable[[], None]:
    decode_extra_state(saved.get(EXTRA_KEY), f"{where}: {EXTRA_KEY}")  # returned by the load, not applied
    return _nothing


def _stateful_value(objs: ResumeObjects) -> Any:
    return stateful_state.capture(objs.stateful)


def _stateful_decode(objs: ResumeObjects, saved: Saved, strict: bool, where: str) -> Callable[[], None]:
    entries = saved.per_rank(STATEFUL_KEY)
    return stateful_state.decode(objs.stateful, entries, saved.rank, saved.world, strict, where)


def _ema_tensors(objs: ResumeObjects) -> tuple[dict, set]:
    records = objs.ema.records()
    return records, set(records)  # changed only by ema.update(), which waits for an async save's copy


def _ema_value(objs: ResumeObjects) -> Any:
    return objs.ema.value()


def _ema_decode(objs: ResumeObjects, saved: Saved, strict: bool, where: str) -> Callable[[], None]:
    ema = objs.ema
    if EMA_KEY not in saved:
        message = f"{where} holds no EMA (saved without ema=)"
        if strict:
            raise MissingKeyError(f"{message}; pass strict=False to restart the EMA at the loaded weights")

        def restart() -> None:
            logger.warning("%s: the EMA restarts at the loaded weights", message)
            ema.reset()

        return restart
    return ema.decode(saved.get(EMA_KEY), f"{where}: {EMA_KEY}")


def _frozen_base_value(objs: ResumeObjects) -> Any:
    # the fingerprint is computed collectively by the door before the capture (state/resume.py ``_capture``, the
    # memory tier at its start): the capture itself joins no collective
    if objs.references_frozen_base:
        return frozen_base.reference(objs.fsdp, collective=False)
    return frozen_base.saved_reference(objs.fsdp)


def _frozen_base_decode(objs: ResumeObjects, saved: Saved, strict: bool, where: str) -> Callable[[], None]:
    frozen_base.check(objs.fsdp, saved.get(FROZEN_BASE_KEY), where)  # (the disk load checks after computing it)
    return _nothing


# in the order a save has always written them (values: optimizer, buffers, RNG, extra_state, GradScaler)
ITEMS: tuple[Item, ...] = (
    Item("parameters", tensors=_parameter_tensors),
    # accumulators and master weights (tensors); class and global state with the LR scheduler (value)
    Item("optimizer", OPTIMIZER_KEY, tensors=_opt_tensors, value=_opt_value, decode=_opt_decode, needs="optimizer"),
    Item("buffers", BUFFERS_KEY, tensors=_buffer_tensors, value=_buffer_value),
    Item("rng", RNG_KEY, per_rank=True, value=lambda objs: rng.capture(), decode=_rng_decode),
    Item("extra_state", EXTRA_KEY, value=lambda objs: dict(objs.extra_state or {}), decode=_extra_decode),
    Item("grad_scaler", GRAD_SCALER_KEY, value=_scaler_value, decode=_scaler_decode, needs="grad_scaler"),
    Item("stateful", STATEFUL_KEY, per_rank=True, value=_stateful_value, decode=_stateful_decode, needs="stateful"),
    Item("ema", EMA_KEY, tensors=_ema_tensors, value=_ema_value, decode=_ema_decode, needs="ema"),
    Item(
        "frozen_base",
        FROZEN_BASE_KEY,
        value=_frozen_base_value,
        decode=_frozen_base_decode,
        needs="records_frozen_base",
        checked_only=True,
    ),
)
PER_RANK_KEYS: tuple[str, ...] = tuple(item.key for item in ITEMS if item.per_rank and item.key)
VALUE_KEYS: tuple[str, ...] = tuple(item.key for item in ITEMS if item.key)


@dataclass
class Built:
    """A captured state: ``tensors`` (key -> tensor or ShardedWeight) and ``values`` (reserved key -> JSON) as
    the engine saves them; ``deferred``: tensor keys only an optimizer step (or ``ema.update``) changes, which an
    async save may copy after it returned; ``by_item``: the keys each item produced."""

    tensors: dict = field(default_factory=dict)
    values: dict = field(default_factory=dict)
    deferred: set = field(default_factory=set)
    by_item: dict = field(default_factory=dict)

    def state_dict(self) -> dict:
        """Tensors and values in one dict, as ``save_state_dict`` takes it."""
        return {**self.tensors, **self.values}

    @property
    def per_rank_keys(self) -> tuple[str, ...]:
        """The per-rank value keys this state holds (``save_state_dict``'s ``per_rank_values``)."""
        return tuple(key for key in PER_RANK_KEYS if key in self.values)


def build(objs: ResumeObjects) -> Built:
    """Capture everything a resume needs from ``objs`` (values at the call; tensors as live records). No
    collective: a rank whose capture fails (user code: a stateful object, an EMA) must still reach its door's
    exchange, which tells every rank (the disk save: state/resume.py)."""
    out = Built()
    for item in ITEMS:
        keys: list[str] = []
        out.by_item[item.name] = keys
        if not item.given(objs):
            continue
        if item.tensors is not None:
            records, deferred = item.tensors(objs)
            _refuse_reserved(item.name, records)  # before the buffers' exchange: every rank raises it alone
            out.tensors.update(records)
            out.deferred |= deferred
            keys.extend(records)
        if item.value is not None:
            out.values[item.key] = item.value(objs)
            keys.append(item.key)
    return out


def _refuse_reserved(item: str, records: dict) -> None:
    """ReservedKeyError naming the first key of ``records`` under the reserved prefix: the one-call API's own
    values live there, and a load would take such a tensor for one of them (a sublayer named ``__fsdp__``)."""
    reserved = sorted(key for key in records if key.startswith(RESERVED_PREFIX))
    if reserved:
        raise ReservedKeyError(
            f"{item} key {reserved[0]!r}{f' (and {len(reserved) - 1} more)' if len(reserved) > 1 else ''} starts "
            f"with the reserved prefix {RESERVED_PREFIX!r} (a sublayer named {RESERVED_PREFIX[:-1]!r}?): rename it"
        )


def load_targets(objs: ResumeObjects) -> dict:
    """The tensors a load writes into, keyed as saved (the same records :func:`build` captures)."""
    targets: dict = {}
    for item in ITEMS:
        if item.tensors is not None and item.given(objs):
            targets.update(item.tensors(objs)[0])
    return targets


def requested_values(objs: ResumeObjects, present) -> list[str]:
    """The value keys a load asks the engine for: RNG and ``extra_state`` always (a checkpoint lacking them is
    reported), the others when their objects were given and the checkpoint holds them (an item's decode says
    what a missing one means)."""
    always = (RNG_KEY, EXTRA_KEY)
    return [
        item.key
        for item in ITEMS
        if item.key is not None
        and item.decode is not None
        and item.given(objs)
        and (item.key in always or item.key == OPTIMIZER_KEY or item.key in present)
    ]


def left_unrequested(objs: ResumeObjects, saved: Saved) -> list[str]:
    """The saved items a load of ``objs`` leaves behind: those whose object was not given (``optimizer`` with
    its LR scheduler, ``grad_scaler``, ``stateful``, ``ema``), and stateful objects saved under names not given
    (``stateful['name']``, from this rank's entry, else saving rank 0's)."""
    out = []
    for item in ITEMS:
        if item.needs is None or item.key is None or item.key not in saved:
            continue
        if not item.given(objs):
            out.append(item.name)
        elif item.name == "stateful":
            entries = saved.per_rank(STATEFUL_KEY)  # a Sequence read by rank (format/rank_values.py)
            if isinstance(entries, Sequence) and not isinstance(entries, (str, bytes)) and len(entries):
                entry = entries[saved.rank] if saved.rank < len(entries) else entries[0]
                names = entry if isinstance(entry, dict) else {}
                out.extend(f"stateful[{name!r}]" for name in sorted(names) if name not in objs.stateful)
    return out


def decode(objs: ResumeObjects, saved: Saved, strict: bool, where: str) -> Callable[[], None]:
    """Check every item's saved value for ``objs`` before anything is written (the first problem raises its
    named error); returns the function applying them all, in ITEMS order, after the tensors landed."""
    actions = [
        (item.name, item.decode(objs, saved, strict, where)) for item in ITEMS if item.decode and item.given(objs)
    ]

    def apply() -> None:
        apply_all(actions)  # user code (a stateful object's setter) may still raise: the rest is applied, it is named

    return apply


def checkpoint_world(fsdp) -> int:
    """The number of ranks in ``fsdp._checkpoint_group`` (every rank under HSDP)."""
    if fsdp.group_layout.replicate_degree > 1:
        import paddle.distributed as dist

        return dist.get_world_size()
    return fsdp.world_size
