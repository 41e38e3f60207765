"""Cross-rank coordination shared by the save and load paths of the checkpoint engine.

The process group wrapper (``Comm``: one ``all_gather_object`` per exchange, none in a single process), the
error exchange that makes all ranks fail together with the same named error (``gather_errors``), the file-based
completion protocol helper used instead of collectives (``poll``), the save target check, and
byte alignment of host buffers. The protocols themselves are described in save/save.py and load/load.py.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from .errors import (
    CheckpointError,
    InvalidStateDictError,
    SaveFailedError,
    TargetNotADirectoryError,
    agreed_error,
    names_rank,
    rebuild_remote_error,
)

# ------------------------------------------------------------------------------------------------ groups


class Comm:
    """Ranks of the process group a save or load runs on, and the one collective it uses."""

    def __init__(self, process_group):
        import paddle.distributed as dist

        self.group = process_group
        if process_group is not None:
            self.world = int(process_group.nranks)
            self.rank = int(process_group.rank)
            if self.rank < 0:
                raise InvalidStateDictError("this process is not a member of the given process_group")
        elif dist.is_initialized() and dist.get_world_size() > 1:
            self.world = dist.get_world_size()
            self.rank = dist.get_rank()
        else:
            self.world, self.rank = 1, 0

    def all_gather_object(self, obj) -> list:
        if self.world == 1:
            return [obj]
        from ..comm.communication import all_gather_object

        return all_gather_object(obj, self.group)

    def _global(self, rank: int) -> int:
        """The global rank of group rank ``rank`` (what paddle's rooted collectives take)."""
        return rank if self.group is None else int(self.group.ranks[rank])

    def gather_bytes(self, data: bytes, root: int) -> list[bytes] | None:
        """Every rank's ``data`` on ``root`` (by rank; None elsewhere): sizes, the largest, padded data."""
        import paddle
        import paddle.distributed as dist

        from .first_save import padded, unpadded

        sizes: list = []
        dist.gather(
            paddle.to_tensor(np.array([len(data)], np.int64)),
            sizes if self.rank == root else None,
            self._global(root),
            self.group,
        )
        top = paddle.to_tensor(np.array([max(int(s.numpy()[0]) for s in sizes) if sizes else 0], np.int64))
        dist.broadcast(top, self._global(root), self.group)
        blocks: list = []
        dist.gather(
            paddle.to_tensor(padded(data, int(top.numpy()[0]))),
            blocks if self.rank == root else None,
            self._global(root),
            self.group,
        )
        return [unpadded(b.numpy()) for b in blocks] if self.rank == root else None

    def scatter_bytes(self, parts: list[bytes] | None, root: int) -> bytes:
        """``parts[r]`` (given on ``root``) on each rank r: the largest size, then the padded parts."""
        import paddle
        import paddle.distributed as dist

        from .first_save import padded, unpadded

        top = paddle.to_tensor(np.array([max(map(len, parts)) if self.rank == root else 0], np.int64))
        dist.broadcast(top, self._global(root), self.group)
        size = int(top.numpy()[0])
        out = paddle.to_tensor(np.zeros(size + 8, np.uint8))
        blocks = [paddle.to_tensor(padded(p, size)) for p in parts] if self.rank == root else None
        dist.scatter(out, blocks, self._global(root), self.group)
        return unpadded(out.numpy())


def gather_errors(comm, error: BaseException | None, payload: Any = None, *, agree: bool = False) -> list:
    """Exchange every rank's error (and ``payload``) in one ``all_gather_object``; if any rank failed, raise on
    every rank: the rank's own error where it has one, else the first failed rank's, rebuilt as the same named
    class (errors.rebuild_remote_error). Returns every rank's ``payload`` (by rank) when none failed.

    A rank that failed while others did not raises the very error its peers rebuild: the same class, its message
    naming the rank (``rank <r> failed: ...``), with its own error chained as the cause (``own_error``).

    ``agree``: for errors each rank finds on its own part (a load's key checks), where ranks may fail for
    different keys: when every failure is a named CheckpointError, every rank raises one error with the same
    text, naming each failed rank's cause (errors.agreed_error), chained to its own.

    ``comm`` is anything with ``all_gather_object(obj) -> list`` (``Comm``, FullyShardFusion's ``comm``). Every
    rank must call it, also a failed one: that is what keeps a failing rank from leaving the others waiting.
    """
    status = None if error is None else (type(error).__name__, message_of(error))
    gathered = comm.all_gather_object((status, payload))
    failed = [(r, st[0], st[1]) for r, (st, _p) in enumerate(gathered) if st is not None]
    # one failed rank: the rebuilt error below is already the same text on every rank
    if agree and len(failed) > 1 and (error is None or isinstance(error, CheckpointError)):
        one = agreed_error(failed)
        if one is not None:
            raise one from error
    if error is not None:
        raise own_error(error, comm, gathered)
    for r, (st, _payload) in enumerate(gathered):
        if st is not None:
            raise rebuild_remote_error(st[0], st[1], r)
    return [p for _st, p in gathered]


def message_of(error: BaseException) -> str:
    """``str(error)``, or a stand-in when user code's exception cannot even be printed (its ``__str__`` raising
    here would make this rank raise alone, before the exchange)."""
    try:
        return str(error)
    except Exception:  # noqa: BLE001 - any failure of user code's __str__
        return f"<{type(error).__name__} whose message cannot be printed>"


def own_error(error: BaseException, comm, gathered: list) -> BaseException:
    """What a failed rank raises after the exchange: ``error`` itself when every rank failed (each names its own
    cause) or its message names the rank already; else the error its peers rebuild (same class, message naming
    this rank), chained to ``error``. ``error`` itself too when its class cannot be rebuilt from a message."""
    rank = getattr(comm, "rank", None)
    if rank is None or all(st is not None for st, _p in gathered) or names_rank(message_of(error), rank):
        return error
    try:
        named = type(error)(f"rank {rank} failed: {message_of(error)}")
    except Exception:  # noqa: BLE001 - a class whose constructor takes other arguments: raised as it is
        return error
    named.__cause__ = error
    return named


def stage_error(error: BaseException, what: str, rank: int, fallback: type[CheckpointError]) -> CheckpointError:
    """This rank's ``error`` in a stage of a save or load (``what``: ``"save to <path> failed"``, ...) as the named
    error every rank will raise: an engine error keeps its class, anything else (a TypeError of user code, an
    OSError, a storage layer's own error) becomes ``fallback`` naming the stage, the rank and the cause
    (``Class: message``), the original chained."""
    if isinstance(error, CheckpointError):
        return error
    named = fallback(f"{what}: rank {rank} failed: {type(error).__name__}: {message_of(error)}")
    named.__cause__ = error
    return named


# ------------------------------------------------------------------------------------------------ file protocol


def check_target_path(path: str) -> None:
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path):
        what = "a file" if os.path.isfile(path) else "not a directory"
        raise TargetNotADirectoryError(
            f"cannot save to {path}: it is {what}; a checkpoint is a directory (nothing was written over it)"
        )
    names = os.listdir(path)
    if not names:
        return
    # a checkpoint of ours is replaced atomically; entries of other tools are kept (save/save.py adopts them)


def poll(cond, timeout: float, what: str):
    t0 = time.monotonic()
    delay = 0.001
    while True:
        r = cond()
        if r:
            return r
        if time.monotonic() - t0 > timeout:
            raise SaveFailedError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.005)


ALIGN = 64  # byte alignment of the pieces carved out of one host buffer


def aligned(n: int) -> int:
    """``n`` rounded up to ALIGN."""
    return -(-n // ALIGN) * ALIGN
