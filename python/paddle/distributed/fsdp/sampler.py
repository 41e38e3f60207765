"""A distributed batch sampler that resumes where it stopped: ``ResumableDistributedBatchSampler``.

Why: paddle's ``DistributedBatchSampler`` has no ``state_dict``, so a resumed run restarts its epoch (samples
seen twice) or, with a hand-kept counter, loses the shuffle order. This sampler is constructed like it and its
state is three numbers: ``seed``, ``epoch`` and ``consumed``, the count of samples of the epoch handed out over
ALL ranks. The epoch's order is derived, never stored: ``numpy.random.default_rng([seed, epoch]).permutation``
of the dataset's indices (``arange`` without ``shuffle``). Given to a checkpoint as
``stateful={"sampler": sampler}`` it is saved with every checkpoint and restored by every door
(state/stateful.py), so the batches after a resume are those of the uninterrupted run, mid-epoch and across an
epoch boundary.

Which samples a rank gets: each step consumes ``world x batch_size`` samples of the epoch's order; rank ``r``
takes the ``r``-th ``batch_size`` of them. The epoch ends when fewer than ``world x batch_size`` are left:
``drop_last`` skips them; otherwise they are one last step, padded with the first samples of the epoch's order
so that every rank gets a full batch (as paddle's sampler pads). Exhausting the iterator starts the next epoch.

World-size change (the rule, tested 2 -> 3 and 2 -> 1): ``consumed`` is global, so a run resumed at another world
size continues the SAME order of the same epoch from sample ``consumed``, split over the new world as above. No
sample of the epoch is seen twice or skipped; only the epoch's last step differs (its padding, or what
``drop_last`` skips, follows the new world). The state is the same on every rank (``stateful_scope =
"global"``), so any rank's copy restores any rank.

The position counts the batches this sampler handed out. A ``paddle.io.DataLoader`` prefetches batches on a
thread, so its sampler runs ahead of the training (measured: 10-12 batches after the first one was delivered).
``ResumableDataLoader`` (a DataLoader over this sampler) counts the batches it DELIVERED instead: its DataLoader
iterates a view that never moves the position, and the loader moves it per delivered batch. Give the loader, not
the sampler, to the checkpoint. Iterating the sampler in the training loop itself is exact too.

Re-entry: iterating again (after a ``break``) continues right after the last batch handed out, for the loader
and the sampler alike. Every new iteration (and ``set_epoch`` to another epoch, ``set_state_dict``) supersedes
the running one, which moves nothing any more: stepping a superseded ``ResumableDataLoader`` iterator raises
``SupersededIterationError``; a superseded sampler iteration ends (logged), because a DataLoader's prefetch
thread may be stepping it and an exception there would leave that DataLoader waiting forever.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np

FORMAT = "fsdp-sampler-v1"
logger = logging.getLogger(__name__)


class ResumableDistributedBatchSampler:
    """Batches of dataset indices for this rank, resumable (see the module docstring).

    Arguments as ``paddle.io.DistributedBatchSampler``'s, plus ``seed`` (the shuffle order of epoch ``e`` is
    derived from ``(seed, e)``). ``num_replicas`` / ``rank`` default to the launch's world size and rank."""

    stateful_scope = "global"  # the same state on every rank: restorable at another world size

    def __init__(
        self,
        dataset,
        batch_size: int,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = False,
        drop_last: bool = False,
        seed: int = 0,
    ) -> None:
        if type(batch_size) is not int or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if num_replicas is None or rank is None:
            import paddle.distributed as dist

            num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
            rank = dist.get_rank() if rank is None else rank
        if type(num_replicas) is not int or num_replicas < 1 or type(rank) is not int or not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank!r} of num_replicas {num_replicas!r} is not a rank of a world")
        if type(seed) is not int or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        self.dataset = dataset
        self.batch_size, self.nranks, self.local_rank = batch_size, num_replicas, rank
        self.shuffle, self.drop_last, self.seed = bool(shuffle), bool(drop_last), seed
        self.epoch = 0
        self.consumed = 0  # samples of this epoch handed out, over every rank
        self._generation = 0  # the newest iteration over the position (older ones are superseded)

    # ------------------------------------------------------------------ the order
    def order(self, epoch: int) -> np.ndarray:
        """The dataset's indices in epoch ``epoch``'s order (the same on every rank and at every world size)."""
        n = len(self.dataset)
        if not self.shuffle:
            return np.arange(n, dtype=np.int64)
        return np.random.default_rng([self.seed, epoch]).permutation(n).astype(np.int64)

    def _step_size(self) -> int:
        return self.nranks * self.batch_size

    def __len__(self) -> int:
        """Batches this rank gets from the current position to the end of the current epoch."""
        left = max(len(self.dataset) - self.consumed, 0)
        return left // self._step_size() if self.drop_last else -(-left // self._step_size())

    def batches_from(self, epoch: int, consumed: int) -> Iterator[tuple[list[int], int]]:
        """This rank's batches of epoch ``epoch`` from position ``consumed``, each with the position after it.
        Moves nothing: the caller decides when a batch counts as handed out."""
        order = self.order(epoch)
        n, step, b = len(order), self._step_size(), self.batch_size
        while consumed < n:
            left = n - consumed
            if left < step and self.drop_last:
                break
            take = min(step, left)
            lo = consumed + min(self.local_rank * b, take)
            hi = consumed + min((self.local_rank + 1) * b, take)
            batch = order[lo:hi].tolist()
            if len(batch) < b:  # the epoch's last step: padded from the start of the order
                batch += np.resize(order, b - len(batch)).tolist()
            consumed += take
            yield batch, consumed

    def begin_iteration(self) -> int:
        """Start a new iteration over the position: every iteration begun earlier is superseded (stepping it
        raises ``SupersededIterationError`` instead of moving the position a second time)."""
        self._generation += 1
        return self._generation

    def check_current(self, generation: int, what: str = "sampler") -> None:
        """``SupersededIterationError`` unless ``generation`` is the newest iteration over this position."""
        if generation != self._generation:
            raise SupersededIterationError(
                f"this iteration over the {what} was superseded (a newer iteration, set_epoch or set_state_dict "
                f"moved the position to epoch {self.epoch}, sample {self.consumed}); iterate again to continue "
                f"from there"
            )

    def advance(self, generation: int, consumed: int) -> None:
        """Record a handed-out batch: the position becomes ``consumed`` (of the current epoch)."""
        self.check_current(generation)
        self.consumed = consumed

    def finish_epoch(self, generation: int) -> None:
        """The current epoch's batches ran out: move to the start of the next epoch."""
        self.check_current(generation)
        self.epoch, self.consumed = self.epoch + 1, 0

    def __iter__(self) -> Iterator[list[int]]:
        """Batches from the current position. A superseded iteration ENDS (logged once) instead of raising: a
        DataLoader's prefetch thread may be the one stepping it, and an exception there leaves that DataLoader's
        iterator waiting forever."""
        generation = self.begin_iteration()
        for batch, after in self.batches_from(self.epoch, self.consumed):
            if generation != self._generation:
                logger.warning("an iteration over the sampler was superseded: it ends (the position moves on)")
                return
            self.consumed = after
            yield batch
        if generation == self._generation:
            self.epoch, self.consumed = self.epoch + 1, 0

    def set_epoch(self, epoch: int) -> None:
        """Paddle's API: make ``epoch`` current. Its position is kept when it already is (a resumed run that
        calls ``set_epoch`` at the top of its epoch loop continues mid-epoch), else it starts at 0."""
        if type(epoch) is not int or epoch < 0:
            raise ValueError(f"epoch must be a non-negative int, got {epoch!r}")
        if epoch != self.epoch:
            self.epoch, self.consumed = epoch, 0
            self.begin_iteration()  # a running iteration belongs to the old epoch

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """The position: JSON, the same on every rank (``world`` and ``batch_size`` are informative)."""
        return {
            "format": FORMAT,
            "seed": self.seed,
            "epoch": self.epoch,
            "consumed": self.consumed,
            "dataset_len": len(self.dataset),
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "world": self.nranks,
            "batch_size": self.batch_size,
        }

    def check_state_dict(self, state: Any) -> None:
        """ValueError unless ``state`` is a position this sampler can continue from (same dataset size and
        shuffling; the checkpoint code calls this before anything is written)."""
        if type(state) is not dict or state.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT} sampler state: {state!r:.200}")
        for name in ("seed", "epoch", "consumed", "dataset_len"):
            if type(state.get(name)) is not int or state[name] < 0:
                raise ValueError(f"sampler state: {name!r} must be a non-negative int, got {state.get(name)!r}")
        if state["dataset_len"] != len(self.dataset):
            raise ValueError(
                f"sampler state is of a dataset of {state['dataset_len']} samples, this one has {len(self.dataset)}"
            )
        if state.get("shuffle") != self.shuffle:
            raise ValueError(
                f"sampler state was saved with shuffle={state.get('shuffle')}, this one has {self.shuffle}"
            )
        if state["consumed"] > state["dataset_len"]:
            raise ValueError(f"sampler state: consumed {state['consumed']} > dataset size {state['dataset_len']}")

    def set_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (see :meth:`check_state_dict`), whatever the world size it was saved at."""
        self.check_state_dict(state)
        self.seed, self.epoch, self.consumed = state["seed"], state["epoch"], state["consumed"]
        self.begin_iteration()  # a running iteration continues from the old position: superseded


class SupersededIterationError(RuntimeError):
    """An iteration over a sampler (or ``ResumableDataLoader``) was stepped after a newer iteration,
    ``set_epoch`` or ``set_state_dict`` moved the position: stepping it on would hand out batches twice."""


class _DeliveredView:
    """The batch sampler paddle's DataLoader iterates: batches from the position the loop was DELIVERED up to,
    without moving it (the loader moves it per delivered batch), so a prefetch thread can run ahead freely."""

    def __init__(self, sampler: ResumableDistributedBatchSampler) -> None:
        self.sampler = sampler
        self.batch_size, self.drop_last = sampler.batch_size, sampler.drop_last

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[list[int]]:
        positioned = self.sampler.batches_from(self.sampler.epoch, self.sampler.consumed)  # the position of now
        return (batch for batch, _after in positioned)


class ResumableDataLoader:
    """``paddle.io.DataLoader(dataset, batch_sampler=sampler, **kwargs)`` whose ``state_dict()`` is the position
    of the batches it delivered to the loop, not of those its prefetch thread took from the sampler. Give it to
    the checkpoint (``stateful={"data": loader}``); it iterates like the DataLoader it wraps."""

    stateful_scope = "global"

    def __init__(self, dataset, batch_sampler: ResumableDistributedBatchSampler, **kwargs) -> None:
        import paddle

        if not isinstance(batch_sampler, ResumableDistributedBatchSampler):
            raise TypeError(
                f"batch_sampler must be a ResumableDistributedBatchSampler, got {type(batch_sampler).__name__}"
            )
        self.sampler = batch_sampler
        self._make = lambda: paddle.io.DataLoader(dataset, batch_sampler=_DeliveredView(batch_sampler), **kwargs)
        self.loader = self._make()
        # paddle's persistent workers cannot restart an iteration abandoned mid-epoch (IndexError in its
        # _reset, stock DataLoader alike): such a loader is rebuilt, with new workers, when that happened
        self._rebuild_if_abandoned = bool(kwargs.get("persistent_workers")) and kwargs.get("num_workers", 0) > 0
        self._running = False  # an iteration began and has not run out

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator:
        """The batches from the delivered position; iterating again (after a ``break``) continues right after
        the last batch the loop got. Stepping an iteration a newer one superseded is a
        ``SupersededIterationError``."""
        generation = self.sampler.begin_iteration()
        if self._running and self._rebuild_if_abandoned:
            self.loader = self._make()
        self._running = True
        positions = self.sampler.batches_from(self.sampler.epoch, self.sampler.consumed)
        for batch in self.loader:  # its view starts at the same position, read now
            _batch, after = next(positions)
            self.sampler.advance(generation, after)
            yield batch
        self.sampler.finish_epoch(generation)
        self._running = False

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def check_state_dict(self, state: Any) -> None:
        self.sampler.check_state_dict(state)

    def set_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.set_state_dict(state)
