"""The architecture check of a ``to-hf`` export made with rules (or none): its names and shapes against the
parameters a known family's ``config.json`` describes.

Why: a preset export is refused unless complete (preset_plan.py); an export made with rules used to be written
whatever it held, so a fused checkpoint exported with plain renaming rules left ``q_proj``/``k_proj``/``v_proj``/
``gate_proj``/``up_proj`` out and still exited 0. With ``--config`` naming a known ``model_type``, the same
completeness rules apply on every path (refused with exit 2, naming the keys, unless ``--allow-unmapped``);
without ``--config`` (or with a ``model_type`` no preset knows), nothing can be checked, and the tool says so.
"""

from __future__ import annotations

import logging

from .preset_plan import _limit, _names, refuse_or_warn
from .presets import PRESETS, Preset, check_model_type, expected_params, model_dims, template_regex

logger = logging.getLogger(__name__)

LOOKS_LIKE = 0.5  # share of an export's names a family's parameter templates must match for it to "look like" it


def _families() -> dict[str, Preset]:
    """One preset per family (the fused and unfused presets of a family describe the same HF parameters)."""
    out: dict[str, Preset] = {}
    for p in PRESETS.values():
        out.setdefault(p.model_types[0], p)
    return out


def family_for(model_type: object) -> Preset | None:
    return next((p for p in _families().values() if model_type in p.model_types), None)


def looks_like(names: list[str]) -> Preset | None:
    """The family whose parameter names match most of ``names`` (at least LOOKS_LIKE of them), else None."""
    best, best_share = None, 0.0
    for p in _families().values():
        patterns = [template_regex(s.name) for s in p.params]
        hits = sum(1 for n in names if any(r.fullmatch(n) for r in patterns))
        share = hits / max(1, len(names))
        if share > best_share:
            best, best_share = p, share
    return best if best_share >= LOOKS_LIKE else None


def check_rules_export(tensors: list, config: dict | None, config_path: object, allow_unmapped: bool) -> str | None:
    """Check the model tensors of a rules export (``HfTensor``s; optimizer states are not parameters) against
    the architecture ``config`` describes; refuse (ToolError) or, with ``allow_unmapped``, log what is off. Without
    a config of a known family: returns the warning that nothing was checked (logged once the export is written,
    so that a failing export ends with its error alone)."""
    params = [t for t in tensors if t.key == t.param]
    names = [t.name for t in params]
    known = ", ".join(sorted(_families()))
    if config is None:
        fam = looks_like(names)
        if fam is None:
            return (
                f"to-hf: the export's names look like no known family ({known}): nothing was checked against an "
                f"architecture (pass --config with a known model_type to check it)"
            )
        return (
            f"to-hf: the export looks like a {fam.model_types[0]} model, but without --config nothing was checked "
            f"against its architecture (pass --config to refuse an incomplete export)"
        )
    where = f"config {config_path}"
    model_type = config.get("model_type")
    preset = family_for(model_type)
    if preset is None:
        return (
            f"to-hf: {where} has model_type {model_type!r}, which no preset knows (known: {known}): nothing was "
            f"checked against an architecture"
        )
    dims = model_dims(config, where)
    check_model_type(preset, dims, where)
    expected = expected_params(preset, dims, *_limit(len(params), allow_unmapped, "export"))
    outside = [n for n in names if n not in expected]
    missing = [n for n, e in expected.items() if e.required and n not in set(names)]
    shapes = [
        f"{t.name!r} has shape {list(t.shape)}, the config gives {list(expected[t.name].shape)}"
        for t in params
        if t.name in expected and tuple(t.shape) != tuple(expected[t.name].shape)
    ]
    problems = []
    if missing:
        problems.append(f"{len(missing)} parameter(s) of the architecture missing from the export: {_names(missing)}")
    if outside:
        problems.append(f"{len(outside)} name(s) outside the architecture of the config: {_names(outside)}")
    if shapes:
        problems.append(f"{len(shapes)} shape(s) do not match the config: " + "; ".join(shapes[:12]))
    refuse_or_warn(problems, allow_unmapped, f"to-hf (rules, checked against {model_type!r} from {where})")
    return None
