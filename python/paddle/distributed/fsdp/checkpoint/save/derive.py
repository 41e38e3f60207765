"""A save's derived weights: which bf16/fp16 weights are left out because they are exactly their fp32 master
weight cast (format/derived.py), decided alike on every rank.

Why its own step: the decision changes the records every rank describes to the write assignment, so it is taken
before the save's exchange, in one ``all_gather_object`` of its own (coordination.gather_errors: an error on one
rank is raised on every rank). A weight ``<k>`` is derived when, on every rank, ``<k>`` and ``<k>.master_weight``
are both sharded records of the same region, the master float32, the weight bfloat16/float16, and every element of
the rank's shard of ``<k>`` equals its master's, cast round to nearest even (checked on the values at the call:
an async save's later copy holds the same values, snapshot_guard.py). Anything else keeps the weight stored.
Cost: one pass over the rank's weights and masters (6 bytes a parameter read). Host tensors: the blocks of all of
them on one thread pool (format/derived.py: ``equals_cast_many``); ~2 ns a parameter of one core's time here,
about what a copy of those 6 bytes costs. Device tensors (GPU; fake-device mode in tests) are checked on their
device in paddle integer ops, the same rounding bit for bit, slices of bounded size, one host sync for all of them
(save/derive_on_device.py): no host copy of a weight or master, which used to cost a full D2H copy of the 6 bytes
on the training loop's clock. Only a weight whose master holds a NaN is then copied and checked on the host (its
NaN pattern is numpy's). Figures: reports/2026-12-07-derive-speed.md.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import replace

from ...devices import device
from ..coordination import gather_errors, stage_error
from ..errors import InvalidStateDictError, SaveFailedError
from ..format import derived
from ..host_memory import is_host_contiguous, raw_view
from ..records import to_record
from .derive_on_device import equals_cast_on_device

logger = logging.getLogger(__name__)


def _local_candidates(state_dict) -> tuple[dict[str, str], list[str]]:
    """``(equal, other)``: this rank's weight keys whose shard is exactly its master's cast (key -> dtype), and
    those that have a master here but differ from its cast (another sharding, an element off, a NaN)."""
    if not isinstance(state_dict, dict):
        return {}, []  # (the save's own validation names it)
    equal, other = {}, []
    checks, keep = [], []  # (weight key, dtype), and what keeps each raw view's memory alive
    on_device = []  # (weight key, dtype, weight, master) of tensors not in host memory
    for mkey, mval in state_dict.items():
        if not isinstance(mkey, str) or not mkey.endswith(derived.MASTER_SUFFIX):
            continue
        wkey = mkey[: -len(derived.MASTER_SUFFIX)]
        if wkey not in state_dict:
            continue
        w, m = to_record(wkey, state_dict[wkey]), to_record(mkey, mval)
        if w is None or m is None or w.dtype not in derived.CAST_DTYPES:
            continue
        if m.dtype != derived.SOURCE_DTYPE or w.region != m.region or w.replicated != m.replicated:
            other.append(wkey)
            continue
        if not (device.is_host(w.tensor) or device.is_host(m.tensor)) and str(w.tensor.place) == str(m.tensor.place):
            on_device.append((wkey, w.dtype, w.tensor, m.tensor))  # (checked where they are: no host copy)
            continue
        if not (is_host_contiguous(w.tensor) and is_host_contiguous(m.tensor)):
            # (a non-contiguous host tensor, or one of the two on the device: copied, checked, dropped one at a time)
            if _check_through_host_copies(w.tensor, m.tensor, w.dtype):
                equal[wkey] = w.dtype
            else:
                other.append(wkey)
            continue
        wraw, keep_w = raw_view(w.tensor)
        mraw, keep_m = raw_view(m.tensor)
        checks.append((wkey, w.dtype))
        keep.append((wraw.view("uint16"), mraw.view("float32"), w.dtype, keep_w, keep_m))
    found = equals_cast_on_device([(w, m, dtype) for _k, dtype, w, m in on_device]) if on_device else []
    for (wkey, dtype, wt, mt), ok in zip(on_device, found):
        if ok is None:  # a NaN in the master: its NaN pattern is the host's (a host copy, rare)
            ok = _check_through_host_copies(wt, mt, dtype)
        if ok:
            equal[wkey] = dtype
        else:
            other.append(wkey)
    for (wkey, dtype), ok in zip(checks, derived.equals_cast_many([k[:3] for k in keep])):
        if ok:
            equal[wkey] = dtype
        else:
            other.append(wkey)
    return equal, other


def _check_through_host_copies(weight, master, dtype: str) -> bool:
    wraw, _keep_w = raw_view(weight)
    mraw, _keep_m = raw_view(master)
    return derived.equals_cast(wraw.view("uint16"), mraw.view("float32"), dtype)


def _digest(equal: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(sorted(equal.items())).encode()).hexdigest()


def plan_derived(req, comm):
    """``(request, derived field)``: the request without the weights every rank found derivable (and the
    ``"derived"`` field naming them), or unchanged with ``{}`` when ``derive_weights`` is off. Collective when on:
    every rank of the save calls it.

    One ``all_gather_object`` of a digest of each rank's derivable keys and the (normally empty) list of those
    that are not: O(1) a rank when every rank holds the same keys (FSDP). Only when the digests differ (expert
    parallelism: ranks hold other keys) a second one gathers the lists. A rank that holds an agreed weight
    without its master (not derivable here, derived elsewhere) makes the save fail by name (a key is never stored
    in part): ``derive_weights=False`` saves such a state."""
    if not req.options.derive_weights or req.opts_error is not None:
        return req, {}
    err, equal, other = None, {}, []
    try:
        equal, other = _local_candidates(req.state_dict)
    except Exception as e:  # noqa: BLE001 - reported to every rank (a bad record is the save's own error)
        err = stage_error(e, f"save to {req.path} failed", comm.rank, SaveFailedError)
    gathered = gather_errors(comm, err, (_digest(equal), bool(equal), other))
    if not any(has for _d, has, _o in gathered):
        return req, {}
    dtypes = dict(equal)
    if len({d for d, _h, _o in gathered}) > 1:
        for theirs in gather_errors(comm, None, equal):
            dtypes.update(theirs)
    agreed = set(dtypes) - {k for _d, _h, o in gathered for k in o}
    kept = sorted(set(dtypes) - agreed)
    if kept:
        logger.info("save to %s: %d weights not derivable on every rank, stored: %s", req.path, len(kept), kept[:5])
    if not agreed:
        return req, {}
    alone = sorted(k for k in agreed if isinstance(req.state_dict, dict) and k in req.state_dict and k not in equal)
    if alone:
        error = InvalidStateDictError(
            f"weights {alone[:5]} are derived from their master weights on other ranks, but this rank holds them "
            f"without one: save with derive_weights=False"
        )
        return replace(req, caller_error=req.caller_error or error), {}
    state = {k: v for k, v in req.state_dict.items() if k not in agreed}
    deferred = None if req.deferred_keys is None else [k for k in req.deferred_keys if k not in agreed]
    field = derived.to_field({k: derived.Derived(k, k + derived.MASTER_SUFFIX, dtypes[k]) for k in agreed})
    return replace(req, state_dict=state, deferred_keys=deferred), field
