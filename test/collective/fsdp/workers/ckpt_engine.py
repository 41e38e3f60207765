"""Checkpoint engine on N ranks: save with one sharding, load with another; each rank reports {case: "ok"}.

Usage (under paddle.distributed.launch):
    ckpt_engine.py save DIR    # 2 ranks: sync + async saves of SPEC into DIR/sync, DIR/async, DIR/async_then_sync,
                               # reload on the same world with another split, cross-rank all-or-nothing
    ckpt_engine.py load DIR    # any world size: load DIR/sync and DIR/async with a world-specific split

Full tensors are generated from a fixed seed on every rank (``full_arrays``), so any world size knows the
expected values without reading the checkpoint; comparisons are bit-exact (raw bytes).
The functions here are also imported by test_checkpoint_engine.py for the 1-process load.
"""

from __future__ import annotations

import os
import sys
import traceback

import numpy as np

SPEC = {  # key -> (global shape, dtype)
    "flat.a": ((37, 5), "float32"),
    "flat.b": ((64,), "float32"),
    "flat.c": ((9, 7), "bfloat16"),
    "flat.d": ((50,), "int64"),
    "box.rows": ((8, 6), "float32"),
    "box.cols": ((4, 10), "float64"),
    "rep.w": ((3, 3), "float32"),
    "rep.scalar": ((), "float32"),
    "rep.i64": ((5,), "int64"),
}
VALUES = {"step": 7, "cfg": {"lr": 0.001, "betas": [0.9, 0.999], "name": "adamw", "flag": True, "none": None}}
SENTINEL = -7.0


def full_arrays() -> dict[str, np.ndarray]:
    """Global float32/float64/int64 values (bf16 keys hold the float32 values that get cast)."""
    rng = np.random.default_rng(1234)
    out = {}
    for key, (shape, dtype) in SPEC.items():
        if dtype == "int64":
            out[key] = rng.integers(-(2**40), 2**40, size=shape, dtype=np.int64)
        elif dtype == "float64":
            out[key] = rng.standard_normal(shape)
        else:
            out[key] = rng.standard_normal(shape).astype(np.float32)
    return out


def to_tensor(arr: np.ndarray, dtype: str):
    import paddle

    # np.array keeps 0-d arrays 0-d (np.ascontiguousarray would make them 1-d)
    if dtype == "bfloat16":
        return paddle.to_tensor(np.array(arr, dtype=np.float32, order="C")).astype("bfloat16")
    return paddle.to_tensor(np.array(arr, order="C"))


def bits(t) -> np.ndarray:
    """Raw bytes of a tensor (bf16 comes out of .numpy() as uint16)."""
    return np.ascontiguousarray(t.numpy()).view(np.uint8).ravel()


def expected_bits(full: dict, key: str) -> np.ndarray:
    shape, dtype = SPEC[key]
    return bits(to_tensor(full[key], dtype))


def flat_sw(key: str, local, start: int, stop: int):
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    shape = SPEC[key][0]
    return ShardedWeight(
        key, local, list(shape), list(shape), [0] * len(shape), is_flattened=True, flattened_range=slice(start, stop)
    )


def box_sw(key: str, local, offset, box):
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    return ShardedWeight(key, local, list(box), list(SPEC[key][0]), list(offset))


def save_state(rank: int, full: dict) -> dict:
    """The 2-rank saving layout: uneven flattened ranges (one empty range, one absent record), row and
    column boxes, replicated plain tensors, JSON values."""
    sd: dict = dict(VALUES)
    flat_ranges = {
        "flat.a": [(0, 100), (100, 185)],
        "flat.b": [(0, 64), None],  # rank 1 owns nothing: record absent
        "flat.c": [(0, 20), (20, 63)],
        "flat.d": [(0, 0), (0, 50)],  # rank 0 holds an empty record
    }
    for key, ranges in flat_ranges.items():
        r = ranges[rank]
        if r is None:
            continue
        dtype = SPEC[key][1]
        local = to_tensor(full[key].reshape(-1)[r[0] : r[1]], dtype)
        sd[key] = flat_sw(key, local, r[0], r[1])
    rows = [(0, 3), (3, 8)][rank]
    sd["box.rows"] = box_sw(
        "box.rows", to_tensor(full["box.rows"][rows[0] : rows[1]], "float32"), (rows[0], 0), (rows[1] - rows[0], 6)
    )
    cols = [(0, 4), (4, 10)][rank]
    sd["box.cols"] = box_sw(
        "box.cols", to_tensor(full["box.cols"][:, cols[0] : cols[1]], "float64"), (0, cols[0]), (4, cols[1] - cols[0])
    )
    for key in ("rep.w", "rep.scalar", "rep.i64"):
        sd[key] = to_tensor(full[key], SPEC[key][1])
    return sd


def split(n: int, world: int, rank: int) -> tuple[int, int]:
    """Uneven split of n into world parts (later ranks get more)."""

    def b(k):
        return int(round(n * (k / world) ** 1.3))

    return b(rank), b(rank + 1)


def load_targets(rank: int, world: int):
    """Request a world-specific split that mixes forms: saved-flat keys loaded as boxes and vice versa, and
    flattened fp32 targets that are views into one fused buffer with sentinel gaps."""
    import paddle

    targets: dict = {"step": None, "cfg": None}
    checks = []  # (key, tensor, function full->expected bytes)
    # flat.a [37,5] saved flat -> load as row boxes
    r0, r1 = split(37, world, rank)
    if r1 > r0:
        t = paddle.full([r1 - r0, 5], SENTINEL, dtype="float32")
        targets["flat.a"] = box_sw("flat.a", t, (r0, 0), (r1 - r0, 5))
        checks.append(("flat.a", t, lambda f, a=r0, b=r1: bits(to_tensor(f["flat.a"][a:b], "float32"))))
    # fused fp32 buffer holding flattened views of flat.b and box.rows (saved as boxes) with gaps
    fb = split(64, world, rank)
    rb = split(48, world, rank)
    nb, nr = fb[1] - fb[0], rb[1] - rb[0]
    fused = paddle.full([3 + nb + 2 + nr + 1], SENTINEL, dtype="float32")
    if nb:
        v = fused._slice(3, 3 + nb)
        targets["flat.b"] = flat_sw("flat.b", v, *fb)
    if nr:
        v = fused._slice(3 + nb + 2, 3 + nb + 2 + nr)
        targets["box.rows"] = flat_sw("box.rows", v, *rb)

    def fused_expected(f, fb=fb, rb=rb, nb=nb, nr=nr):
        e = np.full(3 + nb + 2 + nr + 1, SENTINEL, dtype=np.float32)
        e[3 : 3 + nb] = f["flat.b"].reshape(-1)[fb[0] : fb[1]]
        e[3 + nb + 2 : 3 + nb + 2 + nr] = f["box.rows"].reshape(-1)[rb[0] : rb[1]]
        return e.view(np.uint8)

    checks.append(("fused(flat.b,box.rows)", fused, fused_expected))
    # bf16 and int64 flattened
    for key in ("flat.c", "flat.d"):
        n = int(np.prod(SPEC[key][0]))
        a, b = split(n, world, world - 1 - rank)  # reversed order: rank 0 gets the big part
        if b > a:
            t = paddle.full([b - a], 3, dtype=SPEC[key][1])
            targets[key] = flat_sw(key, t, a, b)
            checks.append((key, t, lambda f, k=key, a=a, b=b: bits(to_tensor(f[k].reshape(-1)[a:b], SPEC[k][1]))))
    # box.cols [4,10] saved as column boxes -> load as row boxes
    c0, c1 = split(4, world, rank)
    if c1 > c0:
        t = paddle.full([c1 - c0, 10], SENTINEL, dtype="float64")
        targets["box.cols"] = box_sw("box.cols", t, (c0, 0), (c1 - c0, 10))
        checks.append(("box.cols", t, lambda f, a=c0, b=c1: bits(to_tensor(f["box.cols"][a:b], "float64"))))
    # replicated plain tensors: full on every rank
    for key in ("rep.w", "rep.scalar", "rep.i64"):
        shape, dtype = SPEC[key]
        t = paddle.full(list(shape), 5, dtype=dtype)
        targets[key] = t
        checks.append((key, t, lambda f, k=key: expected_bits(f, k)))
    return targets, checks


def check_loaded(targets: dict, checks, full: dict, report) -> None:
    for name, t, fn in checks:
        got, want = bits(t), fn(full)
        if not np.array_equal(got, want):
            bad = int(np.nonzero(got != want)[0][0]) if got.shape == want.shape else -1
            raise AssertionError(f"{name}: loaded bytes differ from the saved values (first byte {bad})")
    assert targets["step"] == VALUES["step"], targets["step"]
    assert targets["cfg"] == VALUES["cfg"], targets["cfg"]
    assert report.loaded_keys, report


def snapshot(checks) -> list[np.ndarray]:
    return [bits(t).copy() for _, t, _ in checks]


# ------------------------------------------------------------------------------------------------ cases


def case_save_sync(rank, world, d, full, ck):
    # tiny checksum chunks: loads then exercise multi-chunk pieces, partial head/tail chunks, direct reads
    ck.save_state_dict(save_state(rank, full), os.path.join(d, "sync"), chunk_bytes=64)
    assert ck.verify_checkpoint(os.path.join(d, "sync")) == []


def case_save_async(rank, world, d, full, ck):
    sd = save_state(rank, full)
    h = ck.save_state_dict(sd, os.path.join(d, "async"), async_save=True)
    # the snapshot is taken before returning: scribbling on the tensors now must not reach the file
    for v in sd.values():
        t = getattr(v, "local_tensor", v)
        if hasattr(t, "fill_") and int(t.numel()) > 0:
            t.fill_(0)
    h.wait()
    assert ck.verify_checkpoint(os.path.join(d, "async")) == []


def case_async_then_sync(rank, world, d, full, ck):
    """A second save right after an async one waits for it; both end up committed."""
    p1, p2 = os.path.join(d, "async_then_sync1"), os.path.join(d, "async_then_sync2")
    h = ck.save_state_dict(save_state(rank, full), p1, async_save=True)
    ck.save_state_dict(save_state(rank, full), p2)
    assert h.done()
    h.wait()
    for p in (p1, p2):
        assert ck.verify_checkpoint(p) == [], p


def case_load(rank, world, d, full, ck, name="sync"):
    targets, checks = load_targets(rank, world)
    rep = ck.load_state_dict(targets, os.path.join(d, name))
    check_loaded(targets, checks, full, rep)
    assert rep.bytes_read > 0 or not checks


def case_all_or_nothing(rank, world, d, full, ck):
    """Rank world-1 asks for a key the checkpoint lacks: every rank raises, no rank changes a target."""
    targets, checks = load_targets(rank, world)
    if rank == world - 1:
        import paddle

        targets["no.such.key"] = paddle.zeros([3])
    before = snapshot(checks)
    try:
        ck.load_state_dict(targets, os.path.join(d, "sync"))
    except ck.MissingKeyError as e:
        assert "no.such.key" in str(e), e
    else:
        raise AssertionError("load with a missing key on one rank did not raise")
    after = snapshot(checks)
    for (name, _, _), b, a in zip(checks, before, after):
        assert np.array_equal(a, b), f"{name} changed although the load failed"
    assert targets["step"] is None


def case_description_memo(rank, world, d, full, ck):
    """Saves exchange digests of the record descriptions: the same records again skip the full exchange and the
    assignment on every rank; a rank that lost its memo, or records that changed on one rank only, send every
    rank through the full exchange together (no hang, no mismatch) and the checkpoints stay whole."""
    import paddle
    from paddle.distributed.fsdp.checkpoint.save import save as save_mod

    calls = []
    real = save_mod.exchange_assignment
    save_mod.exchange_assignment = lambda *a: calls.append(1) or real(*a)
    try:
        path = [os.path.join(d, f"memo{i}") for i in range(4)]
        ck.save_state_dict(save_state(rank, full), path[0])
        n = len(calls)
        ck.save_state_dict(save_state(rank, full), path[1], async_save=True).wait()
        assert len(calls) == n, "the same records again were assigned anew"
        if rank == 1:
            save_mod._assignments.clear()
        ck.save_state_dict(save_state(rank, full), path[2])
        assert len(calls) == n + 1, "a rank without the memo did not send every rank through the full exchange"
        sd = save_state(rank, full)
        if rank == 0:
            sd["only_on_rank0"] = paddle.arange(5, dtype="float32")
        ck.save_state_dict(sd, path[3])
        assert len(calls) == n + 2, "records changed on rank 0 were not exchanged in full"
    finally:
        save_mod.exchange_assignment = real
    for p in path:
        assert ck.verify_checkpoint(p) == [], p
    got = ck.load_full_state_dict(path[3])
    assert np.array_equal(got["only_on_rank0"].numpy(), np.arange(5, dtype=np.float32))
    assert "only_on_rank0" not in ck.load_full_state_dict(path[2])


def main() -> None:
    import _paths  # noqa: F401
    import paddle  # noqa: F401
    import paddle.distributed as dist
    import paddle.distributed.fsdp.checkpoint as ck
    from launch_util import report

    mode, d = sys.argv[1], sys.argv[2]
    world_env = int(os.environ.get("PADDLE_TRAINERS_NUM", "1"))
    if world_env > 1:
        dist.init_parallel_env()
    rank, world = (dist.get_rank(), dist.get_world_size()) if world_env > 1 else (0, 1)
    full = full_arrays()
    if mode == "save":
        cases = [
            ("save_sync", lambda: case_save_sync(rank, world, d, full, ck)),
            ("save_async", lambda: case_save_async(rank, world, d, full, ck)),
            ("async_then_sync", lambda: case_async_then_sync(rank, world, d, full, ck)),
            ("load_same_world_sync", lambda: case_load(rank, world, d, full, ck, "sync")),
            ("load_same_world_async", lambda: case_load(rank, world, d, full, ck, "async")),
            ("all_or_nothing", lambda: case_all_or_nothing(rank, world, d, full, ck)),
            ("description_memo", lambda: case_description_memo(rank, world, d, full, ck)),
        ]
    else:
        cases = [
            (f"load_{world}_sync", lambda: case_load(rank, world, d, full, ck, "sync")),
            (f"load_{world}_async", lambda: case_load(rank, world, d, full, ck, "async")),
            (f"all_or_nothing_{world}", lambda: case_all_or_nothing(rank, world, d, full, ck)),
        ]
    results = {}
    for name, fn in cases:
        try:
            fn()
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
            print(f"[rank {rank}] case {name} FAILED:\n{results[name]}", flush=True)
            # later cases depend on earlier ones; stop here (collectives stay aligned: every case is collective)
            break
    report(results)


if __name__ == "__main__":
    main()
