"""The adapter of a LoRA checkpoint as its consumers load it: PaddleFormers' layout and Hugging Face peft's.

A checkpoint of a PaddleFormers ``LoRAModel`` holds the trainable adapter tensors and, in its frozen base
reference (``__fsdp__.frozen_base``, state/frozen_base.py), the LoRA config and the key prefix the wrapper adds.
From those two this module writes, in one process, one file at a time:

* PaddleFormers: ``lora_config.json`` + ``lora_model_state.pdparams`` (the keys ``LoRAModel.get_trainable_state_dict``
  gives, values bit-equal), what ``LoRAModel.from_pretrained(model, dir)`` reads;
* peft: ``adapter_config.json`` + ``adapter_model.safetensors`` (``base_model.model.<module>.lora_A.weight``, in
  torch's ``[out, in]`` orientation: paddle's ``[in, r]`` / ``[r, out]`` transposed), what
  ``PeftModel.from_pretrained(model, dir)`` reads.

The base is not part of an adapter: load it from where the reference says it came from. Trainable weights that
are not LoRA's (PaddleFormers' ``trainable_bias`` / ``trainable_modules``) are part of the adapter: PaddleFormers'
layout holds them (as ``get_trainable_state_dict`` does); peft's layout has no place for them here, so it is not
written and the summary says why (``skipped``), rather than an adapter that silently lacks trained weights.

The export is staged (checkpoint/staged_output.py): ``out`` appears complete or not at all, so a kill or an error
half-way never leaves one layout that looks complete without the other, and a rerun needs no cleanup.
"""

from __future__ import annotations

import json
import logging
import os

import numpy as np

from ..checkpoint.format.reserved import FROZEN_BASE_KEY
from ..checkpoint.format.safetensors import build_header
from ..checkpoint.staged_output import staged_output
from .adapter_base import model_keys
from .ckpt_io import OPTIMIZER, CheckpointReader, classify_keys
from .errors import ToolError

logger = logging.getLogger(__name__)

PADDLEFORMERS_CONFIG, PADDLEFORMERS_WEIGHTS = "lora_config.json", "lora_model_state.pdparams"
PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
LAYOUTS = ("paddleformers", "peft")
_LORA_SUFFIXES = (".lora_A", ".lora_B")
_PEFT_DTYPES = ("float32", "float16", "bfloat16", "float64")  # what peft's safetensors loader reads as floats


def adapter_of(values: dict) -> dict | None:
    """The adapter description a checkpoint's JSON values record (None: not an adapter checkpoint)."""
    ref = values.get(FROZEN_BASE_KEY)
    adapter = ref.get("adapter") if isinstance(ref, dict) else None
    if adapter is None:
        return None
    if not isinstance(adapter, dict) or adapter.get("format") != "paddleformers-lora":
        raise ToolError(f"unknown adapter description in {FROZEN_BASE_KEY}: {adapter!r}")
    return adapter


def adapter_tensors(reader: CheckpointReader, adapter: dict) -> dict[str, np.ndarray]:
    """The adapter's tensors under PaddleFormers' keys (the wrapper's prefix removed), in key order: every
    lora_A / lora_B, then the other trainable weights the checkpoint holds (:func:`extra_keys`)."""
    prefix = adapter.get("prefix", "")
    keys = sorted(k for k in reader.md.tensors if k.startswith(prefix) and k.endswith(_LORA_SUFFIXES))
    if not keys:
        raise ToolError(f"checkpoint {reader.path} records a LoRA adapter but holds no lora_A / lora_B tensor")
    return {key[len(prefix) :]: reader.read(key) for key in [*keys, *extra_keys(reader.md, adapter)]}


def extra_keys(md, adapter: dict) -> list[str]:
    """The trainable weights of an adapter checkpoint that are not LoRA's (PaddleFormers' ``trainable_bias`` /
    ``trainable_modules``). A checkpoint without its base holds no frozen weight (except experts under expert
    parallelism, always saved); one that holds its base (``save_frozen=True``) tells them apart by their optimizer
    state, and without optimizer state no weight besides LoRA's is taken for trained."""
    from ..state.frozen_base import holds_base

    prefix = adapter.get("prefix", "")
    keys = [k for k in model_keys(md) if k.startswith(prefix) and not k.endswith(_LORA_SUFFIXES)]
    if holds_base(md.values.get(FROZEN_BASE_KEY)):
        trained = {role.param for role in classify_keys(md).values() if role.role == OPTIMIZER}
        keys = [k for k in keys if k in trained]
    return sorted(keys)


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_paddleformers(out: str, config: dict, tensors: dict[str, np.ndarray]) -> list[str]:
    import paddle

    # (bfloat16 arrives as its uint16 bits, which paddle.load gives back as a bfloat16 tensor)
    paddle.save({k: np.ascontiguousarray(v) for k, v in tensors.items()}, os.path.join(out, PADDLEFORMERS_WEIGHTS))
    _write(os.path.join(out, PADDLEFORMERS_CONFIG), (json.dumps(config, indent=2, sort_keys=True) + "\n").encode())
    return [PADDLEFORMERS_WEIGHTS, PADDLEFORMERS_CONFIG]


def peft_config(config: dict, tensors: dict[str, np.ndarray], base: str | None) -> dict:
    """peft's ``LoraConfig`` fields for PaddleFormers' LoRA config: same rank, alpha and scaling rule; the target
    modules by their last name (peft matches module names by suffix)."""
    targets = sorted({key.rsplit(".", 2)[-2] for key in tensors if key.endswith(_LORA_SUFFIXES)})
    unsupported = [name for name in ("do_qat", "loraga") if config.get(name)]
    if unsupported:  # (lora_plus_scale only changes the training learning rate of B: nothing to export)
        raise ToolError(f"peft export: PaddleFormers LoRA options {unsupported} have no peft equivalent")
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base or config.get("base_model_name_or_path"),
        "r": int(config["r"]),
        "lora_alpha": config["lora_alpha"],
        "lora_dropout": float(config.get("lora_dropout", 0.0)),
        "use_rslora": bool(config.get("rslora", False)),
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
    }


def peft_tensors(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """PaddleFormers' ``<module>.lora_A`` ``[in, r]`` / ``<module>.lora_B`` ``[r, out]`` as peft's
    ``base_model.model.<module>.lora_A.weight`` ``[r, in]`` / ``...lora_B.weight`` ``[out, r]``."""
    return {f"base_model.model.{key}.weight": np.ascontiguousarray(value.T) for key, value in tensors.items()}


def write_peft(
    out: str, config: dict, tensors: dict[str, np.ndarray], dtypes: dict[str, str], base: str | None
) -> list[str]:
    """``dtypes``: each tensor's dtype name in the checkpoint (numpy holds bfloat16 as its uint16 bits)."""
    converted = peft_tensors(tensors)
    entries, offset, blobs = [], 0, []
    for (key, dtype), (name, value) in zip(dtypes.items(), converted.items()):
        if dtype not in _PEFT_DTYPES:
            raise ToolError(f"peft export: {key} has dtype {dtype}, which this export does not write")
        blob = value.tobytes()
        entries.append((name, dtype, tuple(value.shape), offset, offset + len(blob)))
        blobs.append(blob)
        offset += len(blob)
    _write(os.path.join(out, PEFT_WEIGHTS), build_header(entries, {"format": "pt"}) + b"".join(blobs))
    payload = peft_config(config, tensors, base)
    _write(os.path.join(out, PEFT_CONFIG), (json.dumps(payload, indent=2, sort_keys=True) + "\n").encode())
    return [PEFT_WEIGHTS, PEFT_CONFIG]


def export_adapter(ckpt: str, out: str, layouts: tuple[str, ...] = LAYOUTS) -> dict:
    """Write the adapter of LoRA checkpoint ``ckpt`` into directory ``out`` (absent or empty) in ``layouts`` (one
    process, staged: complete or absent). ToolError when the checkpoint records no adapter. The summary's
    ``skipped`` names each layout not written and why."""
    if "://" in str(out):
        raise ToolError(f"the adapter export writes a local directory; got {out!r} (export locally, then upload)")
    unknown = set(layouts) - set(LAYOUTS)
    if unknown:
        raise ToolError(f"unknown adapter layout(s) {sorted(unknown)} (known: {list(LAYOUTS)})")
    with CheckpointReader(ckpt) as reader:
        adapter = adapter_of(reader.md.values)
        if adapter is None:
            raise ToolError(f"checkpoint {reader.path} records no adapter (not a PaddleFormers LoRAModel)")
        tensors = adapter_tensors(reader, adapter)
        prefix = adapter.get("prefix", "")
        dtypes = {key: reader.md.tensors[prefix + key].dtype for key in tensors}
        extras = [key[len(prefix) :] for key in extra_keys(reader.md, adapter)]
        base = reader.md.values[FROZEN_BASE_KEY].get("source")
    skipped: dict[str, str] = {}
    if "peft" in layouts and extras:
        skipped["peft"] = (
            f"{len(extras)} trainable weight(s) besides LoRA's ({', '.join(extras[:3])}"
            f"{', ...' if len(extras) > 3 else ''}) have no place in peft's LoRA layout; load the PaddleFormers layout"
        )
        if "paddleformers" not in layouts:
            raise ToolError(f"adapter export: peft layout asked for alone, and {skipped['peft']}")
        logger.warning("adapter export: peft layout not written: %s", skipped["peft"])
    files: list[str] = []
    with staged_output(out) as staging:
        if "paddleformers" in layouts:
            files += write_paddleformers(staging, adapter["config"], tensors)
        if "peft" in layouts and "peft" not in skipped:
            files += write_peft(staging, adapter["config"], tensors, dtypes, base)
    logger.info("adapter: %d tensors written to %s (%s)", len(tensors), out, ", ".join(files))
    total = sum(v.nbytes for v in tensors.values())
    return {
        "out": out,
        "files": files,
        "tensors": len(tensors),
        "total_size": total,
        "adapter": True,
        "base": base,
        "skipped": skipped,
    }
