"""Bit-exact resume for every paddle optimizer, through the low-level calls and the one-call form.

Usage: resume.py {save|resume} WORKDIR
  save:   per configuration, train 3 steps, checkpoint, train 3 more, dump every record (reference).
  resume: fresh processes, models built from a DIFFERENT seed, load, train the same 3 more steps,
          compare every parameter and optimizer-state record with the reference, bit for bit.
Each rank reports {case: "ok" | traceback}.
"""

from __future__ import annotations

import os
import sys
import traceback

import _paths  # noqa: F401  (puts launch_util on sys.path)
import numpy as np
import paddle
import paddle.distributed as dist
from launch_util import report
from models import Bf16MLP, global_batches, make_model
from paddle.distributed.fsdp import FullyShardFusion
from paddle.distributed.fsdp.state.optimizer_states import UnsupportedOptimizerStateError
from training import records, train

STEPS, BATCH = 6, 12


class FleetLikeWrapper:
    """What fleet's meta optimizers look like from outside: the real optimizer in ``_inner_opt``."""

    def __init__(self, inner) -> None:
        self._inner_opt = inner

    def __getattr__(self, name):
        return getattr(self._inner_opt, name)


def _opt(kind: str, params, scheduler: bool):
    O = paddle.optimizer
    # Rprop takes no LR scheduler (its __init__ compares the rate with floats)
    lr = O.lr.StepDecay(0.02, step_size=2, gamma=0.5) if scheduler and kind != "rprop" else 0.02
    table = {
        "sgd": lambda: O.SGD(lr, parameters=params),
        "momentum": lambda: O.Momentum(lr, momentum=0.9, parameters=params),
        "momentum_nesterov": lambda: O.Momentum(lr, momentum=0.9, use_nesterov=True, parameters=params),
        "adam": lambda: O.Adam(lr, parameters=params),
        "adamw": lambda: O.AdamW(lr, weight_decay=0.1, parameters=params),
        "adamw_named": lambda: O.AdamW(lr, weight_decay=0.1, parameters=params, name="opt"),
        "adamw_fleet_wrapped": lambda: FleetLikeWrapper(O.AdamW(lr, weight_decay=0.1, parameters=params)),
        "adamax": lambda: O.Adamax(lr, parameters=params),
        "rmsprop": lambda: O.RMSProp(lr, parameters=params),
        "rmsprop_centered_momentum": lambda: O.RMSProp(lr, centered=True, momentum=0.5, parameters=params),
        "adadelta": lambda: O.Adadelta(lr, parameters=params),
        "nadam": lambda: O.NAdam(lr, parameters=params),
        "radam": lambda: O.RAdam(lr, parameters=params),
        "lamb": lambda: O.Lamb(lr, parameters=params),
        "adagrad": lambda: O.Adagrad(lr, parameters=params),
        "asgd": lambda: O.ASGD(lr, batch_num=2, parameters=params),
        "rprop": lambda: O.Rprop(lr, parameters=params),
        "sgd_bf16_master": lambda: O.SGD(lr, parameters=params, multi_precision=True),
    }
    return table[kind]()


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
FORMS = ["low", "one"]  # low-level calls (no dropout); one-call save/load_checkpoint (dropout, scheduler)


def build(kind: str, form: str, seed: int):
    if kind == "sgd_bf16_master":
        paddle.seed(seed)
        model = Bf16MLP()
    else:
        model = make_model(seed, dropout=0.2 if form == "one" else 0.0)
    fsdp = FullyShardFusion(model, fsdp_unit_layers=["Block"] if kind != "sgd_bf16_master" else None)
    opt = _opt(kind, model.parameters(), scheduler=form == "one")
    return model, fsdp, opt


def as_numpy(value) -> np.ndarray:
    tensor = getattr(value, "local_tensor", value)
    return np.array(tensor.numpy())  # bf16 comes out as uint16 bit patterns: compared bit for bit


def save_case(kind, form, workdir, rank, world):
    batches = global_batches(STEPS, BATCH)
    model, fsdp, opt = build(kind, form, seed=7)
    train(model, opt, batches[:3], rank, world)
    path = os.path.join(workdir, f"{kind}-{form}")
    if form == "low":
        dist.save_state_dict(records(fsdp, opt), path)
    else:
        fsdp.save_checkpoint(path, optimizer=opt, extra_state={"step": 3, "data_position": 36})
    train(model, opt, batches[3:], rank, world)
    np.savez(
        os.path.join(workdir, f"{kind}-{form}.ref{rank}.npz"), **{k: as_numpy(v) for k, v in records(fsdp, opt).items()}
    )


def resume_case(kind, form, workdir, rank, world):
    batches = global_batches(STEPS, BATCH)
    model, fsdp, opt = build(kind, form, seed=99)  # a different seed: every value must come from the load
    path = os.path.join(workdir, f"{kind}-{form}")
    if form == "low":
        fsdp.init_optimizer_state(opt)
        dist.load_state_dict(records(fsdp, opt), path)
    else:
        extra = fsdp.load_checkpoint(path, optimizer=opt)
        assert extra == {"step": 3, "data_position": 36}, extra
    train(model, opt, batches[3:], rank, world)
    reference = np.load(os.path.join(workdir, f"{kind}-{form}.ref{rank}.npz"))
    mine = {k: as_numpy(v) for k, v in records(fsdp, opt).items()}
    assert sorted(mine) == sorted(reference.files), sorted(set(mine) ^ set(reference.files))
    for key, value in mine.items():
        assert value.dtype == reference[key].dtype and np.array_equal(value, reference[key]), (
            f"{kind}/{form}: {key} differs after resume: max |diff| "
            f"{np.abs(value.astype('float64') - reference[key].astype('float64')).max()}"
        )


class AdamWithEma(paddle.optimizer.Adam):
    """A user subclass adding an accumulator the table does not declare."""

    def _create_accumulators(self, block, parameters):
        super()._create_accumulators(block, parameters)
        for param in parameters:
            self._add_accumulator("ema", param)


def refusal_cases(workdir, rank, world) -> dict:
    out = {}
    try:
        model = make_model(5)
        fsdp = FullyShardFusion(model, ["Block"])
        opt = AdamWithEma(0.01, parameters=model.parameters())
        train(model, opt, global_batches(1, BATCH), rank, world)
        try:
            fsdp.save_checkpoint(os.path.join(workdir, "undeclared"), optimizer=opt)
            raise AssertionError("save with an undeclared accumulator did not raise")
        except UnsupportedOptimizerStateError as e:
            assert "AdamWithEma" in str(e) and "ema" in str(e), str(e)
        assert not os.path.exists(os.path.join(workdir, "undeclared")), "a refused save left files"
        try:
            fsdp.save_checkpoint(os.path.join(workdir, "hf"), format="hf")
            raise AssertionError("saving in Hugging Face format did not raise")
        except ValueError as e:
            assert "paddle-fsdp-ckpt to-hf" in str(e), str(e)
        out["refusals"] = "ok"
    except Exception:
        out["refusals"] = traceback.format_exc()
    return out


def main() -> None:
    phase, workdir = sys.argv[1:3]
    world = dist.get_world_size()
    if world > 1:
        dist.init_parallel_env()
    rank = dist.get_rank()
    results = {}
    for kind in OPTIMIZERS:
        for form in FORMS:
            try:
                (save_case if phase == "save" else resume_case)(kind, form, workdir, rank, world)
                results[f"{kind}-{form}"] = "ok"
            except Exception:
                results[f"{kind}-{form}"] = traceback.format_exc()
    if phase == "save":
        results.update(refusal_cases(workdir, rank, world))
    report(results)


if __name__ == "__main__":
    main()
