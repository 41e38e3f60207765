"""Expert parallelism (EP): experts in buffers of their own, sharded over fleet's moe_sharding group, trained like one
process; checkpoints independent of the EP degree. Two launches share one directory: 2 ranks (fleet ep_degree=2)
train, refuse, and save the EP=2 and EP=1 checkpoints; 4 ranks (ep2 x moe_sharding2, and EP=4 through explicit
groups) train and reshard them (workers/expert_parallel.py)."""

from __future__ import annotations

import importlib.util
import json
import os

import numpy as np
import pytest
from _results import assert_case_ok
from launch_util import run_launch

TWO = [
    "groups",
    "refusals",
    "training_ep2",
    "save_once",
    "summon",
    "scaler_inf_in_one_experts_gradient",
    "clip_by_norm",
    "master_weights",
    "memory_tier",
]
FOUR = [
    "training_ep2x2",
    "explicit_groups",
    "reshard_ep2_to_ep2x2",
    "reshard_ep1_to_ep2x2",
    "reshard_ep2_to_ep4",
    "reshard_ep2_to_ep1",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "expert_parallel.py")
    work = str(tmp_path_factory.mktemp("ep_ckpts"))
    two = run_launch(worker, 2, [work], log_dir=tmp_path_factory.mktemp("ep2"))
    four = run_launch(worker, 4, [work], log_dir=tmp_path_factory.mktemp("ep4"))
    return {"two": two, "four": four, "dir": work}


@pytest.mark.parametrize("case", TWO)
def test_ep_two_ranks(runs, case):
    """groups: fleet's ep_degree=2 gives an EP group of both ranks and no expert sharding; experts of this EP rank
    only, in buffers of their own. refusals: EP layouts trained wrong are refused by name, the model untouched.
    training_ep2: equals one process (AdamW, weight decay, global-norm clipping), full_state_dict has every expert.
    save_once: the EP=2 checkpoint has EP=1's keys and shapes, every byte written once. summon: writeback.
    scaler_inf_in_one_experts_gradient: an inf in an expert's gradient on one EP rank skips the step everywhere.
    clip_by_norm: per-parameter clipping equals one process. master_weights: bf16 + fp32 master weights EP=2 -> EP=1
    -> EP=2 bit-exact. memory_tier: a tier save at EP=2 restores from memory bit-exactly; its persisted step loads at
    EP=1."""
    assert_case_ok(runs["two"], case, 2)


@pytest.mark.parametrize("case", FOUR)
def test_ep_four_ranks(runs, case):
    """training_ep2x2: ep2 x moe_sharding2 (and EP=4) equal one process, bit for bit the same at prefetch depths 0,
    1, 2 with the collective-order check on. explicit_groups: the same groups made with
    topology.new_group train bit for bit as fleet's; swapped ones are refused. reshard_*: the 2-rank checkpoints load at
    another EP and FSDP degree bit-exactly (re-saved and compared), each rank reading <= 1.1x its share, and
    continue within 1e-5 of the uninterrupted run."""
    assert_case_ok(runs["four"], case, 4)


def test_ep_checkpoint_tools(runs):
    """verify and diff read EP checkpoints like any other: both verify clean; the EP=2 checkpoint (2 ranks) and its
    re-save after a load at EP=4 (4 ranks) are identical key by key; EP=2 and EP=1 runs hold the same keys, and
    their values agree within 1e-12 absolute (the same training, reduced in another order)."""
    from paddle.distributed.fsdp.tools.diff_cmd import diff
    from paddle.distributed.fsdp.tools.verify_cmd import verify

    for name in ("ep2", "ep1", "ep2_to_ep4_again"):
        problems, _ = verify(os.path.join(runs["dir"], name), progress=False)
        assert problems == [], (name, problems)
    same = diff(os.path.join(runs["dir"], "ep2"), os.path.join(runs["dir"], "ep2_to_ep4_again"), progress=False)
    assert same.identical and all(k.status == "equal" for k in same.keys), same.summary()
    close = diff(os.path.join(runs["dir"], "ep2"), os.path.join(runs["dir"], "ep1"), atol=1e-12, progress=False)
    assert {k.status for k in close.keys} <= {"equal", "differs"}, close.summary()
    assert all(close.within(k) for k in close.keys), close.summary()
    assert any(".experts.7." in k.key for k in close.keys)


def test_ep2_checkpoint_resumes_in_one_process(runs):
    """EP=2 on 2 ranks -> one process holding every expert (FSDP over 1): the step after the load equals the
    uninterrupted EP=2 run's third step within 1e-12."""
    import sys

    import paddle

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers"))
    from moe_models import make_moe, moe_batches
    from paddle.distributed.fsdp import FullyShardFusion

    model = make_moe(5)
    fsdp = FullyShardFusion(model, ["MoeDecoderBlock"], moe_layers_name=["MoeExpert"])
    clip = paddle.nn.ClipGradByGlobalNorm(0.05)
    opt = paddle.optimizer.AdamW(0.01, weight_decay=0.1, grad_clip=clip, parameters=model.parameters())
    result = fsdp.load_checkpoint(os.path.join(runs["dir"], "ep2"), optimizer=opt)
    assert result.report.missing_keys == [] and result.report.unexpected_keys == []
    ids, labels = moe_batches(3, 8)[2]
    model(paddle.to_tensor(ids), paddle.to_tensor(labels)).backward()
    opt.step()
    want = dict(np.load(os.path.join(runs["dir"], "ep2_uninterrupted.npz")))
    got = fsdp.full_parameters()
    assert sorted(got) == sorted(want)
    worst = max(float(np.abs(got[k].numpy() - v).max() / np.abs(v).max()) for k, v in want.items())
    assert worst <= 1e-12, worst


# ------------------------------------------------------------------------------------------------ HF export


def _cli(capsys, *args):
    from paddle.distributed.fsdp.tools.cli import main as cli_main

    capsys.readouterr()
    rc = cli_main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out + out.err


def _read_hf(directory) -> dict:
    import safetensors.numpy as stnp

    out = {}
    for f in sorted(os.listdir(directory)):
        if f.endswith(".safetensors"):
            out.update(stnp.load_file(os.path.join(directory, f)))
    return out


@pytest.fixture(scope="module")
def ep_round_trip(tmp_path_factory):
    """HF (PaddleFormers Qwen3-MoE's own weights, exported) -> from-hf -> loaded at EP=2 (fleet ep_degree=2) and
    saved -> to-hf. Paths of both HF directories, the config and the paddle model's logits on ``ids``."""
    import pf_models
    from paddle.distributed.fsdp.tools.cli import main as cli_main

    tmp = tmp_path_factory.mktemp("ep_hf")
    config = pf_models.write_hf_config("qwen3-moe", tmp / "config.json")
    cfg = json.loads(config.read_text())
    model = pf_models.paddle_model("qwen3-moe", False, cfg, seed=1)
    ids = pf_models.input_ids(cfg["vocab_size"])
    np.save(tmp / "ids.npy", ids)
    pf_models.save_single_process(model, tmp / "ckpt1")
    steps = [
        ["to-hf", tmp / "ckpt1", tmp / "hf", "--preset", "qwen3-moe", "--config", config],
        ["from-hf", tmp / "hf", tmp / "in", "--preset", "qwen3-moe"],
    ]
    for step in steps:
        assert cli_main([str(a) for a in step]) == 0, step
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "ep_hf.py")
    res = run_launch(worker, 2, [config, tmp / "in", tmp / "ep2"], log_dir=tmp / "logs")
    assert_case_ok(res, "round_trip", 2)
    step = ["to-hf", tmp / "ep2", tmp / "hf2", "--preset", "qwen3-moe", "--config", config]
    assert cli_main([str(a) for a in step]) == 0
    logits = pf_models.paddle_logits(model, ids)
    return {"dir": tmp, "cfg": cfg, "hf": tmp / "hf", "hf2": tmp / "hf2", "ids": tmp / "ids.npy", "logits": logits}


def test_hf_round_trip_through_ep2_is_bit_exact(ep_round_trip):
    """HF -> ours at EP=2 -> HF: every HF tensor bit-exact, every expert of every sparse layer present (per-expert
    HF keys)."""
    a, b = _read_hf(ep_round_trip["hf"]), _read_hf(ep_round_trip["hf2"])
    assert sorted(a) == sorted(b)
    bad = [k for k in a if a[k].dtype != b[k].dtype or a[k].tobytes() != b[k].tobytes()]
    assert not bad, bad[:5]
    experts = {k for k in b if ".mlp.experts." in k}
    assert len(experts) == ep_round_trip["cfg"]["num_experts"] * 3, sorted(experts)  # layer 0 sparse, 1 dense


@pytest.mark.skipif(
    importlib.util.find_spec("torch") is None,
    reason="torch is not installed: transformers cannot run (pip install torch==2.13.0 to run this)",
)
def test_ep_round_trip_export_loads_in_transformers_with_the_paddle_logits(ep_round_trip):
    """The export of the EP=2 checkpoint loads in transformers (no weight left new or unused) with the paddle
    model's logits."""
    import subprocess
    import sys

    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "hf_transformers.py")
    out = ep_round_trip["dir"] / "transformers.npy"
    case = [{"name": "ep2", "hf_dir": str(ep_round_trip["hf2"]), "ids": str(ep_round_trip["ids"]), "out": str(out)}]
    cases = ep_round_trip["dir"] / "cases.json"
    cases.write_text(json.dumps(case))
    proc = subprocess.run([sys.executable, worker, "logits", str(cases)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"ep2": "ok"}, proc.stdout[-4000:]
    err = float(np.abs(np.load(out) - ep_round_trip["logits"]).max())
    assert err <= 1e-5, err


def test_export_missing_experts_is_refused_by_layer_and_index(tmp_path, capsys):
    """A checkpoint holding one EP rank's experts only (what a per-rank export of an EP model would write) is
    refused with exit 2, naming the layer and the missing expert indices; an HF input with an expert beyond the
    config's is refused the same way; an expert given twice is refused naming it."""
    import pf_models

    config = pf_models.write_hf_config("qwen3-moe", tmp_path / "config.json")
    cfg = json.loads(config.read_text())
    model = pf_models.paddle_model("qwen3-moe", False, cfg, seed=1)
    state = {k: v for k, v in model.state_dict().items() if not any(f".experts.{e}." in k for e in (2, 3))}
    from paddle.distributed.fsdp.checkpoint import save_state_dict

    save_state_dict(state, str(tmp_path / "half"))
    rc, out = _cli(capsys, "to-hf", tmp_path / "half", tmp_path / "hf", "--preset", "qwen3-moe", "--config", config)
    assert rc == 2 and "experts by layer: layer 0: [2-3]" in out, out
    assert not (tmp_path / "hf").exists() or not any((tmp_path / "hf").iterdir())
    # import: an HF directory with one expert too many (expert 4 of 4)
    pf_models.save_single_process(model, tmp_path / "ckpt1")
    rc, out = _cli(capsys, "to-hf", tmp_path / "ckpt1", tmp_path / "hf1", "--preset", "qwen3-moe", "--config", config)
    assert rc == 0, out
    import safetensors.numpy as stnp

    extra = {"model.layers.0.mlp.experts.4.up_proj.weight": np.zeros((16, 32), np.float32)}
    stnp.save_file(extra, str(tmp_path / "hf1" / "extra.safetensors"))
    rc, out = _cli(
        capsys,
        "from-hf",
        tmp_path / "hf1" / "extra.safetensors",
        tmp_path / "in",
        "--preset",
        "qwen3-moe",
        "--config",
        config,
    )
    assert rc == 2 and "experts by layer: layer 0: [4]" in out, out
    # import: expert 2 of layer 0 twice (in two files of one directory)
    whole = _read_hf(tmp_path / "hf1")
    dup = tmp_path / "hf_dup"
    dup.mkdir()
    name = "model.layers.0.mlp.experts.2.up_proj.weight"
    stnp.save_file(whole, str(dup / "a.safetensors"))
    stnp.save_file({name: whole[name]}, str(dup / "b.safetensors"))
    rc, out = _cli(capsys, "from-hf", dup, tmp_path / "in2", "--preset", "qwen3-moe", "--config", config)
    assert rc == 2 and f"tensor '{name}' is in both" in out, out


def test_ep_checkpoint_on_s3(tmp_path, s3_server, s3_bucket):
    """An EP=2 save to a real S3 server (SeaweedFS on 127.0.0.1) equals the local save; it loads at EP=1."""
    from s3_fixtures import S3_CREDENTIALS

    env = {
        "AWS_ENDPOINT_URL": s3_server.endpoint,
        "AWS_ACCESS_KEY_ID": S3_CREDENTIALS[0],
        "AWS_SECRET_ACCESS_KEY": S3_CREDENTIALS[1],
        "AWS_REGION": "us-east-1",
    }
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "expert_parallel.py")
    url = f"s3://{s3_bucket}/ep/ckpt"
    res = run_launch(worker, 2, [tmp_path, "--s3", url], env=env, log_dir=tmp_path / "logs", timeout=300)
    assert_case_ok(res, "s3", 2)
