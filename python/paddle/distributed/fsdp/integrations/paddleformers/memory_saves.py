"""The Trainer's saves through the engine's memory tier (``fsdp_memory_tier=dict(...)``): the engine's equivalent
of PaddleFormers' zero-cost checkpointing (ZCC).

Every save the Trainer makes (``save_steps``) goes to host memory (memtier/manager.py ``MemoryTier``: the rank's
copy in ``memory_root``, the peer copy on another node); every ``persist_every``-th one, counted in saves (the
global steps that are multiples of ``persist_every x save_steps``), is written instead as a normal committed
``output_dir/checkpoint-N`` by the engine's checkpoint save, so rotation, ``resume_from_checkpoint=True``, stock's
``get_last_checkpoint`` and the CLI see the same directories as without the tier.

Why the Trainer persists and not the tier: the tier persists its copy as ``durable_root/step_N``, a layout the
Trainer does not know; a ``checkpoint-N`` is what the Trainer resumes, rotates and exports from. So the tier is
built with ``persist_every`` out of reach and ``persist_on_restore=False``; ``output_dir`` is its durable root
only for its identity (``memtier-id``: a copy is used only for the output directory that wrote it).

Resume (``resume_from_checkpoint=True``): the tier restores the newest step every rank has in memory; when that
step is newer than the newest committed ``checkpoint-N`` the run continues from it, else the ``checkpoint-N`` is
loaded (over what memory restored). A fresh ``train()`` never reads memory copies.
"""

from __future__ import annotations

import logging

from ...memtier import MemoryTier
from ...memtier.errors import MemoryTierError

logger = logging.getLogger(__name__)

_NEVER = 2**62  # the tier's own persist_every: the Trainer persists (see the module docstring)
_OURS = ("durable_root", "persist_every", "persist_on_restore", "grad_scaler", "stateful", "ema")
_ALLOWED = (
    "memory_root",
    "keep_last",
    "job_id",
    "partners",
    "quota_bytes",
    "checksum",
    "peer_timeout_s",
    "memory_slots",
)


def check_options(options: dict | None) -> dict | None:
    """``fsdp_memory_tier`` checked (MemoryTierError naming a wrong key or value); None: no memory tier."""
    if options is None:
        return None
    if not isinstance(options, dict):
        raise MemoryTierError(f"fsdp_memory_tier must be a dict of MemoryTier options, got {type(options).__name__}")
    options = dict(options)
    persist_every = options.pop("persist_every", 10)
    if type(persist_every) is not int or persist_every < 1:
        raise MemoryTierError(f"fsdp_memory_tier persist_every must be an int >= 1, got {persist_every!r}")
    for key in options:
        if key in _OURS:
            raise MemoryTierError(
                f"fsdp_memory_tier[{key!r}] is set by FSDPTrainer (output_dir, the Trainer's objects)"
            )
        if key not in _ALLOWED:
            raise MemoryTierError(
                f"fsdp_memory_tier: unknown option {key!r} (allowed: persist_every, {', '.join(_ALLOWED)})"
            )
    return {"persist_every": persist_every, "tier": options}


def persists(options: dict, step: int, save_steps: int) -> bool:
    """Whether the save at global ``step`` is the ``persist_every``-th one (a committed ``checkpoint-N``)."""
    return step % (options["persist_every"] * max(int(save_steps or 1), 1)) == 0


def build(options: dict, fsdp, optimizer, output_dir: str, grad_scaler, stateful: dict) -> MemoryTier:
    """The tier over ``fsdp`` / ``optimizer`` with ``output_dir`` as its durable identity; nothing restored."""
    return MemoryTier(
        fsdp,
        optimizer,
        durable_root=output_dir,
        persist_every=_NEVER,
        persist_on_restore=False,
        grad_scaler=grad_scaler,
        stateful=stateful,
        **options["tier"],
    )
