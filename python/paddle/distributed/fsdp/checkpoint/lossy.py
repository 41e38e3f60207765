"""Lossy moments, opt-in: the save transform that stores Adam-style moments as int8/int4 codes with per-block
scales, and the load transforms that read them back into fp32 moments (codecs and the metadata field:
format/quant.py).

Why a state-dict transform: the engine below stays exact and generic (coverage, checksums, resharding, S3, the
memory tier's in-memory copies are untouched); a quantized key ``K`` is stored as two ordinary 1-D tensors,
``K@qcodes`` and ``K@qscales``, laid out on the global flat index so any rank at any world size reads only the
codes of its elements and the scales of the blocks they touch. Each saving rank holds a contiguous flat range
of ``K``; a block cut by a rank boundary gets the maximum over both parts (one ``all_gather_object`` of each
piece's edge maxima and first value), and its scale is stored by the rank holding the block's first element.

Which keys: ``<param key>.moment1`` and ``<param key>.moment2`` (state/optimizer_states.py's names for Adam,
AdamW, Lamb, NAdam, RAdam); never master weights, parameters or any other state. A moment holding NaN or
infinity, or held by a record that is not a flat range of the whole tensor, is stored exactly (logged), decided
alike on every rank.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import numpy as np

from .errors import CheckpointError, LossyCheckpointError
from .format.metadata import numel
from .format.quant import (
    CODES_SUFFIX,
    DEFAULT_BLOCK,
    MODES,
    MOMENT_SCHEMES,
    SCALES_SUFFIX,
    SCHEMES,
    NonFiniteError,
    QuantizedKey,
    code_span,
    dequantize_range,
    element_codes,
    field_json,
    read_spans,
    scale_span,
)
from .format.reserved import QUANT_KEY
from .quant_threads import block_maxima_async, dequantize_async, packed_codes_async, thread_count
from .records import to_record

logger = logging.getLogger(__name__)

FLOAT_DTYPES = ("float32", "bfloat16", "float16")


class LossyCheckpointWarning(UserWarning):
    """A checkpoint with quantized moments was loaded: the resume is close to, not bit-identical with, the run
    that saved it (docs/reports/2026-12-07-lossy-moments.md measures how close)."""


def check_mode(mode: Any) -> str | None:
    """``quantize_moments``: "int8" or "int4"; None for None or "none" (exact: what CheckpointOptions, the
    environment switch and MemoryTier accept too, so a save can ask for exact moments against an int8/int4
    default); ValueError otherwise."""
    if mode is None or mode == "none":
        return None
    if mode not in MODES:
        raise ValueError(f"quantize_moments must be None, 'none', 'int8' or 'int4', got {mode!r}")
    return mode


def moment_name(key: str) -> str | None:
    """``moment1``/``moment2`` when ``key`` is an optimizer moment key ``<param key>.<moment>``."""
    head, dot, name = key.rpartition(".")
    return name if dot and head and name in MOMENT_SCHEMES else None


def _flat_span(region) -> tuple[int, int] | None:
    """The global flat range a record's elements are, or None when they are not one range of the whole tensor."""
    whole = tuple(region.box_shape) == tuple(region.shape) and not any(region.box_offset)
    if not whole:
        return None
    return tuple(region.flat_range) if region.flat_range is not None else (0, numel(region.shape))


def _host_fp32(tensor) -> np.ndarray:
    import paddle

    return np.asarray(tensor.astype(paddle.float32).numpy()).reshape(-1)


def _sharded(key: str, array: np.ndarray, lo: int, hi: int, total: int, replicated: bool):
    import paddle
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    t = paddle.to_tensor(array)
    if replicated:
        return t
    return ShardedWeight(key, t, (total,), (total,), (0,), is_flattened=True, flattened_range=slice(lo, hi))


def quantize_state(
    state: dict, mode: str | None, comm, block: int = DEFAULT_BLOCK, threads: int = 0
) -> tuple[dict, list[str]]:
    """``(state, quantized keys)``: ``state`` with every moment key replaced by its codes and scales and the
    ``"quant"`` description added (a reserved value the writer lifts into metadata.json). Collective over
    ``comm`` (checkpoint/coordination.Comm) when ``mode`` is set: every rank calls it, also one with no moments.
    ``threads``: the numpy work's threads (quant_threads.py; ``codec_threads``, 0: chosen)."""
    if check_mode(mode) is None:
        return state, []
    threads = thread_count(threads)
    local: dict[str, tuple] = {}
    mine: dict[str, Any] = {}
    try:  # a rank failing here must still join the exchange, or the others would wait in it forever
        _describe(state, mode, block, local, mine, threads)
    except Exception as e:  # noqa: BLE001 - raised on every rank after the exchange
        mine = {_FAILED: f"rank failed: {type(e).__name__}: {e}"}
    everyone = comm.all_gather_object(mine)
    failed = [per[_FAILED] for per in everyone if _FAILED in per]
    if failed:
        raise CheckpointError(f"quantize_moments: {failed[0]}")
    return _encode(state, mode, block, local, everyone, threads)


def quantize_ranks(
    load_state, world: int, mode: str, block: int = DEFAULT_BLOCK, threads: int = 0
) -> list[tuple[dict, list[str]]]:
    """``quantize_state`` of ``world`` ranks' states in ONE process (memtier/flush.py: after a crash the saving
    ranks are gone), the exchange being the list of every rank's descriptions; ``[(state, quantized keys)]`` by
    rank. ``load_state(r)`` builds rank ``r``'s state; it is called twice a rank (once to describe, once to
    encode), so one rank's moments are in memory at a time, plus the codes and scales of the ranks encoded."""
    mode = check_mode(mode)
    threads = thread_count(threads)
    everyone = []
    for r in range(world):
        mine: dict[str, Any] = {}
        _describe(load_state(r), mode, block, {}, mine, threads)
        everyone.append(mine)
    out = []
    for r in range(world):
        state, local = load_state(r), {}
        _describe(state, mode, block, local, {}, threads)
        out.append(_encode(state, mode, block, local, everyone, threads))
    return out


_FAILED = "\0failed"  # (not a key: keys of a state dict are checked at save; this one never reaches a file)


def _describe(state: dict, mode: str, block: int, local: dict, mine: dict, threads: int) -> None:
    """This rank's moments: ``mine[key]`` what the exchange carries (its flat range, edge block maxima, first value,
    dtype, shape, scheme; or why it stays exact), ``local[key]`` what encoding it needs. Every moment's block
    maxima are queued on the pool before the first is waited for."""
    queued = []
    for key, val in state.items():
        name = moment_name(key)
        rec = to_record(key, val) if name is not None else None
        if rec is None or rec.dtype not in FLOAT_DTYPES or numel(rec.region.shape) == 0:
            continue
        span = _flat_span(rec.region)
        scheme = SCHEMES[MOMENT_SCHEMES[name][mode]]
        if span is None:
            mine[key] = "not a flat range of the whole tensor"
            continue
        x = _host_fp32(rec.tensor)
        queued.append((key, rec, x, span, scheme, block_maxima_async(x, span[0], block, scheme, threads)))
    for key, rec, x, span, scheme, pending in queued:
        try:
            maxima = pending.result()
        except NonFiniteError as e:
            mine[key] = str(e)
            continue
        first = float(x[0]) if x.size else 0.0
        edges = (float(maxima[0]), float(maxima[-1])) if maxima.size else (0.0, 0.0)
        mine[key] = (span, edges, first, rec.dtype, tuple(rec.region.shape), scheme.name)
        local[key] = (rec, x, maxima, scheme)


def _encode(state: dict, mode: str, block: int, local: dict, everyone: list, threads: int) -> tuple[dict, list[str]]:
    """Every rank's description of every moment (``everyone``) -> this rank's codes and scales, and the field.
    Every moment's codes are queued on the pool before the first is waited for."""
    keys = sorted({k for per in everyone for k in per})
    out = dict(state)
    described: dict[str, QuantizedKey] = {}
    queued = []
    for key in keys:
        infos = [per[key] for per in everyone if key in per]
        refused = next((i for i in infos if isinstance(i, str)), None)
        if refused is not None or len({(i[3], i[4], i[5]) for i in infos}) != 1:
            logger.warning("quantize_moments: %s is stored exactly (%s)", key, refused or "ranks disagree on it")
            continue
        _span, _edges, _first, dtype, shape, scheme_name = infos[0]
        scheme, n = SCHEMES[scheme_name], numel(shape)
        edge_max: dict[int, float] = {}  # blocks cut by a piece boundary: the max over every piece's part
        firsts: dict[int, float] = {}
        for (lo, hi), (head, tail), first, *_ in infos:
            for b, m in ((lo // block, head), ((hi - 1) // block, tail)):
                edge_max[b] = max(edge_max.get(b, 0.0), m)
            firsts[lo] = first
        q = QuantizedKey(key, scheme, block, shape, dtype, key + CODES_SUFFIX, key + SCALES_SUFFIX)
        described[key] = q
        if key not in local:
            continue
        rec, x, maxima, _ = local.pop(key)
        lo, hi = _flat_span(rec.region)
        scales = maxima.astype(np.float32)
        scales[0] = edge_max[lo // block]
        scales[-1] = edge_max[(hi - 1) // block]
        next_code = 0
        if scheme.bits == 4 and hi % 2 and hi in firsts:  # the last byte also holds the next piece's first code
            nb = hi // block
            s = np.asarray([edge_max.get(nb, 0.0)], np.float32)
            next_code = int(element_codes(np.asarray([firsts[hi]], np.float32), hi, s, nb, block, scheme)[0])
        queued.append((q, rec, scales, packed_codes_async(x, lo, scales, block, scheme, next_code, threads)))
    for q, rec, scales, pending in queued:
        lo, hi = _flat_span(rec.region)
        n = q.numel
        c0, c1 = code_span(lo, hi, q.scheme)
        s0, s1 = scale_span(lo, hi, block)
        del out[q.key]
        out[q.codes] = _sharded(q.codes, pending.result(), c0, c1, q.scheme.codes_len(n), rec.replicated)
        first_block = lo // block
        out[q.scales] = _sharded(
            q.scales, scales[s0 - first_block : s1 - first_block], s0, s1, -(-n // block), rec.replicated
        )
    if described:
        out[QUANT_KEY] = field_json(described)
    return out, sorted(described)


# ------------------------------------------------------------------------------------------------------- loads


class PendingDequant:
    """Targets of quantized keys, swapped for their codes and scales in a load request; ``finish()`` writes the
    dequantized moments into the original targets once the engine loaded the codes."""

    def __init__(self) -> None:
        self.items: list[tuple[QuantizedKey, Any, Any, Any, tuple[int, int], tuple[int, int], tuple[int, int]]] = []

    def __bool__(self) -> bool:
        return bool(self.items)

    def finish(self, loaded_keys: list[str] | None = None, threads: int = 0) -> None:
        """``threads``: the dequantizing threads (quant_threads.py; ``codec_threads``, 0: chosen); every moment
        is queued on the pool before the first is copied into its target."""
        import paddle

        threads = thread_count(threads)
        done = set(loaded_keys) if loaded_keys is not None else None
        queued = []
        for q, target, codes, scales, (a, b), (c0, _c1), (s0, _s1) in self.items:
            if done is not None and not (q.codes in done and q.scales in done):
                continue
            if b > a:
                pending = dequantize_async(_np(codes), c0, _np(scales), s0, a, b, q.block, q.scheme, threads)
                queued.append((target, pending))
            if done is not None:
                loaded_keys[:] = [k for k in loaded_keys if k not in (q.codes, q.scales)] + [q.key]
        for target, pending in queued:
            t = getattr(target, "local_tensor", target)
            src = paddle.to_tensor(pending.result().reshape(t.shape)).astype(t.dtype)
            t.copy_(src, False)  # in place: moments may be views into fused buffers


def _np(v) -> np.ndarray:
    t = getattr(v, "local_tensor", v)
    return np.asarray(t.numpy()).reshape(-1)


def swap_targets(requested: dict, quant: dict[str, QuantizedKey] | None) -> PendingDequant:
    """Replace in ``requested`` (in place) each target of a quantized key by targets of the codes and scales
    covering its elements (flat ranges of the whole tensor, or whole tensors)."""
    pending = PendingDequant()
    for key, q in (quant or {}).items():
        target = requested.get(key)
        if target is None:
            continue
        rec = to_record(key, target)
        span = _flat_span(rec.region) if rec is not None else None
        if span is None:
            raise CheckpointError(
                f"key {key!r}: quantized moments load into whole tensors or flat ranges of them, not {rec and rec.region}"
            )
        (c0, c1), (s0, s1) = read_spans(span[0], span[1], q.block, q.scheme)
        n = q.numel
        codes = _sharded(q.codes, np.zeros(c1 - c0, q.scheme.codes_dtype), c0, c1, q.scheme.codes_len(n), False)
        scales = _sharded(q.scales, np.zeros(s1 - s0, np.float32), s0, s1, -(-n // q.block), False)
        if c1 == c0:  # nothing to read (an empty piece): keep the request valid with no target
            codes = scales = None
        del requested[key]
        if codes is not None:
            requested[q.codes], requested[q.scales] = codes, scales
        pending.items.append((q, target, codes, scales, span, (c0, c1), (s0, s1)))
    return pending


def warn_lossy(path: str, quant: dict | None, exact: bool) -> None:
    """The resume is not bit-exact: LossyCheckpointWarning, or LossyCheckpointError when ``exact``."""
    if not quant:
        return
    schemes = sorted({q.scheme.name for q in quant.values()})
    what = f"checkpoint {path} stores {len(quant)} optimizer moment(s) quantized ({', '.join(schemes)})"
    if exact:
        raise LossyCheckpointError(f"{what}: it cannot resume bit-exactly (exact=True)")
    warnings.warn(f"{what}: the resume is not bit-exact", LossyCheckpointWarning, stacklevel=3)


def dequantize_full(md, out: dict, wanted: list[str]) -> None:
    """One-process reads (tools: verify, diff, to-hf; ``load_full_state_dict``): the quantized keys of
    ``wanted`` put back in ``out`` as full fp32 tensors from their codes and scales read whole."""
    import paddle

    for key in wanted:
        q = (md.quant or {}).get(key)
        if q is None:
            continue
        codes, scales = _np(out.pop(q.codes)), _np(out.pop(q.scales))
        values = dequantize_async(codes, 0, scales, 0, 0, q.numel, q.block, q.scheme, thread_count(0)).result()
        out[key] = paddle.to_tensor(values.reshape(q.shape) if q.shape else values.reshape([]))


def stored_keys(md, wanted: list[str]) -> list[str]:
    """What to read for ``wanted``: a quantized key's codes and scales instead of itself."""
    out = []
    for key in wanted:
        q = (md.quant or {}).get(key)
        out.extend((q.codes, q.scales) if q is not None else (key,))
    return out


def logical_tensors(md) -> dict:
    """``{key: TensorMeta}`` as the writer saw them (tools: diff, key roles): a quantized key as its dtype and
    shape (no pieces: read it with ``read_dequantized``), its codes and scales left out."""
    from .format.metadata import TensorMeta

    quant = md.quant or {}
    hidden = {q.codes for q in quant.values()} | {q.scales for q in quant.values()}
    out = {k: md.tensors[k] for k in md.tensors if k not in hidden}
    out.update({k: TensorMeta(q.dtype, q.shape, []) for k, q in quant.items()})
    return out


def read_dequantized(read_flat, q: QuantizedKey, start: int, stop: int) -> np.ndarray:
    """fp32 elements ``[start, stop)`` of quantized key ``q`` through ``read_flat(key, start, stop)`` of the
    stored keys (only their codes and the scales of the blocks touched)."""
    (c0, c1), (s0, s1) = read_spans(start, stop, q.block, q.scheme)
    codes, scales = read_flat(q.codes, c0, c1), read_flat(q.scales, s0, s1)
    return dequantize_range(codes, c0, scales, s0, start, stop, q.block, q.scheme)


def logical_keys(md) -> list[str]:
    """The tensor keys of a checkpoint as its writer saw them: quantized keys instead of their codes/scales."""
    quant = md.quant or {}
    hidden = {q.codes for q in quant.values()} | {q.scales for q in quant.values()}
    return [k for k in md.tensors if k not in hidden] + sorted(quant)
