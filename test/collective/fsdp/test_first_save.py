"""The first save's write assignment (assign.py, first_save.py): the coordinator's numpy assignment against a
plain per-piece reference of the same rules on seeded random worlds (writes, or the refusing error's class and
message, equal), each rank's part from the coordinator equal to its share of the full assignment, the bytes a
non-coordinator rank sends and receives independent of the world size, and on 3 real processes every rank
failing with the same named error (workers/first_save.py)."""

from __future__ import annotations

import random
import zlib
from pathlib import Path

import pytest
from paddle.distributed.fsdp.checkpoint import assign, first_save, planner
from paddle.distributed.fsdp.checkpoint.errors import InvalidStateDictError
from paddle.distributed.fsdp.checkpoint.format.coverage import coverage_problems
from paddle.distributed.fsdp.checkpoint.format.metadata import DTYPES

HERE = Path(__file__).resolve().parent


def reference(wires: list, value_keys) -> tuple[list, dict]:
    """assign.py's rules, one piece at a time (what every rank ran on the whole world before)."""
    by_key: dict = {}
    for r, descs in enumerate(wires):
        for w in descs:
            by_key.setdefault(w[0], []).append((r, planner.RecordDesc.from_wire(w), w))
    both = sorted(set(by_key) & set(value_keys))
    if both:
        raise InvalidStateDictError(f"key {both[0]!r} is a tensor on some ranks and a plain value on others")
    groups = []  # (key, options) in key order, then the order their first holder lists them
    for key, entries in by_key.items():
        holders: dict = {}
        for r, d, w in entries:
            reg = d.region.normalized()
            if reg.numel:
                holders.setdefault(reg, []).append((r, d, w, reg.numel * DTYPES[d.dtype][0]))
        groups += [(key, opts) for opts in holders.values()]
    load, choice = [0] * len(wires), {}
    for i, (_key, opts) in enumerate(groups):  # single writers first
        if len(opts) == 1 or opts[0][1].replicated:
            choice[i] = opts[0]
            load[opts[0][0]] += opts[0][3]
    for i, (_key, opts) in enumerate(groups):  # then shared regions, fewest bytes so far
        if i not in choice:
            choice[i] = min(opts, key=lambda o: (load[o[0]], o[0]))
            load[choice[i][0]] += choice[i][3]
    for key, entries in by_key.items():
        r0, d0, _w = entries[0]
        for r, d, _w in entries[1:]:
            if d.dtype != d0.dtype:
                raise InvalidStateDictError(f"key {key!r}: dtype {d0.dtype} on rank {r0} but {d.dtype} on rank {r}")
            if d.region.shape != d0.region.shape:
                raise InvalidStateDictError(
                    f"key {key!r}: global shape {list(d0.region.shape)} on rank {r0} but "
                    f"{list(d.region.shape)} on rank {r}"
                )
        kept = [(choice[i][0], choice[i][1].region) for i, (k, _o) in enumerate(groups) if k == key]
        problems = coverage_problems(key, d0.region.shape, kept)
        if problems:
            raise InvalidStateDictError("cannot save: " + "; ".join(problems))
    writes: dict = {r: [] for r in range(len(wires))}
    for i, (key, _opts) in enumerate(groups):
        writes[choice[i][0]].append((key, choice[i][2]))
    return [(k, e[0][1].dtype, e[0][1].region.shape) for k, e in by_key.items()], writes


def _wire(key, shape, off=None, box=None, fr=None, dtype="float32", rep=False):
    shape = tuple(shape)
    return (key, dtype, shape, tuple(off or (0,) * len(shape)), tuple(box or shape), fr, rep)


def random_world(rng: random.Random) -> tuple[list, dict]:
    """A world of 1-6 ranks: flat shards (some empty), HSDP replicas of them, plain tensors, row boxes (some
    with a flat range of the box), then at most one fault: a gap, an overlap, a shard shifted by one (a gap and
    an overlap, the count right), a dtype or shape on one rank, a key that is also a value."""
    world = rng.randint(1, 6)
    wires: list = [[] for _ in range(world)]
    for k in range(rng.randint(1, 6)):
        key, kind = f"k{k}", rng.choice(["flat", "hsdp", "rep", "box", "boxflat"])
        shape = (rng.randint(1, 7), rng.randint(1, 5)) if rng.random() < 0.8 else ()
        n = planner.numel(shape)
        if kind == "rep" or not shape:
            for r in rng.sample(range(world), rng.randint(1, world)) if kind == "rep" else range(world):
                wires[r].append(_wire(key, shape, rep=True, fr=None if rng.random() < 0.5 else (0, n)))
        elif kind in ("flat", "hsdp"):
            reps = 2 if kind == "hsdp" and world % 2 == 0 else 1
            cuts = sorted([0, n] + [rng.randint(0, n) for _ in range(world // reps - 1)])
            for r in range(world):
                j = r % (world // reps)
                wires[r].append(_wire(key, shape, fr=(cuts[j], cuts[j + 1])))
        else:
            cuts = sorted([0, shape[0]] + [rng.randint(0, shape[0]) for _ in range(world - 1)])
            for r in range(world):
                box = (cuts[r + 1] - cuts[r], shape[1])
                fr = (0, planner.numel(box)) if kind == "boxflat" else None
                wires[r].append(_wire(key, shape, off=(cuts[r], 0), box=box, fr=fr))
    values = {"step": 1}
    fault = rng.choice(["none"] * 5 + ["gap", "overlap", "shift", "dtype", "shape", "value"])
    r = rng.randrange(world)
    if fault != "none" and wires[r]:
        i = rng.randrange(len(wires[r]))
        key, dtype, shape, off, box, fr, rep = wires[r][i]
        if fault == "value":
            values[key] = 0
        elif fault == "dtype":
            wires[r][i] = (key, "float16", shape, off, box, fr, rep)
        elif fault == "shape":
            wires[r][i] = (key, dtype, (*shape, 1), (*off, 0), (*box, 1), fr, rep)
        elif fr is not None and off == (0,) * len(shape) and box == shape:
            n = planner.numel(shape)
            b = {"gap": fr[1] - 1, "overlap": min(n, fr[1] + 1), "shift": min(n, fr[1] + 1)}[fault]
            a = min(n - (fr[1] - fr[0]), fr[0] + 1) if fault == "shift" else fr[0]  # gap + overlap, same count
            wires[r][i] = (key, dtype, shape, off, box, (min(a, b), b), rep)
    for descs in wires:
        rng.shuffle(descs)
    return wires, values


def _outcome(fn, *args):
    try:
        return fn(*args)
    except InvalidStateDictError as e:
        return ("refused", str(e))


def test_numpy_assignment_equals_the_per_piece_reference_and_each_part_its_share():
    refused = shared = 0
    for seed in range(400):
        wires, values = random_world(random.Random(seed))
        want = _outcome(reference, wires, values)
        got = _outcome(planner.assign_writes, wires, values)
        got = got if isinstance(got, tuple) else (got.specs, got.writes)
        assert got == want, (seed, wires)
        full, answers = first_save.coordinate([first_save.rank_columns(w) for w in wires], values)
        for r, answer in enumerate(answers):  # each rank's part: its writes, or the same error everywhere
            part = _outcome(first_save.own_assignment, r, wires[r], answer)
            if want[0] == "refused":
                assert part == want and full is None
            else:
                assert part.writes[r] == want[1][r] == full.writes[r] and part.world_size == len(wires)
                assert part.keys_of(r) == [k for k, _w in want[1][r]]
                assert planner.chunk_for(part) == planner.chunk_for(full)
        refused += want[0] == "refused"
        held = [w for ws in wires for w in ws if not w[6] and (w[5] is None or w[5][1] > w[5][0])]
        shared += want[0] != "refused" and len(set(held)) < len(held)  # a region several ranks hold (HSDP)
    assert 60 < refused < 300 and shared > 30, (refused, shared)  # faults reach the checks; replicas balance


def test_columns_give_back_every_wire():
    for seed in range(50):
        for descs in random_world(random.Random(seed))[0]:
            cols = assign.pack(descs)
            assert [assign.wire_at(cols, i) for i in range(len(descs))] == descs
    for keys in (["\0"], ["", ""], ["a\0b", "c"], [""], ["x", "\0\0", ""]):  # NULs and empty keys survive
        descs = [_wire(k, (3,)) for k in keys]
        cols = assign.pack(descs)
        assert assign.keys_of(cols) == keys and [assign.wire_at(cols, i) for i in range(len(descs))] == descs


def _fsdp_world(world: int, keys: int = 12, share: int = 300) -> list:
    """Every rank holds ``share`` elements of each key (flat shards), plus a plain tensor on every rank."""
    out = []
    for r in range(world):
        descs = [_wire(f"layer.{k:03d}.w", (world * share,), fr=(r * share, (r + 1) * share)) for k in range(keys)]
        out.append(descs + [_wire("step_tensor", (), rep=True)])
    return out


def test_a_rank_sends_and_receives_the_same_bytes_in_worlds_4_and_64():
    """What rank 1 sends (its columns) and receives (the largest answer + 16 bytes of sizes) in a first save,
    for worlds of 4 and 64 ranks holding the same share: equal; the coordinator's grows with the world."""
    seen = {}
    for world in (4, 64):
        wires = _fsdp_world(world)
        blobs = [first_save.rank_columns(w) for w in wires]
        full, answers = first_save.coordinate(blobs, {})
        part = first_save.own_assignment(1, wires[1], answers[1])
        assert len(part.writes[1]) == 12 and list(part.writes) == [1] and len(part.specs) == 12
        raw = (len(zlib.decompress(blobs[1])), len(zlib.decompress(answers[1])))  # before compression
        seen[world] = (*raw, len(blobs[1]), 16 + max(map(len, answers[1:])), sum(map(len, blobs)))
    assert seen[4][:2] == seen[64][:2], seen  # exactly: the same content
    assert all(abs(seen[4][i] - seen[64][i]) <= 0.1 * seen[4][i] for i in (2, 3)), seen  # as sent: compressed
    assert seen[64][4] >= 10 * seen[4][4], seen


def test_three_ranks_fail_together_and_save_through_any_coordinator(tmp_path, launch):
    res = launch(HERE / "workers" / "first_save.py", 3, [str(tmp_path)], timeout=300)
    for r in range(3):
        bad = {k: v for k, v in res.result(r).items() if k != "figures" and v != "ok"}
        assert not bad, f"rank {r}: {bad}"
    for case in ("dtype", "gap"):
        messages = {res.result(r)["figures"][case] for r in range(3)}
        assert len(messages) == 1, messages  # the same named error, word for word, on every rank


@pytest.mark.parametrize("world", [1, 3])
def test_refused_save_names_the_first_bad_key_in_key_order(world):
    wires = [[_wire("a", (6,), fr=(0, 6), dtype="float32")] for _ in range(world)]
    wires[0].append(_wire("b", (4,), fr=(0, 3)))  # a gap in b, and a dtype clash in a
    wires[-1][0] = _wire("a", (6,), fr=(0, 6), dtype="float16") if world > 1 else wires[-1][0]
    want = "dtype float32 on rank 0" if world > 1 else "'b': records cover 3 of 4"
    with pytest.raises(InvalidStateDictError, match=want):
        planner.assign_writes(wires, {})
