"""One save call, resolved once at the door: the caller's inputs, the options and the storage backend.

Why: the save's phases (validate, exchange, open, sources, job) each took a long list of the caller's
arguments and resolved the options' storage backend again for the same path. The request is built once, right
after the keyword check, and every phase reads what it needs from it.

Errors of the resolution are kept, not raised, so that each one still surfaces where the save reported it before:
``opts_error`` (a malformed ``PADDLE_FSDP_CKPT_*`` variable) through the cross-rank exchange, so every rank raises
it; ``path_error`` (a URL no backend serves, a non-path) after the previous save was waited for;
``storage_error`` where the backend is first used (``backend()``: on every rank, before the exchange); and
``caller_error``, what the calling door's own stage raised on this rank, through the exchange too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from ..errors import CheckpointError
from ..io.storage import Storage
from ..options import CheckpointOptions, resolve
from ..paths import local_path
from .commit import Publisher


@dataclass(frozen=True)
class SaveRequest:
    """What one ``save_state_dict`` / ``save_and_publish`` call asks for (``path``: the location, paths.py)."""

    state_dict: dict
    path: str
    process_group: Any
    coordinator_rank: int
    publisher: Publisher | None
    async_save: bool
    chunk_bytes: int | None
    write_stock_metadata: bool
    deferred_keys: Collection[str] | None
    per_rank_values: Collection[str]
    options: CheckpointOptions
    storage: Storage | None
    opts_error: CheckpointError | None = None
    path_error: BaseException | None = None
    storage_error: BaseException | None = None
    caller_error: BaseException | None = None
    # the commit record's ``lineage`` (lineage.py), asked by the coordinator right before it commits; None: none
    lineage: Callable[[], dict | None] | None = None

    def backend(self) -> Storage:
        """The storage backend of ``path``, resolved once; raises what resolving it raised."""
        if self.storage_error is not None:
            raise self.storage_error
        assert self.storage is not None, "no backend for a request whose options or path failed"
        return self.storage


def save_request(
    state_dict: dict,
    path: Any,
    process_group,
    coordinator_rank: int,
    publisher: Publisher | None,
    *,
    lineage: Callable[[], dict | None] | None = None,
    async_save: bool = False,
    chunk_bytes: int | None = None,
    write_stock_metadata: bool = True,
    deferred_keys: Collection[str] | None = None,
    per_rank_values: Collection[str] = (),
    options: CheckpointOptions | None = None,
    caller_error: BaseException | None = None,
    derive_weights: bool | None = None,
) -> SaveRequest:
    """The request of one save: options resolved (None: the environment, read now), ``path`` made a location and
    its backend resolved, each once; what fails is kept in the request (see the module docstring).
    ``caller_error``: what the calling door's own stage raised on this rank (the resume layer's capture of the
    state, the checkpoint root of a CheckpointManager): the exchange reports it, so every rank raises it."""
    opts_error = path_error = storage_error = None
    storage = None
    try:
        opts = resolve(options)
        if derive_weights is not None:  # the keyword wins over options / PADDLE_FSDP_CKPT_DERIVE_WEIGHTS
            opts = dataclasses.replace(opts, derive_weights=bool(derive_weights))  # (a known field: not re-checked)
    except CheckpointError as e:  # reported by the exchange, so every rank raises it
        opts, opts_error = CheckpointOptions(), e
    try:
        path = local_path(path, opts.storage)
    except Exception as e:  # raised after the previous save was waited for
        path_error = e
    if opts_error is None and path_error is None:
        try:
            storage = opts.storage_for(path)
        except Exception as e:  # raised where the backend is first used
            storage_error = e
    return SaveRequest(
        state_dict=state_dict,
        path=path,
        process_group=process_group,
        coordinator_rank=coordinator_rank,
        publisher=publisher,
        async_save=async_save,
        chunk_bytes=chunk_bytes,
        write_stock_metadata=write_stock_metadata,
        deferred_keys=deferred_keys,
        per_rank_values=per_rank_values,
        options=opts,
        storage=storage,
        opts_error=opts_error,
        path_error=path_error,
        storage_error=storage_error,
        caller_error=caller_error,
        lineage=lineage,
    )
