"""Persistable buffers in checkpoints: which ones, and what happens when ranks disagree.

A buffer (``register_buffer``, persistable by default) is model state the optimizer does not step: step
counters, EMA statistics, MoE routing biases updated outside the optimizer, quantization scales. FSDP does not
shard buffers, so every rank holds the whole tensor; it is recorded as a replicated tensor under its
structured name (``model.state_dict()``'s key), saved once and loaded into every rank whatever the world size.
Non-persistable buffers (``persistable=False``) are left out, as ``state_dict()`` leaves them out.

Replicated parameters are recorded the same way: parameters FSDP leaves whole on every rank because the
forward writes to them (batch norm's running ``_mean``/``_variance``, ``param.fsdp_replicated = True``; see
param_grouping.is_replicated_parameter). They are state the optimizer does not step, like buffers.

Ranks that disagree: the saved value is rank 0's, and every rank gets it back on load. This is the rule of
data-parallel training (DDP broadcasts rank 0's buffers), and buffers that legitimately drift per rank (batch
norm statistics over local batches) must stay savable; so ``save_checkpoint`` compares a hash of every buffer
across ranks and logs a warning naming the buffers that differ, instead of refusing the save.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import paddle

logger = logging.getLogger(__name__)


def persistable_buffers(model: paddle.nn.Layer) -> OrderedDict:
    """The model's persistable buffers by structured name, in ``model.state_dict()`` order (a buffer object
    registered under two names is known by the first); on a wrapped model also its replicated parameters
    (those FSDP did not shard)."""
    out: OrderedDict = OrderedDict()
    seen: set[int] = set()
    wrapped = getattr(model, "_fsdp", None) is not None
    for prefix, layer in model.named_sublayers(include_self=True):
        entries = list(layer._buffers.items())
        if wrapped:
            entries = [(n, p) for n, p in layer._parameters.items() if p is not None and not hasattr(p, "_fsdp_buffer")]
            entries += list(layer._buffers.items())
        for name, buffer in entries:
            if buffer is None or name in layer._non_persistable_buffer_names_set or id(buffer) in seen:
                continue
            seen.add(id(buffer))
            out[f"{prefix}.{name}" if prefix else name] = buffer
    return out


_fingerprint_staging = None  # pinned host staging reused by every save's fingerprints (device buffers)


def fingerprints(buffers: dict) -> dict[str, str]:
    """Key -> dtype, shape and xxh3-64 of the bytes of each buffer. Device buffers are copied to host together
    (one copy batch on the copy stream, one GIL-releasing wait; device.to_host), never one blocking ``.cpu()``
    each; host ones are hashed in place."""
    import xxhash

    from ..checkpoint import host_memory
    from ..devices import device

    global _fingerprint_staging
    if _fingerprint_staging is None:
        _fingerprint_staging = device.HostStaging()
    tensors = list(buffers.values())
    hosts = device.to_host(tensors, _fingerprint_staging)
    out = {}
    for key, t, h in zip(buffers, tensors, hosts):
        arr, _keep = host_memory.raw_view(h)
        out[key] = f"{host_memory.dtype_name(t)}{list(t.shape)}:{xxhash.xxh3_64_hexdigest(arr)}"
    return out


def buffers_differing_across_ranks(fsdp, buffers: dict | None = None) -> dict[str, list[int]]:
    """Buffer key -> ranks whose value differs from rank 0's. Collective (one small all_gather_object) when the
    model has persistable buffers (none: no collective, so an async save of such a model blocks for one less).
    ``buffers``: ``persistable_buffers(fsdp.model)`` when the caller has it (a walk of every sublayer)."""
    if buffers is None:
        buffers = persistable_buffers(fsdp.model)
    if not buffers:  # the model's structure is the same on every rank: all skip the collective together
        return {}
    failure = None
    try:
        mine = fingerprints(buffers)
    except Exception as e:  # noqa: BLE001 - raised after the exchange: the others must not wait for this rank
        mine, failure = None, e
    every = fsdp.comm.all_gather_object(mine)
    if failure is not None:
        raise failure
    differing: dict[str, list[int]] = {}
    for rank, prints in enumerate(every[1:], start=1):
        for key, value in (prints or {}).items():  # None: that rank failed (its save reports it to every rank)
            if every[0] is not None and every[0].get(key) != value:
                differing.setdefault(key, []).append(rank)
    return differing


def warn_if_buffers_differ(fsdp, buffers: dict | None = None) -> dict[str, list[int]]:
    """Log (on every rank) which buffers will be saved from rank 0 although other ranks hold other values."""
    differing = buffers_differing_across_ranks(fsdp, buffers)
    if differing:
        shown = ", ".join(f"{key} (ranks {ranks})" for key, ranks in list(differing.items())[:10])
        logger.warning(
            "save_checkpoint: %d persistable buffer(s) differ across ranks; rank 0's value is saved and every rank "
            "gets it back on load: %s%s",
            len(differing),
            shown,
            " ..." if len(differing) > 10 else "",
        )
    return differing
