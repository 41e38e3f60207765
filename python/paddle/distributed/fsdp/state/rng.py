"""Random generator state in a checkpoint: the CPU generator and the current device's, as named entries.

Why not ``paddle.get_rng_state()``: on a GPU it returns one state per *visible* device, and
``paddle.set_rng_state`` raises when the count differs at resume (another ``CUDA_VISIBLE_DEVICES``),
which used to happen after the tensors were already loaded. Each rank saves instead::

    {"format": "fsdp-rng-v2", "cpu": <state>, "device": {"type": "gpu", "state": <state>}}

(``device`` absent on a CPU-only process), and restores by matching entries: the CPU state into the CPU
generator, the device state into the generator of the device this rank runs on now, whatever its index.
:func:`validate` runs before anything is written and refuses a mismatch (a device entry for a device type
this process does not use, or the reverse, or an old-style list of another length);
:func:`restore` runs after the load. In fake-device mode (``device.py``) a stand-in device generator
takes the device entry, so the device branch runs on CPU.
"""

from __future__ import annotations

import logging
from typing import Any

import paddle
from paddle.base import core

from .. import device as device_mode
from ..checkpoint.errors import CheckpointError

logger = logging.getLogger(__name__)

FORMAT = "fsdp-rng-v2"
_fake_device_generator: Any = None


class RngStateMismatchError(CheckpointError):
    """The checkpoint's random state does not fit this process's generators (refused before any write)."""


def _to_json(state) -> list:
    return list(state.__getstate__())


def _from_json(item: list):
    state = core.GeneratorState.__new__(core.GeneratorState)
    state.__setstate__(tuple(item))
    return state


def current_device_generator() -> tuple[str, Any] | None:
    """(device type, generator) of the device this process computes on, or None on CPU."""
    global _fake_device_generator
    if device_mode.options().fake_device:
        if _fake_device_generator is None:
            _fake_device_generator = core.Generator()
            _fake_device_generator.manual_seed(0)
        return "fake_device", _fake_device_generator
    name = paddle.device.get_device()  # "cpu", "gpu:0", "xpu:1", "<custom>:0"
    if name == "cpu":
        return None
    kind, _, index = name.partition(":")
    index = int(index or 0)
    if kind == "gpu":
        return kind, core.default_cuda_generator(index)
    if kind == "xpu":
        return kind, core.default_xpu_generator(index)
    return kind, core.default_custom_device_generator(paddle.CustomPlace(kind, index))


def capture() -> dict:
    """This process's random state: the CPU generator's and the current device's (JSON-serialisable)."""
    out: dict[str, Any] = {"format": FORMAT, "cpu": _to_json(core.default_cpu_generator().get_state())}
    current = current_device_generator()
    if current is not None:
        out["device"] = {"type": current[0], "state": _to_json(current[1].get_state())}
    return out


def _entry(saved: Any, rank: int) -> Any:
    """This rank's saved entry, or None when there is none to restore."""
    if not saved or not isinstance(saved, list) or rank >= len(saved):
        return None
    return saved[rank]


def validate(saved: Any, rank: int, where: str = "checkpoint") -> None:
    """Refuse, before anything is written, random state this process cannot restore exactly."""
    entry = _entry(saved, rank)
    if entry is None:
        return
    if isinstance(entry, list):  # written before fsdp-rng-v2: paddle.get_rng_state() of that process
        count = len(paddle.get_rng_state())
        if len(entry) != count:
            raise RngStateMismatchError(
                f"{where} holds {len(entry)} generator state(s) for rank {rank} (one per device visible when it was "
                f"saved), this process has {count}: device visibility differs"
            )
        return
    if not isinstance(entry, dict) or entry.get("format") != FORMAT or not isinstance(entry.get("cpu"), list):
        raise RngStateMismatchError(f"{where}: random state of rank {rank} is not in a known format")
    current = current_device_generator()
    saved_device = entry.get("device")
    saved_type = saved_device.get("type") if isinstance(saved_device, dict) else None
    current_type = current[0] if current is not None else None
    if saved_type != current_type:
        raise RngStateMismatchError(
            f"{where} holds the random state of a {saved_type or 'CPU-only'} process for rank {rank}, but this "
            f"process runs on {current_type or 'CPU only'}: its device randomness cannot be resumed"
        )


def restore(saved: Any, rank: int, where: str = "checkpoint") -> None:
    """Set the generators from this rank's saved entry (call :func:`validate` first, before any write)."""
    entry = _entry(saved, rank)
    if entry is None:
        if not saved:  # converted from Hugging Face weights, say: no training run whose randomness resumes
            logger.info("%s holds no random state; the current one is kept", where)
        else:
            logger.warning(
                "%s holds no random state for rank %d (saved by %d ranks); it keeps its current one",
                where,
                rank,
                len(saved),
            )
        return
    if isinstance(entry, list):
        paddle.set_rng_state([_from_json(item) for item in entry])
        return
    core.default_cpu_generator().set_state(_from_json(entry["cpu"]))
    if "device" in entry:
        current_device_generator()[1].set_state(_from_json(entry["device"]["state"]))
