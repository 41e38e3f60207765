"""Applying the non-tensor state of a load, and agreeing on the outcome across ranks.

Why: everything a load restores is checked on every rank before a byte is written, except what only user code
can tell: a stateful object's ``set_state_dict`` (or ``load_state_dict``) may still raise when it is given its
state, on one rank only. That rank used to raise alone after the load, and the others went on into their next
collective, which met nobody (a raw gloo timeout, issue #50). Here every item is applied even when an earlier one
failed (what could be applied is), the failures are named, and one small exchange after the apply makes every
rank raise the same PartiallyLoadedError naming the rank, the item and the cause.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..checkpoint.coordination import gather_errors, message_of
from ..checkpoint.errors import PartiallyLoadedError


class NotAppliedError(Exception):
    """Items of the loaded state that could not be applied on this rank (``failures``: ``[(item, error)]``); every
    other item was applied."""

    def __init__(self, failures: Sequence[tuple[str, BaseException]]) -> None:
        self.failures = list(failures)
        super().__init__("; ".join(f"{item}: {type(e).__name__}: {message_of(e)}" for item, e in self.failures))


def apply_all(actions: Sequence[tuple[str, Callable[[], None]]]) -> None:
    """Run every ``(item, action)``; NotAppliedError naming those that raised (after running all the others)."""
    failures: list[tuple[str, BaseException]] = []
    for item, action in actions:
        try:
            action()
        except NotAppliedError as e:  # an item made of several (the stateful objects): each named
            failures.extend(e.failures)
        except Exception as e:  # noqa: BLE001 - the others are applied all the same, then this one is named
            failures.append((item, e))
    if failures:
        raise NotAppliedError(failures) from failures[0][1]


def apply_on_every_rank(comm, apply: Callable[[], None], where: str) -> None:
    """``apply()`` (after every tensor landed), then one exchange of the outcome: when it failed on any rank, every
    rank raises the same PartiallyLoadedError naming that rank and what failed there (the failing rank with its
    error chained). ``comm``: coordination.Comm of the load's group."""
    error = None
    try:
        apply()
    except Exception as e:  # noqa: BLE001 - every rank must hear of it
        if isinstance(e, NotAppliedError):
            what, rest = str(e), f"the items named keep their previous state on rank {comm.rank}"
        else:
            what, rest = f"{type(e).__name__}: {message_of(e)}", f"rank {comm.rank} may hold part of it"
        error = PartiallyLoadedError(
            f"{where}: rank {comm.rank} failed applying the loaded state: {what}. Every tensor (model, optimizer, "
            f"EMA) holds the checkpoint's values on every rank, and so does every other item of state; {rest}. "
            f"Do not continue with this mix: fix what failed and load again"
        )
        error.__cause__ = e
    gather_errors(comm, error)
