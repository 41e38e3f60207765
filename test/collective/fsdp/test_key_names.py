"""Seeded fuzz of state-dict key names across every format a save writes (issue 29).

Formats: the engine's checkpoint (safetensors data files + metadata.json + stock's ``0.metadata`` index), reached
through ``ck.save_state_dict`` and through the stock dispatch with ``safetensors=True``; stock's own ``.distcp``
pickles (the dispatch's stock route). Keys: unicode of every plane, empty, very long (across the reader's bound),
reserved names and prefixes, lone surrogates, separators, nested dicts whose flat names collide.

The contract for every key set: either the save is refused with UnrepresentableKeyError naming the key before
anything is written (no directory, no staging), or every reader gives back exactly what was saved: the engine's
load, ``verify_checkpoint``, the safetensors library on each data file, and stock paddle's own loader (through
``0.metadata``). Keys the formats are known to reserve or not to represent must be refused.
"""

from __future__ import annotations

import os
import random

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.distributed.fsdp.checkpoint as ck
import pytest
from safetensors import safe_open

SEED = int(os.environ.get("FSDP_FUZZ_SEED", "29"))
ROUNDS = 40

MUST_REFUSE = ["__metadata__", "\ud800", "a\udfffb", "x" * ((1 << 16) + 1)]
PIECES = [
    "",
    "w",
    "layer.0.weight",
    "__metadata__",
    "__metadata",
    "__fsdp__.",
    "__fsdp__.rng",
    "é",
    "✓",
    "😀",
    "\u200b",
    "\u202e",
    "a\u0301",
    "\x00",
    "\n",
    " ",
    "/",
    "..",
    ".",
    "\\",
    '"',
    "\ud800",
    "\udfff",
    "中文",
]


def _random_key(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.1:
        return rng.choice(MUST_REFUSE)
    if roll < 0.2:  # very long: on both sides of the readers' bound
        return rng.choice("ab😀") * rng.choice([1000, (1 << 16) - 1, 1 << 16, (1 << 16) + 1, 70000])
    if roll < 0.3:
        return "".join(chr(rng.randrange(0x20, 0x110000)) for _ in range(rng.randrange(1, 12)))
    return "".join(rng.choice(PIECES) for _ in range(rng.randrange(0, 4)))


def _state(keys: list[str], rng: random.Random) -> dict:
    return {k: paddle.to_tensor(np.full([3], rng.random(), dtype=np.float32) + i) for i, k in enumerate(keys)}


def _bits(t) -> bytes:
    return np.asarray(t.numpy()).tobytes()


def _assert_refused(save, path, state: dict, must: list[str]) -> bool:
    """Run ``save``; True when it was refused (by name, nothing written); a key in ``must`` has to be refused."""
    try:
        save(state, str(path))
    except ck.UnrepresentableKeyError as e:
        assert any(repr(k)[:60] in str(e) for k in state), f"the error names no key of the state: {e}"
        left = [p.name for p in path.parent.iterdir() if p.name.startswith(path.name)]
        assert not left, f"a refused save wrote {left}"
        return True
    assert not must, f"keys {[k[:40] for k in must]!r} were saved, but the format cannot hold them"
    return False


def _check_engine_checkpoint(path, state: dict) -> None:
    from paddle.distributed.flex_checkpoint.dcp.load_state_dict import load_state_dict as stock_load

    assert ck.verify_checkpoint(str(path)) == []
    got = {k: paddle.zeros([3]) for k in state}
    ck.load_state_dict(got, str(path))
    assert all(_bits(got[k]) == _bits(v) for k, v in state.items()), "the engine loaded other values"
    names: dict[str, bytes] = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), "np") as st:
                names.update({n: st.get_tensor(n).tobytes() for n in st.keys()})
    assert names == {k: _bits(v) for k, v in state.items()}, "the safetensors library reads other tensors"
    got = {k: paddle.zeros([3]) for k in state}
    stock_load(got, str(path), safetensors=True)  # stock paddle's own loader, through 0.metadata
    assert all(_bits(got[k]) == _bits(v) for k, v in state.items()), "stock paddle loaded other values"


FORMATS = {
    "engine": lambda sd, p: ck.save_state_dict(sd, p),
    "dispatch_safetensors": lambda sd, p: dist.save_state_dict(sd, p, safetensors=True),
    "stock_distcp": lambda sd, p: dist.save_state_dict(sd, p),
}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_key_names_round_trip_exactly_or_are_refused_by_name(tmp_path, fmt):
    rng = random.Random(f"{SEED}-{fmt}")
    refused = saved = 0
    for i in range(ROUNDS):
        keys = list(dict.fromkeys(_random_key(rng) for _ in range(rng.randrange(1, 4))))
        state = _state(keys, rng)
        must = [k for k in keys if k in MUST_REFUSE or len(k) > 1 << 16]
        if fmt == "stock_distcp":  # pickles hold any str: only the safetensors-only rules do not apply
            must = []
        path = tmp_path / f"c{i}"
        what = f"seed {SEED} round {i} ({fmt}), keys {[k[:30] for k in keys]!r}"
        try:
            if _assert_refused(FORMATS[fmt], path, state, must):
                refused += 1
                continue
            if fmt == "stock_distcp":
                got = {k: paddle.zeros([3]) for k in state}
                dist.load_state_dict(got, str(path))
                assert all(_bits(got[k]) == _bits(v) for k, v in state.items()), "loaded other values"
            else:
                _check_engine_checkpoint(path, state)
            saved += 1
        except AssertionError as e:
            raise AssertionError(f"{what}: {e}") from None
    assert saved > ROUNDS // 3 and (refused > 0 or fmt == "stock_distcp"), (saved, refused)


@pytest.mark.parametrize("safetensors", [False, True], ids=["stock_distcp", "safetensors"])
def test_nested_keys_with_one_flat_name_are_refused_not_overwritten(tmp_path, safetensors):
    """Nested dicts are stored under ``outer.inner`` names (stock's layout): ``{"a": {"b": x}, "a.b": y}`` would
    keep one of the two tensors silently (once: the load left the nested one untouched)."""
    state = {"a": {"b": paddle.ones([2])}, "a.b": paddle.zeros([2])}
    with pytest.raises(ck.UnrepresentableKeyError, match="'a.b'.*flat name"):
        dist.save_state_dict(state, str(tmp_path / "c"), safetensors=safetensors)
    assert not list(tmp_path.iterdir())
    state = {"a": {"b": paddle.ones([2]), "c": {"d": paddle.full([2], 3.0)}}, "a.x": paddle.zeros([2])}
    dist.save_state_dict(state, str(tmp_path / "ok"), safetensors=safetensors)
    got = {"a": {"b": paddle.zeros([2]), "c": {"d": paddle.zeros([2])}}, "a.x": paddle.ones([2])}
    dist.load_state_dict(got, str(tmp_path / "ok"), safetensors=safetensors)
    assert got["a"]["b"].numpy().tolist() == [1, 1] and got["a"]["c"]["d"].numpy().tolist() == [3, 3]
    assert got["a.x"].numpy().tolist() == [0, 0]


def test_value_keys_are_checked_too(tmp_path):
    """A JSON value's key lands in metadata.json: one that is not valid Unicode is refused; ``__metadata__`` is a
    fine value key (it never reaches a safetensors header) and comes back."""
    with pytest.raises(ck.UnrepresentableKeyError, match="not valid Unicode"):
        ck.save_state_dict({"w": paddle.ones([2]), "\ud800": 1}, str(tmp_path / "c"))
    assert not list(tmp_path.iterdir())
    ck.save_state_dict({"w": paddle.ones([2]), "__metadata__": {"step": 3}}, str(tmp_path / "ok"))
    got = {"w": paddle.zeros([2]), "__metadata__": None}
    ck.load_state_dict(got, str(tmp_path / "ok"))
    assert got["__metadata__"] == {"step": 3}
    assert ck.verify_checkpoint(str(tmp_path / "ok")) == []
