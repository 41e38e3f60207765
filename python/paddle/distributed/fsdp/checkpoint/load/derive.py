"""Loading derived weights (format 4's ``"derived"``, format/derived.py): every door that loads into a state dict
(``load_state_dict``, CheckpointManager, ``load_checkpoint``, the stock hook: all go through ``run_load``) gets the
weight its save left out as its fp32 master weight cast, round to nearest even, bit-exactly what was trained.

How, without a read path of its own: before the load, each requested derived key whose dtype and shape match is
taken out of the state dict. When its master weight is requested too, for the same region (a resume: FSDP asks
for both, sharded alike), the master's own target is cast into the weight after the load (no extra read).
Otherwise the master's pieces are read under an alias key (``ALIAS_PREFIX``) that the load's metadata view maps
to the master, so the load reads, checks and reshards them as any other key (windowed, atomic or bounded, any
world size). A memory-bounded load (the default) reads such a source a window at a time into a float32 buffer
of its budget and casts each verified window into the weight (load/bounded.py): the float32 source never exists
whole, and its memory counts against ``max_host_bytes``; like every target of a bounded load, the weight is
written while the load reads (a failure then is PartiallyLoadedError). An atomic load requests a float32
temporary of the weight's region under the alias (atomic loads stage the rank's slice anyway) and casts only once
the load has committed on every rank, as it does for the masters' targets: a failed load leaves every target as
it was. A derived key requested with another dtype or shape meets the engine's usual DtypeMismatchError /
ShapeMismatchError (the view declares its dtype and its master's shape).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..directory import CommittedCheckpoint
from ..errors import CheckpointError, DerivedKeyError
from ..format import derived
from ..host_memory import account, is_host_contiguous, is_host_place, numel_of, raw_view
from ..load_checks import staging_tensor
from ..records import to_record

ALIAS_PREFIX = "__fsdp__.derived-source:"  # alias key of a temporary (never a saved key: saves refuse nothing
# of it, but the view below only maps aliases it made itself)


@dataclass(frozen=True)
class DerivedMeta:
    """What a load's validation sees of a derived key: its dtype and its master's shape (never read)."""

    dtype: str
    shape: tuple


class _Tensors(Mapping):
    """``md.tensors`` of a load with derived keys: the stored tensors, plus each alias as its master's tensor
    and each derived key as a DerivedMeta (iterated: the stored tensors only, as before)."""

    def __init__(self, inner, aliases: dict[str, str], views: dict[str, DerivedMeta]):
        self.inner, self.aliases, self.views = inner, aliases, views

    def __getitem__(self, key):
        if key in self.aliases:
            return self.inner[self.aliases[key]]
        if key in self.views:
            return self.views[key]
        return self.inner[key]

    def __contains__(self, key) -> bool:
        return key in self.aliases or key in self.views or key in self.inner

    def __iter__(self):
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)


class _AliasIndex:
    """``md.index`` of such a load: prefetches of an alias read its master's rows (spans merged)."""

    def __init__(self, inner, aliases: dict[str, str]):
        self.inner, self.aliases = inner, aliases

    def load(self, keys, spans=None) -> None:
        real = list(dict.fromkeys(self.aliases.get(k, k) for k in keys))
        merged: dict[str, tuple[int, int]] = {}
        for k, (lo, hi) in (spans or {}).items():
            r = self.aliases.get(k, k)
            old = merged.get(r)
            merged[r] = (lo, hi) if old is None else (min(lo, old[0]), max(hi, old[1]))
        self.inner.load(real, merged)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@dataclass
class Cast:
    """After the load: ``target`` (the weight's tensor) := ``source`` (float32, same elements) cast to ``dtype``."""

    key: str
    target: Any
    source: Any
    dtype: str
    alias: str | None  # the temporary's key, or None when the master's own target is the source
    region: Any = None  # the weight's Region when a memory-bounded load reads and casts it by windows (no source)


def _temporary(rec, alias: str):
    """A float32 host value of ``rec``'s region, requested under ``alias``."""
    t = staging_tensor(list(rec.tensor.shape), derived.SOURCE_DTYPE, False)
    if rec.replicated:
        return t
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    r = rec.region
    fr = None if r.flat_range is None else slice(*r.flat_range)
    return ShardedWeight(alias, t, tuple(r.box_shape), tuple(r.shape), tuple(r.box_offset), fr is not None, fr)


def _record(key, val):
    try:
        return to_record(key, val)
    except CheckpointError:
        return None  # (the load's own validation names it)


def prepare(state_dict, opened: CommittedCheckpoint | None, windowed: bool = False):
    """``(state dict to load, checkpoint to load it from, casts)``: unchanged when nothing requested is derived.
    ``windowed`` (a memory-bounded load): a weight read from its master under an alias gets no temporary; its
    Cast carries the region instead, and the load reads and casts it by windows (``LoadJob.derived``)."""
    md = None if opened is None else opened.metadata
    if md is None or not md.derived or not isinstance(state_dict, dict):
        return state_dict, opened, []
    load_dict, casts, aliases = dict(state_dict), [], {}
    for key, d in md.derived.items():
        rec = _record(key, state_dict[key]) if key in state_dict else None
        if rec is None or d.source not in md.tensors:
            continue
        if rec.dtype != d.dtype or tuple(rec.region.shape) != tuple(md.tensors[d.source].shape):
            continue  # (the view below makes the load name the mismatch)
        del load_dict[key]
        master = _record(d.source, state_dict[d.source]) if d.source in state_dict else None
        if master is not None and master.dtype == derived.SOURCE_DTYPE and master.region == rec.region:
            casts.append(Cast(key, rec.tensor, master.tensor, d.dtype, None))
            continue
        alias = ALIAS_PREFIX + key
        aliases[alias] = d.source
        if windowed:
            casts.append(Cast(key, rec.tensor, None, d.dtype, alias, rec.region))
            continue
        temp = _temporary(rec, alias)
        load_dict[alias] = temp
        casts.append(Cast(key, rec.tensor, getattr(temp, "local_tensor", temp), d.dtype, alias))
    views = {k: DerivedMeta(d.dtype, tuple(md.tensors[d.source].shape)) for k, d in md.derived.items()}
    view = replace(md, tensors=_Tensors(md.tensors, aliases, views), index=_AliasIndex(md.index, aliases))
    view.derived = md.derived
    return load_dict, CommittedCheckpoint(opened.path, view), casts


def write_cast(target, source_f32: np.ndarray, dtype: str) -> None:
    """``target`` (a tensor of ``dtype``) := ``source_f32`` cast: in place for a contiguous host tensor, else
    through a host staging tensor and ``Tensor.copy_`` (views into fused buffers keep aliasing)."""
    if is_host_contiguous(target):
        dst, _keep = raw_view(target, allow_copy=False)
        derived.cast_into(source_f32, dtype, dst)
        return
    staging = staging_tensor(list(target.shape), dtype, False)
    dst, _keep = raw_view(staging, allow_copy=False)
    derived.cast_into(source_f32, dtype, dst)
    target.copy_(staging, True)


CAST_WINDOW_BYTES = 64 << 20  # host memory of a cast whose source or target is not host memory (no budget given)


def cast_tensor(target, source, dtype: str, max_bytes: int = CAST_WINDOW_BYTES) -> None:
    """``target`` := ``source`` (a float32 tensor of the same shape) cast to ``dtype``. In place when both are
    contiguous host memory; else rows at a time through host windows of at most ``max_bytes`` (a window of the
    source copied to the host, cast into a staging window of ``dtype``, copied into the target), so a resume of
    device tensors never holds a whole master on the host. A 0-d or strided tensor is one window."""
    if is_host_contiguous(source) and is_host_contiguous(target):
        src, _keep = raw_view(source, allow_copy=False)
        write_cast(target, src.view(np.float32), dtype)
        return
    shape = list(target.shape)
    if not shape or list(source.shape) != shape or not target.is_contiguous() or not source.is_contiguous():
        src, _keep = raw_view(source)
        write_cast(target, src.view(np.float32), dtype)
        return
    from ...devices import device

    rows = shape[0]
    row = numel_of(target) // max(rows, 1)
    per_window = min(rows, max(1, max_bytes // max(1, row * 6)))  # float32 in, 2 bytes out a element
    host_staging = device.HostStaging(pinned=not is_host_place(source.place))
    if not device.is_host(source):  # the window the source's rows are copied into, reused (to_host)
        account.track(host_staging.buffer(source.dtype, per_window * row), per_window * row * 4)
    out = None
    if not is_host_contiguous(target):
        out = staging_tensor([per_window] + shape[1:], dtype, not is_host_place(target.place))
        account.track(out, per_window * row * 2)
    for r0 in range(0, rows, per_window):
        r1 = min(rows, r0 + per_window)
        piece = device.to_host([source._slice(r0, r1)], host_staging)[0]  # (a host source: itself, no copy)
        src, _keep = raw_view(piece, allow_copy=False)
        if out is None:
            dst, _keep_dst = raw_view(target, allow_copy=False)
            derived.cast_into(src.view(np.float32), dtype, dst[r0 * row * 2 : r1 * row * 2])
            continue
        dst, _keep_dst = raw_view(out, allow_copy=False)
        derived.cast_into(src.view(np.float32), dtype, dst[: (r1 - r0) * row * 2])
        target._slice(r0, r1).copy_(out if r1 - r0 == per_window else out._slice(0, r1 - r0), True)


def apply(casts: list[Cast], report, state_dict: dict, updates: dict) -> None:
    """After a committed load: every cast (windows of at most the load's budget when it had one), the report
    in the caller's keys, and the JSON values the load wrote into its own dict (``updates``) into the caller's."""
    loaded = set(report.loaded_keys)
    budget = report.host_budget or CAST_WINDOW_BYTES
    for c in casts:
        if c.region is not None or (c.alias is not None and c.alias not in loaded):
            continue  # (cast by the load's windows already; a non-strict load that left it out: reported below)
        cast_tensor(c.target, c.source, c.dtype, budget)
    aliased = {c.alias: c.key for c in casts if c.alias is not None}
    report.loaded_keys = [aliased.get(k, k) for k in report.loaded_keys] + [
        c.key for c in casts if c.alias is None and c.key not in loaded
    ]
    report.missing_keys = [aliased.get(k, k) for k in report.missing_keys]
    report.mismatched_keys = {aliased.get(k, k): v for k, v in report.mismatched_keys.items()}
    report.unexpected_keys = [k for k in report.unexpected_keys if not k.startswith(ALIAS_PREFIX)]
    for k, v in updates.items():
        state_dict[k] = v


def source_of(md, key: str) -> derived.Derived:
    """The derivation of ``key`` (a key of ``md.derived``); DerivedKeyError when its master is not stored."""
    d = md.derived[key]
    if d.source not in md.tensors:
        raise DerivedKeyError(f"key {key!r} is derived from {d.source!r}, which the checkpoint does not hold")
    return d
