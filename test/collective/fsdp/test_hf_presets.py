"""to-hf / from-hf presets and ``diff``, proven by the consumers: PaddleFormers' own code and, with torch, transformers.

Without torch (what CI runs):
* each unfused preset's export equals PaddleFormers 0.4.1's own ``save_pretrained(save_to_hf=True)`` tensor by
  tensor, byte for byte (Qwen2, Qwen3, Qwen3-MoE); Llama, whose ``save_to_hf`` keeps ``llama.*`` names and
  ``[in, out]`` weights, against PaddleFormers' own declared HF name mapping (``_get_name_mappings``);
* merging an unfused export into a FUSED PaddleFormers model (``from-hf --preset X-fused``) gives the unfused
  model's logits: PaddleFormers' fused forward is the judge of the fused order; splitting that fused checkpoint
  again (``to-hf --preset X-fused``) gives back the unfused export byte for byte;
* incomplete or inconsistent conversions are refused with exit 2 naming the keys, and nothing is written;
* ``diff`` across world sizes (1 vs 2 ranks), bounded windows, named differences.
With torch importable (``pip install torch==2.13.0``; skipped otherwise, saying so): every preset's export loads in
transformers with the paddle logits (max abs <= 1e-4), and transformers-saved models imported with ``from-hf``
give transformers' logits on 1, 2 and 3 FSDP ranks.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pf_models
import pytest
import safetensors.numpy as stnp
from _results import assert_case_ok
from launch_util import run_launch
from paddle.distributed.fsdp.checkpoint import load_full_state_dict
from paddle.distributed.fsdp.tools.cli import main as cli_main

TEST_DIR = Path(__file__).resolve().parent
WORKER = TEST_DIR / "workers" / "hf_presets.py"
TORCH_WORKER = TEST_DIR / "workers" / "hf_transformers.py"
HAVE_TORCH = importlib.util.find_spec("torch") is not None
needs_torch = pytest.mark.skipif(
    not HAVE_TORCH, reason="torch is not installed: transformers cannot run (pip install torch==2.13.0 to run this)"
)
LOGITS_ATOL = 1e-4


def cli(capsys, *args) -> SimpleNamespace:
    capsys.readouterr()
    rc = cli_main([str(a) for a in args])
    out = capsys.readouterr()
    return SimpleNamespace(rc=rc, out=out.out, err=out.err)


def read_hf(directory: Path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(stnp.load_file(str(f)))
    return out


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Per preset: its HF config, a seeded PaddleFormers model, its single-process checkpoint and logits."""
    root = tmp_path_factory.mktemp("presets")
    out = {}
    for preset in pf_models.PRESET_NAMES:
        family, fused = pf_models.family_of(preset)
        d = root / preset
        d.mkdir()
        config = pf_models.write_hf_config(family, d / "config.json")
        cfg = json.loads(config.read_text())
        model = pf_models.paddle_model(family, fused, cfg, seed=1)
        ids = pf_models.input_ids(cfg["vocab_size"])
        np.save(d / "ids.npy", ids)
        pf_models.save_single_process(model, d / "ckpt")
        out[preset] = SimpleNamespace(
            dir=d,
            config=config,
            cfg=cfg,
            model=model,
            ckpt=d / "ckpt",
            ids=d / "ids.npy",
            logits=pf_models.paddle_logits(model, ids),
            state={k: v.numpy() for k, v in model.state_dict().items()},
        )
    return out


@pytest.fixture(scope="module")
def exports(models, tmp_path_factory):
    """Every preset's to-hf export of its own checkpoint (small shards: splits land in several files)."""
    root = tmp_path_factory.mktemp("exports")
    out = {}
    for preset, m in models.items():
        dst = root / preset
        rc = cli_main(
            [
                "to-hf",
                str(m.ckpt),
                str(dst),
                "--preset",
                preset,
                "--config",
                str(m.config),
                "--max-shard-size",
                "20KB",
            ]
        )
        assert rc == 0, preset
        out[preset] = dst
    return out


# ------------------------------------------------------------------------------------------------ no torch


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3-moe"])
def test_unfused_export_equals_paddleformers_save_to_hf(models, exports, family, tmp_path):
    m = models[family]
    m.model.save_pretrained(str(tmp_path / "pf"), save_to_hf=True)
    theirs = read_hf(tmp_path / "pf")
    ours = read_hf(exports[family])
    assert sorted(ours) == sorted(theirs), sorted(set(ours) ^ set(theirs))
    for name, value in theirs.items():
        assert ours[name].dtype == value.dtype and ours[name].shape == value.shape, name
        assert ours[name].tobytes() == value.tobytes(), name
    assert json.loads((exports[family] / "config.json").read_text()) == m.cfg


def test_llama_export_equals_paddleformers_declared_hf_mapping(models, exports):
    """PaddleFormers' Llama ``save_to_hf`` keeps ``llama.*`` names and ``[in, out]`` weights (not loadable by
    transformers), so the reference is its own HF name mapping: HF name, paddle name, transpose or not."""
    import paddleformers.transformers as pft

    m = models["llama"]
    config = copy.deepcopy(m.model.config)
    config.architectures = ["LlamaForCausalLM"]
    mappings = pft.LlamaForCausalLM._get_name_mappings(config)
    ours = read_hf(exports["llama"])
    expected = {}
    for mp in mappings:
        if mp.target_name.endswith("rotary_emb.inv_freq"):  # listed, but not a parameter of this model
            assert mp.target_name not in m.state
            continue
        value = m.state[mp.target_name]
        expected[mp.source_name] = np.ascontiguousarray(value.T) if mp.action == "transpose" else value
    assert sorted(ours) == sorted(expected), sorted(set(ours) ^ set(expected))
    for name, value in expected.items():
        assert ours[name].tobytes() == value.tobytes(), name


@pytest.mark.parametrize("family", list(pf_models.FAMILIES))
def test_merge_into_fused_model_gives_unfused_logits(models, exports, family, tmp_path, capsys):
    """from-hf --preset X-fused of the unfused export, loaded into a FUSED PaddleFormers model: same logits.
    Then to-hf --preset X-fused of that fused checkpoint gives back the unfused export, byte for byte."""
    m = models[family]
    res = cli(capsys, "from-hf", exports[family], tmp_path / "fused_ckpt", "--preset", f"{family}-fused")
    assert res.rc == 0, res.err
    assert "merged into fused keys" in res.out
    fused = pf_models.paddle_model(family, True, m.cfg, seed=42)
    before = pf_models.paddle_logits(fused, np.load(m.ids))
    assert np.abs(before - m.logits).max() > 1e-2  # the check below can fail
    full = load_full_state_dict(str(tmp_path / "fused_ckpt"))
    assert sorted(full) == sorted(fused.state_dict()), sorted(set(full) ^ set(fused.state_dict()))
    missing, unexpected = fused.set_state_dict(full)
    assert not missing and not unexpected
    after = pf_models.paddle_logits(fused, np.load(m.ids))
    np.testing.assert_allclose(after, m.logits, rtol=0, atol=1e-5)

    res = cli(
        capsys,
        "to-hf",
        tmp_path / "fused_ckpt",
        tmp_path / "again",
        "--preset",
        f"{family}-fused",
        "--config",
        m.config,
    )
    assert res.rc == 0, res.err
    again, first = read_hf(tmp_path / "again"), read_hf(exports[family])
    assert sorted(again) == sorted(first)
    for name in first:
        assert again[name].tobytes() == first[name].tobytes(), name


@pytest.mark.parametrize("preset", pf_models.PRESET_NAMES)
def test_export_import_round_trip_is_bit_exact(models, exports, preset, tmp_path, capsys):
    """from-hf of a preset export (the preset is recorded: no flag needed) == the original checkpoint (diff)."""
    res = cli(capsys, "from-hf", exports[preset], tmp_path / "back")
    assert res.rc == 0, res.err
    res = cli(capsys, "diff", models[preset].ckpt, tmp_path / "back", "--json")
    assert res.rc == 0, res.out
    report = json.loads(res.out)
    assert report["summary"]["keys"] == len(models[preset].state)
    assert report["summary"].get("equal") == len(models[preset].state)


def test_split_layout_is_interleaved_per_kv_head(models, exports):
    """The fused qkv columns of kv head h are [q heads of group h | k head h | v head h] (PaddleFormers' forward)."""
    m = models["qwen3-fused"]
    hf = read_hf(exports["qwen3-fused"])
    qkv = m.state["model.layers.0.self_attn.qkv_proj.weight"]  # [hidden, (groups + 2) * kv * head_dim]
    d, kv = m.cfg["head_dim"], m.cfg["num_key_value_heads"]
    g = m.cfg["num_attention_heads"] // kv
    q = hf["model.layers.0.self_attn.q_proj.weight"]
    k = hf["model.layers.0.self_attn.k_proj.weight"]
    v = hf["model.layers.0.self_attn.v_proj.weight"]
    for h in range(kv):
        base = h * (g + 2) * d
        assert np.array_equal(qkv[:, base : base + g * d].T, q[h * g * d : (h + 1) * g * d])
        assert np.array_equal(qkv[:, base + g * d : base + (g + 1) * d].T, k[h * d : (h + 1) * d])
        assert np.array_equal(qkv[:, base + (g + 1) * d : base + (g + 2) * d].T, v[h * d : (h + 1) * d])
    up_gate = m.state["model.layers.0.mlp.up_gate_proj.weight"]
    inter = m.cfg["intermediate_size"]
    assert np.array_equal(up_gate[:, :inter].T, hf["model.layers.0.mlp.gate_proj.weight"])
    assert np.array_equal(up_gate[:, inter:].T, hf["model.layers.0.mlp.up_proj.weight"])


# ------------------------------------------------------------------------------------------------ refusals


def _refused(res, *needles) -> None:
    assert res.rc == 2, (res.rc, res.out, res.err)
    lines = [line for line in res.err.splitlines() if line.startswith("paddle-fsdp-ckpt")]
    assert len(lines) == 1, res.err
    for n in needles:
        assert n in lines[0], (n, lines[0])


def test_fused_checkpoint_with_unfused_preset_is_refused(models, tmp_path, capsys):
    m = models["qwen3-fused"]
    out = tmp_path / "out"
    res = cli(capsys, "to-hf", m.ckpt, out, "--preset", "qwen3", "--config", m.config)
    _refused(
        res,
        "'model.layers.0.self_attn.qkv_proj.weight'",
        "'model.layers.1.mlp.up_gate_proj.weight'",
        "missing",
        "'model.layers.0.self_attn.q_proj.weight'",
        "preset qwen3-fused maps them",
    )
    assert not out.exists() and not list(tmp_path.glob("out.tmp-*"))
    res = cli(capsys, "to-hf", m.ckpt, out, "--preset", "qwen3", "--config", m.config, "--allow-unmapped")
    assert res.rc == 0, res.err
    names = set(read_hf(out))
    assert "model.embed_tokens.weight" in names and not any("q_proj" in n or "qkv" in n for n in names)


# names kept, every Linear turned (the MoE router too)
PLAIN_RULES = {
    "transpose": ["\\.(q|k|v|o|gate|up|down|qkv|up_gate|gate_up_fused)_proj\\.weight$", "\\.mlp\\.gate\\.weight$"]
}


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "qwen3-moe", "llama"])
def test_rules_export_is_checked_against_the_config(models, exports, family, tmp_path, capsys):
    """Issue 29: ``to-hf --rules plain.json --config`` on a fused checkpoint wrote an export without q/k/v_proj and
    gate/up_proj and exited 0. With --config, a rules export is checked as a preset's is: a complete one (rules
    equal to the preset's) is written and equals the preset's export; a fused one is refused, naming the missing
    parameters and the names outside the architecture; an untransposed one is refused for its shapes."""
    rules = tmp_path / "plain.json"
    rules.write_text(json.dumps(PLAIN_RULES))
    fused, plain = models[f"{family}-fused"], models[family]
    if family != "llama":  # llama's checkpoint names (llama.*) are not its HF names: no plain rules for it
        res = cli(capsys, "to-hf", plain.ckpt, tmp_path / "ok", "--rules", rules, "--config", plain.config)
        assert res.rc == 0, res.err
        want, got = read_hf(exports[family]), read_hf(tmp_path / "ok")
        assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)
        res = cli(capsys, "to-hf", plain.ckpt, tmp_path / "flat", "--config", plain.config)  # no transposes
        _refused(res, "shape(s) do not match the config", "_proj.weight' has shape", "--allow-unmapped")
        assert not (tmp_path / "flat").exists()
    out = tmp_path / "out"
    res = cli(capsys, "to-hf", fused.ckpt, out, "--rules", rules, "--config", fused.config)
    _refused(res, "missing from the export", "'model.layers.0.self_attn.q_proj.weight'", "--allow-unmapped")
    if family != "llama":
        _refused(res, "'model.layers.0.self_attn.qkv_proj.weight'", "outside the architecture")
    assert not out.exists() and not list(tmp_path.glob("out.tmp-*"))
    res = cli(capsys, "to-hf", fused.ckpt, out, "--rules", rules, "--config", fused.config, "--allow-unmapped")
    assert res.rc == 0 and "missing from the export" in res.err, res.err
    assert out.exists()


def test_rules_export_without_a_checkable_config_says_nothing_was_checked(models, tmp_path, capsys):
    rules = tmp_path / "plain.json"
    rules.write_text(json.dumps(PLAIN_RULES))
    m = models["qwen3-fused"]
    res = cli(capsys, "to-hf", m.ckpt, tmp_path / "a", "--rules", rules)
    assert res.rc == 0 and "looks like a qwen3 model" in res.err and "nothing was checked" in res.err, res.err
    odd = tmp_path / "odd.json"
    odd.write_text(json.dumps({"rename": [["^model\\.", "backbone."]]}))
    res = cli(capsys, "to-hf", m.ckpt, tmp_path / "b", "--rules", odd)
    assert res.rc == 0 and "look like no known family" in res.err and "nothing was checked" in res.err, res.err
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(dict(m.cfg, model_type="mamba")))
    res = cli(capsys, "to-hf", m.ckpt, tmp_path / "c", "--rules", rules, "--config", cfg)
    assert res.rc == 0 and "'mamba', which no preset knows" in res.err and "nothing was checked" in res.err, res.err


def test_missing_parameters_and_bad_shapes_are_refused(models, tmp_path, capsys):
    m = models["qwen3-moe"]
    more_layers = dict(m.cfg, num_hidden_layers=3, mlp_only_layers=[1])
    res = cli(
        capsys,
        "to-hf",
        m.ckpt,
        tmp_path / "a",
        "--preset",
        "qwen3-moe",
        "--config",
        _json(tmp_path / "c1.json", more_layers),
    )
    _refused(
        res,
        "21 parameter(s) of the architecture missing from the export",
        "'model.layers.2.self_attn.q_proj.weight'",
        "'model.layers.2.mlp.experts.2.gate_proj.weight'",
    )
    other_size = dict(m.cfg, moe_intermediate_size=24)
    res = cli(
        capsys,
        "to-hf",
        m.ckpt,
        tmp_path / "b",
        "--preset",
        "qwen3-moe",
        "--config",
        _json(tmp_path / "c2.json", other_size),
    )
    _refused(
        res, "shapes do not match the config", "'model.layers.0.mlp.experts.0.gate_proj.weight' has shape [32, 16]"
    )
    other_heads = dict(models["qwen3-fused"].cfg, num_key_value_heads=4)
    res = cli(
        capsys,
        "to-hf",
        models["qwen3-fused"].ckpt,
        tmp_path / "c",
        "--preset",
        "qwen3-fused",
        "--config",
        _json(tmp_path / "c3.json", other_heads),
    )
    _refused(res, "'model.layers.0.self_attn.qkv_proj.weight' has shape [32, 64]", "[32, 96]")
    res = cli(capsys, "to-hf", m.ckpt, tmp_path / "d", "--preset", "qwen3", "--config", m.config)
    _refused(res, "model_type 'qwen3_moe'", "preset qwen3 is for qwen3")
    for layers, needle in ((10**12, "not a plausible layer count"), (100_000, "the checkpoint holds")):
        huge = dict(m.cfg, num_hidden_layers=layers)
        res = cli(
            capsys,
            "to-hf",
            m.ckpt,
            tmp_path / "h",
            "--preset",
            "qwen3-moe",
            "--config",
            _json(tmp_path / "h.json", huge),
        )
        _refused(res, needle)
    for field, value in (("num_key_value_heads", 3), ("hidden_size", "32"), ("vocab_size", None), ("head_dim", -8)):
        bad = dict(m.cfg, **{field: value})
        res = cli(
            capsys,
            "to-hf",
            m.ckpt,
            tmp_path / "h",
            "--preset",
            "qwen3-moe",
            "--config",
            _json(tmp_path / "h.json", bad),
        )
        _refused(res, field)
    res = cli(capsys, "to-hf", m.ckpt, tmp_path / "e", "--preset", "qwen3-moe")
    _refused(res, "needs --config")
    res = cli(capsys, "to-hf", m.ckpt, tmp_path / "f", "--preset", "nope", "--config", m.config)
    _refused(res, "unknown preset 'nope'", "qwen3-moe-fused")
    rules = _json(tmp_path / "rules.json", {"rename": []})
    res = cli(capsys, "to-hf", m.ckpt, tmp_path / "g", "--preset", "qwen3-moe", "--config", m.config, "--rules", rules)
    _refused(res, "either --preset or --rules")
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]


def test_from_hf_refuses_missing_and_unmapped_tensors(models, exports, tmp_path, capsys):
    src = exports["qwen2"]
    tensors = read_hf(src)
    d = tmp_path / "hf_missing"
    d.mkdir()
    shutil.copy(src / "config.json", d / "config.json")
    dropped = {k: v for k, v in tensors.items() if k != "model.layers.1.self_attn.k_proj.bias"}
    stnp.save_file(dropped, str(d / "model.safetensors"), metadata={"format": "pt"})
    res = cli(capsys, "from-hf", d, tmp_path / "o1", "--preset", "qwen2-fused")
    _refused(res, "'model.layers.1.self_attn.k_proj.bias'", "missing from the input", "lacking parts")
    res = cli(capsys, "from-hf", d, tmp_path / "o2", "--preset", "qwen2-fused", "--allow-unmapped")
    assert res.rc == 0, res.err
    full = load_full_state_dict(str(tmp_path / "o2"))
    assert "model.layers.1.self_attn.qkv_proj.bias" not in full and "model.layers.0.self_attn.qkv_proj.bias" in full

    e = tmp_path / "hf_extra"
    e.mkdir()
    shutil.copy(src / "config.json", e / "config.json")
    extra = dict(tensors, **{"model.layers.0.mlp.bogus.weight": np.zeros((2, 2), np.float32)})
    stnp.save_file(extra, str(e / "model.safetensors"), metadata={"format": "pt"})
    res = cli(capsys, "from-hf", e, tmp_path / "o3", "--preset", "qwen2")
    _refused(res, "not mapped by preset qwen2", "'model.layers.0.mlp.bogus.weight'")
    bad = dict(tensors, **{"model.norm.weight": np.zeros((7,), np.float32)})
    stnp.save_file(bad, str(e / "model.safetensors"), metadata={"format": "pt"})
    res = cli(capsys, "from-hf", e, tmp_path / "o4", "--preset", "qwen2")
    _refused(res, "'model.norm.weight' has shape [7]", "[32]")
    (e / "config.json").unlink()
    res = cli(capsys, "from-hf", e, tmp_path / "o5", "--preset", "qwen2")
    _refused(res, "needs the model's config.json")
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o3").exists() and not (tmp_path / "o4").exists()


def test_buffers_are_left_out_unless_asked(models, tmp_path, capsys):
    """A checkpoint that records ``__fsdp__.buffers`` (save_checkpoint does): to-hf leaves those keys out."""
    from paddle.distributed.fsdp.tools.ckpt_io import CheckpointReader, CheckpointWriter, WriteEntry

    m = models["qwen3"]
    src = tmp_path / "with_buffer"
    src.mkdir()
    buf = "model.layers.0.self_attn.step_counter"
    with CheckpointReader(m.ckpt) as r:
        entries = [
            WriteEntry(k, tm.dtype, tuple(tm.shape), lambda k=k: r.read_raw(k)) for k, tm in r.md.tensors.items()
        ]
        entries.append(WriteEntry(buf, "int64", (1,), lambda: np.array([7], np.int64).view(np.uint8)))
        w = CheckpointWriter(str(src))
        w.write_file(entries)
        w.commit({"__fsdp__.buffers": [buf]})
    res = cli(capsys, "to-hf", src, tmp_path / "a", "--preset", "qwen3", "--config", m.config)
    assert res.rc == 0, res.err
    assert buf not in read_hf(tmp_path / "a")
    res = cli(capsys, "to-hf", src, tmp_path / "b", "--preset", "qwen3", "--config", m.config, "--include-buffers")
    _refused(res, f"'{buf}'", "not mapped")
    res = cli(capsys, "to-hf", src, tmp_path / "c", "--include-buffers")
    assert res.rc == 0 and read_hf(tmp_path / "c")[buf].tolist() == [7]
    res = cli(capsys, "to-hf", src, tmp_path / "d")
    assert res.rc == 0 and buf not in read_hf(tmp_path / "d")
    report = json.loads(cli(capsys, "diff", src, m.ckpt, "--json").out)
    assert [k["role"] for k in report["keys"] if k["key"] == buf] == ["buffer"]


def _json(path: Path, obj) -> Path:
    path.write_text(json.dumps(obj))
    return path


# ------------------------------------------------------------------------------------------------ diff


@pytest.fixture(scope="module")
def two_worlds(tmp_path_factory):
    """The same training step of Qwen3-MoE (fused) saved by 1 rank and by 2 ranks (with AdamW state)."""
    work = tmp_path_factory.mktemp("diff_worlds")
    pf_models.write_hf_config("qwen3-moe", work / "config.json")
    for n in (1, 2):
        res = run_launch(WORKER, n, ["save", str(work), "qwen3-moe-fused"], log_dir=tmp_path_factory.mktemp(f"logs{n}"))
        assert_case_ok(res, "save", n)
    return work


def test_diff_across_world_sizes(two_worlds, capsys):
    a, b = two_worlds / "ckpt_w1", two_worlds / "ckpt_w2"
    res = cli(capsys, "diff", a, b, "--json", "--window", "256B")
    report = json.loads(res.out)
    keys = {k["key"]: k for k in report["keys"]}
    assert not [k for k in keys.values() if k["status"] in ("missing", "extra", "dtype", "shape")]
    roles = {k["role"] for k in keys.values()}
    assert roles == {"model", "optimizer"}
    assert any(k.endswith(".moment1") for k in keys)
    # the 2-rank step averages gradients in another order: tiny differences, never large ones
    assert float(report["summary"]["max_abs"]) < 1e-5, report["summary"]
    same = cli(capsys, "diff", a, b, "--json")  # default window: the same report
    assert json.loads(same.out)["keys"] == report["keys"]
    res = cli(capsys, "diff", b, b)
    assert res.rc == 0 and "IDENTICAL" in res.out


def test_diff_names_each_difference(models, exports, tmp_path, capsys):
    m = models["qwen2"]
    tensors = read_hf(exports["qwen2"])
    d = tmp_path / "hf"
    d.mkdir()
    shutil.copy(exports["qwen2"] / "config.json", d / "config.json")
    w = tensors["model.layers.1.mlp.down_proj.weight"].copy()
    w[3, 5] += 0.25
    tensors["model.layers.1.mlp.down_proj.weight"] = w
    b = tensors["model.layers.0.self_attn.q_proj.bias"].copy()
    b[2] = np.nan
    tensors["model.layers.0.self_attn.q_proj.bias"] = b
    stnp.save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    assert cli(capsys, "from-hf", d, tmp_path / "ck", "--preset", "qwen2").rc == 0
    res = cli(capsys, "diff", m.ckpt, tmp_path / "ck", "--json", "--window", "100B")
    assert res.rc == 1
    report = json.loads(res.out)
    differs = {k["key"]: k for k in report["keys"] if k["status"] != "equal"}
    assert sorted(differs) == ["model.layers.0.self_attn.q_proj.bias", "model.layers.1.mlp.down_proj.weight"]
    down = differs["model.layers.1.mlp.down_proj.weight"]
    original = m.state["model.layers.1.mlp.down_proj.weight"][5, 3]
    assert down["n_diff"] == 1 and abs(down["max_abs"] - abs(np.float32(original + 0.25) - original)) < 1e-7
    assert differs["model.layers.0.self_attn.q_proj.bias"]["nan_mismatch"] == 1
    text = cli(capsys, "diff", m.ckpt, tmp_path / "ck")
    assert text.rc == 1 and "DIFFERS  model.layers.1.mlp.down_proj.weight" in text.out and "DIFFERENT" in text.out
    # missing / extra keys and tolerances
    res = cli(capsys, "diff", m.ckpt, tmp_path / "ck", "--key", "model.layers.1.mlp.down_proj.weight", "--atol", "0.3")
    assert res.rc == 0, res.out
    sub = tmp_path / "hf_sub"
    sub.mkdir()
    shutil.copy(d / "config.json", sub / "config.json")
    stnp.save_file({"model.norm.weight": tensors["model.norm.weight"]}, str(sub / "model.safetensors"))
    assert cli(capsys, "from-hf", sub, tmp_path / "ck_sub", "--preset", "qwen2", "--allow-unmapped").rc == 0
    report = json.loads(cli(capsys, "diff", tmp_path / "ck_sub", m.ckpt, "--json").out)
    assert report["summary"]["extra"] == len(m.state) - 1 and report["summary"]["equal"] == 1
    report = json.loads(cli(capsys, "diff", m.ckpt, tmp_path / "ck_sub", "--json").out)
    assert report["summary"]["missing"] == len(m.state) - 1


# ------------------------------------------------------------------------------------------------ with torch


def _torch_worker(mode: str, cases: list[dict], path: Path) -> None:
    path.write_text(json.dumps(cases))
    proc = subprocess.run(
        [sys.executable, str(TORCH_WORKER), mode, str(path)], capture_output=True, text=True, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    failed = {k: v for k, v in results.items() if v != "ok"}
    assert not failed, "\n".join(f"{k}:\n{v}" for k, v in failed.items())


@needs_torch
def test_exports_load_in_transformers_with_the_paddle_logits(models, exports, tmp_path):
    cases = [
        {"name": p, "hf_dir": str(exports[p]), "ids": str(models[p].ids), "out": str(tmp_path / f"{p}.npy")}
        for p in pf_models.PRESET_NAMES
    ]
    _torch_worker("logits", cases, tmp_path / "cases.json")
    for p in pf_models.PRESET_NAMES:
        theirs = np.load(tmp_path / f"{p}.npy")
        assert theirs.shape == models[p].logits.shape
        err = float(np.abs(theirs - models[p].logits).max())
        print(f"\ntransformers logits of the {p} export vs paddle: max abs {err:.2e}")
        assert err <= LOGITS_ATOL, (p, err)


@needs_torch
@pytest.mark.parametrize("world", [1, 2, 3])
def test_transformers_models_imported_into_fsdp_give_transformers_logits(world, hf_saved, tmp_path):
    cases = [dict(c, out=str(tmp_path / f"{c['name']}.npy")) for c in hf_saved.cases]
    cases_file = _json(tmp_path / "cases.json", cases)
    res = run_launch(WORKER, world, ["load", str(cases_file)], log_dir=tmp_path / "logs")
    for c in cases:
        assert_case_ok(res, c["name"], world)
        ours = np.load(c["out"])
        theirs = np.load(hf_saved.logits[c["name"]])
        err = float(np.abs(ours - theirs).max())
        print(f"\nfrom-hf --preset {c['name']} on {world} rank(s) vs transformers: max abs {err:.2e}")
        assert err <= LOGITS_ATOL, (c["name"], world, err)


@pytest.fixture(scope="module")
def hf_saved(tmp_path_factory):
    """transformers models (random weights) saved by transformers, imported with from-hf for every preset; plus a
    Qwen3 with tied embeddings (transformers saves no lm_head.weight) imported fused."""
    root = tmp_path_factory.mktemp("hf_saved")
    variants = {family: (family, {}) for family in pf_models.FAMILIES}
    variants["qwen3-tied"] = ("qwen3", {"tie_word_embeddings": True})
    save_cases = []
    for name, (family, over) in variants.items():
        d = root / name
        d.mkdir()
        config = _json(d / "config.json", dict(pf_models.hf_config(family), **over))
        ids = pf_models.input_ids(json.loads(config.read_text())["vocab_size"], seed=8)
        np.save(d / "ids.npy", ids)
        save_cases.append(
            {
                "name": name,
                "config": str(config),
                "out_dir": str(d / "hf"),
                "ids": str(d / "ids.npy"),
                "out": str(d / "logits.npy"),
                "seed": 3,
            }
        )
    _torch_worker("save", save_cases, root / "save_cases.json")
    assert "lm_head.weight" not in read_hf(root / "qwen3-tied" / "hf")
    cases, logits = [], {}
    imports = [(p, pf_models.family_of(p)[0]) for p in pf_models.PRESET_NAMES] + [("qwen3-fused", "qwen3-tied")]
    for preset, variant in imports:
        d = root / variant
        name = f"{preset}@{variant}"
        ckpt = root / f"ckpt_{name}"
        assert cli_main(["from-hf", str(d / "hf"), str(ckpt), "--preset", preset]) == 0, name
        cases.append(
            {
                "name": name,
                "preset": preset,
                "config": str(d / "config.json"),
                "ckpt": str(ckpt),
                "ids": str(d / "ids.npy"),
            }
        )
        logits[name] = d / "logits.npy"
    return SimpleNamespace(cases=cases, logits=logits)


# ------------------------------------------------------------------------------------------------ memory

_MEASURE = (
    "import resource, subprocess, sys\n"
    "rc = subprocess.call(sys.argv[1:], stdout=subprocess.DEVNULL)\n"
    "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)\n"
    "sys.exit(rc)\n"
)


def _peak_rss_mb(*args, rc: int = 0) -> float:
    """Peak RSS (MB) of one `python -m paddle.distributed.fsdp.tools ARGS` process."""
    cmd = [sys.executable, "-c", _MEASURE, sys.executable, "-m", "paddle.distributed.fsdp.tools", *map(str, args)]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONWARNINGS="ignore")
    )
    assert proc.returncode == rc, proc.stderr
    return int(proc.stdout.split()[-1]) / 1024


def test_split_merge_and_diff_memory_is_bounded(tmp_path):
    """A Qwen3 (fused) checkpoint of ~300 MB whose largest tensor is 32 MiB: to-hf splitting every fused key,
    from-hf merging them back, and diff (4 MiB windows) stay near one tensor over the interpreter's baseline."""
    import paddle
    from paddle.distributed.fsdp.checkpoint import save_state_dict

    cfg = dict(
        pf_models.hf_config("qwen3"),
        hidden_size=1024,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=4096,
        num_hidden_layers=4,
        vocab_size=8192,
    )
    config = _json(tmp_path / "config.json", cfg)
    h, qkv, inter, vocab = 1024, (16 + 2 * 4) * 64, 4096, 8192
    shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,), "lm_head.weight": (vocab, h)}
    for i in range(4):
        p = f"model.layers.{i}"
        shapes.update(
            {
                f"{p}.self_attn.qkv_proj.weight": (h, qkv),
                f"{p}.self_attn.o_proj.weight": (16 * 64, h),
                f"{p}.self_attn.q_norm.weight": (64,),
                f"{p}.self_attn.k_norm.weight": (64,),
                f"{p}.mlp.up_gate_proj.weight": (h, 2 * inter),
                f"{p}.mlp.down_proj.weight": (inter, h),
                f"{p}.input_layernorm.weight": (h,),
                f"{p}.post_attention_layernorm.weight": (h,),
            }
        )
    state = {}
    for j, (k, shape) in enumerate(shapes.items()):
        arr = (np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) % 251 + j).astype(np.float32)
        state[k] = paddle.to_tensor(arr)
    ckpt = tmp_path / "ckpt"
    save_state_dict(state, str(ckpt))
    del state, arr
    largest = max(int(np.prod(s)) for s in shapes.values()) * 4 / 2**20
    total = sum(int(np.prod(s)) for s in shapes.values()) * 4 / 2**20

    baseline = _peak_rss_mb("inspect", ckpt)
    to_hf = _peak_rss_mb(
        "to-hf", ckpt, tmp_path / "hf", "--preset", "qwen3-fused", "--config", config, "--max-shard-size", "50MB"
    )
    from_hf = _peak_rss_mb("from-hf", tmp_path / "hf", tmp_path / "back")
    diff = _peak_rss_mb("diff", ckpt, tmp_path / "back", "--window", "4MiB")
    print(
        f"\npeak RSS: baseline (inspect) {baseline:.0f} MB, to-hf {to_hf:.0f} MB, from-hf {from_hf:.0f} MB, "
        f"diff {diff:.0f} MB; model {total:.0f} MB, largest tensor {largest:.0f} MB"
    )
    assert to_hf - baseline < 2 * largest + 32, (baseline, to_hf)
    assert from_hf - baseline < 2 * largest + 32, (baseline, from_hf)
    assert diff - baseline < largest, (baseline, diff)
    assert max(to_hf, from_hf, diff) - baseline < total / 3


def test_optimizer_state_round_trips_through_a_preset(two_worlds, tmp_path, capsys):
    """to-hf --include-optimizer splits AdamW moments like their fused parameter (and copies per-parameter
    scalars to each part); from-hf merges them back: the 2-rank checkpoint comes back bit for bit."""
    ckpt = two_worlds / "ckpt_w2"
    res = cli(
        capsys,
        "to-hf",
        ckpt,
        tmp_path / "hf",
        "--preset",
        "qwen3-moe-fused",
        "--config",
        two_worlds / "config.json",
        "--include-optimizer",
    )
    assert res.rc == 0, res.err
    hf = read_hf(tmp_path / "hf")
    q = hf["model.layers.0.self_attn.q_proj.weight"]
    assert hf["model.layers.0.self_attn.q_proj.weight.moment1"].shape == q.shape
    assert "model.layers.0.mlp.experts.1.up_proj.weight.beta1_pow_acc" in hf
    res = cli(capsys, "from-hf", tmp_path / "hf", tmp_path / "back")
    assert res.rc == 0, res.err
    res = cli(capsys, "diff", ckpt, tmp_path / "back", "--json")
    report = json.loads(res.out)
    assert res.rc == 0, report["summary"]
    assert report["summary"]["equal"] == report["summary"]["keys"] and report["values"]["__fsdp__.optimizer"] == "equal"
    assert any(k["role"] == "optimizer" for k in report["keys"])


def test_bf16_export_of_split_keys(models, exports, tmp_path, capsys):
    """--dtype bf16 on split parts: each element rounded to nearest even from the fp32 export."""
    from test_tools import bf16_reference, read_safetensors_raw

    m = models["qwen3-fused"]
    res = cli(
        capsys, "to-hf", m.ckpt, tmp_path / "bf16", "--preset", "qwen3-fused", "--config", m.config, "--dtype", "bf16"
    )
    assert res.rc == 0, res.err
    raw = tmp_path / "bf16"
    fp32 = read_hf(exports["qwen3-fused"])
    index = json.loads((raw / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(fp32)
    got = {}
    for f in sorted(raw.glob("*.safetensors")):
        got.update(read_safetensors_raw(f))
    for name, value in fp32.items():
        dtype, shape, data = got[name]
        assert dtype == "BF16" and list(shape) == list(value.shape), name
        assert data == bf16_reference(value).tobytes(), name


def _fuzz_configs(n: int, seed: int = 20261201):
    """Seeded random architectures: MHA, GQA and MQA, head_dim != hidden/heads (Qwen3), odd sizes."""
    rng = np.random.default_rng(seed)
    families = list(pf_models.FAMILIES)
    for i in range(n):
        family = families[i % len(families)]
        kv = int(rng.choice([1, 2, 3]))
        heads = kv * int(rng.choice([1, 2, 3]))
        d = int(rng.choice([4, 6, 8]))
        hidden = heads * d if family in ("llama", "qwen2") else int(rng.choice([12, 20, 24]))
        over = dict(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            intermediate_size=int(rng.choice([10, 22, 36])),
            num_hidden_layers=int(rng.choice([1, 2])),
            vocab_size=int(rng.choice([50, 77])),
        )
        over["head_dim"] = d  # == hidden / heads for Llama and Qwen2, free for Qwen3
        if family == "qwen3-moe":
            over.update(moe_intermediate_size=int(rng.choice([6, 14])), num_experts=int(rng.choice([2, 3])))
            over["num_experts_per_tok"] = min(2, over["num_experts"])
            over["mlp_only_layers"] = [0] if over["num_hidden_layers"] == 2 else []
        yield family, over


@pytest.mark.parametrize("family,over", list(_fuzz_configs(8)), ids=lambda x: x if isinstance(x, str) else "")
def test_fused_layouts_over_random_architectures(family, over, tmp_path, capsys):
    """The class, not the case: for random head counts (MHA/GQA/MQA) and sizes, an unfused PaddleFormers model
    exported and merged into a fused one (judged by PaddleFormers' fused forward) keeps its logits, and the fused
    checkpoint splits back into the same bytes."""
    cfg = dict(pf_models.hf_config(family), **over)
    config = _json(tmp_path / "config.json", cfg)
    model = pf_models.paddle_model(family, False, cfg, seed=7)
    ids = pf_models.input_ids(cfg["vocab_size"], seed=3)
    want = pf_models.paddle_logits(model, ids)
    pf_models.save_single_process(model, tmp_path / "ckpt")
    assert cli(capsys, "to-hf", tmp_path / "ckpt", tmp_path / "hf", "--preset", family, "--config", config).rc == 0
    res = cli(capsys, "from-hf", tmp_path / "hf", tmp_path / "fused", "--preset", f"{family}-fused")
    assert res.rc == 0, res.err
    fused = pf_models.paddle_model(family, True, cfg, seed=8)
    missing, unexpected = fused.set_state_dict(load_full_state_dict(str(tmp_path / "fused")))
    assert not missing and not unexpected
    np.testing.assert_allclose(pf_models.paddle_logits(fused, ids), want, rtol=0, atol=1e-5)
    res = cli(capsys, "to-hf", tmp_path / "fused", tmp_path / "hf2", "--preset", f"{family}-fused", "--config", config)
    assert res.rc == 0, res.err
    a, b = read_hf(tmp_path / "hf"), read_hf(tmp_path / "hf2")
    assert sorted(a) == sorted(b) and all(a[k].tobytes() == b[k].tobytes() for k in a)


def test_help_and_progress_of_the_new_options(models, tmp_path, capsys):
    for command, needles in (
        ("diff", ("largest absolute", "--atol", "--window", "Exit codes")),
        ("to-hf", ("--preset", "--config", "--allow-unmapped", "--include-buffers", "qwen3-moe-fused", "per kv head")),
        ("from-hf", ("--preset", "--allow-unmapped", "llama-fused", "HF_DIR/config.json")),
    ):
        res = cli(capsys, command, "--help")
        assert res.rc == 0
        for n in needles:
            assert n in res.out, (command, n)
    from paddle.distributed.fsdp.tools import diff, to_hf

    m = models["qwen3-moe-fused"]
    capsys.readouterr()
    to_hf(str(m.ckpt), str(tmp_path / "hf"), preset="qwen3-moe-fused", config=str(m.config), progress=True)
    err = capsys.readouterr().err
    assert "to-hf [" in err and "100.0%" in err
    report = diff(str(m.ckpt), str(m.ckpt), progress=True)
    err = capsys.readouterr().err
    assert "diff [" in err and "100.0%" in err and report.identical


def test_crafted_configs_never_crash(models, exports, tmp_path, capsys):
    """Seeded fuzz of config.json values (types, signs, sizes) for to-hf and from-hf: exit 0 or a one-line exit 2,
    never an internal error (3), never a half-written output."""
    rng = np.random.default_rng(7)
    m = models["qwen3-moe-fused"]
    fields = [
        "hidden_size",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "moe_intermediate_size",
        "num_experts",
        "num_hidden_layers",
        "vocab_size",
        "decoder_sparse_step",
        "mlp_only_layers",
        "tie_word_embeddings",
        "model_type",
    ]
    values = [None, -1, 0, 1, 3, 10**18, 2.5, "32", [], [0, "x"], {"a": 1}, True, "qwen3_moe", [10**9]]
    for i in range(60):
        cfg = dict(m.cfg)
        for field in rng.choice(fields, size=int(rng.integers(1, 3)), replace=False):
            value = values[int(rng.integers(len(values)))]
            if value is None and rng.random() < 0.5:
                cfg.pop(str(field), None)
            else:
                cfg[str(field)] = value
        config = _json(tmp_path / f"c{i}.json", cfg)
        out = tmp_path / f"o{i}"
        res = cli(capsys, "to-hf", m.ckpt, out, "--preset", "qwen3-moe-fused", "--config", config)
        assert res.rc in (0, 2), (cfg, res.err)
        assert out.exists() == (res.rc == 0)
        hf = tmp_path / f"h{i}"
        shutil.copytree(exports["qwen3-moe-fused"], hf)
        (hf / "config.json").write_text(config.read_text())
        res = cli(capsys, "from-hf", hf, tmp_path / f"b{i}", "--preset", "qwen3-moe-fused", "--allow-unmapped")
        assert res.rc in (0, 2), (cfg, res.err)
