"""Errors of the memory tier (all CheckpointErrors, so callers catching the engine's family catch these too)."""

from __future__ import annotations

from ..checkpoint.errors import ERROR_CLASSES, CheckpointEnvError, CheckpointError


class MemoryTierError(CheckpointError):
    """Base class of the memory tier's errors."""


class MemoryTierEnvError(MemoryTierError, CheckpointEnvError):
    """A memory tier environment switch (``PADDLE_FSDP_MEMTIER_QUOTA``) holds a value it does not accept."""


class MemoryTierFullError(MemoryTierError):
    """The memory root has not enough free space (or the configured quota is too small) for this rank's copies.

    The tier then saves to durable storage instead (logged); the error is kept as ``MemoryTier.disabled_reason``.
    """


class InvalidMemoryCopyError(MemoryTierError):
    """A memory copy cannot be used: truncated, corrupt (checksum), of another job, world size, rank or layout."""


class NoCommonStepError(MemoryTierError):
    """On restart no step is restorable by every rank (from its memory, its peer's copy or storage)."""


class PeerTransferError(MemoryTierError):
    """A peer copy could not be sent or received: the partner died (its socket closed mid-transfer), did not
    connect or stalled past the deadline (``peer_timeout_s``), or sent something else than expected."""


class MemoryRootError(MemoryTierError):
    """A memory root or job directory the tier must not use: a symlink, not a directory, owned by another user,
    open to others' writes (flush-memory), or a job id that is not a plain name (roots.py)."""


class MemoryRootInUseError(MemoryRootError):
    """Another live process holds this job id and rank's lock in the memory root (two jobs with one job id)."""


class PeerAuthError(PeerTransferError):
    """The process at a partner's address did not prove it holds the job's peer-link key (wire.py)."""


# another rank's failure is raised on every rank as the same class (rebuild_remote_error)
ERROR_CLASSES.update(
    {
        c.__name__: c
        for c in (
            MemoryTierError,
            MemoryTierFullError,
            InvalidMemoryCopyError,
            NoCommonStepError,
            PeerTransferError,
            MemoryRootError,
            MemoryRootInUseError,
            PeerAuthError,
        )
    }  # fmt: skip
)
