"""A LoRA model merged into its base: ``W + scale * A @ B`` per adapted layer, in the base weight's dtype.

Input: a checkpoint holding every weight of a PaddleFormers ``LoRAModel`` (``save_frozen=True``) and the adapter
description (state/frozen_base.py ``adapter_info``). Output: a checkpoint of the plain base model (the wrapper's key
prefix removed, no ``lora_A`` / ``lora_B``), which ``to-hf`` with the base's preset turns into weights that
``from_pretrained`` loads. Paddle's ``Linear`` weight is ``[in, out]`` and LoRA's ``A`` ``[in, r]``, ``B`` ``[r, out]``,
so the delta is ``A @ B`` as it stands; computed in fp32 (fp64 for fp64 weights), cast once. One tensor at a time.
"""

from __future__ import annotations

import math
import os

import numpy as np

from ..checkpoint.one_process import CheckpointWriter, WriteEntry
from .ckpt_io import MODEL, CheckpointReader, cast_array, classify_keys
from .errors import ToolError


def lora_scale(config: dict) -> float:
    """PaddleFormers' ``LoRALinear.scaling``: ``lora_alpha / r``, or ``/ sqrt(r)`` with rslora."""
    r = int(config["r"])
    return config["lora_alpha"] / (math.sqrt(r) if config.get("rslora") else r)


def merge_adapter(ckpt: str, out: str, adapter: dict) -> int:
    """Write the merged base model of ``ckpt`` as a checkpoint into the (new, empty) directory ``out``; returns
    the number of weights merged."""
    prefix, scale = adapter.get("prefix", ""), lora_scale(adapter["config"])
    os.makedirs(out)  # new: a merge never writes into an existing checkpoint
    writer = CheckpointWriter(out)
    merged = 0
    with CheckpointReader(ckpt) as reader:
        roles = classify_keys(reader.md)
        keys = [k for k, role in roles.items() if role.role == MODEL and k in reader.md.tensors]
        lora = {k for k in keys if k.endswith((".lora_A", ".lora_B"))}
        entries = []
        for key in keys:
            if key in lora:
                continue
            if not key.startswith(prefix):
                raise ToolError(f"merge: key {key!r} lacks the adapter wrapper's prefix {prefix!r}")
            meta = reader.md.tensors[key]
            module = key[: -len(".weight")] if key.endswith(".weight") else None
            adapted = module is not None and f"{module}.lora_A" in lora
            merged += adapted
            entries.append(
                WriteEntry(key[len(prefix) :], meta.dtype, tuple(meta.shape), _producer(reader, key, adapted, scale))
            )
        for entry in entries:  # one tensor per data file: the writer holds one in memory
            writer.write_file([entry])
        if not merged:
            raise ToolError(f"merge: checkpoint {ckpt} has no weight with a LoRA adapter (lora_A / lora_B)")
        writer.commit({})
    return merged


def _producer(reader: CheckpointReader, key: str, adapted: bool, scale: float):
    def produce() -> np.ndarray:
        if not adapted:
            return np.ascontiguousarray(reader.read_raw(key)).reshape(-1).view(np.uint8)
        dtype = reader.md.tensors[key].dtype
        module = key[: -len(".weight")]
        work = "float64" if dtype == "float64" else "float32"
        weight = _as(reader.read(key), dtype, work)
        a = _as(reader.read(f"{module}.lora_A"), reader.md.tensors[f"{module}.lora_A"].dtype, work)
        b = _as(reader.read(f"{module}.lora_B"), reader.md.tensors[f"{module}.lora_B"].dtype, work)
        if weight.shape != (a.shape[0], b.shape[1]):
            raise ToolError(f"merge: {key} is {weight.shape}, its adapter makes {(a.shape[0], b.shape[1])}")
        # the same arithmetic as LoRALinear.merge: W + (A @ B) * scaling, in the weight's dtype
        value = (weight + (a @ b) * np.asarray(scale, dtype=work)).astype(work)
        out = cast_array(value, work, dtype) if dtype != work else value
        return np.ascontiguousarray(out).reshape(-1).view(np.uint8)

    return produce


def _as(arr: np.ndarray, src: str, dst: str) -> np.ndarray:
    return arr if src == dst else cast_array(arr, src, dst)
