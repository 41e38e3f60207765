"""Derived weights (issue #52, format 4's ``"derived"``): a bf16 weight equal to its fp32 master weight cast is not
stored, and every door reads it back bit-exactly; anything else keeps it stored; crafted ``"derived"`` fields are
named MetadataErrors with bounded memory. In one process (the multi-rank resume and reshard: test_master_weights).

Every check compares with a checkpoint of the same state saved with ``derive_weights=False`` (format 3, every
weight stored) or with the saved tensors themselves.
"""

from __future__ import annotations

import json
import random
import tracemalloc
from pathlib import Path

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.distributed.fsdp.checkpoint as ck
import pytest
import safetensors.numpy as stnp
from crafted import reseal
from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight
from paddle.distributed.fsdp.checkpoint.errors import (
    CheckpointEnvError,
    CheckpointError,
    DerivedKeyError,
    MetadataError,
)
from paddle.distributed.fsdp.checkpoint.format import derived
from paddle.distributed.fsdp.checkpoint.format.versions import EXTENDED_VERSION, WRITE_VERSION, write_version
from paddle.distributed.fsdp.tools.cli import main as cli_main
from test_checkpoint_fuzz import _mutate_json

SHAPES = {"embed.weight": (48, 16), "blocks.0.w": (16, 32), "blocks.0.b": (32,), "head.weight": (32, 40)}
NOT_CAST = "blocks.0.b"  # its weight is NOT its master cast (nudged by one ulp): stays stored


def _bits(t) -> np.ndarray:
    t = t.local_tensor if isinstance(t, ShardedWeight) else t
    return t.view("uint16").numpy() if t.dtype in (paddle.bfloat16, paddle.float16) else t.numpy()


def _state(seed: int = 0) -> dict:
    """An FSDP-like state: each weight a flattened ShardedWeight (bf16), its master, two moments, a step."""
    rng = np.random.default_rng(seed)
    out: dict = {"step": 7}
    for key, shape in SHAPES.items():
        n = int(np.prod(shape))
        master = rng.standard_normal(n).astype(np.float32)
        bits = derived.cast_bits(master, "bfloat16")
        if key == NOT_CAST:
            bits = bits.copy()
            bits[3] ^= 1

        def sw(k, t, shape=shape, n=n):
            return ShardedWeight(k, t, shape, shape, (0,) * len(shape), True, slice(0, n))

        out[key] = sw(key, paddle.to_tensor(bits))  # (uint16 numpy -> a bfloat16 tensor)
        out[key + ".master_weight"] = sw(key + ".master_weight", paddle.to_tensor(master))
        for m in ("moment1", "moment2"):
            out[f"{key}.{m}"] = sw(f"{key}.{m}", paddle.to_tensor(rng.random(n).astype(np.float32)))
    return out


def _zeros_like(state: dict, keys=None, flat: tuple[int, int] | None = None) -> dict:
    """Targets for ``keys`` of ``state`` (all: None), zeroed; ``flat``: only elements [a, b) of each."""
    out = {}
    for k in keys or state:
        v = state[k]
        if not isinstance(v, ShardedWeight):
            out[k] = 0
            continue
        a, b = flat or (v.flattened_range.start, v.flattened_range.stop)
        t = paddle.zeros([b - a], dtype=v.local_tensor.dtype)
        out[k] = ShardedWeight(k, t, v.local_shape, v.global_shape, v.global_offset, True, slice(a, b))
    return out


def _assert_loaded(got: dict, want: dict, flat: tuple[int, int] | None = None) -> None:
    for k, v in got.items():
        if isinstance(v, ShardedWeight):
            w = _bits(want[k])
            w = w if flat is None else w[flat[0] : flat[1]]
            assert np.array_equal(_bits(v), w), f"{k} differs"
        else:
            assert v == want[k], k


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("derived")
    state = _state()
    ck.save_state_dict(state, str(root / "derived"))
    ck.save_state_dict(state, str(root / "raw"), options=ck.CheckpointOptions(derive_weights=False))
    return root, state


def _md(path: Path) -> dict:
    return json.loads((path / "metadata.json").read_bytes())


def _data_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def test_equal_weights_are_derived_and_the_rest_stored(saved):
    root, _state_ = saved
    md, raw = _md(root / "derived"), _md(root / "raw")
    want = sorted(k for k in SHAPES if k != NOT_CAST)
    assert md["version"] == EXTENDED_VERSION and sorted(md["derived"]) == want
    assert raw["version"] == WRITE_VERSION == 3 and "derived" not in raw
    for k in want:
        assert md["derived"][k] == {"from": k + ".master_weight", "dtype": "bfloat16", "rounding": "nearest-even"}
    saved_bytes = sum(2 * int(np.prod(SHAPES[k])) for k in want)
    assert 0 <= _data_bytes(root / "raw") - _data_bytes(root / "derived") - saved_bytes < 1024  # (+ their headers)
    assert NOT_CAST in ck.read_metadata(str(root / "derived")).tensors
    assert write_version({"derived": {}}) == 3 and write_version({"derived": {"a": {}}}) == 4


@pytest.mark.parametrize(
    "how",
    [
        {},
        {"atomic": True},
        {"max_host_bytes": 1},
        {"options": ck.CheckpointOptions(in_place=False)},
        {"atomic": True, "options": ck.CheckpointOptions(in_place=False)},
    ],
)
@pytest.mark.parametrize("which", ["everything", "model-only", "window", "window-with-whole-masters"])
def test_every_load_gets_the_derived_weights_bit_exact(saved, how, which):
    """A resume (masters requested alike: cast from their targets), a model-only load (masters read under an
    alias), and windows of every key (what a rank of another world size asks for), each memory-bounded, atomic
    and staged."""
    root, state = saved
    keys = list(SHAPES) + ["step"] if which == "model-only" else None
    flat = (5, 29) if which.startswith("window") else None
    got = _zeros_like(state, keys, flat)
    if which == "window-with-whole-masters":  # a master requested whole, its weight in part: read under an alias
        for k in SHAPES:
            got.update(_zeros_like(state, [k + ".master_weight"]))
    report = ck.load_state_dict(got, str(root / "derived"), **how)
    for k in list(got):
        whole_master = which == "window-with-whole-masters" and k.endswith(".master_weight")
        part = None if whole_master else flat
        _assert_loaded({k: got[k]}, state, part)
    assert sorted(report.loaded_keys) == sorted(got) and not report.missing_keys
    assert not any(k.startswith("__fsdp__.derived") for k in report.unexpected_keys)


def test_full_reads_tools_and_stock_hook_see_the_same_tensors(saved, tmp_path):
    root, state = saved
    a, b = ck.load_full_state_dict(str(root / "derived")), ck.load_full_state_dict(str(root / "raw"))
    assert sorted(a) == sorted(b)
    for k in a:
        if k != "step":
            assert a[k].dtype == b[k].dtype and np.array_equal(_bits(a[k]), _bits(b[k])), k
    one = ck.load_full_state_dict(str(root / "derived"), keys=["head.weight"])
    assert np.array_equal(_bits(one["head.weight"]).reshape(-1), _bits(state["head.weight"]))
    # to-hf: the same files from both; diff: identical; verify: sound, naming the derived weights
    for name in ("derived", "raw"):
        assert cli_main(["to-hf", str(root / name), str(tmp_path / f"hf_{name}"), "--dtype", "float32"]) == 0
    hf_a = stnp.load_file(str(next((tmp_path / "hf_derived").glob("*.safetensors"))))
    hf_b = stnp.load_file(str(next((tmp_path / "hf_raw").glob("*.safetensors"))))
    assert sorted(hf_a) == sorted(hf_b) == sorted(SHAPES)
    assert all(np.array_equal(hf_a[k], hf_b[k]) for k in hf_a)
    assert cli_main(["diff", str(root / "derived"), str(root / "raw")]) == 0
    assert not ck.verify_checkpoint(str(root / "derived"))
    # the stock hook's own reader of our checkpoints (aoa_config): a derived weight renamed and cast
    got = {"renamed": paddle.zeros(list(SHAPES["head.weight"]), dtype="float32")}
    dist.load_state_dict(
        got, str(root / "derived"), aoa_config={"aoa_statements": ['head.weight -> renamed, dtype="float32"']}
    )
    want = (_bits(state["head.weight"]).astype(np.uint32) << 16).view(np.float32).reshape(SHAPES["head.weight"])
    assert np.array_equal(got["renamed"].numpy(), want)


def test_inspect_names_a_derived_weights_state_optimizer_state(saved):
    """``inspect`` classifies keys as the writer saw them: the master and moments of a derived (not stored)
    weight are its optimizer state, not model weights of their own (they were, the weight being absent)."""
    from paddle.distributed.fsdp.tools.inspect_cmd import inspect_checkpoint

    root, _state_ = saved
    for name in ("derived", "raw"):
        roles = {k: v["role"] for k, v in inspect_checkpoint(str(root / name))["tensors"].items()}
        for key in SHAPES:
            for state in ("master_weight", "moment1", "moment2"):
                assert roles[f"{key}.{state}"] == "optimizer", (name, key, state)


def test_derive_off_by_option_and_environment(tmp_path, monkeypatch):
    state = _state(1)
    monkeypatch.setenv("PADDLE_FSDP_CKPT_DERIVE_WEIGHTS", "off")
    ck.save_state_dict(state, str(tmp_path / "env_off"))
    assert _md(tmp_path / "env_off")["version"] == 3
    monkeypatch.setenv("PADDLE_FSDP_CKPT_DERIVE_WEIGHTS", "maybe")
    with pytest.raises(CheckpointEnvError, match="PADDLE_FSDP_CKPT_DERIVE_WEIGHTS"):
        ck.save_state_dict(state, str(tmp_path / "bad"))
    monkeypatch.setenv("PADDLE_FSDP_CKPT_DERIVE_WEIGHTS", "YES")
    ck.save_state_dict(state, str(tmp_path / "env_on"))
    assert _md(tmp_path / "env_on")["version"] == 4
    no_masters = {k: v for k, v in state.items() if not k.endswith(".master_weight")}
    ck.save_state_dict(no_masters, str(tmp_path / "plain"))
    assert _md(tmp_path / "plain")["version"] == 3  # nothing derived: format 3, readable by older builds


def test_stock_door_stores_every_weight_unless_asked(tmp_path, monkeypatch):
    """``paddle.distributed.save_state_dict`` (stock's door) writes every tensor it is given, as stock does: a
    stock reader without the fork must find each weight. Derived only when asked (options or the switch)."""
    import paddle.distributed as dist

    state = _state(2)
    monkeypatch.delenv("PADDLE_FSDP_CKPT_DERIVE_WEIGHTS", raising=False)
    dist.save_state_dict(state, str(tmp_path / "stock"))
    md = _md(tmp_path / "stock")
    assert md["version"] == 3 and "derived" not in md
    dist.save_state_dict(state, str(tmp_path / "asked"), options=ck.CheckpointOptions(derive_weights=True))
    asked = _md(tmp_path / "asked")
    assert asked["version"] == 4 and asked["derived"]
    monkeypatch.setenv("PADDLE_FSDP_CKPT_DERIVE_WEIGHTS", "on")
    dist.save_state_dict(state, str(tmp_path / "switch"))
    assert _md(tmp_path / "switch")["version"] == 4


def test_a_failed_load_leaves_derived_targets_untouched(saved, tmp_path):
    """The master's bytes damaged: the load fails with a named error, and the derived weight (cast only after
    the load committed on every rank) keeps what it held."""
    import shutil

    root, state = saved
    bad = tmp_path / "bad"
    shutil.copytree(root / "derived", bad)
    data = bad / "0_0.safetensors"
    md = ck.read_metadata(str(bad))
    piece = md.tensors["head.weight.master_weight"].pieces[0]
    raw = bytearray(data.read_bytes())
    raw[piece.offset + piece.nbytes // 2] ^= 0xFF  # a master weight's byte: what a derived weight is read from
    data.write_bytes(bytes(raw))
    got = _zeros_like(state, list(SHAPES))
    for k in got:
        got[k].local_tensor.set_value(paddle.full(got[k].local_tensor.shape, 1.5, "float32").astype("bfloat16"))
    with pytest.raises(CheckpointError):
        ck.load_full_state_dict(str(bad))  # (every byte: the damage is found)
    with pytest.raises(CheckpointError):
        ck.load_state_dict(got, str(bad), atomic=True)
    assert all((_bits(v) == 0x3FC0).all() for v in got.values()), "a target changed by a failed load"


CRAFTED = {
    "unknown source": {"embed.weight": {"from": "nope", "dtype": "bfloat16", "rounding": "nearest-even"}},
    "source not float32": {"x": {"from": NOT_CAST, "dtype": "bfloat16", "rounding": "nearest-even"}},
    "derived as float32": {"x": {"from": "head.weight.moment1", "dtype": "float32", "rounding": "nearest-even"}},
    "key also stored": {
        NOT_CAST: {"from": "blocks.0.b.master_weight", "dtype": "bfloat16", "rounding": "nearest-even"}
    },
    "key also a value": {"step": {"from": "blocks.0.b.master_weight", "dtype": "bfloat16", "rounding": "nearest-even"}},
    "cycle": {
        "p": {"from": "q", "dtype": "bfloat16", "rounding": "nearest-even"},
        "q": {"from": "p", "dtype": "bfloat16", "rounding": "nearest-even"},
    },
    "chain": {
        "p": {"from": "embed.weight", "dtype": "bfloat16", "rounding": "nearest-even"},
    },
    "one source twice": {
        "p": {"from": "head.weight.moment1", "dtype": "bfloat16", "rounding": "nearest-even"},
        "q": {"from": "head.weight.moment1", "dtype": "bfloat16", "rounding": "nearest-even"},
    },
    "huge shape": {
        "p": {"from": "head.weight.moment1", "dtype": "bfloat16", "rounding": "nearest-even", "shape": [1 << 40]}
    },
    "other rounding": {"p": {"from": "head.weight.moment1", "dtype": "bfloat16", "rounding": "toward-zero"}},
    "not an object": ["embed.weight"],
    "entry not an object": {"p": "head.weight.master_weight"},
    "2000 entries": {f"k{i}": {"from": "x", "dtype": "bfloat16", "rounding": "nearest-even"} for i in range(2000)},
}


def _crafted_copy(root: Path, tmp_path: Path, field) -> Path:
    import shutil

    path = tmp_path / "crafted"
    shutil.copytree(root / "derived", path)
    md = _md(path)
    md["derived"] = field
    reseal(path, json.dumps(md).encode())
    return path


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_crafted_derived_fields_are_named_metadata_errors(saved, tmp_path, case):
    root, state = saved
    path = _crafted_copy(root, tmp_path, CRAFTED[case])
    tracemalloc.start()
    try:
        with pytest.raises(MetadataError, match="derived"):
            ck.read_metadata(str(path))
        _cur, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * len(json.dumps(CRAFTED[case])) + (8 << 20), peak  # bounded by the JSON read, nothing more
    with pytest.raises(MetadataError):
        ck.load_full_state_dict(str(path))
    with pytest.raises(MetadataError):
        ck.load_state_dict(_zeros_like(state, list(SHAPES)), str(path))
    assert any("derived" in p for p in ck.verify_checkpoint(str(path)))


@pytest.mark.parametrize("seed", [1, 2])
def test_seeded_mutations_of_the_derived_field(saved, tmp_path, seed):
    """Each round one structural edit of ``"derived"``: a load returns exactly the saved state or raises a named
    CheckpointError (an edit may declare a consistent derivation, then what it loads is not compared)."""
    root, state = saved
    rnd = random.Random(seed)
    pristine = _md(root / "derived")["derived"]
    for i in range(40):
        field = json.loads(json.dumps(pristine))
        mutated = _mutate_json(field, rnd)
        path = tmp_path / f"r{i}"
        import shutil

        shutil.copytree(root / "derived", path)
        md_bytes = (path / "metadata.json").read_bytes()
        text = md_bytes.decode()
        cut = text.index('"derived":') + len('"derived":')
        end = cut + len(json.dumps(pristine, separators=(",", ":")))
        reseal(path, (text[:cut] + mutated.decode() + text[end:]).encode())
        try:
            got = _zeros_like(state, list(SHAPES))
            ck.load_state_dict(got, str(path))
        except CheckpointError:
            continue
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"seed {seed} round {i}: {type(e).__name__}: {e} for {mutated[:300]!r}") from e
        finally:
            shutil.rmtree(path)


def test_a_derived_key_without_its_master_is_named():
    md = ck.format.metadata.CheckpointMetadata("id", 1)
    md.derived = {"w": derived.Derived("w", "w.master_weight", "bfloat16")}
    from paddle.distributed.fsdp.checkpoint.load.derive import source_of

    with pytest.raises(DerivedKeyError, match="w.master_weight"):
        source_of(md, "w")


def test_cast_is_round_to_nearest_even_as_paddle_casts():
    rng = np.random.default_rng(3)
    x = np.concatenate(
        [
            rng.standard_normal(10000).astype(np.float32) * 10.0 ** rng.integers(-30, 30, 10000),
            [0.0, -0.0, np.inf, -np.inf],
        ]
    ).astype(np.float32)
    # halfway cases: ties go to the even neighbour
    ties = (np.arange(0, 64, dtype=np.uint32) << 16 | 0x8000).view(np.float32) + np.float32(0)
    x = np.concatenate([x, ties]).astype(np.float32)
    ours = derived.cast_bits(x, "bfloat16")
    theirs = paddle.to_tensor(x).astype("bfloat16").view("uint16").numpy()
    assert np.array_equal(ours, theirs)
    assert np.array_equal(derived.cast_bits(x, "float16"), x.astype(np.float16).view(np.uint16))


def test_the_bytes_benchmark_measures_two_bytes_a_parameter_less(tmp_path):
    """tools/ckpt_bench/bytes.py on a small model: bf16 + master weights 14 -> 12 bytes a parameter, fp32 12 in
    both modes (nothing to derive), every mode of its MODES table run."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))
    from ckpt_bench import bytes as bench

    args = bench.parse_args(["--vocab", "512", "--dim", "64", "--blocks", "1", "--repeats", "1"])
    got = bench.run(args)
    assert set(got) == {f"{k}/{m}" for k in ("fp32", "bf16+master") for m in bench.MODES}
    raw, default = got["bf16+master/raw"], got["bf16+master/default"]
    assert abs(raw["total"] - default["total"] - 2.0) < 0.01 and default["weights"] == 0 and default["format"] == 4
    assert raw["weights"] == 2.0 and raw["master"] == 4.0 and raw["moments"] == 8.0
    assert abs(got["fp32/raw"]["total"] - got["fp32/default"]["total"]) < 1e-3  # (the index's ids and times vary)
    assert got["fp32/default"]["format"] == 3


@pytest.fixture(scope="module")
def big_saved(tmp_path_factory):
    """One derived weight of 4M elements (its master 16 MiB), saved derived."""
    n = 1 << 22
    master = np.random.default_rng(5).standard_normal(n).astype(np.float32)
    state = {
        "w": ShardedWeight(
            "w", paddle.to_tensor(derived.cast_bits(master, "bfloat16")), (n,), (n,), (0,), True, slice(0, n)
        ),
        "w.master_weight": ShardedWeight(
            "w.master_weight", paddle.to_tensor(master), (n,), (n,), (0,), True, slice(0, n)
        ),
    }
    path = tmp_path_factory.mktemp("big") / "ckpt"
    ck.save_state_dict(state, str(path))
    assert "w" in ck.read_metadata(str(path)).derived
    return path, state


def _record_host_buffers(monkeypatch) -> list[int]:
    """The bytes of every host buffer the engine allocates from now on (``device.host_empty``), in order."""
    from paddle.distributed.fsdp.devices import device

    sizes: list[int] = []
    real_host_empty = device.host_empty

    def recording_host_empty(shape, dtype, pinned=True):
        t = real_host_empty(shape, dtype, pinned)
        sizes.append(int(np.prod(shape)) * t.element_size())
        return t

    monkeypatch.setattr(device, "host_empty", recording_host_empty)
    return sizes


@pytest.mark.parametrize("on_device", [False, True])
def test_a_model_only_load_derives_within_the_host_budget(big_saved, monkeypatch, on_device):
    """A derived weight loaded without its master (model-only) under ``max_host_bytes``: its master is read and
    cast by windows, so no host buffer is larger than the budget and the engine's peak stays within it (a whole
    float32 temporary of the weight was 16 MiB here, outside the account); device weights (fake-device mode) go
    through a staging window of their own dtype."""
    from paddle.distributed.fsdp.devices import device

    path, state = big_saved
    budget = 2 << 20
    before = device.options()
    if on_device:
        device.set_options(device.DeviceOptions(fake_device=True, emulate_gpu_collectives=True))
    try:
        got = _zeros_like(state, ["w"])
        sizes = _record_host_buffers(monkeypatch)
        report = ck.load_state_dict(got, str(path), max_host_bytes=budget)
    finally:
        device.set_options(before)
    assert np.array_equal(_bits(got["w"]), _bits(state["w"]))
    assert report.loaded_keys == ["w"] and report.host_budget == budget
    assert max(sizes, default=0) <= budget, f"a host buffer of {max(sizes)} bytes for a budget of {budget}"
    assert 0 < report.peak_host_bytes <= budget


def test_a_resume_of_device_tensors_casts_the_masters_by_windows(big_saved, monkeypatch):
    """Weights and masters both requested (a resume) as device tensors (fake-device mode): each master's target
    is cast into its weight after the load a window at a time, so no host buffer holds a whole master (16 MiB
    here) and the weight is bit-exact."""
    from paddle.distributed.fsdp.devices import device

    path, state = big_saved
    budget = 2 << 20
    before = device.options()
    device.set_options(device.DeviceOptions(fake_device=True, emulate_gpu_collectives=True))
    try:
        got = _zeros_like(state)
        sizes = _record_host_buffers(monkeypatch)
        report = ck.load_state_dict(got, str(path), max_host_bytes=budget)
    finally:
        device.set_options(before)
    _assert_loaded(got, state)
    assert sorted(report.loaded_keys) == ["w", "w.master_weight"]
    assert max(sizes, default=0) <= budget, f"a host buffer of {max(sizes)} bytes for a budget of {budget}"


def test_a_save_of_device_weights_checks_them_on_the_device(saved, tmp_path, monkeypatch):
    """Device weights (fake-device mode) are checked where they are (save/derive_on_device.py): the check copies
    no weight or master to the host (``raw_view``, its one way to host bytes, is not called for them), and the
    save derives the same weights as a save of host tensors. A weight whose master holds a NaN is the one left to
    the host check: derived when it is the load's NaN cast, stored when it is paddle's."""
    from paddle.distributed.fsdp.checkpoint.save import derive
    from paddle.distributed.fsdp.devices import device

    root, state = saved
    copied: list[int] = []
    real_raw_view = derive.raw_view

    def recording_raw_view(t, *args, **kwargs):
        copied.append(int(np.prod(t.shape)))
        return real_raw_view(t, *args, **kwargs)

    monkeypatch.setattr(derive, "raw_view", recording_raw_view)
    nan_master = np.array([1.0, np.nan, -np.nan, 3.0, 0.0], np.float32)
    with_nan = dict(state)
    for key, weight in (("nan.ours", derived.cast_bits(nan_master, "bfloat16")), ("nan.paddle", None)):
        n = nan_master.size
        w = paddle.to_tensor(weight) if weight is not None else paddle.to_tensor(nan_master).astype("bfloat16")
        with_nan[key] = ShardedWeight(key, w, (n,), (n,), (0,), True, slice(0, n))
        mkey = key + ".master_weight"
        with_nan[mkey] = ShardedWeight(mkey, paddle.to_tensor(nan_master), (n,), (n,), (0,), True, slice(0, n))
    before = device.options()
    device.set_options(device.DeviceOptions(fake_device=True, emulate_gpu_collectives=True))
    try:
        ck.save_state_dict(state, str(tmp_path / "device"))
        assert copied == []
        ck.save_state_dict(with_nan, str(tmp_path / "nan"))
    finally:
        device.set_options(before)
    assert sorted(_md(tmp_path / "device")["derived"]) == sorted(_md(root / "derived")["derived"])
    assert sorted(_md(tmp_path / "device")["derived"]) == sorted(k for k in SHAPES if k != NOT_CAST)
    assert sorted(copied) == [5] * 4  # (the two NaN weights and their masters, nothing else)
    assert sorted(_md(tmp_path / "nan")["derived"]) == sorted([*(k for k in SHAPES if k != NOT_CAST), "nan.ours"])
    got = _zeros_like(with_nan, ["nan.ours", "nan.paddle"])
    ck.load_state_dict(got, str(tmp_path / "nan"))
    _assert_loaded(got, with_nan)
