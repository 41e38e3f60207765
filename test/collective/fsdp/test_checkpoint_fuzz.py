"""Seeded random mutation fuzzing of a checkpoint: metadata.json, COMMIT, safetensors headers and data files.

Every mutation is followed by ``load_state_dict`` into targets holding sentinel bytes, ``load_full_state_dict`` and
``verify_checkpoint``, all in this process. The contract, for each: a correct load (every target byte equal to the
saved value) or an error of the documented hierarchy (``CheckpointError``) with every target byte still the
sentinel; never another exception type, never a hang (an alarm turns one into a failure); ``verify_checkpoint``
always returns a list. Metadata edits are re-sealed into COMMIT in most rounds, so they reach the parser and the
checks behind the hash instead of stopping at the hash. The seed is printed with every failure.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import paddle
import paddle.distributed.fsdp.checkpoint as ck
import pytest
from crafted import craft, reseal, snapshot_files
from hangs import alarm
from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight
from paddle.distributed.fsdp.checkpoint import host_memory

ROUNDS = int(os.environ.get("FSDP_FUZZ_ROUNDS", "2000"))
SEED = int(os.environ.get("FSDP_FUZZ_SEED", "1234"))
SENTINEL = 0xA5


def _global_values():
    rng = np.random.default_rng(7)
    return {
        "w": rng.standard_normal((6, 10)).astype(np.float32),  # column boxes in two files
        "flat": rng.standard_normal((5, 7)).astype(np.float32),  # flat ranges in two files
        "ids": np.arange(24, dtype=np.int64).reshape(2, 12),  # one whole piece
    }


def _pieces():
    return {
        "w": [(0, (0, 0), (6, 4), None), (1, (0, 4), (6, 6), None)],
        "flat": [(0, (0, 0), (5, 7), (0, 13)), (1, (0, 0), (5, 7), (13, 35))],
        "ids": [(1, (0, 0), (2, 12), None)],
    }


def _targets(values):
    """Load targets (host tensors, one of them a flat shard) and the byte views the checks read."""
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
        ),
        "ids": paddle.zeros([2, 12], dtype="int64"),
        "step": None,
    }
    want = {
        "w": values["w"].view(np.uint8).ravel(),
        "flat": values["flat"].reshape(-1)[9:29].view(np.uint8),
        "ids": values["ids"].view(np.uint8).ravel(),
    }
    return t, want


def _raw(v):
    return host_memory.raw_view(v.local_tensor if isinstance(v, ShardedWeight) else v, allow_copy=False)[0]


REPLACEMENTS = [
    0,
    -1,
    1,
    3,
    2**31,
    2**63,
    2**64 + 5,
    10**50,
    1.5,
    -0.0,
    1e308,
    "x",
    "12",
    "",
    "../evil",
    [],
    [1],
    [0, 0],
    ["a"],
    {},
    {"a": 1},
    None,
    True,
    False,
    "__NaN__",
    "__Infinity__",
    "__deep__",
]


def _paths(obj, prefix=()):
    """Every (container path, key) in a JSON value (the targets of a mutation)."""
    out = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.append((prefix, k))
            out += _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.append((prefix, i))
            out += _paths(v, prefix + (i,))
    return out


def _get(obj, path):
    for p in path:
        obj = obj[p]
    return obj


def _mutate_json(doc, rnd: random.Random) -> bytes:
    """One structural edit of a JSON document (replace, delete, duplicate, add), serialised (NaN/Infinity as the
    bare tokens, deep nesting as brackets)."""
    paths = _paths(doc)
    if not paths:
        return json.dumps(rnd.choice(REPLACEMENTS)).encode()
    prefix, key = rnd.choice(paths)
    parent = _get(doc, prefix)
    op = rnd.random()
    if op < 0.65:
        parent[key] = rnd.choice(REPLACEMENTS)
    elif op < 0.8:
        del parent[key]
    elif op < 0.9 and isinstance(parent, list):
        parent.insert(key, json.loads(json.dumps(parent[key])))
    elif isinstance(parent, dict):
        parent[rnd.choice(["extra", "crc32", "flat_range", "values"])] = rnd.choice(REPLACEMENTS)
    else:
        parent[key] = rnd.choice(REPLACEMENTS)
    text = json.dumps(doc)
    text = text.replace('"__NaN__"', "NaN").replace('"__Infinity__"', "-Infinity")
    return text.replace('"__deep__"', "[" * 5000 + "]" * 5000).encode()


def _mutate_bytes(data: bytes, rnd: random.Random) -> bytes:
    if not data:
        return bytes([rnd.randrange(256)])
    b = bytearray(data)
    op = rnd.random()
    if op < 0.5:
        for _ in range(rnd.randint(1, 3)):
            b[rnd.randrange(len(b))] ^= 1 << rnd.randrange(8)
    elif op < 0.7:
        del b[rnd.randrange(len(b)) :]
    elif op < 0.85:
        i = rnd.randrange(len(b))
        b[i:i] = bytes(rnd.randrange(256) for _ in range(rnd.randint(1, 16)))
    else:
        i = rnd.randrange(len(b))
        b[i : i + 8] = rnd.randrange(1 << 64).to_bytes(8, "little")
    return bytes(b)


def _mutate(ckpt: Path, pristine: dict[str, bytes], rnd: random.Random) -> str:
    """Apply one random mutation to the checkpoint directory; returns what was done."""
    kind = rnd.choices(
        ["metadata_json", "metadata_bytes", "metadata_unsealed", "commit", "st_header", "data", "file_kind"],
        weights=[40, 12, 3, 8, 12, 18, 7],
    )[0]
    if kind == "metadata_json":
        reseal(ckpt, _mutate_json(json.loads(pristine["metadata.json"]), rnd))
    elif kind == "metadata_bytes":
        reseal(ckpt, _mutate_bytes(pristine["metadata.json"], rnd))
    elif kind == "metadata_unsealed":
        (ckpt / "metadata.json").write_bytes(_mutate_bytes(pristine["metadata.json"], rnd))
    elif kind == "commit":
        if rnd.random() < 0.5:
            (ckpt / "COMMIT").write_bytes(_mutate_bytes(pristine["COMMIT"], rnd))
        else:
            (ckpt / "COMMIT").write_bytes(_mutate_json(json.loads(pristine["COMMIT"]), rnd))
    elif kind in ("st_header", "data"):
        name = rnd.choice(["0_0.safetensors", "1_0.safetensors"])
        raw = pristine[name]
        n = 8 + int.from_bytes(raw[:8], "little")
        if kind == "st_header":
            head = raw[:n]
            if rnd.random() < 0.5:
                doc = json.loads(head[8:])
                body = _mutate_json(doc, rnd)
                head = len(body).to_bytes(8, "little") + body
            else:
                head = _mutate_bytes(head, rnd)
            (ckpt / name).write_bytes(head + raw[n:])
        else:
            (ckpt / name).write_bytes(raw[:n] + _mutate_bytes(raw[n:], rnd))
    else:
        name = rnd.choice(["0_0.safetensors", "1_0.safetensors", "metadata.json", "COMMIT"])
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


def _restore(ckpt: Path, pristine: dict[str, bytes]) -> None:
    for name in os.listdir(ckpt):
        p = ckpt / name
        if p.is_symlink() or p.is_file():
            p.unlink()
        elif p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()  # FIFO
    for name, data in pristine.items():
        (ckpt / name).write_bytes(data)


def _check_round(ckpt: Path, values, targets, want, what: str) -> str:
    for key in want:
        _raw(targets[key])[:] = SENTINEL
    targets["step"] = None
    outcome = "loaded"
    with alarm(20, f"load_state_dict after {what}"):
        try:
            ck.load_state_dict(targets, str(ckpt))
        except ck.PartiallyLoadedError:  # damaged data found while reading: said loudly, targets written in part
            outcome = "partial"
        except ck.CheckpointError:
            outcome = "refused"
    if outcome == "partial":  # the same input with atomic=True: refused, and nothing may change
        for key in want:
            _raw(targets[key])[:] = SENTINEL
        with alarm(20, f"atomic load_state_dict after {what}"):
            try:
                ck.load_state_dict(targets, str(ckpt), atomic=True)
            except ck.PartiallyLoadedError:
                raise AssertionError(f"{what}: an atomic load reported partly written targets") from None
            except ck.CheckpointError:
                outcome = "refused"
        assert outcome == "refused", f"{what}: the atomic load accepted what the bounded load refused"
    for key, w in want.items():
        got = _raw(targets[key])
        if outcome == "loaded":
            assert np.array_equal(got, w), f"{what}: load succeeded with changed bytes of {key!r}"
        else:
            assert np.all(got == SENTINEL), f"{what}: a refused load changed {key!r}"
    with alarm(20, f"load_full_state_dict after {what}"):
        try:
            full = ck.load_full_state_dict(str(ckpt))
        except ck.CheckpointError:
            full = None
    if full is not None:
        for key, arr in values.items():
            if key in full:
                got = np.ascontiguousarray(full[key].numpy()).view(np.uint8).ravel()
                assert np.array_equal(got, arr.view(np.uint8).ravel()), f"{what}: load_full returned changed {key!r}"
    with alarm(20, f"verify_checkpoint after {what}"):
        problems = ck.verify_checkpoint(str(ckpt))
    assert isinstance(problems, list) and all(isinstance(p, str) for p in problems), what
    return outcome


def _check_cli(ckpt: Path, what: str) -> None:
    """The CLI on the same input: bad input is exit 2 (verify: 1 for problems found) with one line, never 3."""
    import io

    from paddle.distributed.fsdp.tools.cli import main

    for cmd, allowed in (("inspect", (0, 2)), ("verify", (0, 1, 2))):
        err = io.StringIO()
        with alarm(20, f"paddle-fsdp-ckpt {cmd} after {what}"):
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                rc = main([cmd, str(ckpt)])
        assert rc in allowed and "internal error" not in err.getvalue(), f"{what}: {cmd} exit {rc}: {err.getvalue()}"
        if rc == 2:
            assert len(err.getvalue().strip().splitlines()) == 1, f"{what}: {cmd}: {err.getvalue()}"


@pytest.fixture
def fuzz_dir():
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    d = Path(tempfile.mkdtemp(prefix="robust-fuzz-", dir=base))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_pristine_crafted_checkpoint_loads_and_verifies(fuzz_dir):
    values = _global_values()
    craft(fuzz_dir / "ckpt", values, _pieces(), values={"step": 3})
    targets, want = _targets(values)
    assert _check_round(fuzz_dir / "ckpt", values, targets, want, "nothing") == "loaded"
    assert ck.verify_checkpoint(str(fuzz_dir / "ckpt")) == []
    assert targets["step"] == 3


def test_seeded_mutation_fuzz(fuzz_dir):
    """ROUNDS seeded mutations (FSDP_FUZZ_ROUNDS / FSDP_FUZZ_SEED to change them)."""
    values = _global_values()
    ckpt = fuzz_dir / "ckpt"
    craft(ckpt, values, _pieces(), values={"step": 3, "cfg": {"lr": 0.1, "names": ["a", "b"]}})
    pristine = snapshot_files(ckpt)
    targets, want = _targets(values)
    outcomes: dict[str, dict[str, int]] = {}
    for i in range(ROUNDS):
        rnd = random.Random(SEED * 1_000_003 + i)
        what = _mutate(ckpt, pristine, rnd)
        label = f"seed={SEED} round={i} mutation={what}"
        try:
            outcome = _check_round(ckpt, values, targets, want, label)
            if i % 5 == 0:
                _check_cli(ckpt, label)
        except AssertionError:
            raise
        except Exception as e:  # another exception type is a failure of the contract
            raise AssertionError(f"{label}: {type(e).__name__}: {e}") from e
        outcomes.setdefault(what.split(":")[0], {}).setdefault(outcome, 0)
        outcomes[what.split(":")[0]][outcome] += 1
        _restore(ckpt, pristine)
    # the fuzzer must exercise both outcomes (else it tests nothing)
    assert sum(o.get("refused", 0) for o in outcomes.values()) > ROUNDS // 4, outcomes
    assert sum(o.get("loaded", 0) for o in outcomes.values()) > ROUNDS // 20, outcomes
    print(f"fuzz outcomes by mutation kind: {outcomes}")


@pytest.mark.parametrize("name", ["metadata.json", "COMMIT"])
def test_every_field_of_every_type(fuzz_dir, name):
    """Issue 29: every field of metadata.json (re-sealed, so each edit reaches the parser) and of COMMIT given
    every other JSON type (json_types.py): the load refuses with a named CheckpointError and changes nothing,
    never another exception; a field the engine reads (all but the caller's ``values``) is never accepted."""
    from crafted import reseal
    from json_types import type_mutations

    values = _global_values()
    ckpt = fuzz_dir / "ckpt"
    craft(ckpt, values, _pieces(), values={"step": 3})
    pristine = snapshot_files(ckpt)
    targets, want = _targets(values)
    doc = json.loads(pristine[name])
    n = 0
    for what, path, value, mutated in type_mutations(doc):
        label = f"{name} {what}"
        text = json.dumps(mutated).encode()
        if name == "metadata.json":
            reseal(ckpt, text)
        else:
            (ckpt / name).write_bytes(text)
        try:
            outcome = _check_round(ckpt, values, targets, want, label)
        except AssertionError:
            raise
        except Exception as e:  # another exception type is a failure of the contract
            raise AssertionError(f"{label}: {type(e).__name__}: {e}") from e
        if value is not None and (not path or path[0] != "values"):
            assert outcome == "refused", f"{label}: a field of the wrong type was accepted ({outcome})"
        _restore(ckpt, pristine)
        n += 1
    assert n > 10, n


def test_every_field_of_the_one_call_values_of_every_type(tmp_path):
    """The JSON values ``save_checkpoint`` stores (optimizer class and global state with an LR scheduler, RNG
    states, buffers, extra_state) with every field given every other type: ``load_checkpoint`` loads or refuses
    with a named CheckpointError, leaving the model and optimizer as they were; never another exception. A field
    of the optimizer's or the RNG's state of another type is always refused."""
    from crafted import reseal
    from json_types import type_mutations
    from paddle.distributed.fsdp import FullyShardFusion

    def build(seed: int):
        paddle.seed(seed)
        model = paddle.nn.Linear(4, 4)
        fsdp = FullyShardFusion(model)
        sched = paddle.optimizer.lr.StepDecay(0.1, step_size=1, gamma=0.5)
        opt = paddle.optimizer.AdamW(sched, parameters=model.parameters())
        model(paddle.ones([2, 4])).sum().backward()
        opt.step()
        opt.clear_grad()
        sched.step()
        return model, fsdp, opt

    model, fsdp, opt = build(1)
    ckpt = tmp_path / "ckpt"
    fsdp.save_checkpoint(str(ckpt), optimizer=opt, extra_state={"epoch": 1})
    pristine = snapshot_files(ckpt)
    md = json.loads(pristine["metadata.json"])
    model, fsdp, opt = build(2)

    def everything() -> dict:
        state = dict(fsdp.sharded_state_dict(), **fsdp.optimizer_sharded_state_dict(opt))
        return {k: np.array(getattr(v, "local_tensor", v).numpy()) for k, v in state.items()}

    before = everything()
    outcomes: dict[str, int] = {}
    for what, path, value, mutated in type_mutations(md["values"]):
        label = f"metadata.json values.{what}"
        reseal(ckpt, json.dumps(dict(md, values=mutated)).encode())
        try:
            with alarm(20, label):
                fsdp.load_checkpoint(str(ckpt), optimizer=opt)
            outcome = "loaded"
        except ck.CheckpointError:
            outcome = "refused"
        except Exception as e:  # another exception type is a failure of the contract
            raise AssertionError(f"{label}: {type(e).__name__}: {e}") from e
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        if outcome == "refused":
            after = everything()
            assert all(np.array_equal(after[k], before[k]) for k in before), (
                f"{label}: a refused load changed the model"
            )
        elif value is not None and path and path[0] in ("__fsdp__.optimizer", "__fsdp__.rng"):
            raise AssertionError(f"{label}: a field of the wrong type was accepted")
        else:
            before = everything()
        _restore(ckpt, pristine)
    assert outcomes.get("refused", 0) > 20, outcomes
