"""A LoRA model merged into its base: ``W + scale * A @ B`` per adapted layer, in the base weight's dtype.

Input: a checkpoint of a PaddleFormers ``LoRAModel`` (holding its frozen base, ``save_frozen=True``, or with the
base from elsewhere, tools/adapter_base.py) and the adapter description (state/frozen_base.py ``adapter_info``). Output: a checkpoint of the plain base model (the wrapper's key
prefix removed, no ``lora_A`` / ``lora_B``), which ``to-hf`` with the base's preset turns into weights that
``from_pretrained`` loads. Paddle's ``Linear`` weight is ``[in, out]`` and LoRA's ``A`` ``[in, r]``, ``B`` ``[r, out]``,
so the delta is ``A @ B`` as it stands; computed in fp32 (fp64 for fp64 weights), cast once. One tensor at a time.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import tempfile
from collections.abc import Callable

import numpy as np

from ..checkpoint.one_process import CheckpointWriter, WriteEntry
from ..checkpoint.paths import local_path, url_scheme
from .adapter_base import FrozenBase
from .ckpt_io import MODEL, CheckpointReader, cast_array, classify_keys
from .errors import ToolError
from .merge_scratch import merge_scratch

logger = logging.getLogger(__name__)


def lora_scale(config: dict) -> float:
    """PaddleFormers' ``LoRALinear.scaling``: ``lora_alpha / r``, or ``/ sqrt(r)`` with rslora."""
    r = int(config["r"])
    return config["lora_alpha"] / (math.sqrt(r) if config.get("rslora") else r)


def export_merged(
    ckpt: str,
    out: str,
    *,
    convert: Callable[..., dict],
    adapter: dict | None = None,
    base: str | None = None,
    from_hf: Callable[..., dict] | None = None,
    preset: str | None = None,
    config: str | None = None,
) -> dict:
    """The merged model of LoRA checkpoint ``ckpt`` as Hugging Face weights in ``out``: the one code of the
    Trainer's ``hf_merge_adapter=True`` and of ``to-hf --merge-adapter``.

    The frozen base is found and its fingerprint checked first (tools/adapter_base.py; ``base``: a directory
    holding it); only then is anything written. The merge goes into a scratch checkpoint beside ``out`` and
    ``convert`` (``to_hf``, passed in: this module sits below the command that imports it) turns it into ``out``
    with ``preset`` / ``config`` (none: checkpoint names kept). ``adapter``: the description when the caller has
    it (else the one the checkpoint records). Returns ``convert``'s summary plus ``merged`` and ``base``."""
    from .adapter_base import locate
    from .adapter_export import adapter_of
    from .ckpt_io import check_output_path

    out = local_path(out)  # a local directory, or a URL of a storage backend (s3://): the scratch stays local
    check_output_path(out)
    parent = tempfile.gettempdir() if url_scheme(out) else os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    with merge_scratch(parent, out) as scratch:  # (a killed merge's scratch is removed by the next one)
        with CheckpointReader(ckpt, verify=False) as reader:
            md = reader.md
        adapter = adapter or adapter_of(md.values)
        if adapter is None:
            raise ToolError(f"checkpoint {ckpt} records no LoRA adapter to merge (not a PaddleFormers LoRAModel)")
        frozen = locate(md, base, scratch, from_hf=from_hf, preset=preset)  # checked before anything is written
        merged_ckpt = os.path.join(scratch, "merged")
        merged = merge_adapter(ckpt, merged_ckpt, adapter, frozen)
        summary = convert(merged_ckpt, out, preset=preset, config=config)
    logger.info("merged model (%d adapted weights, base from %s) written to %s", merged, frozen.origin, out)
    return {**summary, "merged": merged, "base": frozen.origin}


def merge_adapter(ckpt: str, out: str, adapter: dict, frozen: FrozenBase | None = None) -> int:
    """Write the merged base model of ``ckpt`` as a checkpoint into the (new, empty) directory ``out``; returns
    the number of weights merged. ``frozen``: where the base's tensors are when ``ckpt`` does not hold them."""
    prefix, scale = adapter.get("prefix", ""), lora_scale(adapter["config"])
    os.makedirs(out)  # new: a merge never writes into an existing checkpoint
    writer = CheckpointWriter(out)
    merged = 0
    with contextlib.ExitStack() as stack:
        reader = stack.enter_context(CheckpointReader(ckpt))
        tensors = _Tensors(reader)
        if frozen is not None and frozen.path:
            tensors.add(stack.enter_context(CheckpointReader(frozen.path)), frozen.keys)
        keys = tensors.keys()
        lora = {k for k in keys if k.endswith((".lora_A", ".lora_B"))}
        entries = []
        for key in keys:
            if key in lora:
                continue
            if not key.startswith(prefix):
                raise ToolError(f"merge: key {key!r} lacks the adapter wrapper's prefix {prefix!r}")
            meta = tensors.meta(key)
            module = key[: -len(".weight")] if key.endswith(".weight") else None
            adapted = module is not None and f"{module}.lora_A" in lora
            merged += adapted
            entries.append(
                WriteEntry(key[len(prefix) :], meta.dtype, tuple(meta.shape), _producer(tensors, key, adapted, scale))
            )
        for entry in entries:  # one tensor per data file: the writer holds one in memory
            writer.write_file([entry])
        if not merged:
            raise ToolError(f"merge: checkpoint {ckpt} has no weight with a LoRA adapter (lora_A / lora_B)")
        writer.commit({})
    return merged


class _Tensors:
    """The adapter model's weights by key: the LoRA checkpoint's, and the frozen base's from another checkpoint
    (base first, in its order, then the checkpoint's own weights)."""

    def __init__(self, reader: CheckpointReader) -> None:
        roles = classify_keys(reader.md)
        self._own = {k: (reader, k) for k, role in roles.items() if role.role == MODEL and k in reader.md.tensors}
        self._base: dict[str, tuple[CheckpointReader, str]] = {}

    def add(self, reader: CheckpointReader, keys: dict[str, str]) -> None:
        self._base = {key: (reader, theirs) for key, theirs in keys.items()}

    def keys(self) -> list[str]:
        return [*self._base, *(k for k in self._own if k not in self._base)]

    def _at(self, key: str) -> tuple[CheckpointReader, str]:
        return self._own[key] if key in self._own else self._base[key]

    def meta(self, key: str):
        reader, theirs = self._at(key)
        return reader.md.tensors[theirs]

    def read(self, key: str) -> np.ndarray:
        reader, theirs = self._at(key)
        return reader.read(theirs)

    def read_raw(self, key: str) -> np.ndarray:
        reader, theirs = self._at(key)
        return reader.read_raw(theirs)


_BLOCK_BYTES = 4 << 20  # the delta A @ B is computed this many bytes of rows at a time


def _producer(tensors: _Tensors, key: str, adapted: bool, scale: float):
    def produce() -> np.ndarray:
        if not adapted:
            return np.ascontiguousarray(tensors.read_raw(key)).reshape(-1).view(np.uint8)
        dtype = tensors.meta(key).dtype
        module = key[: -len(".weight")]
        work = "float64" if dtype == "float64" else "float32"
        weight = tensors.read(key)
        a = _as(tensors.read(f"{module}.lora_A"), tensors.meta(f"{module}.lora_A").dtype, work)
        b = _as(tensors.read(f"{module}.lora_B"), tensors.meta(f"{module}.lora_B").dtype, work)
        if weight.shape != (a.shape[0], b.shape[1]):
            raise ToolError(f"merge: {key} is {weight.shape}, its adapter makes {(a.shape[0], b.shape[1])}")
        return _merged(weight, dtype, work, a, b, scale).reshape(-1).view(np.uint8)

    return produce


def _merged(weight: np.ndarray, dtype: str, work: str, a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
    """``weight + (A @ B) * scale`` (LoRALinear.merge's arithmetic) in ``work``, stored in ``dtype``, a block of
    rows at a time: the weight, the result (the weight itself when its dtype is the working one) and one block,
    never a second and third full-size working copy (the tool's memory stays near one tensor, docs/tools.md)."""
    if dtype != work:
        out = np.empty_like(weight)
    else:
        out = weight if weight.flags.writeable else weight.copy()
    rows = max(1, _BLOCK_BYTES // max(1, weight.shape[1] * np.dtype(work).itemsize))
    factor = np.asarray(scale, dtype=work)
    for start in range(0, weight.shape[0], rows):
        stop = min(start + rows, weight.shape[0])
        value = out[start:stop] if dtype == work else cast_array(weight[start:stop], dtype, work)
        delta = a[start:stop] @ b
        delta *= factor
        value += delta
        if dtype != work:
            out[start:stop] = cast_array(value, work, dtype)
    return out


def _as(arr: np.ndarray, src: str, dst: str) -> np.ndarray:
    return arr if src == dst else cast_array(arr, src, dst)
