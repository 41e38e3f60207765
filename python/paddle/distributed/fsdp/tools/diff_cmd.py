"""``paddle-fsdp-ckpt diff A B``: compare two checkpoints key by key, whatever world sizes wrote them.

Why: "does the resumed run hold exactly the state of the uninterrupted one" and "do two topologies agree" are
answered per tensor, model weights and optimizer state alike, without loading either run.

Every tensor key of either checkpoint gets one entry: ``missing`` (only in A), ``extra`` (only in B), ``dtype`` or
``shape`` (both, but different), ``equal`` (bit-identical bytes) or ``differs`` (with the number of differing
elements, the largest absolute difference ``|b - a|`` and the largest relative difference ``|b - a| / |a|``;
``inf`` where ``a == 0 != b``; NaNs in the same place count as equal, elsewhere as differing, ``nan_mismatch``).
Tensors are read as windows of their row-major flattening (``window_bytes`` per side, default 16 MiB), each from
the byte ranges of whichever pieces hold it, checksums verified: memory is two windows plus their float64 copies,
never a whole tensor. JSON values (optimizer class, scheduler, extra state; not the RNG) are compared too, an
absent value counting as equal to an empty one.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from ..checkpoint.format.metadata import itemsize
from ..checkpoint.format.rank_values import plain
from ..checkpoint.format.reserved import RNG_KEY
from ..checkpoint.geometry import Region
from ..checkpoint.lossy import logical_tensors
from .ckpt_io import BUFFER, MODEL, OPTIMIZER, CheckpointReader, buffer_keys, classify_keys
from .errors import ToolError
from .progress import Progress

DEFAULT_WINDOW_BYTES = 16 << 20
IGNORED_VALUES = (RNG_KEY,)  # per-run random state: never equal across runs, not a weight
EMPTY_VALUES = (None, {}, [])
VALUES = "values"  # the JSON values: optimizer class, LR scheduler, the caller's extra state
PARTS = (MODEL, OPTIMIZER, VALUES)  # what ``only`` selects: parameters and buffers, optimizer tensors, values


@dataclass
class KeyDiff:
    key: str
    role: str  # model | optimizer | buffer
    status: str  # equal | differs | missing | extra | dtype | shape
    dtype: str | None = None
    shape: list[int] | None = None
    numel: int = 0
    n_diff: int = 0
    nan_mismatch: int = 0
    max_abs: float = 0.0
    max_rel: float = 0.0
    detail: str = ""

    def to_json(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if v not in (None, "")}
        for k in ("max_abs", "max_rel"):
            if k in d and not math.isfinite(d[k]):
                d[k] = str(d[k])
        return d


@dataclass
class DiffReport:
    a: str
    b: str
    keys: list[KeyDiff] = field(default_factory=list)
    values: dict[str, str] = field(default_factory=dict)  # value key -> equal | differs | missing | extra
    atol: float = 0.0
    rtol: float = 0.0

    def within(self, k: KeyDiff) -> bool:
        if k.status == "equal":
            return True
        if k.status != "differs" or k.nan_mismatch:
            return False
        return k.max_abs <= self.atol or k.max_rel <= self.rtol

    @property
    def identical(self) -> bool:
        return all(self.within(k) for k in self.keys) and all(v == "equal" for v in self.values.values())

    def summary(self) -> dict:
        counts: dict[str, int] = {}
        for k in self.keys:
            counts[k.status] = counts.get(k.status, 0) + 1
        differing = [k for k in self.keys if k.status == "differs"]
        worst = max(differing, key=lambda k: k.max_abs if not math.isnan(k.max_abs) else math.inf, default=None)
        return {
            "keys": len(self.keys),
            **counts,
            "values_differing": sorted(v for v, s in self.values.items() if s != "equal"),
            "max_abs": worst.max_abs if worst else 0.0,
            "worst_key": worst.key if worst else None,
            "within_tolerance": self.identical,
        }

    def to_json(self) -> dict:
        s = self.summary()
        if not math.isfinite(s["max_abs"]):
            s["max_abs"] = str(s["max_abs"])
        return {
            "a": self.a,
            "b": self.b,
            "atol": self.atol,
            "rtol": self.rtol,
            "summary": s,
            "keys": [k.to_json() for k in self.keys],
            "values": self.values,
        }


def _window_diff(a: np.ndarray, b: np.ndarray, dtype: str, acc: KeyDiff) -> None:
    """Fold one window pair (numpy storage arrays of engine dtype ``dtype``) into ``acc``."""
    if a.tobytes() == b.tobytes():  # bit-equal window (cheap; tobytes of a window is bounded)
        return
    if dtype.startswith("float8") or a.dtype.kind == "V":
        ne = np.any(a.view(np.uint8).reshape(a.size, -1) != b.view(np.uint8).reshape(b.size, -1), axis=1)
        acc.n_diff += int(ne.sum())
        acc.max_abs = math.nan
        return
    if dtype == "bfloat16":
        fa = (a.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)
        fb = (b.astype(np.uint32) << np.uint32(16)).view(np.float32).astype(np.float64)
    elif a.dtype.kind in "fiub":
        fa, fb = a.astype(np.float64), b.astype(np.float64)
    else:  # complex
        fa, fb = a.astype(np.complex128), b.astype(np.complex128)
    na, nb = np.isnan(fa), np.isnan(fb)
    both_nan = na & nb
    one_nan = na ^ nb
    diff = np.abs(fb - fa)
    diff[both_nan | one_nan] = 0.0
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(diff == 0, 0.0, diff / np.abs(fa))
    acc.nan_mismatch += int(one_nan.sum())
    acc.n_diff += int(np.count_nonzero(diff)) + int(one_nan.sum())
    if diff.size:
        acc.max_abs = max(acc.max_abs, float(diff.max()))
        acc.max_rel = max(acc.max_rel, float(rel.max()))


def diff(
    a: str,
    b: str,
    *,
    window_bytes: int = DEFAULT_WINDOW_BYTES,
    atol: float = 0.0,
    rtol: float = 0.0,
    keys: list[str] | None = None,
    progress: bool | None = None,
    verify: bool = True,
    only: Iterable[str] | None = None,
) -> DiffReport:
    """Compare checkpoints ``a`` and ``b`` (see the module docstring). ``keys`` limits the comparison to those
    keys, ``only`` to parts of the state (``PARTS``: e.g. ``["model"]`` compares weights and buffers alone, as
    for a checkpoint against its to-hf -> from-hf round trip, which carries no optimizer state)."""
    parts = set(PARTS) if only is None else set(only)
    if not parts or parts - set(PARTS):
        raise ToolError(f"unknown part(s) {sorted(parts - set(PARTS)) or '(none)'}; choose from {', '.join(PARTS)}")
    with CheckpointReader(a, verify=verify) as ra, CheckpointReader(b, verify=verify) as rb:
        report = DiffReport(ra.path, rb.path, atol=float(atol), rtol=float(rtol))
        roles_a, roles_b = classify_keys(ra.md), classify_keys(rb.md)
        buffers = buffer_keys(ra.md) | buffer_keys(rb.md)
        ta, tb = logical_tensors(ra.md), logical_tensors(rb.md)  # quantized moments compared dequantized

        def role_of(k: str) -> str:
            return BUFFER if k in buffers else (roles_a.get(k) or roles_b[k]).role

        names = [k for k in list(ta) + [k for k in tb if k not in ta] if _part(role_of(k)) in parts]
        if keys is not None:
            wanted = set(keys)
            names = [k for k in names if k in wanted]
        common = [k for k in names if k in ta and k in tb]
        total = sum(ra.nbytes(k) for k in common if ta[k].dtype == tb[k].dtype and ta[k].shape == tb[k].shape)
        with Progress(total, "diff", enabled=progress) as bar:
            for k in names:
                role = role_of(k)
                if k not in tb:
                    report.keys.append(KeyDiff(k, role, "missing", ta[k].dtype, list(ta[k].shape)))
                    continue
                if k not in ta:
                    report.keys.append(KeyDiff(k, role, "extra", tb[k].dtype, list(tb[k].shape)))
                    continue
                ma, mb = ta[k], tb[k]
                if ma.dtype != mb.dtype:
                    report.keys.append(
                        KeyDiff(k, role, "dtype", ma.dtype, list(ma.shape), detail=f"{ma.dtype} vs {mb.dtype}")
                    )
                    continue
                if tuple(ma.shape) != tuple(mb.shape):
                    report.keys.append(
                        KeyDiff(
                            k, role, "shape", ma.dtype, list(ma.shape), detail=f"{list(ma.shape)} vs {list(mb.shape)}"
                        )
                    )
                    continue
                n = Region.full(ma.shape).numel
                acc = KeyDiff(k, role, "equal", ma.dtype, list(ma.shape), numel=n)
                step = max(1, window_bytes // max(itemsize(ma.dtype), 1))
                for s in range(0, n, step):
                    e = min(n, s + step)
                    wa, wb = ra.read_flat(k, s, e), rb.read_flat(k, s, e)
                    _window_diff(wa, wb, ma.dtype, acc)
                    bar.update((e - s) * itemsize(ma.dtype), k)
                    del wa, wb
                if acc.n_diff or acc.nan_mismatch:
                    acc.status = "differs"
                report.keys.append(acc)
        if VALUES not in parts:
            return report
        va = {k: v for k, v in ra.md.values.items() if k not in IGNORED_VALUES}
        vb = {k: v for k, v in rb.md.values.items() if k not in IGNORED_VALUES}
        for k in list(va) + [k for k in vb if k not in va]:
            if va.get(k) in EMPTY_VALUES and vb.get(k) in EMPTY_VALUES:  # absent == empty ({} extra state)
                report.values[k] = "equal"
            elif k not in vb:
                report.values[k] = "missing"
            elif k not in va:
                report.values[k] = "extra"
            else:
                # a per-rank value (the caller's stateful objects) is read whole: every saving rank's entry
                same = json.dumps(plain(va[k]), sort_keys=True) == json.dumps(plain(vb[k]), sort_keys=True)
                report.values[k] = "equal" if same else "differs"
    return report


def _part(role: str) -> str:
    """The ``--only`` part a tensor of ``role`` belongs to: buffers are model state."""
    return OPTIMIZER if role == OPTIMIZER else MODEL


def _fmt(x: float) -> str:
    return f"{x:.3e}" if math.isfinite(x) else str(x)


def format_text(report: DiffReport, show_equal: bool = False) -> str:
    lines = [f"A: {report.a}", f"B: {report.b}"]
    for k in report.keys:
        if k.status == "equal" and not show_equal:
            continue
        if k.status == "differs":
            lines.append(
                f"  DIFFERS  {k.key} [{k.role}] {k.n_diff}/{k.numel} elements, max abs {_fmt(k.max_abs)}, "
                f"max rel {_fmt(k.max_rel)}"
                + (f", {k.nan_mismatch} NaN mismatches" if k.nan_mismatch else "")
                + ("" if not report.within(k) else " (within tolerance)")
            )
        elif k.status == "equal":
            lines.append(f"  equal    {k.key} [{k.role}]")
        elif k.status == "missing":
            lines.append(f"  MISSING  {k.key} [{k.role}] only in A")
        elif k.status == "extra":
            lines.append(f"  EXTRA    {k.key} [{k.role}] only in B")
        else:
            lines.append(f"  {k.status.upper():<8} {k.key} [{k.role}] {k.detail}")
    for v, s in report.values.items():
        if s != "equal":
            lines.append(f"  value {v}: {s}")
    s = report.summary()
    counts = ", ".join(f"{s.get(x, 0)} {x}" for x in ("equal", "differs", "missing", "extra", "dtype", "shape"))
    verdict = "IDENTICAL" if all(k.status == "equal" for k in report.keys) else "DIFFERENT"
    if verdict == "DIFFERENT" and s["within_tolerance"]:
        verdict = "WITHIN TOLERANCE"
    elif all(k.status == "equal" for k in report.keys) and s["values_differing"]:
        verdict = "DIFFERENT (values)"
    worst = f"; max abs {_fmt(s['max_abs'])} at {s['worst_key']}" if s["worst_key"] else ""
    lines.append(f"{verdict}: {s['keys']} keys: {counts}{worst}")
    return "\n".join(lines)
