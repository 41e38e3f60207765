"""A save's derived weights: which bf16/fp16 weights are left out because they are exactly their fp32 master
weight cast (format/derived.py), decided alike on every rank.

Why its own step: the decision changes the records every rank describes to the write assignment, so it is taken
before the save's exchange, in one ``all_gather_object`` of its own (coordination.gather_errors: an error on one
rank is raised on every rank). A weight ``<k>`` is derived when, on every rank, ``<k>`` and ``<k>.master_weight``
are both sharded records of the same region, the master float32, the weight bfloat16/float16, and every element of
the rank's shard of ``<k>`` equals its master's, cast round to nearest even (checked on the values at the call:
an async save's later copy holds the same values, snapshot_guard.py). Anything else keeps the weight stored.
Cost: one pass over the rank's weights and masters (6 bytes a parameter read), a block of 1M elements at a time.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from ..coordination import gather_errors, stage_error
from ..errors import SaveFailedError
from ..format import derived
from ..host_memory import raw_view
from ..records import to_record

logger = logging.getLogger(__name__)


def _local_candidates(state_dict) -> tuple[list[tuple[str, str]], list[str]]:
    """``(equal, other)``: this rank's weight keys (and dtypes) whose shard is exactly its master's cast, its other
    bf16/fp16 tensor keys (a rank whose shard of a weight is not derivable keeps it stored on every rank: a key
    is never stored in part)."""
    if not isinstance(state_dict, dict):
        return [], []  # (the save's own validation names it)
    equal, other = [], []
    for wkey, wval in state_dict.items():
        w = to_record(wkey, wval) if isinstance(wkey, str) else None
        if w is None or w.dtype not in derived.CAST_DTYPES:
            continue
        mkey = wkey + derived.MASTER_SUFFIX
        m = to_record(mkey, state_dict[mkey]) if mkey in state_dict else None
        if m is None or m.dtype != derived.SOURCE_DTYPE or w.region != m.region or w.replicated != m.replicated:
            other.append(wkey)
            continue
        wraw, _keep_w = raw_view(w.tensor)
        mraw, _keep_m = raw_view(m.tensor)
        if derived.equals_cast(wraw.view("uint16"), mraw.view("float32"), w.dtype):
            equal.append((wkey, w.dtype))
        else:
            other.append(wkey)
    return equal, other


def plan_derived(req, comm):
    """``(request, derived field)``: the request without the weights every rank found derivable (and the
    ``"derived"`` field naming them), or unchanged with ``{}`` when ``derive_weights`` is off. Collective when on:
    every rank of the save calls it."""
    if not req.options.derive_weights or req.opts_error is not None:
        return req, {}
    err, payload = None, ([], [])
    try:
        payload = _local_candidates(req.state_dict)
    except Exception as e:  # noqa: BLE001 - reported to every rank (a bad record is the save's own error)
        err = stage_error(e, f"save to {req.path} failed", comm.rank, SaveFailedError)
    gathered = gather_errors(comm, err, payload)
    dtypes = {k: d for equal, _o in gathered for k, d in equal}
    agreed = set(dtypes) - {k for _e, other in gathered for k in other}
    kept = sorted(set(dtypes) - agreed)
    if kept:
        logger.info("save to %s: %d weights not derivable on every rank, stored: %s", req.path, len(kept), kept[:5])
    if not agreed:
        return req, {}
    state = {k: v for k, v in req.state_dict.items() if k not in agreed}
    deferred = None if req.deferred_keys is None else [k for k in req.deferred_keys if k not in agreed]
    field = derived.to_field({k: derived.Derived(k, k + derived.MASTER_SUFFIX, dtypes[k]) for k in agreed})
    return replace(req, state_dict=state, deferred_keys=deferred), field
