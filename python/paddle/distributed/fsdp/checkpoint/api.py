"""Public functions of the checkpoint engine: a façade that re-exports them from the modules below.

* ``save.py``: ``save_state_dict`` (sync and async), ``SaveHandle``, ``release_host_buffers``; the layout of a
  checkpoint directory, the save/commit protocol, crash safety and async saves are described there.
* ``load.py``: ``read_metadata``, ``load_state_dict``, ``load_full_state_dict``, ``LoadReport``; how a load reads,
  verifies and commits into the targets all-or-nothing.
* ``verify.py``: ``verify_checkpoint``.
* ``coordination.py``: what save and load share for cross-rank coordination (process group, error exchange,
  file-based polling, tracing).

Module globals that switch behaviour live in (and must be set on) the module that owns them: ``_TRACE`` in
coordination.py, ``_HOST_FAST_PATH`` in load.py.
"""

from __future__ import annotations

from .coordination import (  # noqa: F401
    DEFAULT_COMMIT_TIMEOUT,
    PARTS_DIR,
    _Comm,
    _error_payload,
    _raise_gathered,
    _Tracer,
)
from .load import (  # noqa: F401
    LoadReport,
    load_full_state_dict,
    load_state_dict,
    read_metadata,
)
from .save import (  # noqa: F401
    SaveHandle,
    _Publisher,
    release_host_buffers,
    save_state_dict,
)
from .snapshot_guard import snapshot_in_flight, wait_for_snapshot  # noqa: F401
from .verify import verify_checkpoint  # noqa: F401

__all__ = [
    "save_state_dict",
    "load_state_dict",
    "load_full_state_dict",
    "read_metadata",
    "verify_checkpoint",
    "release_host_buffers",
    "wait_for_snapshot",
    "snapshot_in_flight",
    "SaveHandle",
    "LoadReport",
]
