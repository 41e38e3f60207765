"""The frozen base of a model (LoRA and other adapter fine-tuning): a checkpoint keeps a reference to it, not its tensors.

Why: frozen parameters (``stop_gradient=True``) never change during a run, so writing them into every checkpoint
only repeats the base model (about 14 GB per checkpoint for a 7B base, where the adapters and their optimizer
state are tens of MB). By default a checkpoint therefore holds the trainable parameters, their optimizer state
and the resume state, and under :data:`FROZEN_BASE_KEY` a reference to the base: how many frozen parameters and
bytes, where it came from (``fsdp.base_source``, else the model config's ``name_or_path`` when it has one) and a
content fingerprint. A resume checks the fingerprint and refuses another base with FrozenBaseMismatchError,
before anything is written. ``save_frozen=True`` writes the base too (a run whose base exists nowhere else);
such a checkpoint restores the base and needs no check. Not told (``save_frozen=None``), a save writes the frozen
parameters when they are no larger than the trainable ones (:func:`writes_base_by_default`).

The fingerprint is the same at every world size and is what a tool would compute from whole weights: xxh3-64 of
each frozen parameter's bytes (its whole value, gathered one buffer at a time as a forward would; each rank
hashes a share of the parameters and the digests are exchanged), combined over the parameters sorted by key
with their dtypes and shapes. It is computed once per run (cached on the model; a load that writes the base
drops it). Expert parameters under expert parallelism are always saved (their buffers are sharded over another
group and are not part of the base reference).
"""

from __future__ import annotations

import logging
from typing import Any

from ..checkpoint.errors import FrozenBaseMismatchError, MetadataError

logger = logging.getLogger(__name__)

ALGORITHM = "xxh3-64/param-sorted-v1"
_CACHE_ATTR = "_frozen_base_fingerprint"


def is_base_buffer(buffer) -> bool:
    """Whether ``buffer`` holds frozen base parameters (not trainable, not experts)."""
    return not buffer.layout.trainable and not buffer.layout.attrs.get("expert")


def frozen_keys(fsdp) -> list[str]:
    """The keys of the frozen base's parameters, in model order."""
    return [key for key, _p, buffer, _i in fsdp.managed_parameters() if is_base_buffer(buffer)]


def _bytes(fsdp, base: bool) -> int:
    return sum(
        slot.numel * buffer.shard.element_size()
        for buffer in fsdp.buffers
        if is_base_buffer(buffer) == base and (base or buffer.layout.trainable)
        for slot in buffer.layout.slots
    )


def writes_base_by_default(fsdp) -> bool:
    """Whether a save writes the frozen parameters when not told (``save_frozen=None``): when they are no larger
    than the trainable ones (a frozen positional table, a frozen norm: they cost nothing and keep the checkpoint
    self-contained); a base that dominates the model (LoRA and other adapters) is referenced. The same on every
    rank (from the buffers' layouts)."""
    return _bytes(fsdp, base=True) <= _bytes(fsdp, base=False)


def base_source(fsdp) -> str | None:
    """Where the base came from: ``fsdp.base_source`` when the caller set it, else the model config's
    ``name_or_path`` (PaddleFormers and Hugging Face models record the directory or hub name they loaded)."""
    given = getattr(fsdp, "base_source", None)
    if given:
        return str(given)
    model = fsdp.model
    for candidate in (model, getattr(model, "model", None)):  # a LoRAModel wraps the base as .model
        config = getattr(candidate, "config", None)
        for attr in ("name_or_path", "_name_or_path"):
            value = getattr(config, attr, None) if config is not None else None
            if isinstance(value, str) and value:
                return value
    return None


def digest_entry(dtype: str, shape, raw) -> str:
    """One parameter's part of the fingerprint: ``"dtype[shape]:xxh3"`` of its whole value's bytes (row-major);
    what the tools compute from a checkpoint's tensors too (tools/adapter_base.py)."""
    import xxhash

    return f"{dtype}{[int(n) for n in shape]}:{xxhash.xxh3_64_hexdigest(raw)}"


def combine(digests: dict[str, str]) -> str:
    """The fingerprint of the parameters whose ``digest_entry`` values are ``digests`` (key -> entry)."""
    import xxhash

    combined = xxhash.xxh3_64()
    for key in sorted(digests):
        combined.update(f"{key}={digests[key]}\n".encode())
    return combined.hexdigest()


def _digests_of_my_share(fsdp) -> dict[str, str]:
    """``key -> "dtype[shape]:xxh3"`` of the frozen parameters this rank hashes (every ``world``-th one)."""
    from ..checkpoint import host_memory

    out: dict[str, str] = {}
    position = 0
    for buffer in fsdp.buffers:
        if not is_base_buffer(buffer):
            continue
        was_gathered = buffer.is_gathered
        buffer.gather(full_precision=True)  # collective: every rank gathers every base buffer in the same order
        try:
            for param, slot in zip(buffer.params, buffer.layout.slots):
                if position % fsdp.world_size == fsdp.rank:
                    arr, _keep = host_memory.raw_view(param.cpu())
                    out[slot.key] = digest_entry(host_memory.dtype_name(param), slot.shape, arr)
                position += 1
        finally:
            if not was_gathered:
                buffer.release()
    return out


def fingerprint(fsdp, collective: bool = True) -> dict | None:
    """The base's reference (``{"algorithm", "fingerprint", "parameters", "bytes"}``), computed once per run;
    None for a model without frozen parameters. Collective on its first call; ``collective=False`` (the memory
    tier's collective-free saves) returns the cached one or None."""
    cached = getattr(fsdp, _CACHE_ATTR, None)
    if cached is not None or not collective:
        return cached or None
    keys = frozen_keys(fsdp)
    if not keys:
        setattr(fsdp, _CACHE_ATTR, {})
        return None
    mine = _digests_of_my_share(fsdp)
    every: dict[str, str] = {}
    for share in fsdp.comm.all_gather_object(mine):
        every.update(share)
    if sorted(every) != sorted(keys):
        raise RuntimeError(f"frozen base fingerprint: ranks hashed {len(every)} of {len(keys)} frozen parameters")
    total = _bytes(fsdp, base=True)
    value = {"algorithm": ALGORITHM, "fingerprint": combine(every), "parameters": len(keys), "bytes": total}
    setattr(fsdp, _CACHE_ATTR, value)
    logger.info("frozen base: %d parameters, %d bytes, fingerprint %s", len(keys), total, value["fingerprint"])
    return value


def forget(fsdp) -> None:
    """Drop the cached fingerprint (a load wrote the base)."""
    setattr(fsdp, _CACHE_ATTR, None)


def adapter_info(fsdp) -> dict | None:
    """What the exports need to write the trainable part as an adapter: a PaddleFormers ``LoRAModel`` records its
    LoRA config and the prefix its own keys add to the base model's (``model.``); None for another model."""
    config = getattr(fsdp.model, "lora_config", None)
    if config is None or not callable(getattr(config, "to_dict", None)):
        return None
    return {"format": "paddleformers-lora", "config": config.to_dict(), "prefix": "model."}


def reference(fsdp, collective: bool) -> dict:
    """The JSON value a checkpoint that does not hold the frozen base stores under FROZEN_BASE_KEY. A
    collective-free save before the fingerprint is known stores none (its load does not check)."""
    found = fingerprint(fsdp, collective) or {"algorithm": ALGORITHM, "fingerprint": None}
    value = {**found, "saved": False, "source": base_source(fsdp)}
    adapter = adapter_info(fsdp)
    if adapter is not None:
        value["adapter"] = adapter
    return value


def saved_reference(fsdp) -> dict:
    """The value a checkpoint that holds the frozen base stores under FROZEN_BASE_KEY for an adapter model (a
    model without an adapter stores none): the adapter description and the source, so that the tools can export
    the adapter or the merged model (tools/adapter_merge.py) from it."""
    return {"saved": True, "source": base_source(fsdp), "adapter": adapter_info(fsdp)}


def holds_base(value: Any) -> bool:
    """Whether a checkpoint whose FROZEN_BASE_KEY value is ``value`` holds the frozen parameters' tensors (a
    checkpoint without the key, written before base references existed or of a model without frozen parameters,
    holds every parameter)."""
    return not isinstance(value, dict) or bool(value.get("saved", True))


def check(fsdp, value: Any, where: str) -> None:
    """Refuse to resume onto another base than the checkpoint's (FrozenBaseMismatchError, before anything is
    written). Checks nothing while the model's fingerprint is not computed (:func:`fingerprint`, collective)."""
    if holds_base(value):
        return
    if value.get("fingerprint") is None:  # saved by a collective-free door before any fingerprint was known
        logger.warning("%s: the checkpoint's frozen base has no fingerprint; not checked", where)
        return
    if not isinstance(value.get("parameters"), int) or not isinstance(value["fingerprint"], str):
        raise MetadataError(f"{where}: the frozen base reference needs 'parameters' (int) and 'fingerprint' (str)")
    mine = getattr(fsdp, _CACHE_ATTR, None)
    if mine is None:  # not computed yet: the door checks after computing it collectively (state/resume.py)
        return
    source = value.get("source")
    hint = (
        f"load the base it was trained on{f' ({source})' if source else ''} into the model before resuming, or "
        "resume from a checkpoint saved with save_frozen=True"
    )
    if not mine:
        raise FrozenBaseMismatchError(
            f"{where} was saved without its frozen base ({value['parameters']} parameters), but this model has no "
            f"frozen parameters: {hint}"
        )
    if mine["parameters"] != value["parameters"]:
        raise FrozenBaseMismatchError(
            f"{where} references a frozen base of {value['parameters']} parameters, this model freezes "
            f"{mine['parameters']}: another set of trainable parameters? {hint}"
        )
    if mine["fingerprint"] != value["fingerprint"]:
        raise FrozenBaseMismatchError(
            f"{where} was trained on a frozen base with fingerprint {value['fingerprint']}; this model's frozen "
            f"parameters have fingerprint {mine['fingerprint']} (another base): {hint}"
        )
