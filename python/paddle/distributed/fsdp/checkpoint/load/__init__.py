"""The load phase of the checkpoint engine: ``load_state_dict``, ``load_full_state_dict`` and what only a load uses.

Why a package: the modules only a load needs live together, apart from the save's (``save/``). ``load.py`` is the
door (the protocol is described there), ``job.py`` the steps every load shares (validate, exchange, finish),
``bounded.py`` the default memory-bounded load, ``atomic.py`` the all-or-nothing one with ``inplace.py``'s reads.
Modules shared with the save, ``verify`` and the tools stay one level up (regions, ranges, chunks, reader, ...);
``load/`` imports them and never ``save/`` (test_checkpoint_layers.py). This ``__init__`` only re-exports the
door's names.
"""

from .load import LoadReport, default_load_budget, load_full_state_dict, load_state_dict, run_load

__all__ = [
    "LoadReport",
    "default_load_budget",
    "load_full_state_dict",
    "load_state_dict",
    "run_load",
]
