"""Hugging Face weights of a sharded Trainer model (``save_model``, ``save_hf_steps``) through the engine's ``to-hf``.

Why not the Trainer's own ``save_pretrained``: it gathers through stock ``full_param`` (``.cuda()``, fails on CPU)
and knows nothing of our shards. Here every rank writes its shard once as a checkpoint (or an existing checkpoint
of the same step is reused), then rank 0 streams it into HF safetensors with the model family's preset (names,
transposes, fused-key splits: ``tools/presets.py``), one tensor in memory at a time, and adds ``config.json``,
the generation config and the tokenizer, so that ``from_pretrained`` of PaddleFormers (and of transformers) loads
the directory. An adapter model (a PaddleFormers ``LoRAModel``, whose checkpoints reference the frozen base) exports
its adapter instead (tools/adapter_export.py), and on request the merged model (tools/adapter_merge.py).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import uuid

import paddle.distributed as dist

from ...checkpoint.coordination import Comm, gather_errors
from ...checkpoint.errors import ToolError
from ...state.frozen_base import adapter_info
from ...tools.presets import PRESETS

logger = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"


class NoHfPresetError(ToolError):
    """No to-hf preset maps every parameter of this model (its architecture has no export rules yet)."""


def choose_preset(model_type: str | None, keys: list[str]) -> str:
    """The preset whose family accepts ``model_type`` and whose rules map every key of the model."""
    tried = []
    for name, preset in PRESETS.items():
        if model_type not in preset.model_types:
            continue
        tried.append(name)
        patterns = [pattern for pattern, _rule in preset.ckpt_patterns()]
        if all(any(p.match(k) for p in patterns) for k in keys):
            return name
    raise NoHfPresetError(
        f"no to-hf preset maps every parameter of this {model_type!r} model (tried {tried or 'none'}; keys such as "
        f"{keys[:3]}); pass hf_preset= with one of {sorted(PRESETS)}, or save_hf_steps=-1"
    )


def base_preset(fsdp, model, adapter: dict) -> str:
    """The preset of the base model under an adapter (the wrapper's key prefix and the adapters left out)."""
    base = getattr(model, "model", model)  # a LoRAModel wraps the base model as .model
    prefix = adapter.get("prefix", "")
    keys = [k[len(prefix) :] for k, _p, _b, _i in fsdp.managed_parameters() if "lora_" not in k.rsplit(".", 1)[-1]]
    return choose_preset(getattr(base.config, "model_type", None), keys)


def check_exportable(fsdp, model, preset: str | None, merged: bool = False) -> str | None:
    """What ``export`` will write, decided before training (a run must not die at its first ``save_hf_steps``):
    None for an adapter model (its adapter, tools/adapter_export.py; with ``merged`` the base's preset must map
    every base parameter), else the preset (NoHfPresetError now; also for ``merged`` without an adapter)."""
    adapter = adapter_info(fsdp)
    if merged and adapter is None:
        raise NoHfPresetError(
            f"hf_merge_adapter=True: this {type(model).__name__} is not an adapter model (a PaddleFormers LoRAModel, "
            "which records its lora_config): there is no adapter to merge; leave hf_merge_adapter unset"
        )
    if adapter is not None:
        if merged:
            base_preset(fsdp, model, adapter)
        return None
    if preset is not None:
        if preset not in PRESETS:
            raise NoHfPresetError(f"hf_preset {preset!r} is not a to-hf preset (known: {sorted(PRESETS)})")
        return preset
    keys = [key for key, _p, _b, _i in fsdp.managed_parameters()]
    return choose_preset(getattr(getattr(model, "config", None), "model_type", None), keys)


def export(
    fsdp, model, out_dir: str, *, preset: str | None, tokenizer=None, source: str | None = None, merged: bool = False
) -> None:
    """Write HF weights + config (+ tokenizer) of ``model`` into ``out_dir`` (collective; local paths only); for an
    adapter model (a PaddleFormers ``LoRAModel``) its adapter in PaddleFormers' and peft's layouts instead.

    ``source``: a committed checkpoint of the current weights (reused, not rewritten); None saves one into a
    temporary directory next to ``out_dir`` first. Files land in ``out_dir`` one by one, the index last.
    ``merged`` (adapter models): also the base with the adapter merged in, as HF weights in ``out_dir/merged``.
    """
    from ...tools import to_hf
    from ...tools.adapter_export import export_adapter

    if "://" in str(out_dir):
        raise ValueError(f"HF export writes a local directory; got {out_dir!r} (export locally, then upload)")
    out_dir = os.path.abspath(out_dir)
    parent = os.path.dirname(out_dir)
    adapter = adapter_info(fsdp) is not None
    scratch = None
    if source is not None and not adapter and not _holds_every_weight(source):
        source = None  # a checkpoint-N references the frozen base only (state/frozen_base.py)
    if source is None:
        scratch = f"{out_dir.rstrip('/')}.fsdp-weights.tmp"
        # model only (optimizer=None), frozen base included unless the adapter is exported: every rank its shard
        fsdp.save_checkpoint(scratch, save_frozen=not adapter)
        source = scratch
    error = None
    whole = None
    if adapter and merged:  # every weight, for the merge
        whole = f"{out_dir.rstrip('/')}.fsdp-merge.tmp"
        fsdp.save_checkpoint(whole, save_frozen=True)
    if _is_rank0() and adapter:
        try:
            with tempfile.TemporaryDirectory(prefix=".fsdp-adapter-", dir=_made(parent)) as work:
                export_adapter(source, work)
                if whole is not None:
                    _export_merged(fsdp, model, whole, os.path.join(work, "merged"), tokenizer)
                _move_into(work, out_dir)
            logger.info("FSDPTrainer: adapter%s written to %s", " and merged model" if merged else "", out_dir)
        except Exception as e:  # noqa: BLE001 - every rank raises it below (rank 0 wrote alone)
            error = e
        if whole is not None:
            shutil.rmtree(whole, ignore_errors=True)
    elif _is_rank0():
        try:
            if preset is None:
                keys = [key for key, _p, _b, _i in fsdp.managed_parameters()]
                preset = choose_preset(getattr(model.config, "model_type", None), keys)
            os.makedirs(parent, exist_ok=True)
            with tempfile.TemporaryDirectory(prefix=".fsdp-hf-", dir=parent) as work:
                config_dir = os.path.join(work, "config")
                model.config.save_pretrained(config_dir)
                staged = os.path.join(work, "out")
                to_hf(source, staged, preset=preset, config=os.path.join(config_dir, "config.json"), progress=False)
                generation = getattr(model, "generation_config", None)
                if generation is not None and hasattr(generation, "save_pretrained"):
                    generation.save_pretrained(staged)
                if tokenizer is not None:
                    tokenizer.save_pretrained(staged)
                _move_into(staged, out_dir)
            logger.info("FSDPTrainer: HF weights (preset %s) written to %s", preset, out_dir)
        except Exception as e:  # noqa: BLE001 - every rank raises it below (rank 0 wrote alone)
            error = e
    if scratch is not None and _is_rank0():
        shutil.rmtree(scratch, ignore_errors=True)
    gather_errors(Comm(fsdp._checkpoint_group), error)  # also the barrier: every rank returns after the export


def _export_merged(fsdp, model, whole: str, out: str, tokenizer) -> None:
    """The base model with the adapter merged in, as HF weights + config (+ tokenizer) in ``out``: the code of
    ``to-hf --merge-adapter`` (tools/adapter_merge.py), with the base's preset and config."""
    from ...tools import to_hf
    from ...tools.adapter_merge import export_merged

    adapter = adapter_info(fsdp)
    base = getattr(model, "model", model)  # a LoRAModel wraps the base model as .model
    config_dir = os.path.join(os.path.dirname(out), ".merged-config")
    base.config.save_pretrained(config_dir)
    preset = base_preset(fsdp, model, adapter)
    config = os.path.join(config_dir, "config.json")
    export_merged(whole, out, adapter=adapter, preset=preset, config=config, convert=_quiet(to_hf))
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    shutil.rmtree(config_dir, ignore_errors=True)


def _quiet(convert):
    return lambda ckpt, out, **kwargs: convert(ckpt, out, progress=False, **kwargs)


def _made(directory: str) -> str:
    os.makedirs(directory, exist_ok=True)
    return directory


def _holds_every_weight(checkpoint: str) -> bool:
    """Whether ``checkpoint`` holds the frozen base's tensors too (or references none): the same on every rank."""
    from ...checkpoint.directory import open_checkpoint
    from ...checkpoint.format.reserved import FROZEN_BASE_KEY
    from ...state.frozen_base import holds_base

    return holds_base(open_checkpoint(checkpoint).metadata.values.get(FROZEN_BASE_KEY))


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _move_into(staged: str, out_dir: str) -> None:
    """Every file of ``staged`` into ``out_dir`` (replacing same-named ones), the HF index last: a reader that sees
    the index sees every shard it names. A directory (the merged model) replaces an earlier export's of the same
    name whole: the old one is renamed aside first (a rename cannot replace a non-empty directory; a second
    ``save_model`` into the same directory must not fail half-way with the new adapter beside the old merged model)."""
    os.makedirs(out_dir, exist_ok=True)
    names = sorted(os.listdir(staged), key=lambda n: n == INDEX_FILE)
    for name in names:
        target = os.path.join(out_dir, name)
        old = None
        if os.path.isdir(os.path.join(staged, name)) and os.path.isdir(target) and not os.path.islink(target):
            old = f"{target}.replaced-{uuid.uuid4().hex[:12]}"
            os.rename(target, old)
        os.replace(os.path.join(staged, name), target)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def rotate_exports(output_dir: str, prefix: str, keep: int | None) -> list[str]:
    """Remove all but the ``keep`` newest ``<prefix>-N`` export directories (None or <= 0: keep all)."""
    if not keep or keep <= 0 or not os.path.isdir(output_dir):
        return []
    pattern = re.compile(rf"^{re.escape(prefix)}-(\d+)$")
    found = sorted((int(m.group(1)), n) for n in os.listdir(output_dir) if (m := pattern.match(n)))
    removed = [os.path.join(output_dir, n) for _step, n in found[:-keep]]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    if removed:
        logger.info("save_hf_total_limit=%d: removed %s", keep, removed)
    return removed
