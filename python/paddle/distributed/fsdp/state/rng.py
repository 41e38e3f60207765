"""Random generator state in a checkpoint: the CPU generator and the current device's, as named entries.

Why not ``paddle.get_rng_state()``: on a GPU it returns one state per *visible* device, and
``paddle.set_rng_state`` raises when the count differs at resume (another ``CUDA_VISIBLE_DEVICES``),
which used to happen after the tensors were already loaded. Each rank saves instead::

    {"format": "fsdp-rng-v2", "cpu": <state>, "device": {"type": "gpu", "state": <state>}}

(``device`` absent on a CPU-only process), and restores by matching entries: the CPU state into the CPU
generator, the device state into the generator of the device this rank runs on now, whatever its index.
:func:`decode` runs before anything is written: it checks every saved state completely (MetadataError for
damaged state) and refuses a mismatch (RngStateMismatchError: a device entry for a device type this process
does not use, or the reverse, or an old-style list of another length); the function it returns restores. In fake-device mode (``devices/device.py``) a stand-in device generator
takes the device entry, so the device branch runs on CPU.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import paddle
from paddle.base import core

from ..checkpoint.errors import MetadataError, RngStateMismatchError
from ..checkpoint.format.rank_values import RankValueList
from ..checkpoint.format.reserved import RNG_KEY
from ..devices import device as device_mode

logger = logging.getLogger(__name__)

FORMAT = "fsdp-rng-v2"
_fake_device_generator: Any = None
__all__ = ["RngStateMismatchError", "capture", "check_generator_state", "decode", "restore", "validate"]


def _to_json(state) -> list:
    return list(state.__getstate__())


_scratch_generator: Any = None


def check_generator_state(item: Any, where: str):
    """One saved generator state (``[device, seed, offset, engine state bytes]``) decoded and checked completely
    before use, as a ``GeneratorState``: paddle validates nothing (a truncated engine text is accepted and leaves a
    half-set engine), so the text must survive a round trip through a scratch generator unchanged (the engine
    parsed all of it). MetadataError naming ``where`` otherwise."""
    global _scratch_generator
    if type(item) is not list or len(item) != 4 or any(type(x) is not int for x in item[:3]):
        raise MetadataError(f"{where} must be [device, seed, offset, state bytes]")
    if type(item[3]) is not list or len(item[3]) > 1 << 16 or set(map(type, item[3])) - {int}:
        raise MetadataError(f"{where}: the engine state must be a list of byte values")
    if any(not 0 <= b < 256 for b in item[3]) or not -(1 << 63) <= item[1] < 1 << 64 or item[2] < 0:
        raise MetadataError(f"{where}: a value is out of range")
    state = core.GeneratorState.__new__(core.GeneratorState)
    try:
        state.__setstate__(tuple(item))
        if _scratch_generator is None:
            _scratch_generator = core.Generator()
        _scratch_generator.set_state(state)
        back = _scratch_generator.get_state().__getstate__()
    except Exception as e:  # noqa: BLE001 - whatever paddle raises on a bad state
        raise MetadataError(f"{where} is not a generator state: {e}") from None
    if list(back[3]) != item[3]:
        raise MetadataError(f"{where}: the generator engine state is damaged (it does not parse whole)")
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


def _decode_legacy(entry: list, where: str) -> Callable[[], None]:
    """An entry written before fsdp-rng-v2: ``paddle.get_rng_state()`` of that process, one state per visible
    device; it fits only the same count and device ids."""
    current = [st.__getstate__() for st in paddle.get_rng_state()]
    if len(entry) != len(current):
        raise RngStateMismatchError(
            f"{where} holds {len(entry)} generator state(s) (one per device visible when it was saved), this "
            f"process has {len(current)}: device visibility differs"
        )
    states = []
    for i, (item, now) in enumerate(zip(entry, current)):
        states.append(check_generator_state(item, f"{where}[{i}]"))
        if item[0] != now[0]:
            raise RngStateMismatchError(f"{where}[{i}] is the state of device {item[0]}, this process has {now[0]}")
    return lambda: paddle.set_rng_state(states)


def _decode_entry(entry: Any, where: str) -> Callable[[], None]:
    if type(entry) is list:
        return _decode_legacy(entry, where)
    if type(entry) is not dict or entry.get("format") != FORMAT:
        raise MetadataError(f"{where}: random state is not in a known format")
    cpu_state = check_generator_state(entry.get("cpu"), f"{where}.cpu")
    saved_device = entry.get("device")
    if saved_device is not None and (type(saved_device) is not dict or type(saved_device.get("type")) is not str):
        raise MetadataError(f"{where}.device must be an object with a 'type' string and a 'state'")
    device_state = check_generator_state(saved_device["state"], f"{where}.device") if saved_device else None
    current = current_device_generator()
    saved_type = saved_device["type"] if saved_device else None
    current_type = current[0] if current is not None else None
    if saved_type != current_type:
        raise RngStateMismatchError(
            f"{where} is the random state of a {saved_type or 'CPU-only'} process, but this process runs on "
            f"{current_type or 'CPU only'}: its device randomness cannot be resumed"
        )

    def apply() -> None:
        core.default_cpu_generator().set_state(cpu_state)
        if device_state is not None:
            current[1].set_state(device_state)

    return apply


def decode(saved: Any, rank: int, where: str = "checkpoint") -> Callable[[], None]:
    """Check a checkpoint's random state completely for this rank, before anything is written; returns the
    function that restores it (it cannot fail half-way). MetadataError for malformed state,
    RngStateMismatchError for state of another device setup."""
    key = f"{where}: {RNG_KEY}"
    if saved is None:
        return lambda: None
    if isinstance(saved, RankValueList):  # format 3: only this rank's entry is read (and checked) here
        if rank < len(saved):
            return _decode_entry(saved[rank], f"{key}[{rank}]")
    elif type(saved) is not list or any(type(entry) not in (list, dict) for entry in saved):
        raise MetadataError(f"{key} must be a list (one entry per saving rank)")
    elif rank < len(saved):
        return _decode_entry(saved[rank], f"{key}[{rank}]")

    def keep_current() -> None:
        if not saved:  # converted from Hugging Face weights, say: no training run whose randomness resumes
            logger.info("%s holds no random state; the current one is kept", where)
        else:  # saved by fewer ranks than load it
            logger.warning(
                "%s holds no random state for rank %d (saved by %d ranks); it keeps its current one",
                where,
                rank,
                len(saved),
            )

    return keep_current


def validate(saved: Any, rank: int, where: str = "checkpoint") -> None:
    """Refuse, before anything is written, random state this process cannot restore exactly."""
    decode(saved, rank, where)


def restore(saved: Any, rank: int, where: str = "checkpoint") -> None:
    """Set the generators from this rank's saved entry."""
    decode(saved, rank, where)()
