"""Seeded mutation fuzzing of every object of a format-3 checkpoint, and agreement of loads with verify (issue 40).

The checkpoint (crafted.py, two data files): a key of column boxes (no row directory), flat halves, a whole
piece, a key of 20 flat rows (row directory with fences; loaded by a window), per-rank values. Each round
mutates one object: metadata.json (re-sealed), COMMIT, index.keys (bytes; or its JSON edited and every hash
made to match, as a crafter would), index.pieces (bytes; or a row's field edited with its check, the row
directory and every hash made to match; or two rows of a key swapped), index.starts, index.fences, index.ranks,
a ``<rank>.values`` (bytes; or its JSON edited and re-sealed), a checksum sidecar, a data file's header or data,
or any of them replaced by a FIFO, a directory, a symlink out, or nothing.

Then, for each round: ``load_state_dict`` (sharded targets: a window of the long key; memory-bounded, which
may also say PartiallyLoadedError, and atomic) and ``load_full_state_dict`` return exactly the saved state or
raise a named CheckpointError (test_checkpoint_fuzz's contract, sentinels
included; a crafted mutation may declare other values consistently, so what it loads is not compared), and
they agree with ``verify_checkpoint``: when verify finds the checkpoint sound, both loads return
the saved state; when a load of everything refuses, verify names a problem. Every tenth round the CLI's
``inspect`` and ``verify`` run on it too (exit 0, 1 or 2, one line; never 3). The seed is printed with a failure.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import zlib
from pathlib import Path

import numpy as np
import paddle
import paddle.distributed.fsdp.checkpoint as ck
import pytest
from crafted import craft, reseal, rewrite_rows, snapshot_files
from hangs import alarm
from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight
from paddle.distributed.fsdp.checkpoint.format.index import PIECE_ROW
from test_checkpoint_fuzz import SENTINEL, _check_cli, _mutate_bytes, _mutate_json, _raw, _restore

ROUNDS = int(os.environ.get("FSDP_FUZZ3_ROUNDS", "250"))
SEEDS = [int(s) for s in os.environ.get("FSDP_FUZZ3_SEEDS", "11,12,13").split(",")]
RNG = [[1, 2, 3], [4, 5, 6]]  # per-rank values (rank 0's and rank 1's)
LONG = 200  # elements of the key split into 20 rows


def _values():
    rng = np.random.default_rng(9)
    return {
        "w": rng.standard_normal((6, 10)).astype(np.float32),
        "flat": rng.standard_normal((5, 7)).astype(np.float32),
        "ids": np.arange(24, dtype=np.int64).reshape(2, 12),
        "long": rng.standard_normal(LONG).astype(np.float32),
    }


def _pieces():
    cuts = np.linspace(0, LONG, 21).astype(int)
    return {
        "w": [(0, (0, 0), (6, 4), None), (1, (0, 4), (6, 6), None)],
        "flat": [(0, (0, 0), (5, 7), (0, 13)), (1, (0, 0), (5, 7), (13, 35))],
        "ids": [(1, (0, 0), (2, 12), None)],
        "long": [(i % 2, (0,), (LONG,), (int(a), int(b))) for i, (a, b) in enumerate(zip(cuts, cuts[1:]))],
    }


def _targets(values):
    t = {
        "w": paddle.zeros([6, 10], dtype="float32"),
        "flat": ShardedWeight(
            "flat",
            paddle.zeros([20], dtype="float32"),
            [5, 7],
            [5, 7],
            [0, 0],
            is_flattened=True,
            flattened_range=slice(9, 29),
        ),  # fmt: skip
        "ids": paddle.zeros([2, 12], dtype="int64"),
        "long": ShardedWeight(
            "long",
            paddle.zeros([37], dtype="float32"),
            [LONG],
            [LONG],
            [0],
            is_flattened=True,
            flattened_range=slice(101, 138),
        ),  # fmt: skip  (a window of the 20 rows: the row directory, fences included)
        "step": None,
        "rng": None,
    }
    want = {
        "w": values["w"].view(np.uint8).ravel(),
        "flat": values["flat"].reshape(-1)[9:29].view(np.uint8),
        "ids": values["ids"].view(np.uint8).ravel(),
        "long": values["long"][101:138].view(np.uint8),
    }
    return t, want


def _build(path: Path) -> dict:
    values = _values()
    craft(path, values, _pieces(), values={"step": 3, "rng": RNG}, per_rank=("rng",))
    assert (path / "index.fences").stat().st_size > 0 and (path / "1.values").exists()
    return values


# ------------------------------------------------------------------------------------------------ mutations


def _reseal_index(ckpt: Path, name: str, blob: bytes, extra: dict | None = None) -> None:
    """Write index object ``name`` and make metadata.json (and COMMIT) name its size and SHA-256."""
    (ckpt / name).write_bytes(blob)
    md = json.loads((ckpt / "metadata.json").read_bytes())
    entry = md["index"][name]
    entry["sha256"] = hashlib.sha256(blob).hexdigest()
    if "bytes" in entry:
        entry["bytes"] = len(blob)
    entry.update(extra or {})
    reseal(ckpt, json.dumps(md).encode())


def _keys_crafted(ckpt: Path, pristine: dict, rnd: random.Random) -> None:
    doc = json.loads(zlib.decompress(pristine["index.keys"]))
    text = _mutate_json(doc, rnd)
    if rnd.random() < 0.1:  # nesting far beyond the limit, or a bomb that inflates beyond what is declared
        text = b'{"keys":' + b"[" * 100_000 + b"]" * 100_000 + b"}" if rnd.random() < 0.5 else b" " * (64 << 20)
    blob = zlib.compress(text)
    _reseal_index(ckpt, "index.keys", blob, {"inflated": len(text) if rnd.random() < 0.8 else 1000})


FIELD_VALUES = [0, 1, 2, 3, 5, 7, 8, 13, 100, 199, 200, 201, 1 << 31, (1 << 63) - 1, -1]


def _pieces_crafted(ckpt: Path, pristine: dict, rnd: random.Random) -> str:
    rows0 = np.frombuffer(pristine["index.pieces"], PIECE_ROW)
    op = rnd.random()

    def edit(rows):
        i = rnd.randrange(len(rows))
        if op < 0.2:  # two rows of one key swapped (out of order), or a row made a copy of its neighbour
            j = i + 1 if i + 1 < len(rows) and rows[i + 1]["key"] == rows[i]["key"] else max(0, i - 1)
            if rnd.random() < 0.5:
                rows[[i, j]] = rows[[j, i]]
            else:
                rows[i] = rows[j]
            return
        field = rnd.choice(["file", "box", "offset", "nbytes", "flat_a", "flat_b", "sums", "key"])
        kind = PIECE_ROW.fields[field][0]
        v = rnd.choice(FIELD_VALUES + [int(rows0[rnd.randrange(len(rows0))][field])])
        rows[i][field] = np.array(v).astype(kind) if kind.kind != "u" or v >= 0 else np.iinfo(kind).max

    rewrite_rows(ckpt, edit)
    return "swap" if op < 0.2 else "field"


def _values_crafted(ckpt: Path, pristine: dict, rnd: random.Random) -> None:
    from paddle.distributed.fsdp.checkpoint.format.rank_values import RANK_ROW

    r = rnd.randrange(2)
    blob = _mutate_json(json.loads(pristine[f"{r}.values"]), rnd)
    (ckpt / f"{r}.values").write_bytes(blob)
    table = np.frombuffer(pristine["index.ranks"], RANK_ROW).copy()
    table[r] = (len(blob), hashlib.sha256(blob).digest())
    raw = table.tobytes()
    (ckpt / "index.ranks").write_bytes(raw)
    md = json.loads((ckpt / "metadata.json").read_bytes())
    md["rank_values"]["sha256"] = hashlib.sha256(raw).hexdigest()
    reseal(ckpt, json.dumps(md).encode())


OBJECTS = [
    "index.keys", "index.pieces", "index.starts", "index.fences", "index.ranks", "0.values", "1.values",
    "0_0.safetensors.sums", "1_0.safetensors.sums",
]  # fmt: skip


def _mutate(ckpt: Path, pristine: dict, rnd: random.Random) -> str:
    kind = rnd.choices(
        ["metadata_json_crafted", "metadata_bytes_crafted", "commit", "object_bytes", "keys_crafted", "pieces_crafted",
         "values_crafted", "st_header", "data", "file_kind"],
        weights=[14, 5, 4, 30, 8, 16, 5, 6, 8, 4],
    )[0]  # fmt: skip
    if kind == "metadata_json_crafted":  # (re-sealed into COMMIT: a consistent edit of what is declared)
        reseal(ckpt, _mutate_json(json.loads(pristine["metadata.json"]), rnd))
    elif kind == "metadata_bytes_crafted":
        reseal(ckpt, _mutate_bytes(pristine["metadata.json"], rnd))
    elif kind == "commit":
        (ckpt / "COMMIT").write_bytes(_mutate_json(json.loads(pristine["COMMIT"]), rnd))
    elif kind == "object_bytes":
        name = rnd.choice(OBJECTS)
        (ckpt / name).write_bytes(_mutate_bytes(pristine[name], rnd))
        kind = f"object_bytes:{name}"
    elif kind == "keys_crafted":
        _keys_crafted(ckpt, pristine, rnd)
    elif kind == "pieces_crafted":
        kind = f"pieces_crafted:{_pieces_crafted(ckpt, pristine, rnd)}"
    elif kind == "values_crafted":
        _values_crafted(ckpt, pristine, rnd)
    elif kind in ("st_header", "data"):
        name = rnd.choice(["0_0.safetensors", "1_0.safetensors"])
        raw = pristine[name]
        n = 8 + int.from_bytes(raw[:8], "little")
        if kind == "st_header":
            (ckpt / name).write_bytes(_mutate_bytes(raw[:n], rnd) + raw[n:])
        else:
            (ckpt / name).write_bytes(raw[:n] + _mutate_bytes(raw[n:], rnd))
    else:
        name = rnd.choice(OBJECTS + ["metadata.json", "0_0.safetensors"])
        target = ckpt / name
        target.unlink()
        op = rnd.choice(["fifo", "dir", "missing", "symlink_out"])
        if op == "fifo":
            os.mkfifo(target)
        elif op == "dir":
            target.mkdir()
        elif op == "symlink_out":
            outside = ckpt.parent / f"outside-{name}"
            outside.write_bytes(pristine[name])
            os.symlink(outside, target)
        kind = f"file_kind:{op}:{name}"
    return kind


# ------------------------------------------------------------------------------------------------ the round


def _round(ckpt: Path, values: dict, targets: dict, want: dict, what: str) -> tuple[str, str, bool]:
    """(sharded load outcome, full load outcome, verify sound); asserts the contract of each. A crafted
    mutation (every hash and check made to match) may declare other values: then a load that succeeds is not
    compared with the saved state, only the agreement with verify and the named errors are asserted."""
    crafted = "crafted" in what
    for key in want:  # the memory-bounded load (the default): exact, refused untouched, or said partial
        _raw(targets[key])[:] = SENTINEL
    targets["step"] = targets["rng"] = None
    with alarm(30, f"bounded load_state_dict after {what}"):
        try:
            ck.load_state_dict(targets, str(ckpt))
            bounded = "loaded"
        except ck.PartiallyLoadedError:
            bounded = "partial"
        except ck.StateDictMismatchError as e:
            bounded = f"mismatch:{type(e).__name__}"
        except ck.CheckpointError as e:
            bounded = f"refused:{type(e).__name__}"
    for key, w in want.items():
        got = _raw(targets[key])
        if bounded == "loaded":
            assert crafted or np.array_equal(got, w), f"{what}: bounded load succeeded with changed bytes of {key!r}"
        elif bounded.startswith(("refused", "mismatch")):
            assert np.all(got == SENTINEL), f"{what}: a refused bounded load changed {key!r}"
    for key in want:  # the atomic load: exact or refused untouched
        _raw(targets[key])[:] = SENTINEL
    targets["step"] = targets["rng"] = None
    with alarm(30, f"load_state_dict after {what}"):
        try:
            ck.load_state_dict(targets, str(ckpt), atomic=True)
            sharded = "loaded"
        except ck.StateDictMismatchError as e:  # a sound checkpoint of another state (a crafted edit)
            sharded = f"mismatch:{type(e).__name__}"
        except ck.CheckpointError as e:
            sharded = f"refused:{type(e).__name__}"
    for key, w in want.items():
        got = _raw(targets[key])
        if sharded == "loaded":
            assert crafted or np.array_equal(got, w), f"{what}: load succeeded with changed bytes of {key!r}"
        else:
            assert np.all(got == SENTINEL), f"{what}: a refused load changed {key!r}"
    if sharded == "loaded":
        try:  # per-rank values are read (and checked) by rank when first asked for: a named error then
            rng = list(targets["rng"])
            assert crafted or (targets["step"] == 3 and rng == RNG), f"{what}: values changed"
        except ck.CheckpointError as e:
            sharded = f"refused:{type(e).__name__}"
    with alarm(30, f"load_full_state_dict after {what}"):
        try:
            full = ck.load_full_state_dict(str(ckpt), list(values) + ["step", "rng"])
            rng = list(full["rng"])
            if not crafted:
                assert all(full[k].numpy().tobytes() == v.tobytes() for k, v in values.items()), f"{what}: full"
                assert full["step"] == 3 and rng == RNG, f"{what}: full load values changed"
            whole = "loaded"
        except ck.StateDictMismatchError as e:
            whole = f"mismatch:{type(e).__name__}"
        except ck.CheckpointError as e:
            whole = f"refused:{type(e).__name__}"
    with alarm(30, f"verify_checkpoint after {what}"):
        problems = ck.verify_checkpoint(str(ckpt))
    assert isinstance(problems, list) and all(isinstance(p, str) for p in problems), what
    if not problems:  # verify says sound: every load returns the saved state
        outcomes = (bounded, sharded, whole)
        assert all(o.split(":")[0] in ("loaded", "mismatch") for o in outcomes), f"{what}: sound, loads: {outcomes}"
    if sharded == "loaded" and bounded != "loaded":  # the same request: the bounded and atomic loads agree
        raise AssertionError(f"{what}: the atomic load loaded, the bounded one: {bounded}")
    if whole.startswith("refused"):  # a load of everything names damage: so does verify
        assert problems, f"{what}: load_full refused ({whole}), verify says sound"
    return sharded, whole, not problems


@pytest.fixture
def fuzz_dir(tmp_path):
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else str(tmp_path)
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="fuzz3-", dir=base))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_pristine_format3_checkpoint_loads_and_verifies(fuzz_dir):
    values = _build(fuzz_dir / "ckpt")
    targets, want = _targets(values)
    assert _round(fuzz_dir / "ckpt", values, targets, want, "nothing") == ("loaded", "loaded", True)


@pytest.mark.parametrize("seed", SEEDS)
def test_seeded_mutation_of_every_format3_object(fuzz_dir, seed):
    ckpt = fuzz_dir / "ckpt"
    values = _build(ckpt)
    pristine = snapshot_files(ckpt)
    targets, want = _targets(values)
    outcomes: dict[str, dict[str, int]] = {}
    for i in range(ROUNDS):
        rnd = random.Random(seed * 1_000_003 + i)
        what = _mutate(ckpt, pristine, rnd)
        label = f"seed={seed} round={i} mutation={what}"
        try:
            sharded, whole, sound = _round(ckpt, values, targets, want, label)
            if i % 10 == 0:  # the CLI on the same input: exit 0/1/2 with one line, never an internal error
                _check_cli(ckpt, label)
        except AssertionError:
            raise
        except Exception as e:  # another exception type is a failure of the contract
            raise AssertionError(f"{label}: {type(e).__name__}: {e}") from e
        kind = what.split(":")[0] if not what.startswith(("object_bytes", "pieces")) else what.rsplit(":", 0)[0]
        o = outcomes.setdefault(kind, {})
        o[whole.split(":")[0]] = o.get(whole.split(":")[0], 0) + 1
        _restore(ckpt, pristine)
    refused = sum(o.get("refused", 0) for o in outcomes.values())
    loaded = sum(o.get("loaded", 0) for o in outcomes.values())
    assert refused > ROUNDS // 3 and loaded > ROUNDS // 50, outcomes  # the fuzzer exercises both outcomes
    print(f"seed {seed}: full-load outcomes by mutation: {outcomes}")
