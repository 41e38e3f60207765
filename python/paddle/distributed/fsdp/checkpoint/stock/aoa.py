"""``aoa_config`` (stock's rename / transpose / cast / split / merge statements) applied by our loader.

The statements are parsed and resolved by stock's own ``AOAEngine`` (pure Python shape bookkeeping, no I/O); it
answers, for each target box, which boxes of which saved keys land where and with which post-processing
(a transpose permutation written as ``"[1, 0]"``, or a dtype name to cast to). Reading, post-processing and
assigning are ours (``loader.py``), so they run on CPU and read only what is needed.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidStateDictError
from ..format.metadata import NUMPY_STORAGE
from .cpu_tensor import to_paddle
from .index import PieceIndex
from .targets import Target


@dataclass
class Assignment:
    """Copy box ``src_offset``/``src_shape`` of saved key ``src_key``, post-processed, into the target's read box
    at ``dst_offset`` (relative to the read box)."""

    src_key: str
    src_offset: tuple[int, ...]
    src_shape: tuple[int, ...]
    dst_offset: tuple[int, ...]
    postprocess: list[str] | None = None


def _desc(key, local_shape, global_shape, offset, dtype):
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeightDesc

    return ShardedWeightDesc(
        key=key,
        local_shape=tuple(local_shape),
        global_shape=tuple(global_shape),
        global_offset=tuple(offset),
        dtype=dtype,
    )


def source_shard_info(index: PieceIndex) -> dict:
    out = {}
    for key, entry in index.tensors.items():
        boxes = sorted({(p.box_offset, p.box_shape) for p in entry.pieces})
        out[key] = [_desc(key, s, entry.shape, o, entry.dtype) for o, s in boxes]
    return out


def target_shard_info(targets: list[Target]) -> dict:
    out: dict = {}
    for t in targets:
        off, shape = t.read_box()
        out.setdefault(t.key, []).append((off, shape, t.shape, t.dtype))
    return out


def _refuse_quantized(aoa_config: dict, index: PieceIndex, all_target_info: list[dict]) -> None:
    """A quantized moment of our format 4 (stored as codes and scales only) read by a statement (left of its
    ``->``) or asked for as a target no statement writes: a named error saying why and what reads it (stock's
    parser would call it "not assigned before")."""
    if not index.quantized:
        return
    sources, written = set(), set()
    for statement in aoa_config.get("aoa_statements") or ():
        left, arrow, right = str(statement).partition("->")
        sources.update(re.split(r"[^\w.@]+", left if arrow else ""))
        written.update(re.split(r"[^\w.@]+", right))
    sources.update(k for info in all_target_info for k in info if k not in written)
    hit = sorted(sources & index.quantized)
    if hit:
        raise InvalidStateDictError(
            f"aoa_config: {hit[:3]} of {index.root} are optimizer moments stored quantized (lossy, format 4 "
            f"'quant'), which the reader behind aoa_config does not dequantize: load them without aoa_config "
            f"(load_checkpoint, load_state_dict)"
        )


def plan_aoa(aoa_config: dict, index: PieceIndex, targets: list[Target], all_target_info: list[dict]) -> dict:
    """target key -> assignments; ``all_target_info`` is every rank's ``target_shard_info`` (stock resolves
    statements against the global destination layout)."""
    from paddle.distributed.flex_checkpoint.aoa.aoa_engine import AOAEngine

    if not isinstance(aoa_config, dict):
        raise InvalidStateDictError(f"aoa_config must be a dict like {{'aoa_statements': [...]}}, got {aoa_config!r}")
    _refuse_quantized(aoa_config, index, all_target_info)
    dst: dict = {}
    for info in all_target_info:
        for key, boxes in info.items():
            for off, shape, gshape, dtype in boxes:
                d = _desc(key, shape, gshape, off, dtype)
                if d not in dst.setdefault(key, []):
                    dst[key].append(d)
    try:
        engine = AOAEngine(
            aoa_config=aoa_config, source_state_shard_info=source_shard_info(index), destination_state_shard_info=dst
        )
    except Exception as e:  # stock's parser reports errors with AssertionError/ValueError/KeyError...
        raise InvalidStateDictError(f"aoa_config could not be applied: {type(e).__name__}: {e}") from None
    plan: dict[str, list[Assignment]] = {}
    for t in targets:
        off, shape = t.read_box()
        try:
            mappings = engine.find_shard_sources(_desc(t.key, shape, t.shape, off, t.dtype))
        except Exception as e:
            raise InvalidStateDictError(f"aoa_config: key {t.key!r}: {type(e).__name__}: {e}") from None
        items = []
        for m in mappings:
            src, tgt = m.source_slice, m.target_slice
            if src.key not in index.tensors:
                raise InvalidStateDictError(
                    f"aoa_config maps {t.key!r} from {src.key!r}, which is not in the checkpoint"
                )
            rel = tuple(int(a) - int(b) for a, b in zip(tgt.global_offset, off))
            items.append(
                Assignment(src.key, tuple(src.global_offset), tuple(src.local_shape), rel, m.postprocess_list or None)
            )
        plan[t.key] = items
    return plan


def postprocess(arr: np.ndarray, dtype: str, steps: list[str] | None) -> tuple[np.ndarray, str]:
    """Apply stock's post-processing steps: ``"[perm]"`` transposes, a dtype name casts (through paddle, so
    bfloat16/float16 round exactly as stock's ``paddle.cast``)."""
    for step in steps or []:
        try:
            parsed = ast.literal_eval(step)
        except (ValueError, SyntaxError):
            parsed = None
        if isinstance(parsed, list):
            arr = np.ascontiguousarray(np.transpose(arr, parsed))
        elif isinstance(step, str) and step in NUMPY_STORAGE:
            if step != dtype:
                arr = np.ascontiguousarray(to_paddle(arr, dtype).cast(step).numpy())
                dtype = step
        else:
            raise InvalidStateDictError(f"aoa_config: unsupported post-processing step {step!r}")
    return arr, dtype
