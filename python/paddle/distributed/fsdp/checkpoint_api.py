"""One-call checkpointing of a FullyShardFusion model: tensors, optimizer, LR scheduler, RNG, user state.

Built on the records of checkpoint_mapping and the storage engine in ``checkpoint/``. Besides tensors,
a checkpoint carries small JSON values under reserved keys (``__fsdp__.*``): the optimizer's class and
non-tensor state, every rank's random generator state, and the caller's ``extra_state``.
"""

from __future__ import annotations

import logging

import paddle
from paddle.base import core

from . import optimizer_state_names as names
from .checkpoint import load_state_dict, read_metadata, save_state_dict

logger = logging.getLogger(__name__)

OPTIMIZER_KEY = "__fsdp__.optimizer"
RNG_KEY = "__fsdp__.rng"
EXTRA_KEY = "__fsdp__.extra_state"
HF_FORMAT_NAMES = {"hf", "huggingface", "hugging_face", "hf_safetensors", "transformers"}


def _rng_state() -> list:
    """This process's generator states as JSON (paddle's own pickle-free tuple form)."""
    return [list(state.__getstate__()) for state in paddle.get_rng_state()]


def _set_rng_state(saved: list) -> None:
    states = []
    for item in saved:
        state = core.GeneratorState.__new__(core.GeneratorState)
        state.__setstate__(tuple(item))
        states.append(state)
    paddle.set_rng_state(states)


def _state(fsdp, optimizer) -> dict:
    state = fsdp.sharded_state_dict()
    if optimizer is not None:
        state.update(fsdp.optimizer_sharded_state_dict(optimizer))
    return state


def save_checkpoint(
    fsdp,
    path: str,
    optimizer=None,
    extra_state: dict | None = None,
    *,
    format: str = "fsdp",
    async_save: bool = False,
):
    """Save everything needed to resume bit-exactly. Collective: every rank of the group calls it.

    Returns the engine's SaveHandle when ``async_save`` (call ``wait()`` before relying on the files).
    """
    if str(format).lower() in HF_FORMAT_NAMES:
        raise ValueError(
            "save_checkpoint writes sharded FSDP checkpoints only: Hugging Face safetensors need whole "
            "parameters, which no rank holds. Save normally, then convert offline with "
            "`paddle-fsdp-ckpt to-hf CKPT_DIR OUT_DIR`."
        )
    if str(format).lower() != "fsdp":
        raise ValueError(f"unknown checkpoint format {format!r} (supported: 'fsdp')")
    state = _state(fsdp, optimizer)
    if optimizer is not None:
        inner = names.unwrap_optimizer(optimizer)
        state[OPTIMIZER_KEY] = {
            "class": type(inner).__name__,
            "global_state": names.optimizer_global_state(inner),
        }
    state[RNG_KEY] = fsdp.comm.all_gather_object(_rng_state())
    state[EXTRA_KEY] = dict(extra_state or {})
    return save_state_dict(state, path, process_group=fsdp.comm.group, async_save=async_save)


def load_checkpoint(fsdp, path: str, optimizer=None, *, strict: bool = True, verify_checksums: bool = True) -> dict:
    """Restore what :func:`save_checkpoint` wrote into ``fsdp``'s model and ``optimizer``, in place.

    All-or-nothing: every key, shape, dtype and checksum is checked before any tensor is written.
    Returns the saved ``extra_state``.
    """
    metadata = read_metadata(path)
    saved_optimizer = metadata.values.get(OPTIMIZER_KEY)
    if optimizer is not None:
        inner = names.unwrap_optimizer(optimizer)
        if saved_optimizer is None:
            raise ValueError(f"checkpoint {path} has no optimizer state; load it without optimizer=")
        if saved_optimizer["class"] != type(inner).__name__:
            raise ValueError(
                f"checkpoint {path} holds {saved_optimizer['class']} state, but the optimizer given is "
                f"{type(inner).__name__}"
            )
        fsdp.init_optimizer_state(optimizer)
    state = _state(fsdp, optimizer)
    for key in (RNG_KEY, EXTRA_KEY) + ((OPTIMIZER_KEY,) if optimizer is not None else ()):
        state[key] = None
    load_state_dict(
        state, path, process_group=fsdp.comm.group, strict=strict, verify_checksums=verify_checksums
    )
    if optimizer is not None:
        names.set_optimizer_global_state(inner, state[OPTIMIZER_KEY]["global_state"])
    rng = state[RNG_KEY]
    if fsdp.rank < len(rng):
        _set_rng_state(rng[fsdp.rank])
    else:
        logger.warning(
            "checkpoint %s was saved by %d ranks; rank %d keeps its current random state",
            path, len(rng), fsdp.rank,
        )
    return state[EXTRA_KEY]
