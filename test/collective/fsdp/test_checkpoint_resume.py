"""Sharded checkpoints resume bit-exactly for every paddle optimizer (2 ranks, fresh processes)."""

from __future__ import annotations

import os

import pytest
from _results import assert_case_ok
from launch_util import run_launch

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "resume.py")
OPTIMIZERS = [
    "sgd",
    "momentum",
    "momentum_nesterov",
    "adam",
    "adamw",
    "adamw_named",
    "adamw_fleet_wrapped",
    "adamax",
    "rmsprop",
    "rmsprop_centered_momentum",
    "adadelta",
    "nadam",
    "radam",
    "lamb",
    "adagrad",
    "asgd",
    "rprop",
    "sgd_bf16_master",
]
NPROC = 2


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Save in one launch, resume in another: the second set of processes knows only the files."""
    workdir = tmp_path_factory.mktemp("checkpoints")
    saved = run_launch(WORKER, NPROC, ["save", str(workdir)], log_dir=tmp_path_factory.mktemp("save"))
    resumed = run_launch(WORKER, NPROC, ["resume", str(workdir)], log_dir=tmp_path_factory.mktemp("resume"))
    return workdir, saved, resumed


@pytest.mark.parametrize("form", ["low", "one"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_resume_is_bit_exact(runs, optimizer, form):
    """3 steps, save, fresh processes with another seed, load, 3 steps == 6 uninterrupted steps, bit for bit
    (every parameter and every optimizer-state record). 'one' = save_/load_checkpoint with dropout and an
    LR scheduler; 'low' = sharded_state_dict + dist.save_state_dict / load_state_dict."""
    _, saved, resumed = runs
    assert_case_ok(saved, f"{optimizer}-{form}", NPROC)
    assert_case_ok(resumed, f"{optimizer}-{form}", NPROC)


def test_undeclared_accumulator_and_hf_format_are_refused(runs):
    _, saved, _ = runs
    assert_case_ok(saved, "refusals", NPROC)


def test_checkpoint_keys_and_shapes_are_the_models(runs):
    """What a user of TinyLM would expect: structured names, the tied weight once (as embed.weight), the
    frozen table without optimizer state, `<param>.<state>` optimizer keys free of counters and names."""
    from paddle.distributed.fsdp.checkpoint import read_metadata

    workdir, _, _ = runs
    metadata = read_metadata(os.path.join(workdir, "adamw_named-one"))
    shapes = {key: tuple(meta.shape) for key, meta in metadata.tensors.items()}
    block = {
        "norm1.weight": (16,),
        "norm1.bias": (16,),
        "mix.weight": (16, 16),
        "mix.bias": (16,),
        "norm2.weight": (16,),
        "norm2.bias": (16,),
        "up.weight": (16, 48),
        "up.bias": (48,),
        "down.weight": (48, 16),
        "down.bias": (16,),
    }
    params = {"embed.weight": (37, 16), "pos": (6, 16), "norm.weight": (16,), "norm.bias": (16,)}
    params.update({f"blocks.{i}.{k}": v for i in range(3) for k, v in block.items()})
    expected = dict(params)
    for key, shape in params.items():
        if key == "pos":
            continue  # frozen: no optimizer state
        expected[f"{key}.moment1"] = shape
        expected[f"{key}.moment2"] = shape
        expected[f"{key}.beta1_pow_acc"] = (1,)
        expected[f"{key}.beta2_pow_acc"] = (1,)
    assert shapes == expected
    assert set(metadata.values) == {"__fsdp__.optimizer", "__fsdp__.rng", "__fsdp__.extra_state", "__fsdp__.buffers"}
    assert metadata.values["__fsdp__.buffers"] == []  # TinyLM has no persistable buffers
    assert metadata.values["__fsdp__.optimizer"]["class"] == "AdamW"
    assert metadata.values["__fsdp__.extra_state"] == {"step": 3, "data_position": 36}


class _MasterSGD(__import__("paddle").optimizer.SGD):
    """SGD that steps the fp32 master weight and derives the parameter from it, as paddle's GPU multi-precision
    kernels do (the CPU bf16 kernel leaves the master weight alone, so it cannot show a stale one)."""

    def _append_optimize_op(self, block, param_and_grad):
        import paddle

        if isinstance(param_and_grad, dict):
            param_and_grad = self._update_param_group(param_and_grad)
        param, grad = param_and_grad
        master = self._master_weights[param.name]
        lr = self._create_param_lr(param_and_grad).astype("float32")
        with paddle.no_grad():
            new = master - lr * grad.astype("float32")
            paddle.assign(new, output=master)
            paddle.assign(new.astype(param.dtype), output=param)


def test_parameter_loaded_without_master_weight_refreshes_it(tmp_path):
    """strict=False load of a checkpoint saved before the first step (parameters, no master weights): the master
    weights created for the load are re-cast from the loaded parameters, so a step that computes the parameter
    from its master weight continues from the loaded values (same bits as a run that never stopped)."""
    import numpy as np
    import paddle
    from paddle.distributed.fsdp import FullyShardFusion

    class Bf16Linear(paddle.nn.Layer):
        def __init__(self) -> None:
            super().__init__()
            self.w = self.create_parameter([8, 4], dtype="bfloat16")

        def forward(self, x):
            return (x @ self.w.astype("float32")).square().sum()

    def build(seed: int):
        paddle.seed(seed)
        model = Bf16Linear()
        fsdp = FullyShardFusion(model)
        return model, fsdp, _MasterSGD(0.1, parameters=model.parameters(), multi_precision=True)

    def step(model, opt) -> np.ndarray:
        model(paddle.arange(16, dtype="float32").reshape([2, 8]) / 16).backward()
        opt.step()
        opt.clear_grad()
        return np.array(model.w.numpy())  # bf16 as uint16 bit patterns

    model, fsdp, opt = build(1)
    fsdp.save_checkpoint(str(tmp_path / "ckpt"), optimizer=opt)  # before the first step: no master weights
    reference = step(model, opt)

    model, fsdp, opt = build(2)
    result = fsdp.load_checkpoint(str(tmp_path / "ckpt"), optimizer=opt, strict=False)
    assert result.report.missing_keys == ["w.master_weight"]
    state = fsdp.optimizer_sharded_state_dict(opt)
    master = state["w.master_weight"].local_tensor
    loaded = fsdp.sharded_state_dict()["w"].local_tensor
    assert np.array_equal(master.numpy(), loaded.astype("float32").numpy())
    assert np.array_equal(step(model, opt), reference)
