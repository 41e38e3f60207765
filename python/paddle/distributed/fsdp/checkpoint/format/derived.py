"""Derived weights (format 4's ``"derived"`` field): a low-precision parameter that is not stored because it is
exactly its fp32 master weight cast to its dtype, round to nearest even.

Why: a bf16 model trained with fp32 master weights saved 2 of its 14 bytes per parameter twice (issue #52: every
bf16 weight equalled its master weight cast, 0 mismatches in 2.6M elements). The save checks it per tensor on every
rank's shard and stores the weight where it does not hold (save/derive.py); every reader derives it
(load/derive.py, the tools' reader). The field is ``{"<key>": {"from": "<key>.master_weight", "dtype":
"bfloat16", "rounding": "nearest-even"}}``: no shape of its own (the source's), each source used once, a source is
a stored float32 tensor (so no cycles, no chains), the key neither a stored tensor nor a value; anything else is a
MetadataError naming the entry, before anything is allocated.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ..cores import core_share
from ..errors import MetadataError
from ..thread_pools import shared_pool

FIELD = "derived"
MASTER_SUFFIX = ".master_weight"  # the optimizer's fp32 copy of a parameter (state/optimizer_states.py)
SOURCE_DTYPE = "float32"
ROUNDING = "nearest-even"
CAST_DTYPES = ("bfloat16", "float16")  # what a weight may be derived as
_ENTRY_FIELDS = frozenset({"from", "dtype", "rounding"})
_BLOCK = 1 << 18  # elements cast at a time (bounded temporary memory, in the CPU's L2 cache)


@dataclass(frozen=True)
class Derived:
    """Key ``key`` is ``source`` (a stored float32 tensor) cast to ``dtype``, round to nearest even."""

    key: str
    source: str
    dtype: str

    def to_json(self) -> dict:
        return {"from": self.source, "dtype": self.dtype, "rounding": ROUNDING}


def cast_bits(src: np.ndarray, dtype: str) -> np.ndarray:
    """The storage bits (uint16) of float32 ``src`` cast to ``dtype`` (``CAST_DTYPES``), round to nearest even.
    bfloat16: NaN -> 0x7FC0 with the sign of the source (a NaN never equals on save, so it is stored anyway)."""
    src = np.ascontiguousarray(src, dtype=np.float32).reshape(-1)
    if dtype == "float16":
        return src.astype(np.float16).view(np.uint16)
    if dtype != "bfloat16":
        raise ValueError(f"cannot derive a {dtype} weight (derivable: {', '.join(CAST_DTYPES)})")
    u = src.view(np.uint32)
    t = u >> np.uint32(16)  # (in place from here on: one temporary, not five)
    t &= np.uint32(1)
    t += np.uint32(0x7FFF)
    t += u
    t >>= np.uint32(16)
    out = t.astype(np.uint16)
    nan = np.isnan(src)
    if nan.any():
        out[nan] = (u[nan] >> np.uint32(16)).astype(np.uint16) | np.uint16(0x7FC0)
    return out


def _blocks(n: int, fn) -> bool:
    """``fn(i)`` for every block start ``i`` of ``n`` elements, on the thread pool when there are several
    (numpy releases the GIL: the cost scales with the cores); True when every call returned True."""
    starts = range(0, n, _BLOCK)
    if len(starts) < 4:
        return all(map(fn, starts))
    return all(list(_pool().map(fn, starts)))


def cast_into(src: np.ndarray, dtype: str, out: np.ndarray) -> None:
    """Write ``src`` (float32 elements) cast to ``dtype`` into ``out`` (uint16 or uint8 bytes, same element
    count), a block at a time."""
    src = src.reshape(-1).view(np.float32)
    dst = out.reshape(-1).view(np.uint16)
    if dst.size != src.size:
        raise ValueError(f"derived cast: {src.size} source elements for {dst.size} target elements")

    def block(i: int) -> bool:
        dst[i : i + _BLOCK] = cast_bits(src[i : i + _BLOCK], dtype)
        return True

    _blocks(src.size, block)


def equals_cast(weight_bits: np.ndarray, master: np.ndarray, dtype: str) -> bool:
    """Whether every element of ``weight_bits`` (uint16 storage) is exactly ``master`` (float32) cast to
    ``dtype``, compared a block at a time."""
    w = weight_bits.reshape(-1).view(np.uint16)
    m = master.reshape(-1).view(np.float32)
    if w.size != m.size:
        return False

    def block(i: int) -> bool:
        return np.array_equal(w[i : i + _BLOCK], cast_bits(m[i : i + _BLOCK], dtype))

    return _blocks(m.size, block)


def equals_cast_many(pairs: list[tuple[np.ndarray, np.ndarray, str]]) -> list[bool]:
    """``equals_cast`` of each ``(weight bits, master, dtype)``, the blocks of every pair on the thread pool at
    once: a rank's many small shards (fewer than 4 blocks each would run one at a time) keep every core busy,
    with one wait for all of them instead of one a tensor."""
    tasks = []
    for j, (w, m, dtype) in enumerate(pairs):
        if dtype not in CAST_DTYPES:
            raise ValueError(f"cannot derive a {dtype} weight (derivable: {', '.join(CAST_DTYPES)})")
        if w.size == m.size:
            tasks.extend((j, i) for i in range(0, m.size, _BLOCK))

    def block(task: tuple[int, int]) -> bool:
        j, i = task
        w, m, dtype = pairs[j]
        w, m = w.reshape(-1).view(np.uint16), m.reshape(-1).view(np.float32)
        return np.array_equal(w[i : i + _BLOCK], cast_bits(m[i : i + _BLOCK], dtype))

    results = list(map(block, tasks)) if len(tasks) < 4 else list(_pool().map(block, tasks))
    equal = [w.size == m.size for w, m, _d in pairs]
    for (j, _i), ok in zip(tasks, results):
        equal[j] = equal[j] and ok
    return equal


def _pool() -> ThreadPoolExecutor:
    """Sized by this rank's share of the node's cores (cores.py), not the node's: eight ranks of a GPU node each
    with a pool of every core would contend for them."""
    return shared_pool("derive-check", min(16, core_share()))


def parse_field(raw, tensors, values, where: str) -> dict[str, Derived]:
    """The checked ``"derived"`` field of ``metadata.json`` (absent: {}); ``tensors``/``values``: the stored keys
    (mappings). MetadataError naming the first entry that is not a weight derived from a stored float32 tensor."""
    if raw is None:
        return {}
    if type(raw) is not dict:
        raise MetadataError(f"{where}: field {FIELD!r} must be an object, got {type(raw).__name__}")
    if len(raw) > len(tensors):  # each entry needs a source of its own among the stored tensors
        raise MetadataError(f"{where}: field {FIELD!r} has {len(raw)} entries for {len(tensors)} stored tensors")
    out: dict[str, Derived] = {}
    used: dict[str, str] = {}
    for key, entry in raw.items():
        name = f"{where}: {FIELD}[{key!r:.200}]"
        if type(entry) is not dict or set(entry) != _ENTRY_FIELDS:
            raise MetadataError(f"{name} must be an object of exactly {sorted(_ENTRY_FIELDS)}")
        source, dtype, rounding = entry["from"], entry["dtype"], entry["rounding"]
        if type(source) is not str or type(dtype) is not str or rounding != ROUNDING:
            raise MetadataError(f"{name}: 'from' and 'dtype' must be names and 'rounding' {ROUNDING!r}")
        if key in tensors or key in values:
            raise MetadataError(f"{name}: the key is also stored (a derived key is not)")
        if dtype not in CAST_DTYPES:
            raise MetadataError(f"{name}: cannot derive dtype {dtype!r:.50} (derivable: {', '.join(CAST_DTYPES)})")
        if source not in tensors:
            raise MetadataError(f"{name}: source {source!r:.200} is not a stored tensor of the checkpoint")
        if tensors[source].dtype != SOURCE_DTYPE:
            raise MetadataError(f"{name}: source {source!r:.200} is {tensors[source].dtype}, not {SOURCE_DTYPE}")
        if source in used:
            raise MetadataError(f"{name}: source {source!r:.200} is already the source of {used[source]!r:.200}")
        used[source] = key
        out[key] = Derived(key, source, dtype)
    return out


def to_field(derived: dict[str, Derived]) -> dict:
    """The ``"derived"`` field written for ``derived`` (sorted by key)."""
    return {k: derived[k].to_json() for k in sorted(derived)}


class WithDerived(Mapping):
    """``md.tensors`` as the tools see it (tools/ckpt_io.py): every stored tensor, then every derived key as a
    TensorMeta of its dtype and its master's shape, without pieces (the reader reads the master and casts)."""

    def __init__(self, stored, derived_keys: dict[str, Derived]):
        self.stored, self.derived = stored, derived_keys

    def __getitem__(self, key):
        d = self.derived.get(key)
        if d is None:
            return self.stored[key]
        from .metadata import TensorMeta

        return TensorMeta(d.dtype, tuple(self.stored[d.source].shape), [])

    def __contains__(self, key) -> bool:
        return key in self.derived or key in self.stored

    def __iter__(self):
        yield from self.stored
        yield from self.derived

    def __len__(self) -> int:
        return len(self.stored) + len(self.derived)
