"""A loss scaler's state in a checkpoint (``save_checkpoint(..., grad_scaler=scaler)``), as one JSON value.

Why its own record: ``GradScaler.state_dict()`` holds the scale as a numpy array, which the strict JSON of
``extra_state`` refuses, and a resume that restarts at the initial scale (or loses the counters of good and bad
steps) is not the run it continues. The value saved under ``__fsdp__.grad_scaler`` is::

    {"enabled": true, "scale_bits": <the float32 scale's bits, uint32>, "scale": <the same as a float, or a
     string when not finite: for readers>, "incr_ratio": float, "decr_ratio": float, "incr_every_n_steps": int,
     "decr_every_n_nan_or_inf": int, "incr_count": int, "decr_count": int, "use_dynamic_loss_scaling": bool}

(``{"enabled": false}`` for a disabled scaler). The scale goes through its bits, so any float32 value, even
inf, comes back exactly. Every rank holds the same scaler state (``found_inf`` is agreed over the sharding
group before each step, see step/optimizer_integration.py), so the coordinator's value is saved.

Loading follows stock ``load_state_dict``: a disabled scaler (e.g. GradScaler on a CPU) takes nothing; an
enabled one takes every field. :func:`decode` checks everything before a load writes anything and returns the
function that applies it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import numpy as np
from paddle.amp import AmpScaler

from ..checkpoint.errors import GradScalerMismatchError, MetadataError, MissingKeyError
from ..checkpoint.format.reserved import GRAD_SCALER_KEY

logger = logging.getLogger(__name__)

_INT_FIELDS = ("incr_every_n_steps", "decr_every_n_nan_or_inf", "incr_count", "decr_count")
_FLOAT_FIELDS = ("incr_ratio", "decr_ratio")


def check_scaler(scaler: Any) -> AmpScaler:
    """``scaler`` itself if it is a paddle loss scaler (``paddle.amp.GradScaler`` / ``AmpScaler``), else TypeError."""
    if not isinstance(scaler, AmpScaler):
        raise TypeError(f"grad_scaler must be a paddle.amp.GradScaler (or AmpScaler), got {type(scaler).__name__}")
    return scaler


def capture(scaler: AmpScaler) -> dict:
    """The scaler's state as the JSON value saved under ``__fsdp__.grad_scaler``."""
    check_scaler(scaler)
    if not scaler.is_enable():
        return {"enabled": False}
    state = scaler.state_dict()
    scale = np.asarray(state["scale"], dtype=np.float32).reshape([-1])
    if scale.size != 1:
        raise ValueError(f"grad_scaler: the loss scale must hold one value, it has {scale.size}")
    value = float(scale[0])
    out: dict[str, Any] = {
        "enabled": True,
        "scale_bits": int(scale.view(np.uint32)[0]),
        "scale": value if math.isfinite(value) else str(value),
    }
    for name in _FLOAT_FIELDS:
        out[name] = float(state[name])
    for name in _INT_FIELDS:
        out[name] = int(state[name])
    out["use_dynamic_loss_scaling"] = bool(state["use_dynamic_loss_scaling"])
    return out


def _number(saved: dict, name: str, kind: type, where: str):
    value = saved.get(name)
    ok = type(value) is kind or (kind is float and type(value) is int)
    if not ok or (kind is int and value < 0) or (kind is float and not math.isfinite(value)):
        raise MetadataError(f"{where}: {name!r} must be a {'non-negative int' if kind is int else 'finite number'}")
    return kind(value)


def _decode_enabled(saved: dict, where: str) -> dict:
    bits = saved.get("scale_bits")
    if type(bits) is not int or not 0 <= bits < 1 << 32:
        raise MetadataError(f"{where}: 'scale_bits' must be the uint32 bits of the float32 scale")
    if type(saved.get("use_dynamic_loss_scaling")) is not bool:
        raise MetadataError(f"{where}: 'use_dynamic_loss_scaling' must be a bool")
    state: dict[str, Any] = {"scale": np.array([bits], dtype=np.uint32).view(np.float32)}
    for name in _FLOAT_FIELDS:
        state[name] = _number(saved, name, float, where)
    for name in _INT_FIELDS:
        state[name] = _number(saved, name, int, where)
    state["use_dynamic_loss_scaling"] = saved["use_dynamic_loss_scaling"]
    return state


def decode(scaler: AmpScaler | None, saved: Any, present: bool, strict: bool, where: str) -> Callable[[], None]:
    """Check the saved scaler state for ``scaler`` before anything is written; returns the function applying it.

    ``present``: whether the checkpoint holds the key at all. MetadataError for malformed state; with
    ``strict``, MissingKeyError when the checkpoint holds none and GradScalerMismatchError for an enabled scaler
    given the state of a disabled one (stock ``load_state_dict`` refuses that too); without ``strict`` those two
    are logged and the scaler is left as it is."""
    if scaler is None:
        return lambda: None
    check_scaler(scaler)
    key = f"{where}: {GRAD_SCALER_KEY}"
    if not present:
        message = f"{where} holds no GradScaler state (saved without grad_scaler=)"
        if strict:
            raise MissingKeyError(f"{message}; pass strict=False to keep the scaler's current state")
        return lambda: logger.warning("%s: the scaler keeps its current state", message)
    if type(saved) is not dict or type(saved.get("enabled")) is not bool:
        raise MetadataError(f"{key} must be an object with an 'enabled' bool")
    state = _decode_enabled(saved, key) if saved["enabled"] else None
    if not scaler.is_enable():
        return lambda: logger.info("%s: the GradScaler given is disabled: its saved state is not applied", where)
    if state is None:
        message = f"{where} holds the state of a disabled GradScaler, but the one given is enabled"
        if strict:
            raise GradScalerMismatchError(message)
        return lambda: logger.warning("%s: the scaler keeps its current state", message)
    return lambda: scaler.load_state_dict(state)
