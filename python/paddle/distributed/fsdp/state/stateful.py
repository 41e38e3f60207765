"""The caller's stateful objects in a checkpoint: anything with ``state_dict()`` and ``set_state_dict()``.

Why: a resume must continue the data where it stopped (a sampler's epoch and position, fsdp/sampler.py) and
any other state the training loop owns (a curriculum, a counter). Paddle's convention for such objects is
``state_dict()`` / ``set_state_dict(state)``; ``load_state_dict`` is accepted too. Given as
``stateful={"sampler": s, "my_obj": o}`` to ``save_checkpoint`` / ``load_checkpoint`` / the memory tier, every
rank's ``{name: state}`` is saved as its own per-rank value (``__fsdp__.stateful``), so state that differs per
rank comes back to the rank that saved it. A state must be JSON (dicts, lists, str, int, float, bool, None).

At another world size a rank has no saved entry of its own. An object whose state is the same on every rank
declares it with the class attribute ``stateful_scope = "global"`` (the sampler does: it keeps the global count
of consumed samples); every rank then takes saving rank 0's state. Any other object is refused at another world
size (StatefulMismatchError; ``strict=False`` keeps its current state and logs it).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from typing import Any

from ..checkpoint.errors import MetadataError, MissingKeyError, StateDictMismatchError
from .apply import apply_all

logger = logging.getLogger(__name__)

GLOBAL_SCOPE = "global"


class StatefulMismatchError(StateDictMismatchError):
    """A stateful object's saved state cannot be restored here (per-rank state at another world size)."""


def check_stateful(stateful: Any) -> dict[str, Any]:
    """``stateful`` as a dict ``{name: object}`` (TypeError naming what is wrong); ``{}`` for None."""
    if stateful is None:
        return {}
    if not isinstance(stateful, dict):
        raise TypeError(f"stateful must be a dict {{name: object}}, got {type(stateful).__name__}")
    for name, obj in stateful.items():
        if not isinstance(name, str) or not name:
            raise TypeError(f"stateful: names must be non-empty str, got {name!r}")
        if not callable(getattr(obj, "state_dict", None)) or _setter(obj) is None:
            raise TypeError(
                f"stateful[{name!r}] ({type(obj).__name__}) needs state_dict() and set_state_dict() (or load_state_dict())"
            )
    return stateful


def _setter(obj: Any) -> Callable[[Any], Any] | None:
    for attr in ("set_state_dict", "load_state_dict"):
        fn = getattr(obj, attr, None)
        if callable(fn):
            return fn
    return None


def capture(stateful: dict[str, Any]) -> dict[str, Any]:
    """``{name: obj.state_dict()}``, each checked to be JSON now (TypeError naming the object), copied so that
    later changes of the object do not reach a save still in flight."""
    out = {}
    for name, obj in stateful.items():
        state = obj.state_dict()
        try:
            out[name] = json.loads(json.dumps(state, allow_nan=False))
        except (TypeError, ValueError) as e:
            raise TypeError(
                f"stateful[{name!r}].state_dict() is not JSON ({e}): convert it, e.g. numbers with int()"
            ) from None
    return out


def decode(
    stateful: dict[str, Any], entries: Sequence | None, rank: int, world: int, strict: bool, where: str
) -> Callable[[], None]:
    """Check the saved states for ``stateful`` before anything is written; returns the function applying them.

    ``entries``: every saving rank's ``{name: state}`` by rank (None: the checkpoint holds none). The saved
    entry of this rank when the world is the same, saving rank 0's for a ``stateful_scope = "global"`` object.
    MissingKeyError (strict) for an object the checkpoint holds no state of; StatefulMismatchError (strict) for
    per-rank state at another world size."""
    if not stateful:
        return lambda: None
    key = f"{where}: stateful"
    if entries is not None and (not isinstance(entries, Sequence) or isinstance(entries, (str, bytes))):
        raise MetadataError(f"{key} must be a list (one entry per saving rank)")
    saved_world = 0 if entries is None else len(entries)
    actions: list[tuple[str, Callable[[], None]]] = []
    for name, obj in stateful.items():
        is_global = getattr(obj, "stateful_scope", None) == GLOBAL_SCOPE
        problem = None
        if saved_world == 0:
            problem = MissingKeyError(f"{where} holds no stateful state (saved without stateful=)")
        elif saved_world != world and not is_global:
            problem = StatefulMismatchError(
                f"{key}[{name!r}] is per-rank state of {saved_world} ranks, this run has {world}: give the object "
                f"the class attribute stateful_scope = 'global' if its state is the same on every rank"
            )
        else:
            entry = entries[rank if saved_world == world else 0]
            if type(entry) is not dict:
                raise MetadataError(f"{key}[{rank}] must be an object {{name: state}}")
            if name not in entry:
                problem = MissingKeyError(f"{where} holds no state of stateful[{name!r}]")
            else:
                actions.append((f"stateful[{name!r}]", _applier(obj, entry[name], f"{key}[{name!r}]")))
                continue
        if strict:
            raise type(problem)(f"{problem}; pass strict=False to keep its current state")
        message = str(problem)
        actions.append(
            (name, lambda message=message: logger.warning("%s: the object keeps its current state", message))
        )

    def apply() -> None:
        apply_all(actions)  # every object, also after one raised; those that raised named (NotAppliedError)

    return apply


def _applier(obj: Any, state: Any, where: str) -> Callable[[], None]:
    check = getattr(obj, "check_state_dict", None)
    if callable(check):  # an object that can refuse before anything is written (the sampler) does it now
        try:
            check(state)
        except (TypeError, ValueError) as e:
            raise StatefulMismatchError(f"{where}: {e}") from None
    setter = _setter(obj)
    return lambda: setter(json.loads(json.dumps(state)))
