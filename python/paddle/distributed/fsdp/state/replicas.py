"""Checkpoint loads under hybrid sharding (HSDP): each byte read once per replica group, then broadcast.

The R replicas of a shard position hold identical records (same keys, same regions), so the records are split
between them by bytes (greedy over the sorted keys: every replica computes the same split), each replica loads
its part from storage, and each part is broadcast over the replicate group as raw bytes, in windows that keep
the extra host memory bounded (``max_host_bytes``). Storage reads total the state's size, not R times it (``LoadReport.bytes_read``).

Saves need nothing here: the save plan gives each replicated shard piece to the holder with the fewest bytes
so far (checkpoint/assign.py), so replicas split the writing and the files are the same format
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

from ..checkpoint.format.metadata import DTYPES
from ..checkpoint.host_memory import is_host_contiguous, raw_view
from ..checkpoint.records import to_record
from ..devices import device

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


#: Bytes per broadcast: a load's extra host memory stays within a window (plus one device tensor's staging).
BROADCAST_WINDOW = 64 << 20


def window_for(max_host_bytes: int | None) -> int:
    """Broadcast window of a load: BROADCAST_WINDOW, or half of a smaller ``max_host_bytes`` (at least 4 KiB)."""
    if max_host_bytes is None:
        return BROADCAST_WINDOW
    return max(4096, min(BROADCAST_WINDOW, int(max_host_bytes) // 2))


def broadcast_parts(
    split: ReplicaSplit, loaded: set[str], replicate_group, window: int = BROADCAST_WINDOW
) -> list[str]:
    """Send each replica's loaded part to the others over ``replicate_group``; returns the keys received here.
    Collective over the replicate group: one small exchange (which keys each part loaded: ``strict=False`` may
    skip mismatched ones), then each part's bytes, in order, in broadcasts of at most ``window`` bytes."""
    from ..comm.communication import all_gather_object

    if not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be a positive int, got {window!r}")
    me = replicate_group.rank
    mine = [k for k in split.keys_of(me) if k in loaded]
    every = all_gather_object(mine, replicate_group)
    received: list[str] = []
    for replica, keys in enumerate(every):
        stream = _ByteStream([split.tensors[k] for k in keys])
        for lo in range(0, stream.total, window):
            n = min(window, stream.total - lo)
            buf = paddle.to_tensor(stream.read(lo, n)) if replica == me else paddle.empty([n], dtype="uint8")
            dist.broadcast(buf, src=replicate_group.ranks[replica], group=replicate_group)
            if replica != me:
                stream.write(lo, buf.numpy())
        if replica != me:
            received.extend(keys)
    return received


class _ByteStream:
    """The bytes of a list of tensors, back to back, read or written by ranges in increasing order. Host
    contiguous tensors are read and written in place; others through one host copy (read) or one host staging
    tensor (written, then ``copy_`` into the target when complete, as the load engine commits such targets)."""

    def __init__(self, tensors: list) -> None:
        self.tensors = tensors
        self.sizes = [int(t.numel()) * t.element_size() for t in tensors]
        self.starts = np.concatenate([[0], np.cumsum(self.sizes, dtype=np.int64)]).tolist()
        self.total = self.starts[-1]
        self._cached: tuple[int, np.ndarray, object] | None = None  # (index, bytes, what keeps them alive)

    def _pieces(self, lo: int, n: int):
        """(tensor index, start in the tensor, end in the tensor, start in the range) covering [lo, lo + n)."""
        i = int(np.searchsorted(self.starts, lo, side="right")) - 1
        while n > 0 and i < len(self.tensors):
            a = lo - self.starts[i]
            b = min(self.sizes[i], a + n)
            if b > a:
                yield i, a, b
                lo, n = lo + (b - a), n - (b - a)
            i += 1

    def _bytes(self, i: int, staging: bool) -> np.ndarray:
        if self._cached is None or self._cached[0] != i:
            t = self.tensors[i]
            if staging and not is_host_contiguous(t):
                keep = device.host_empty(list(t.shape), str(t.dtype).replace("paddle.", ""), pinned=False)
                arr = raw_view(keep, allow_copy=False)[0]
            else:
                arr, keep = raw_view(t)  # a host copy for device tensors (kept alive below)
            self._cached = (i, arr, keep)
        return self._cached[1]

    def read(self, lo: int, n: int) -> np.ndarray:
        out = np.empty(n, np.uint8)
        pos = 0
        for i, a, b in self._pieces(lo, n):  # copied at once: the next tensor's host copy replaces this one's
            out[pos : pos + (b - a)] = self._bytes(i, staging=False)[a:b]
            pos += b - a
        return out

    def write(self, lo: int, data: np.ndarray) -> None:
        pos = 0
        for i, a, b in self._pieces(lo, len(data)):
            np.copyto(self._bytes(i, staging=True)[a:b], data[pos : pos + (b - a)])
            pos += b - a
            t = self.tensors[i]
            if b == self.sizes[i] and not is_host_contiguous(t):  # complete: commit the staging
                t.copy_(self._cached[2], True)
