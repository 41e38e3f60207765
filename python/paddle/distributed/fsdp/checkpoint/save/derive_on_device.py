"""The derived-weight check of device tensors on their device: whether a bf16/fp16 weight is exactly its fp32
master cast round to nearest even (format/derived.py), in paddle integer ops where the tensors live.

Why: the host check (``equals_cast_many``) needs host bytes, and a device weight and master were copied to the host
for it (6 bytes a parameter over PCIe), on the save's critical path. Here the master's bits (``view("int32")``)
are rounded in int32 arithmetic on the device and compared with the weight's bits (``view("int16")``); only one
pair of booleans per weight comes back, all of them in one host sync (a place). Temporaries: a few int32 tensors of at most
``SLICE`` elements (tensors are checked a slice at a time).

Semantics are the host check's bit for bit on every non-NaN master: bfloat16 ``(a + 0x7FFF + lsb) >> 16`` of the
magnitude ``a`` (no overflow in int32: ``a <= 0x7F800000``), float16 RNE with the overflow to inf from 65520 and
its subnormals by a right shift of the full significand. A weight whose master holds a NaN is not decided here
(``None``): its NaN pattern is numpy's (format/derived.py), so the caller checks it on the host (a NaN master is
rare: a diverged run).
"""

from __future__ import annotations

import paddle

from ..host_memory import numel_of

SLICE = 1 << 20  # elements a slice: int32 temporaries of 4 MiB each (about ten alive at a time)

_INF32 = 0x7F800000
_F16_INF_FROM = 0x477FF000  # 65520.0: the midpoint above float16's largest finite value, rounds to inf
_F16_NORMAL_FROM = 0x38800000  # 2**-14: float16's smallest normal


class _Consts:
    """0-d int32 constants on the tensors' own place (``full_like``: a fill on the device, not a host copy),
    made once a call."""

    def __init__(self, like: paddle.Tensor):
        self._like = like.reshape([-1])[0].astype("int32")
        self._made: dict[int, paddle.Tensor] = {}

    def __call__(self, value: int) -> paddle.Tensor:
        c = self._made.get(value)
        if c is None:
            c = self._made[value] = paddle.full_like(self._like, value)
        return c


def _bf16_bits(a: paddle.Tensor, c: _Consts) -> paddle.Tensor:
    """bfloat16 magnitude bits (int32) of float32 magnitude bits ``a`` (no NaN), round to nearest even."""
    lsb = paddle.bitwise_and(paddle.bitwise_right_shift(a, c(16)), c(1))
    return paddle.bitwise_right_shift(a + c(0x7FFF) + lsb, c(16))


def _f16_bits(a: paddle.Tensor, c: _Consts) -> paddle.Tensor:
    """float16 magnitude bits (int32) of float32 magnitude bits ``a`` (no NaN), round to nearest even."""
    lsb = paddle.bitwise_and(paddle.bitwise_right_shift(a, c(13)), c(1))
    normal = paddle.bitwise_right_shift(a + c(0x0FFF) + lsb, c(13)) - c(112 << 10)
    # below 2**-14: the significand (implicit bit set) shifted right by 126 - exponent, rounded to even; a shift of
    # 25 makes 0 of anything smaller (the significand is below 2**24)
    exponent = paddle.bitwise_right_shift(a, c(23))
    shift = paddle.clip(c(126) - exponent, 14, 25)
    significand = paddle.bitwise_or(paddle.bitwise_and(a, c(0x7FFFFF)), c(0x800000))
    half_minus_one = paddle.bitwise_left_shift(c(1), shift - c(1)) - c(1)
    keep_lsb = paddle.bitwise_and(paddle.bitwise_right_shift(significand, shift), c(1))
    subnormal = paddle.bitwise_right_shift(significand + half_minus_one + keep_lsb, shift)
    out = paddle.where(a < c(_F16_NORMAL_FROM), subnormal, normal)
    return paddle.where(a >= c(_F16_INF_FROM), c(0x7C00), out)


def _check_slice(w: paddle.Tensor, m: paddle.Tensor, dtype: str, c: _Consts) -> tuple[paddle.Tensor, paddle.Tensor]:
    """``(equal, has_nan)`` (0-d bool tensors on the device) of one slice: weight bits ``w`` (int16), master bits
    ``m`` (int32)."""
    has_nan = paddle.any(paddle.bitwise_and(m, c(0x7FFFFFFF)) > c(_INF32))
    have = paddle.bitwise_and(w.astype("int32"), c(0xFFFF))
    return paddle.all(have == _cast_bits(m, dtype, c)), has_nan


def _cast_bits(m: paddle.Tensor, dtype: str, c: _Consts) -> paddle.Tensor:
    """Storage bits (int32, 0..0xFFFF) of float32 bits ``m`` (int32) cast to ``dtype``; a NaN's are not
    defined here (rounded as inf, so no int32 overflow)."""
    a = paddle.minimum(paddle.bitwise_and(m, c(0x7FFFFFFF)), c(_INF32))
    bits = _bf16_bits(a, c) if dtype == "bfloat16" else _f16_bits(a, c)
    return paddle.bitwise_or(bits, paddle.bitwise_and(paddle.bitwise_right_shift(m, c(16)), c(0x8000)))


def cast_bits_on_device(master: paddle.Tensor, dtype: str) -> paddle.Tensor:
    """The storage bits (int32 tensor on ``master``'s place) of float32 ``master`` cast to ``dtype``: what the
    check compares against, exposed for tests (NaN elements: undefined)."""
    m = _flat(master).view("int32")
    return _cast_bits(m, dtype, _Consts(m)) if numel_of(m) else m


def equals_cast_on_device(pairs: list[tuple[paddle.Tensor, paddle.Tensor, str]]) -> list[bool | None]:
    """For each ``(weight, master, dtype)`` (paddle tensors, the pair on one place; weight ``dtype``
    bfloat16/float16, master float32): True when every element of the weight is the master's cast, False when one
    is not (or the element counts differ), None when the master holds a NaN (check on the host). One host sync a
    place (normally one: the rank's device)."""
    answers: list[bool | tuple[str, int]] = []  # decided here, or (place, index of its flags on that place)
    flags: dict[str, list[paddle.Tensor]] = {}
    for weight, master, dtype in pairs:
        if dtype not in ("bfloat16", "float16"):
            raise ValueError(f"cannot derive a {dtype} weight on the device")
        n = numel_of(master)
        if numel_of(weight) != n or n == 0:
            answers.append(n == 0 and numel_of(weight) == 0)  # (no elements: equal, as on the host)
            continue
        with paddle.no_grad():  # (parameters: no autograd graph of the check)
            w, m = _flat(weight).view("int16"), _flat(master).view("int32")
            consts = _Consts(m)
            equal, nan = [], []
            for i in range(0, n, SLICE):
                e, has_nan = _check_slice(w[i : i + SLICE], m[i : i + SLICE], dtype, consts)
                equal.append(e)
                nan.append(has_nan)
            flag = paddle.stack([paddle.all(paddle.stack(equal)), paddle.any(paddle.stack(nan))])
        on_place = flags.setdefault(str(m.place), [])
        answers.append((str(m.place), len(on_place)))
        on_place.append(flag)
    back = {place: paddle.stack(fs).numpy().tolist() for place, fs in flags.items()}  # the syncs
    out: list[bool | None] = []
    for a in answers:
        if isinstance(a, bool):
            out.append(a)
        else:
            equal, has_nan = back[a[0]][a[1]]
            out.append(None if has_nan else bool(equal))
    return out


def _flat(t: paddle.Tensor) -> paddle.Tensor:
    """``t`` as one row of its elements (a non-contiguous tensor is made contiguous on its device first)."""
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape([-1])
