"""Checkpoint loads under hybrid sharding (HSDP): each byte read once per replica group, then broadcast.

The R replicas of a shard position hold identical records (same keys, same regions), so the records are split
between them by bytes (greedy over the sorted keys: every replica computes the same split), each replica loads
its part from storage, and each part is broadcast over the replicate group, packed as raw bytes in one
collective per replica. Storage reads total the state's size, not R times it (``LoadReport.bytes_read``).

Saves need nothing here: the save plan gives each replicated shard piece to the holder with the fewest bytes
so far (checkpoint/planner.py ``_pick_writers``), so replicas split the writing and the files are the same format
as plain FSDP's. RNG: every process's generator state is saved, indexed by its global rank (the checkpoint group
is the whole world under HSDP) and restored at the same global rank (state/rng.py; a load by more ranks than
saved keeps the current state of the extra ranks).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import paddle
import paddle.distributed as dist

from .. import device
from ..checkpoint.format.metadata import DTYPES
from ..checkpoint.host_memory import is_host_contiguous, raw_view
from ..checkpoint.records import to_record

logger = logging.getLogger(__name__)


@dataclass
class ReplicaSplit:
    """Which replica loads which tensor key; keys not in ``owner`` (plain values, keys the checkpoint lacks) are
    requested by every replica (they load, or are reported, alike everywhere)."""

    owner: dict[str, int] = field(default_factory=dict)  # key -> replica position that reads it
    tensors: dict[str, paddle.Tensor] = field(default_factory=dict)  # key -> this rank's target tensor

    def keys_of(self, replica: int) -> list[str]:
        return [k for k, r in self.owner.items() if r == replica]


def split_for_replicas(state: dict, metadata, replicas: int) -> ReplicaSplit:
    """Balance the tensor keys of ``state`` found in ``metadata`` over ``replicas`` by bytes (deterministic)."""
    if not isinstance(replicas, int) or replicas < 1:
        raise ValueError(f"replicas must be a positive int, got {replicas!r}")
    split = ReplicaSplit()
    load = [0] * replicas
    for key in sorted(state):
        rec = to_record(key, state[key])
        if rec is None or key not in metadata.tensors:
            continue
        nbytes = rec.region.numel * DTYPES[rec.dtype][0]
        replica = min(range(replicas), key=lambda r: (load[r], r))
        load[replica] += nbytes
        split.owner[key] = replica
        split.tensors[key] = rec.tensor
    return split


def my_part(state: dict, split: ReplicaSplit, replica: int) -> dict:
    """The sub-dict this replica requests from storage (its keys and every shared key)."""
    return {k: v for k, v in state.items() if split.owner.get(k, replica) == replica}


def broadcast_parts(split: ReplicaSplit, loaded: set[str], replicate_group) -> list[str]:
    """Send each replica's loaded part to the others over ``replicate_group``; returns the keys received here.
    Collective over the replicate group: one small exchange (which keys each part loaded: ``strict=False`` may
    skip mismatched ones), then one raw-byte broadcast per replica."""
    from ..communication import all_gather_object

    me = replicate_group.rank
    mine = [k for k in split.keys_of(me) if k in loaded]
    every = all_gather_object(mine, replicate_group)
    received: list[str] = []
    for replica, keys in enumerate(every):
        tensors = [split.tensors[k] for k in keys]
        sizes = [int(t.numel()) * t.element_size() for t in tensors]
        total = sum(sizes)
        if total == 0:
            continue
        if replica == me:
            views = [raw_view(t) for t, n in zip(tensors, sizes) if n]  # (bytes, the host copy keeping them alive)
            buf = paddle.to_tensor(np.concatenate([arr for arr, _keep in views]))
            del views
        else:
            buf = paddle.empty([total], dtype="uint8")
        dist.broadcast(buf, src=replicate_group.ranks[replica], group=replicate_group)
        if replica == me:
            continue
        _unpack(buf, tensors, sizes)
        received.extend(keys)
    return received


def _unpack(buf: paddle.Tensor, tensors: list, sizes: list[int]) -> None:
    """Copy the packed bytes into the target tensors (views into fused buffers keep aliasing)."""
    data = buf.numpy()
    pos = 0
    for t, n in zip(tensors, sizes):
        if n == 0:
            continue
        chunk = data[pos : pos + n]
        pos += n
        if is_host_contiguous(t):
            np.copyto(raw_view(t, allow_copy=False)[0], chunk)
        else:  # device (or strided) target: through host staging, as the load engine commits such targets
            staging = device.host_empty(list(t.shape), str(t.dtype).replace("paddle.", ""), pinned=False)
            np.copyto(raw_view(staging, allow_copy=False)[0], chunk)
            t.copy_(staging, True)
