"""Unknown keyword arguments: a TypeError naming the nearest valid keyword, never silently ignored.

Why: the engine's functions take stock paddle's keywords too (``unique_id``, ``safetensors``, ...; accepted and
ignored, as documented by each function), and the wrappers (CheckpointManager, FullyShardFusion) pass keywords
on; a catch-all that accepts anything turned a typo such as ``asnyc_save=True`` into a synchronous save without
a word. Every catch-all checks what it got against the keywords it (or the function it calls) accepts.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Callable, Collection, Mapping

# stock paddle's own keywords of dist.save_state_dict / load_state_dict that the engine's functions accept (and
# ignore: it writes and reads its own single-version safetensors format, on the host)
STOCK_SAVE_KEYWORDS = ("unique_id", "safetensors", "save_replicas")
STOCK_LOAD_KEYWORDS = (
    "unique_id",
    "offload",
    "mw_name_compatibility",
    "aoa_config",
    "safetensors",
    "worker_groups",
    "comm_method",
)


@functools.cache
def keyword_names(fn: Callable, exclude: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The public keyword names of ``fn``'s signature (no ``*args``/``**kwargs``, no ``_private`` ones)."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return tuple(
        n
        for n, p in inspect.signature(fn).parameters.items()
        if p.kind in kinds and not n.startswith("_") and n not in exclude
    )


def unexpected_keyword(fn_name: str, name: str, valid: Collection[str]) -> TypeError:
    """Python's own message for an unknown keyword, with the nearest valid one (difflib) or the valid ones."""
    near = difflib.get_close_matches(name, sorted(valid), n=1, cutoff=0.6)
    hint = f"; did you mean {near[0]!r}?" if near else f"; valid keywords: {', '.join(sorted(valid))}"
    return TypeError(f"{fn_name}() got an unexpected keyword argument {name!r}{hint}")


def check_keywords(fn_name: str, given: Mapping[str, object], valid: Collection[str]) -> None:
    """Raise ``unexpected_keyword`` for the first (sorted) keyword of ``given`` that is not in ``valid``."""
    unknown = sorted(set(given) - set(valid))
    if unknown:
        raise unexpected_keyword(fn_name, unknown[0], valid)
