"""Write assignment: which rank writes which piece of a save, and the checks that can refuse a state dict.

Why columns: the first save of a set of records (and every save after an elastic restart) assigns the pieces of
the whole world. Only the coordinator does that (first_save.py): each rank sends its record descriptions as
columns (``pack``, O(its records)) and receives the positions of the records it writes (O(its records)). The
coordinator's work is numpy over the pieces of the world; Python runs per key or per piece only where the
records need it: box regions (grouped as Regions), regions held by several ranks that are not plain tensors
(HSDP replicas: a greedy balance) and the message of the first refused key.

Decisions (deterministic):
- one writer per distinct region of a key. A plain tensor (every rank holds it whole) is written by the lowest
  rank. A sharded region held by several ranks (HSDP replicas) goes to the holder with the fewest bytes assigned
  so far (ties: the lowest rank), counting first every region with a single writer, then the shared ones in key
  order, so replicas split the writing evenly.
- a rank writes its pieces in key order (keys numbered as first seen, rank by rank), a key's regions in the
  order their first holder lists them.
- refused (InvalidStateDictError; the first refused key in that order wins, each key's checks in this order): a
  key that is a tensor on some ranks and a plain value on others; a dtype or global shape that differs between
  ranks; written regions that overlap or leave a gap (format/coverage.py, the check loads use too).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from .errors import InvalidStateDictError
from .format.coverage import coverage_problems
from .format.metadata import DTYPES, numel
from .geometry import Region

REPLICATED, FLAT, GENERAL = 1, 2, 4  # Columns.flags bits


class Columns(NamedTuple):
    """One rank's record descriptions (planner.RecordDesc wire form) as columns: what a rank sends the
    coordinator in a first save. ``span``: ``[a, b)`` of the one flat run of a region whose box is the whole
    tensor (FSDP's flat shards, plain tensors); ``general``: ``{i: (box_offset, box_shape, flat_range)}`` of the
    other regions, whose ``span`` is ``(-1, -1)``."""

    keys: list | str  # a str: the keys joined by NUL (one object to pickle, split in C), when none holds one
    dtypes: tuple
    dt: np.ndarray  # uint8 index into dtypes
    shapes: tuple
    sh: np.ndarray  # int32 index into shapes
    span: np.ndarray  # int64 (n, 2)
    flags: np.ndarray  # uint8: REPLICATED | FLAT (the wire has a flat range) | GENERAL
    general: dict


def pack(wires: list) -> Columns:
    """The columns of one rank's descriptions (wire tuples ``(key, dtype, shape, off, box, flat_range, rep)``)."""
    n = len(wires)
    keys, dt_ids, sh_ids, general = [], {}, {}, {}
    dt, sh, span, flags = [], [], [], []
    for i, (key, dtype, shape, off, box, fr, rep) in enumerate(wires):
        keys.append(key)
        shape = tuple(shape)
        dt.append(dt_ids.setdefault(dtype, len(dt_ids)))
        sh.append(sh_ids.setdefault(shape, len(sh_ids)))
        f = (REPLICATED if rep else 0) | (FLAT if fr is not None else 0)
        if tuple(box) != shape or any(off):  # not one run of the whole box (Region.single_run)
            general[i] = (tuple(off), tuple(box), None if fr is None else tuple(fr))
            f |= GENERAL
            span.append((-1, -1))
        elif fr is not None:
            span.append((fr[0], max(fr[0], fr[1])))
        else:
            span.append((0, 0 if 0 in shape else numel(shape)))
        flags.append(f)
    span = np.array(span, np.int64).reshape(n, 2)
    dt, sh, flags = np.array(dt, np.uint8), np.array(sh, np.int32), np.array(flags, np.uint8)
    joined = "\0".join(keys)
    if joined.count("\0") == n - 1:  # no key holds a NUL (else the list goes as it is)
        keys = joined
    return Columns(keys, tuple(dt_ids), dt, tuple(sh_ids), sh, span, flags, general)


def keys_of(cols: Columns) -> list:
    """The keys of ``cols``, in order."""
    if isinstance(cols.keys, list):
        return cols.keys
    return cols.keys.split("\0") if len(cols.dt) else []


def wire_at(cols: Columns, i: int, keys: list | None = None) -> tuple:
    """The wire tuple of record ``i`` of ``cols`` (equal to the one packed); ``keys``: ``keys_of(cols)``."""
    shape, f = cols.shapes[int(cols.sh[i])], int(cols.flags[i])
    if f & GENERAL:
        off, box, fr = cols.general[i]
    else:
        a, b = (int(x) for x in cols.span[i])
        off, box, fr = (0,) * len(shape), shape, ((a, b) if f & FLAT else None)
    return (
        (keys_of(cols) if keys is None else keys)[i],
        cols.dtypes[int(cols.dt[i])],
        shape,
        off,
        box,
        fr,
        bool(f & REPLICATED),
    )


@dataclass
class Assigned:
    """The checked assignment: ``specs`` ``[(key, dtype, shape)]`` in key order, ``picks[r]`` the positions (in
    rank r's own descriptions) of the records it writes, in write order; the bytes of every tensor and the
    number of pieces written (planner.auto_chunk's inputs)."""

    specs: list
    picks: list
    total_bytes: int
    pieces: int


class _World:
    """Every rank's columns, concatenated: one entry per record of the world, in rank order."""

    def __init__(self, cols: list[Columns]):
        self.cols = cols
        self.per_rank = per_rank = [keys_of(c) for c in cols]
        every = list(itertools.chain.from_iterable(per_rank))
        self.keys = list(dict.fromkeys(every))  # first seen, rank by rank
        self.kid_of = {k: i for i, k in enumerate(self.keys)}
        self.kid = np.fromiter(map(self.kid_of.__getitem__, every), np.int64, len(every))
        counts = np.array([len(k) for k in per_rank], np.int64)
        self.offset = np.concatenate([[0], np.cumsum(counts)])
        self.rank = np.repeat(np.arange(len(cols), dtype=np.int64), counts)
        dtypes: dict[str, int] = {}
        shapes: dict[tuple, int] = {}
        self.dt = self._global(dtypes, [(c.dtypes, c.dt) for c in cols])
        self.sh = self._global(shapes, [(c.shapes, c.sh) for c in cols])
        self.dtypes, self.shapes = list(dtypes), list(shapes)
        self.itemsize = np.array([DTYPES[d][0] if d in DTYPES else 1 for d in self.dtypes] or [1], np.int64)
        self.total = np.array([_total(s) for s in self.shapes] or [0], np.int64)
        self.span = np.concatenate([c.span for c in cols]) if cols else np.zeros((0, 2), np.int64)
        self.flags = np.concatenate([c.flags for c in cols]) if cols else np.zeros(0, np.uint8)
        n = len(self.kid)
        self.first = np.full(len(self.keys), n, np.int64)  # each key's first entry (lowest rank)
        np.minimum.at(self.first, self.kid, np.arange(n, dtype=np.int64))

    @staticmethod
    def _global(table: dict, per_rank: list) -> np.ndarray:
        parts = []
        for names, local in per_rank:
            ids = np.array([table.setdefault(x, len(table)) for x in names] or [0], np.int64)
            parts.append(ids[local])
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def region(self, e: int) -> Region:
        r = int(self.rank[e])
        w = wire_at(self.cols[r], e - int(self.offset[r]), self.per_rank[r])
        return Region(w[2], w[3], w[4], w[5])


def _total(shape) -> int:
    """Elements the coverage check expects (format/coverage.py's count)."""
    return math.prod(shape) if all(s > 0 for s in shape) or not shape else 0


@dataclass
class _Groups:
    """Distinct regions of the world: per group its key, first entry (lowest rank holding it), bytes, and for
    groups with several possible writers their holders (entry arrays)."""

    kid: np.ndarray
    first: np.ndarray
    nbytes: np.ndarray
    shared: dict  # group index -> entries holding it (regions of several holders that are not plain tensors)
    span: np.ndarray  # (a, b) of the group's one run; (-1, -1) for box regions


def _simple_groups(w: _World, sel: np.ndarray) -> _Groups:
    """Groups of the entries ``sel`` (single runs over the whole box, not empty): one numpy sort."""
    kid, a, b = w.kid[sel], w.span[sel, 0], w.span[sel, 1]
    order = _by_key_start_stop(kid, a, b)
    kid, a, b, ent = kid[order], a[order], b[order], sel[order]
    new = np.ones(len(ent), bool)
    new[1:] = (kid[1:] != kid[:-1]) | (a[1:] != a[:-1]) | (b[1:] != b[:-1])
    starts = np.flatnonzero(new)
    ends = np.append(starts[1:], len(ent))
    first = ent[starts]
    nbytes = (b[starts] - a[starts]) * w.itemsize[w.dt[first]]
    shared = {}
    multi = np.flatnonzero((ends - starts > 1) & ((w.flags[first] & REPLICATED) == 0))
    for g in multi.tolist():
        shared[g] = ent[starts[g] : ends[g]]
    span = np.stack([a[starts], b[starts]], axis=1) if len(starts) else np.zeros((0, 2), np.int64)
    return _Groups(kid[starts], first, nbytes, shared, span)


def _by_key_start_stop(kid: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Stable order by (key, start, stop): within a region, its holders in rank order. One sort of a packed
    int64 (key, start) where it fits and no two runs of a key start alike with different stops (the usual case;
    ~3x faster than the three-key lexsort it falls back to)."""
    if len(kid) and int(kid.max()) < (1 << 22) and int(a.max()) < (1 << 40):
        order = np.argsort((kid << 40) | a, kind="stable")
        k, s, e = kid[order], a[order], b[order]
        if not np.any((k[1:] == k[:-1]) & (s[1:] == s[:-1]) & (e[1:] != e[:-1])):
            return order
    return np.lexsort((b, a, kid))


def _box_groups(w: _World, keys: np.ndarray) -> _Groups:
    """Groups of every entry of ``keys`` (keys with a box region): grouped by the normalized Region."""
    entries = np.flatnonzero(np.isin(w.kid, keys))
    by: dict[tuple[int, Region], list[int]] = {}
    for e in entries.tolist():
        reg = w.region(e).normalized()
        if reg.numel:
            by.setdefault((int(w.kid[e]), reg), []).append(e)
    kid, first, nbytes, shared = [], [], [], {}
    for g, ((k, reg), holders) in enumerate(by.items()):
        kid.append(k)
        first.append(holders[0])
        nbytes.append(reg.numel * int(w.itemsize[w.dt[holders[0]]]))
        if len(holders) > 1 and not w.flags[holders[0]] & REPLICATED:
            shared[g] = np.array(holders, np.int64)
    z = np.array
    return _Groups(z(kid, np.int64), z(first, np.int64), z(nbytes, np.int64), shared, np.full((len(kid), 2), -1))


def _writers(w: _World, groups: list[_Groups]) -> list[np.ndarray]:
    """The writing entry of every group (per _Groups): its first holder, or for shared regions the holder with
    the fewest bytes so far (single-writer regions counted first, then shared ones in key order)."""
    load = np.zeros(len(w.cols), np.int64)
    out = [g.first.copy() for g in groups]
    for g in groups:
        single = np.ones(len(g.first), bool)
        single[list(g.shared)] = False
        np.add.at(load, w.rank[g.first[single]], g.nbytes[single])
    todo = [(int(g.kid[i]), int(g.first[i]), gi, i) for gi, g in enumerate(groups) for i in g.shared]
    for _k, _f, gi, i in sorted(todo):
        holders = groups[gi].shared[i]
        ranks = w.rank[holders]
        j = int(np.lexsort((ranks, load[ranks]))[0])
        out[gi][i] = holders[j]
        load[ranks[j]] += groups[gi].nbytes[i]
    return out


def _meta_bad(w: _World) -> np.ndarray:
    """Keys whose dtype or global shape differs between ranks."""
    f = w.first[w.kid]
    return np.unique(w.kid[(w.dt != w.dt[f]) | (w.sh != w.sh[f])])


def _gap_or_overlap(w: _World, g: _Groups, simple_keys: np.ndarray) -> np.ndarray:
    """Keys (of ``simple_keys``) whose written runs overlap or do not cover the tensor: groups are sorted by
    (key, start), so an overlap is a start before the previous run's end."""
    a, b = g.span[:, 0], g.span[:, 1]
    bad = np.zeros(len(w.keys), bool)
    if len(a) > 1:
        same = g.kid[1:] == g.kid[:-1]
        bad[g.kid[1:][same & (a[1:] < b[:-1])]] = True
    covered = np.zeros(len(w.keys), np.int64)
    np.add.at(covered, g.kid, b - a)
    bad |= covered != w.total[w.sh[w.first]]
    return np.flatnonzero(bad & np.isin(np.arange(len(w.keys)), simple_keys))


def _problem(w: _World, k: int, meta: bool, kept: list[int]) -> str:
    """The message of refused key ``k`` (``kept``: its writing entries in their first holders' order)."""
    key = w.keys[k]
    if meta:
        e0 = int(w.first[k])
        r0, d0, s0 = int(w.rank[e0]), w.dtypes[w.dt[e0]], w.shapes[w.sh[e0]]
        for e in np.flatnonzero(w.kid == k).tolist():
            r, d, s = int(w.rank[e]), w.dtypes[w.dt[e]], w.shapes[w.sh[e]]
            if d != d0:
                return f"key {key!r}: dtype {d0} on rank {r0} but {d} on rank {r}"
            if s != s0:
                return f"key {key!r}: global shape {list(s0)} on rank {r0} but {list(s)} on rank {r}"
    shape = w.shapes[w.sh[w.first[k]]]
    problems = coverage_problems(key, shape, [(int(w.rank[e]), w.region(e)) for e in kept])
    return "cannot save: " + "; ".join(problems) if problems else ""


def assign_columns(cols: list[Columns], value_keys) -> Assigned:
    """The checked assignment of every rank's columns (see the module docstring); raises InvalidStateDictError."""
    w = _World(cols)
    both = sorted(set(w.kid_of) & set(value_keys))
    if both:
        raise InvalidStateDictError(f"key {both[0]!r} is a tensor on some ranks and a plain value on others")
    boxed = np.zeros(len(w.keys), bool)
    boxed[w.kid[(w.flags & GENERAL) != 0]] = True
    box_keys, simple_keys = np.flatnonzero(boxed), np.flatnonzero(~boxed)
    length = w.span[:, 1] - w.span[:, 0]
    simple = _simple_groups(w, np.flatnonzero(~boxed[w.kid] & (length > 0)))
    box = _box_groups(w, box_keys)
    writer_s, writer_b = _writers(w, [simple, box])
    meta = _meta_bad(w)
    bad = set(meta.tolist()) | set(_gap_or_overlap(w, simple, simple_keys).tolist())
    kept_box: dict[int, list[int]] = {}
    for k, _f, e in sorted(zip(box.kid.tolist(), box.first.tolist(), writer_b.tolist())):
        kept_box.setdefault(k, []).append(e)
    for k in box_keys.tolist():  # Python per box key, as the general coverage check is
        if k not in bad and _problem(w, k, False, kept_box.get(k, [])):
            bad.add(k)
    if bad:
        k = min(bad)
        if k in kept_box or boxed[k]:
            kept = kept_box.get(k, [])
        else:
            mine = np.flatnonzero(simple.kid == k)
            kept = writer_s[mine[np.argsort(simple.first[mine], kind="stable")]].tolist()
        raise InvalidStateDictError(_problem(w, k, k in set(meta.tolist()), kept))
    return _result(w, [simple, box], [writer_s, writer_b])


def _result(w: _World, groups: list[_Groups], writers: list[np.ndarray]) -> Assigned:
    kid = np.concatenate([g.kid for g in groups])
    first = np.concatenate([g.first for g in groups])
    ent = np.concatenate(writers)
    ent = ent[_by_key_start_stop(kid, first, first)]  # write order: key order, then the region's first holder
    ranks = w.rank[ent]
    by_rank = np.argsort(ranks, kind="stable")
    local = ent[by_rank] - w.offset[ranks[by_rank]]
    bounds = np.cumsum(np.bincount(ranks, minlength=len(w.cols)))[:-1]
    picks = np.split(local.astype(np.int32), bounds)
    specs = [(key, w.dtypes[w.dt[e]], w.shapes[w.sh[e]]) for key, e in zip(w.keys, w.first.tolist())]
    total = sum(numel(s) * DTYPES[d][0] for _k, d, s in specs if d in DTYPES)
    return Assigned(specs, picks, total, len(ent))
