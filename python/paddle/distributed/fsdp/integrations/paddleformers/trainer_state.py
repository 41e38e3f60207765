"""What the Trainer itself resumes from, saved with the tensors in one commit.

* ``extra_state`` (one value, rank 0's): ``trainer_state``, the ``TrainerState`` as JSON (global step, epoch,
  consumed samples, log history, best metric). The Trainer turns the global step back into its data position
  (skipped batches / ``consumed_samples``). Timings and memory readings in the log history are left out: they are
  of the machine, not of the run, and would make a resumed checkpoint differ from an uninterrupted one
  (``paddle-fsdp-ckpt diff``).
* :class:`RankRandomState`, given to the engine as ``stateful={"trainer_rng": ...}``: this rank's Python and NumPy
  generator states and paddle generators (``state/rng.py`` format), saved as the rank's own per-rank value
  (``__fsdp__.stateful``), so a loading rank reads only its own entry (checkpoint/format/rank_values.py), nothing
  gathered. The engine restores the paddle generators at load; the Trainer restores all of them once more after it
  skipped the consumed batches (as stock's ``rng_state_<rank>.pth``), and, like stock, only at the same world size.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import random
from typing import Any

import numpy as np

from ...checkpoint.errors import MetadataError
from ...state import rng as engine_rng

logger = logging.getLogger(__name__)

FORMAT = "paddleformers-trainer-v2"  # v1 (never released) gathered RNG here


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


class RankRandomState:
    """This rank's random generators as a stateful object of the engine (``stateful=``).

    ``set_state_dict`` only keeps the saved state: the Trainer applies it with :meth:`restore` after skipping the
    consumed batches. ``stateful_scope = "global"`` lets a load at another world size through (the engine then
    hands every rank saving rank 0's entry); :meth:`restore` itself keeps the current states there, as stock does."""

    stateful_scope = "global"
    NAME = "trainer_rng"

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.saved: dict | None = None

    def state_dict(self) -> dict:
        return {"world_size": self.world_size, **_rank_rng()}

    def set_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or not {"world_size", "python", "numpy", "paddle"} <= set(state):
            raise MetadataError(f"{self.NAME}: a saved random state needs world_size, python, numpy and paddle")
        self.saved = state

    def restore(self) -> bool:
        """Set the saved generator states (Python, NumPy, paddle); False (logged) when saved at another world size."""
        saved, self.saved = self.saved, None
        if saved is None:
            return False
        if saved["world_size"] != self.world_size:
            logger.warning(
                "FSDPTrainer: checkpoint saved by %s ranks, now %s: random states not restored (as stock's Trainer)",
                saved["world_size"],
                self.world_size,
            )
            return False
        apply_paddle = engine_rng.decode([saved["paddle"]], 0, f"checkpoint stateful {self.NAME}")
        version, internal, gauss = saved["python"]
        kind, keys, pos, has_gauss, cached = saved["numpy"]
        random.setstate((version, tuple(internal), gauss))
        np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
        apply_paddle()
        return True


def capture(state) -> dict:
    """``extra_state`` for a checkpoint of the Trainer at ``state`` (not collective: RNG is per-rank stateful)."""
    return {"format": FORMAT, "trainer_state": _state_json(state)}


def check(extra: Any, where: str) -> dict:
    """``extra`` (a loaded ``extra_state``) checked to be a Trainer checkpoint's; MetadataError naming ``where``."""
    if not isinstance(extra, dict) or extra.get("format") != FORMAT:
        raise MetadataError(
            f"{where} holds no PaddleFormers Trainer state (extra_state format {extra.get('format') if isinstance(extra, dict) else None!r}, "
            f"expected {FORMAT!r}): was it saved by FSDPTrainer?"
        )
    if not isinstance(extra.get("trainer_state"), str):
        raise MetadataError(f"{where}: trainer_state must be a JSON string")
    return extra


def trainer_state_json(extra: dict) -> str:
    return extra["trainer_state"]
