"""The memory tier: checkpoints in host shared memory with a peer copy on another node (manager.py: MemoryTier).

Modules: ``slot.py`` (one fully allocated, mapped copy file), ``copies.py`` (a rank's copies: its own slots and
a peer's; writing a save), ``slots.py`` (which own slot a save writes), ``state.py`` (what a copy holds for a
FullyShardFusion model), ``peers.py`` (partner map), ``wire.py`` (peer transfers over TCP), ``readback.py`` (a
copy read into the tensors in one pass),
``agreement.py`` (the restart rule), ``restore.py`` (a restart, collective), ``persist.py`` (a copy written to
storage as a committed checkpoint), ``flush.py`` (the same from one process after a crash: ``paddle-fsdp-ckpt
flush-memory``), ``errors.py``; ``manager.py`` (MemoryTier) ties them together. What is trusted
(docs/memory-tier-trust.md): ``header.py`` (a copy's header checked field by field), ``roots.py`` (memory roots:
no symlink, FIFO or foreign file; job ids; one live process per job and rank), ``identity.py`` (which durable
root a copy belongs to).
"""

from .errors import (
    InvalidMemoryCopyError,
    MemoryRootError,
    MemoryRootInUseError,
    MemoryTierError,
    MemoryTierFullError,
    NoCommonStepError,
    PeerAuthError,
    PeerTransferError,
)
from .manager import MemoryTier
from .restore import RestoreResult

__all__ = [
    "MemoryTier",
    "RestoreResult",
    "MemoryTierError",
    "MemoryTierFullError",
    "InvalidMemoryCopyError",
    "NoCommonStepError",
    "PeerTransferError",
    "PeerAuthError",
    "MemoryRootError",
    "MemoryRootInUseError",
]
