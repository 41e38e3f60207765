"""Planning a preset conversion: which tensors to write, split or merged how, and refusing incomplete ones.

``to-hf``: every model key of the checkpoint is matched against the preset's rules; a fused key becomes several
HF tensors, each a list of row ranges of the source seen in HF orientation (:class:`~.to_hf_cmd.HfTensor` with
``rows``). ``from-hf``: HF names are grouped back per rule and binding (all of ``q/k/v`` of layer 3) and merged
into one checkpoint tensor (:class:`MergedTensor`). Both check every shape against the config and refuse (a
``ToolError``, exit 2) an output that would leave a parameter of the architecture missing or an input key
unmapped, naming the keys, unless ``allow_unmapped`` (then the keys are skipped and logged).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from .ckpt_io import MODEL, OPTIMIZER, classify_keys
from .errors import ToolError
from .presets import PRESETS, ExpectedParam, ModelDims, Preset, Rule, expected_params, layout_blocks

logger = logging.getLogger(__name__)

MAX_NAMED = 12  # keys named in one error message


def _names(keys: list[str]) -> str:
    shown = ", ".join(repr(k) for k in keys[:MAX_NAMED])
    return shown + (f" and {len(keys) - MAX_NAMED} more" if len(keys) > MAX_NAMED else "")


_EXPERT = re.compile(r"layers\.(\d+)\..*?experts\.(\d+)\.")


def expert_accounting(names: list[str]) -> str:
    """The experts among ``names`` (HF names or checkpoint keys), per layer: ``" (experts by layer: layer 0:
    [4, 5, 6, 7]; layer 2: [1])"``, or ``""`` when none is an expert. Exports that lose experts (an EP checkpoint
    read by one rank's view) show up here at a glance, not as hundreds of tensor names."""
    layers: dict[int, set[int]] = {}
    for name in names:
        m = _EXPERT.search(name)
        if m:
            layers.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    if not layers:
        return ""
    shown = "; ".join(f"layer {i}: {_ranges(sorted(e))}" for i, e in sorted(layers.items())[:MAX_NAMED])
    more = f"; and {len(layers) - MAX_NAMED} more layers" if len(layers) > MAX_NAMED else ""
    return f" (experts by layer: {shown}{more})"


def _ranges(values: list[int]) -> str:
    """``[0, 1, 2, 3, 7]`` -> ``"[0-3, 7]"``."""
    parts, start = [], None
    for k, v in enumerate(values):
        if start is None:
            start = v
        if k + 1 == len(values) or values[k + 1] != v + 1:
            parts.append(str(start) if start == v else f"{start}-{v}")
            start = None
    return "[" + ", ".join(parts) + "]"


@dataclass(frozen=True)
class Split:
    """Where HF tensor ``name`` lies inside its fused source: row ranges along HF axis 0, in output order."""

    name: str
    shape: tuple[int, ...]  # HF shape
    rows: tuple[tuple[int, int], ...] | None  # None: the whole source


def _target_shapes(rule: Rule, names: list[str], expected: dict[str, ExpectedParam]) -> list[tuple[int, ...]]:
    shapes = [expected[n].shape for n in names]
    if any(len(s) == 0 or s[1:] != shapes[0][1:] for s in shapes):  # pragma: no cover - preset data bug
        raise ToolError(f"preset rule {rule.ckpt}: targets {names} cannot be fused (shapes {shapes})")
    return shapes


def fused_shape(rule: Rule, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The checkpoint shape of the fused tensor whose HF parts have ``shapes``."""
    hf = (sum(s[0] for s in shapes),) + tuple(shapes[0][1:])
    return tuple(reversed(hf)) if rule.transpose else hf


def split_of(rule: Rule, dims: ModelDims, names: list[str], shapes: list[tuple[int, ...]]) -> list[Split]:
    """The parts of a fused source, in the order of ``rule.hf``."""
    if len(names) == 1:
        return [Split(names[0], shapes[0], None)]
    ranges: dict[int, list[tuple[int, int, int]]] = {j: [] for j in range(len(names))}
    pos = 0
    for j, a, b in layout_blocks(rule, dims, [s[0] for s in shapes]):
        ranges[j].append((a, pos, pos + b - a))
        pos += b - a
    out = []
    for j, name in enumerate(names):
        parts = sorted(ranges[j])
        covered = 0
        for a, _p, _q in parts:
            if a != covered:  # pragma: no cover - layouts tile each target
                raise ToolError(f"preset rule {rule.ckpt}: layout leaves rows of {name} uncovered")
            covered = a + (_q - _p)
        out.append(Split(name, shapes[j], tuple((p, q) for _a, p, q in parts)))
    return out


def _match(patterns, name: str):
    for item in patterns:
        m = item[0].fullmatch(name)
        if m:
            return m, item[1:]
    return None, None


def _suggest(keys: list[str], current: Preset) -> str:
    """A preset of the same family that maps every one of ``keys``, as a hint (empty if none)."""
    same = [p for p in PRESETS.values() if p is not current and p.model_types == current.model_types]
    for p in same:
        if all(_match(p.ckpt_patterns(), k)[0] for k in keys):
            return f" (preset {p.name} maps them)"
    return ""


def _limit(n_tensors: int, allow_unmapped: bool, what: str) -> tuple[int, str]:
    """The most parameters a config may describe for an input of ``n_tensors`` tensors (and why): a complete
    conversion needs every one of them, so a config describing far more is refused before they are listed."""
    from .presets import MAX_EXPECTED

    if allow_unmapped:
        return MAX_EXPECTED, ""
    limit = min(MAX_EXPECTED, 3 * n_tensors + 64)
    return limit, f" (the {what} holds {n_tensors} tensors: most of the architecture would be missing)"


def refuse_or_warn(problems: list[str], allow_unmapped: bool, what: str) -> None:
    if not problems:
        return
    if not allow_unmapped:
        raise ToolError(f"{what} refused: " + "; ".join(problems) + " (pass --allow-unmapped to convert anyway)")
    for p in problems:
        logger.warning("%s: --allow-unmapped: %s", what, p)


@dataclass
class ToHfItem:
    """One checkpoint key and the HF tensors it becomes."""

    key: str
    param: str
    transpose: bool
    splits: list[Split]


def plan_to_hf_preset(
    md, preset: Preset, dims: ModelDims, include_optimizer: bool, allow_unmapped: bool, skip: set[str]
) -> list[ToHfItem]:
    """Checkpoint keys -> HF tensors under ``preset`` (model keys; optimizer state too if asked).

    ``skip``: model-role keys that are deliberately not exported (e.g. buffers); they are neither mapped nor
    reported as unmapped.
    """
    roles = classify_keys(md)
    expected = expected_params(preset, dims, *_limit(len(md.tensors), allow_unmapped, "checkpoint"))
    produced: dict[str, str] = {}
    unmapped: list[str] = []
    outside: list[str] = []
    outside_keys: list[str] = []
    shape_errors: list[str] = []
    items: list[ToHfItem] = []
    by_param: dict[str, ToHfItem] = {}
    for key, tm in md.tensors.items():
        if roles[key].role != MODEL or key in skip:
            continue
        m, rest = _match(preset.ckpt_patterns(), key)
        if m is None:
            unmapped.append(key)
            continue
        rule: Rule = rest[0]
        names = [t.format(**m.groupdict()) for t in rule.hf]
        extra = [n for n in names if n not in expected]
        if extra:
            outside.append(f"{key!r} -> {_names(extra)}")
            outside_keys.extend(extra)
            continue
        shapes = _target_shapes(rule, names, expected)
        want = fused_shape(rule, shapes)
        if tuple(tm.shape) != want:
            shape_errors.append(
                f"{key!r} has shape {list(tm.shape)}, but the config gives {list(want)} (for {', '.join(names)})"
            )
            continue
        for n in names:
            if n in produced:  # pragma: no cover - rules are one-to-one by construction
                raise ToolError(f"{key!r} and {produced[n]!r} both become {n!r}")
            produced[n] = key
        item = ToHfItem(key, key, rule.transpose, split_of(rule, dims, names, shapes))
        items.append(item)
        by_param[key] = item
    if shape_errors:
        raise ToolError(f"to-hf --preset {preset.name}: shapes do not match the config: " + "; ".join(shape_errors))
    missing = [n for n, e in expected.items() if e.required and n not in produced]
    problems = []
    if unmapped:
        problems.append(
            f"{len(unmapped)} checkpoint key(s) not mapped by preset {preset.name}: {_names(unmapped)}"
            + _suggest(unmapped, preset)
        )
    if outside:
        problems.append(
            f"key(s) outside the architecture of the config: {_names(outside)}" + expert_accounting(outside_keys)
        )
    if missing:
        problems.append(
            f"{len(missing)} parameter(s) of the architecture missing from the export: {_names(missing)}"
            + expert_accounting(missing)
        )
    refuse_or_warn(problems, allow_unmapped, f"to-hf --preset {preset.name}")
    if not include_optimizer:
        return items
    out = list(items)
    for key, tm in md.tensors.items():
        r = roles[key]
        if r.role != OPTIMIZER:
            continue
        parent = by_param.get(r.param)
        if parent is None:
            logger.warning("to-hf: optimizer state %r: its parameter is not exported, skipped", key)
            continue
        same = tuple(tm.shape) == tuple(md.tensors[r.param].shape)
        if same:
            splits = [Split(f"{s.name}.{r.state}", s.shape, s.rows) for s in parent.splits]
        else:  # e.g. beta1_pow_acc: one value per parameter, copied to each HF part
            shape = tuple(tm.shape)
            splits = [Split(f"{s.name}.{r.state}", shape, None) for s in parent.splits]
        out.append(ToHfItem(key, r.param, parent.transpose and same, splits))
    return out


# ------------------------------------------------------------------------------------------------ from-hf


@dataclass
class MergePart:
    source: object  # (SafetensorsFile, SafetensorsEntry) of the HF tensor
    row_start: int
    row_stop: int
    fused_pos: int  # first row of this block in the fused tensor (HF orientation)


@dataclass
class MergedTensor:
    """One checkpoint tensor assembled from HF tensors (one part per layout block)."""

    key: str
    shape: tuple[int, ...]  # checkpoint shape
    src_dtype: str
    transpose: bool
    parts: list[MergePart]
    hf_names: list[str]
    state: str | None = None  # optimizer state name, None for a parameter


def plan_from_hf_preset(
    sources: dict[str, tuple], preset: Preset, dims: ModelDims, allow_unmapped: bool
) -> list[MergedTensor]:
    """HF tensors (``name -> (SafetensorsFile, SafetensorsEntry)``) -> checkpoint tensors under ``preset``."""
    expected = expected_params(preset, dims, *_limit(len(sources), allow_unmapped, "input"))
    shape_errors: list[str] = []
    unmapped: list[str] = []
    groups: dict[tuple, dict[int, str]] = {}  # (rule, binding) -> {target index: HF name}
    rules_of: dict[tuple, Rule] = {}
    for name, (_st, e) in sources.items():
        exp = expected.get(name)
        if exp is not None and tuple(e.shape) != exp.shape:
            shape_errors.append(f"{name!r} has shape {list(e.shape)}, but the config gives {list(exp.shape)}")
            continue
        state = None
        m, rest = _match(preset.hf_patterns(), name)
        if m is None or exp is None:
            # optimizer state written by `to-hf --include-optimizer`: "<HF param name>.<state>"
            head, dot, tail = name.rpartition(".")
            m, rest = (
                _match(preset.hf_patterns(), head) if dot and head in expected and head in sources else (None, None)
            )
            if m is None:
                unmapped.append(name)
                continue
            state = tail
        rule, j = rest
        gkey = (id(rule), tuple(sorted(m.groupdict().items())), state)
        groups.setdefault(gkey, {})[j] = name
        rules_of[gkey] = rule
    if shape_errors:
        raise ToolError(f"from-hf --preset {preset.name}: shapes do not match the config: " + "; ".join(shape_errors))
    out: list[MergedTensor] = []
    incomplete: list[str] = []
    for gkey in groups:
        rule = rules_of[gkey]
        binding, state = dict(gkey[1]), gkey[2]
        params = [t.format(**binding) for t in rule.hf]
        names = params if state is None else [f"{n}.{state}" for n in params]
        key = rule.ckpt.format(**binding) + ("" if state is None else f".{state}")
        absent = [n for n in names if n not in sources]
        if absent:
            incomplete.append(f"{key!r} needs {_names(absent)}")
            continue
        shapes = [tuple(sources[n][1].shape) for n in names]
        dtypes = {sources[n][1].dtype for n in names}
        if len(dtypes) != 1:
            raise ToolError(f"from-hf: {', '.join(names)} have different dtypes {sorted(dtypes)}: cannot merge them")
        if state is not None and shapes != [expected[n].shape for n in params]:
            # per-parameter state of another shape (beta1_pow_acc): to-hf copied it to every part; take one
            if len(set(shapes)) != 1:
                raise ToolError(f"from-hf: optimizer state {', '.join(names)} has different shapes {shapes}")
            src = sources[names[0]]
            rows = shapes[0][0] if shapes[0] else 1
            out.append(MergedTensor(key, shapes[0], dtypes.pop(), False, [MergePart(src, 0, rows, 0)], names, state))
            continue
        parts = []
        for s in split_of(rule, dims, names, shapes):
            src = sources[s.name]
            if s.rows is None:
                parts.append(MergePart(src, 0, s.shape[0] if s.shape else 1, 0))
                continue
            a = 0
            for p, q in s.rows:
                parts.append(MergePart(src, a, a + q - p, p))
                a += q - p
        out.append(MergedTensor(key, fused_shape(rule, shapes), dtypes.pop(), rule.transpose, parts, names, state))
    missing = [n for n, e in expected.items() if e.required and n not in sources]
    problems = []
    if unmapped:
        problems.append(
            f"{len(unmapped)} Hugging Face tensor(s) not mapped by preset {preset.name} for this config: "
            f"{_names(unmapped)}" + expert_accounting(unmapped)
        )
    if missing:
        problems.append(
            f"{len(missing)} parameter(s) of the architecture missing from the input: {_names(missing)}"
            + expert_accounting(missing)
        )
    if incomplete:
        problems.append(f"fused key(s) lacking parts: {_names(incomplete)}")
    refuse_or_warn(problems, allow_unmapped, f"from-hf --preset {preset.name}")
    return out
