"""The derived-weight kernels (format/derived.py) against paddle's own ``cast``, over a zoo of float32 values:
every bfloat16 pattern's neighbourhood (exact, ties either way, just off a tie, the last bit before the next
pattern: NaN, inf, subnormals, -0.0 and the carry into the exponent included) and every float16 pattern's
(its float32 midpoints and their neighbours, subnormals, the overflow to inf at 65520). In one process.

What must hold for derived weights to be lossless and useful: the save's check (``equals_cast``) says "equal"
exactly when the load's cast (``cast_into``) reproduces the weight's bits, and for every non-NaN master that is
paddle's cast; a weight off by anything is stored (the check says "not equal").
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest
from paddle.distributed.fsdp.checkpoint.format import derived
from paddle.distributed.fsdp.checkpoint.save import derive_on_device as on_device

BF16_LOWS = [
    0,
    1,
    2,
    0x0100,
    0x7F00,
    0x3FFF,
    0x4000,
    0x7FFE,
    0x7FFF,
    0x8000,
    0x8001,
    0x8002,
    0xBFFF,
    0xC000,
    0xFFFE,
    0xFFFF,
]


def _bf16_zoo() -> np.ndarray:
    high = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    return (high[:, None] + np.array(BF16_LOWS, np.uint32)[None, :]).reshape(-1).view(np.float32)


def _f16_zoo() -> np.ndarray:
    values = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    values = values[np.isfinite(values)]
    ordered = np.unique(values)  # (-0.0 and 0.0 are one: both are added below)
    mids = ((ordered[:-1].astype(np.float64) + ordered[1:]) / 2).astype(np.float32)  # exact in float32
    edges = np.array(
        [0.0, -0.0, 65504, 65519.996, 65520, 65520.004, 1e5, -1e5, np.inf, -np.inf, 2.0**-25, 2.0**-26, 1e-30, -1e-30],
        np.float32,
    )
    around = np.concatenate([values, mids, edges])
    bits = around.view(np.uint32)
    out = np.concatenate([bits, bits + np.uint32(1), bits - np.uint32(1)]).view(np.float32)
    return out[~np.isnan(out)]  # (bits - 1 of +0.0 wraps to a NaN: the NaN cases are the bfloat16 zoo's)


def _paddle_bits(x: np.ndarray, dtype: str) -> np.ndarray:
    return paddle.to_tensor(x).astype(dtype).view("uint16").numpy()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_load_cast_is_paddles_cast_on_every_zoo_value(dtype):
    x = _bf16_zoo() if dtype == "bfloat16" else _f16_zoo()
    assert x.size >= 4 * (1 << 18) or dtype == "float16"  # (the bfloat16 zoo takes the thread pool's path)
    theirs = _paddle_bits(x, dtype)
    ours = np.empty(x.size, np.uint16)
    derived.cast_into(x, dtype, ours)
    finite_or_inf = ~np.isnan(x)
    assert finite_or_inf.sum() > 0.98 * x.size
    bad = np.nonzero((ours != theirs) & finite_or_inf)[0]
    assert not bad.size, [(hex(x[i : i + 1].view(np.uint32)[0]), hex(ours[i]), hex(theirs[i])) for i in bad[:5]]
    assert np.array_equal(derived.cast_bits(x, dtype), ours)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_save_check_says_equal_exactly_when_the_load_reproduces_the_weight(dtype):
    x = _bf16_zoo() if dtype == "bfloat16" else _f16_zoo()
    theirs = _paddle_bits(x, dtype)
    nan = np.isnan(x)
    # the whole zoo (every tie, inf, subnormal, -0.0) with paddle's weights: derived (NaN masters aside)
    assert derived.equals_cast(theirs[~nan], x[~nan], dtype)
    if nan.any():  # a NaN master: paddle's NaN weight is not what the load's cast makes, so it is stored
        assert not derived.equals_cast(theirs, x, dtype)
    # element by element, on a sample: each candidate weight is "equal" iff the load's cast reproduces it
    rng = np.random.default_rng(7)
    sample = rng.choice(x.size, 1500, replace=False)
    for i in sample:
        m = x[i : i + 1]
        made = derived.cast_bits(m, dtype)[0]
        if not np.isnan(m[0]):
            assert made == theirs[i]
        for w in {int(theirs[i]), int(made), (int(made) + 1) & 0xFFFF, (int(made) - 1) & 0xFFFF, int(made) ^ 0x8000}:
            got = derived.equals_cast(np.array([w], np.uint16), m, dtype)
            assert got == (w == made), (hex(m.view(np.uint32)[0]), hex(w), hex(made), got)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_one_element_off_anywhere_in_a_large_weight_keeps_it_stored(dtype):
    """Over several blocks (the thread pool's path): one element one ulp off, in the first, a middle or the last
    block, or only its sign, makes the whole weight "not equal"."""
    x = _bf16_zoo() if dtype == "bfloat16" else _f16_zoo()
    x = x[~np.isnan(x)]
    w = _paddle_bits(x, dtype)
    assert derived.equals_cast(w, x, dtype)
    for i in (0, 1, x.size // 2, x.size - 1):
        for change in (lambda b: b ^ 1, lambda b: b ^ 0x8000):
            off = w.copy()
            off[i] = change(off[i])
            if off[i] == w[i] or (derived.cast_bits(x[i : i + 1], dtype)[0] == off[i]):
                continue  # (+0.0 vs -0.0 of a zero master cast the same way only when they are one value)
            assert not derived.equals_cast(off, x, dtype), (dtype, i)


def test_signed_zeros_and_the_smallest_values_are_told_apart():
    neg_zero, tiny_neg = np.array([-0.0], np.float32), np.array([-1e-45], np.float32)
    for dtype in ("bfloat16", "float16"):
        assert derived.equals_cast(np.array([0x8000], np.uint16), neg_zero, dtype)
        assert not derived.equals_cast(np.array([0x0000], np.uint16), neg_zero, dtype)
        assert derived.equals_cast(_paddle_bits(tiny_neg, dtype), tiny_neg, dtype)


def test_a_ranks_many_weights_are_checked_together_each_on_its_own():
    """``equals_cast_many`` (the save's check of a rank's weights, every block on the pool at once): each pair
    judged on all of its blocks and on nothing else."""
    rng = np.random.default_rng(11)
    pairs, want = [], []
    for j, n in enumerate([1000] * 30 + [3 * (1 << 18) + 7, 5]):
        m = rng.standard_normal(n).astype(np.float32)
        w = derived.cast_bits(m, "bfloat16" if j % 2 else "float16")
        off = j in (3, 30)  # a small one, and the large one in its first block (not its last)
        if off:
            w[5] ^= 1
        pairs.append((w, m, "bfloat16" if j % 2 else "float16"))
        want.append(not off)
    pairs.append((np.zeros(4, np.uint16), np.zeros(5, np.float32), "bfloat16"))  # sizes differ
    want.append(False)
    assert derived.equals_cast_many(pairs) == want
    assert derived.equals_cast_many(pairs[:2]) == want[:2]  # (fewer than 4 blocks: on the calling thread)


# The device-side check (save/derive_on_device.py): paddle int32 ops where the tensors live, run here on CPU paddle
# tensors (the code path a GPU takes; the host check is the reference it must match bit for bit).


@pytest.mark.parametrize("dtype, zoo", [("bfloat16", "bfloat16"), ("float16", "float16"), ("float16", "bfloat16")])
def test_the_device_cast_bits_are_the_host_checks_on_every_zoo_value(dtype, zoo):
    """Bit for bit per element; float16 also over the bfloat16 zoo (every float32 exponent: the overflow band above
    65520, the float32 subnormals far below float16's)."""
    x = _bf16_zoo() if zoo == "bfloat16" else _f16_zoo()
    x = x[~np.isnan(x)]  # (a NaN master is left to the host: see the NaN test below)
    got = on_device.cast_bits_on_device(paddle.to_tensor(x), dtype).numpy()
    want = derived.cast_bits(x, dtype)
    bad = np.nonzero(got != want)[0]
    assert not bad.size, [(hex(x[i : i + 1].view(np.uint32)[0]), hex(got[i]), hex(want[i])) for i in bad[:5]]


def _as_weight(bits: np.ndarray, dtype: str) -> paddle.Tensor:
    return paddle.to_tensor(bits.astype(np.uint16).view(np.int16)).view(dtype)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_device_check_agrees_with_the_host_check(dtype, monkeypatch):
    """The whole zoo as one weight over many slices (equal), one element off in the first, a middle or the last
    slice, or only its sign (not equal); and per element, on a sample, each candidate weight as a weight of its
    own, all in one call: the device's answer is the host's."""
    monkeypatch.setattr(on_device, "SLICE", 1 << 16)
    x = _bf16_zoo() if dtype == "bfloat16" else _f16_zoo()
    x = x[~np.isnan(x)]
    w = derived.cast_bits(x, dtype)
    m = paddle.to_tensor(x)
    assert x.size > 5 * on_device.SLICE
    assert on_device.equals_cast_on_device([(_as_weight(w, dtype), m, dtype)]) == [True]
    pairs, want = [], []
    for i in (0, 1, on_device.SLICE - 1, on_device.SLICE, x.size // 2, x.size - 1):
        for flip in (1, 0x8000):
            off = w.copy()
            off[i] ^= flip
            pairs.append((_as_weight(off, dtype), m, dtype))
            want.append(derived.equals_cast(off, x, dtype))
    assert not any(want)  # (a flipped bit is never the cast: the host says "not equal")
    rng = np.random.default_rng(3)
    for i in rng.choice(x.size, 150, replace=False):
        made = int(w[i])
        for cand in {made, made ^ 1, (made + 1) & 0xFFFF, (made - 1) & 0xFFFF, made ^ 0x8000}:
            cand_bits = np.array([cand], np.uint16)
            pairs.append((_as_weight(cand_bits, dtype), paddle.to_tensor(x[i : i + 1]), dtype))
            want.append(derived.equals_cast(cand_bits, x[i : i + 1], dtype))
    assert on_device.equals_cast_on_device(pairs) == want
    assert want.count(True) >= 150 and want.count(False) >= 150


def test_the_device_check_leaves_nan_masters_to_the_host_and_sizes_must_match():
    m = np.array([1.0, np.nan, -0.0], np.float32)
    pairs = [
        (_as_weight(derived.cast_bits(m, "bfloat16"), "bfloat16"), paddle.to_tensor(m), "bfloat16"),
        (_as_weight(derived.cast_bits(m[:2], "bfloat16"), "bfloat16"), paddle.to_tensor(m), "bfloat16"),
        (_as_weight(np.zeros(0, np.uint16), "float16"), paddle.to_tensor(np.zeros(0, np.float32)), "float16"),
        (_as_weight(np.array([0x8000, 0x8000], np.uint16), "float16"), paddle.to_tensor(m[[2, 2]]), "float16"),
        (_as_weight(np.array([0x8000, 0x0000], np.uint16), "float16"), paddle.to_tensor(m[[2, 2]]), "float16"),
    ]
    assert on_device.equals_cast_on_device(pairs) == [None, False, True, True, False]
