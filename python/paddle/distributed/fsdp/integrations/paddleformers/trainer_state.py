"""What the Trainer itself resumes from, carried in the checkpoint's ``extra_state`` (committed with the tensors).

* ``trainer_state``: the ``TrainerState`` as JSON (global step, epoch, consumed samples, log history, best metric).
  The Trainer turns the global step back into its data position (skipped batches / ``consumed_samples``). Timings
  and memory readings in the log history are left out: they are of the machine, not of the run, and would make a
  resumed checkpoint differ from an uninterrupted one (``paddle-fsdp-ckpt diff``).
* ``rng``: every rank's Python and NumPy generator states and paddle generators (``state/rng.py`` format), by rank.
  The engine restores the paddle generators at load; the Trainer restores all of them once more after it skipped
  the consumed batches (as stock's ``rng_state_<rank>.pth``), and, like stock, only at the same world size.

Why gathered into ``extra_state`` (one value, rank 0's): ``save_checkpoint`` takes no per-rank user values yet.
This is O(world) small records (~15 KB a rank), like the engine's own per-rank RNG entry.
TODO(resume helper): when ``state/`` takes arbitrary per-rank stateful objects, hand these over to it instead.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
from typing import Any

import numpy as np
import paddle.distributed as dist

from ...checkpoint.errors import MetadataError
from ...state import rng as engine_rng

logger = logging.getLogger(__name__)

FORMAT = "paddleformers-trainer-v1"


def _rank_rng() -> dict:
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "paddle": engine_rng.capture(),
    }


_MEASURED = ("runtime", "per_second", "memory", "mem_", "data_load_time")


def _state_json(state) -> str:
    fields = dataclasses.asdict(state)
    fields["log_history"] = [
        {k: v for k, v in entry.items() if not any(m in k for m in _MEASURED)}
        for entry in fields.get("log_history", [])
    ]
    return json.dumps(fields, sort_keys=True)


def capture(state, group=None) -> dict:
    """``extra_state`` for a checkpoint of the Trainer at ``state`` (collective over ``group``: the RNG gather)."""
    gathered: list = []
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_gather_object(gathered, _rank_rng(), group=group)
    else:
        gathered = [_rank_rng()]
    return {
        "format": FORMAT,
        "trainer_state": _state_json(state),
        "world_size": len(gathered),
        "rng": gathered,
    }


def check(extra: Any, where: str) -> dict:
    """``extra`` (a loaded ``extra_state``) checked to be a Trainer checkpoint's; MetadataError naming ``where``."""
    if not isinstance(extra, dict) or extra.get("format") != FORMAT:
        raise MetadataError(
            f"{where} holds no PaddleFormers Trainer state (extra_state format {extra.get('format') if isinstance(extra, dict) else None!r}, "
            f"expected {FORMAT!r}): was it saved by FSDPTrainer?"
        )
    if not isinstance(extra.get("trainer_state"), str) or not isinstance(extra.get("rng"), list):
        raise MetadataError(f"{where}: trainer_state must be a JSON string and rng a list")
    return extra


def trainer_state_json(extra: dict) -> str:
    return extra["trainer_state"]


def restore_rng(extra: dict, rank: int, world_size: int) -> bool:
    """Set this rank's saved generator states (Python, NumPy, paddle); False (logged) at another world size."""
    if extra.get("world_size") != world_size or rank >= len(extra["rng"]):
        logger.warning(
            "FSDPTrainer: checkpoint saved by %s ranks, now %s: random states not restored (as stock's Trainer)",
            extra.get("world_size"),
            world_size,
        )
        return False
    saved = extra["rng"][rank]
    apply_paddle = engine_rng.decode([saved["paddle"]], 0, "checkpoint extra_state rng")
    version, internal, gauss = saved["python"]
    kind, keys, pos, has_gauss, cached = saved["numpy"]
    random.setstate((version, tuple(internal), gauss))
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    apply_paddle()
    return True
