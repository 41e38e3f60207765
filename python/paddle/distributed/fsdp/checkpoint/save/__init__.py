"""The save phase of the checkpoint engine: ``save_state_dict`` and what only a save uses.

Why a package: the modules only a save needs live together, apart from the load's (``load/``). ``save.py`` is the
door (the protocol is described there), ``request.py`` the one request a save carries, ``commit.py`` steps 2-3
(write, hand over, commit, publish) over ``channel.py`` (the TCP store, reached through ``store_client.py``: every
call bounded, every reply checked), ``markers.py`` the records of a failed save, ``abandon.py`` how a rank gives a
save up. Modules shared with the load stay one level up; ``save/`` imports them
and never ``load/`` (test_checkpoint_layers.py). This ``__init__`` only re-exports the door's names.
"""

from .save import Publisher, SaveHandle, release_host_buffers, save_and_publish, save_state_dict, wait_pending

__all__ = [
    "SaveHandle",
    "Publisher",
    "release_host_buffers",
    "save_and_publish",
    "save_state_dict",
    "wait_pending",
]
