"""A load that leaves saved state unrequested says so (issue #50 item 8): ``fsdp.load_checkpoint(path)`` without
``optimizer=`` on a checkpoint holding AdamW state (or a GradScaler, an EMA, stateful objects) lists what it left in
``result.report.left_unrequested`` and logs ONE warning naming the parts, unless ``model_only=True``. One process:
the decision is per rank and the same on every rank.
"""

from __future__ import annotations

import itertools
import logging

import paddle
import pytest
from paddle.distributed.fsdp import FullyShardFusion
from paddle.distributed.fsdp.sampler import ResumableDistributedBatchSampler

RESUME_LOGGER = "paddle.distributed.fsdp.state.resume"


class _Counter:
    def __init__(self) -> None:
        self.n = 0

    def state_dict(self):
        return {"n": self.n}

    def set_state_dict(self, state):
        self.n = state["n"]


def _setup():
    paddle.seed(5)
    model = paddle.nn.Linear(4, 3)
    fsdp = FullyShardFusion(model)
    opt = paddle.optimizer.AdamW(learning_rate=1e-2, parameters=model.parameters())
    fsdp.init_optimizer_state(opt)
    return fsdp, opt


def _objects(fsdp):
    return {
        "grad_scaler": paddle.amp.GradScaler(init_loss_scaling=256.0),
        "stateful": {"data": ResumableDistributedBatchSampler(list(range(10)), 2, 1, 0), "counter": _Counter()},
        "ema": fsdp.ema(0.9),
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint holding every optional item: AdamW (after a step), GradScaler, EMA, two stateful objects."""
    fsdp, opt = _setup()
    objs = _objects(fsdp)
    fsdp.model(paddle.ones([2, 4])).sum().backward()
    opt.step()
    objs["ema"].update()
    path = str(tmp_path_factory.mktemp("unrequested") / "ckpt")
    fsdp.save_checkpoint(path, optimizer=opt, **objs)
    return path


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == RESUME_LOGGER and r.levelno == logging.WARNING]


ALL = ["optimizer", "grad_scaler", "stateful", "ema"]


@pytest.mark.parametrize("given", [g for n in range(5) for g in itertools.combinations(ALL, n)])
def test_every_subset_of_objects_left_out_is_listed_and_warned_once(saved, caplog, given):
    fsdp, opt = _setup()
    objs = _objects(fsdp)
    kwargs = {name: (opt if name == "optimizer" else objs[name]) for name in given}
    with caplog.at_level(logging.WARNING, logger=RESUME_LOGGER):
        result = fsdp.load_checkpoint(saved, **kwargs)
    left = [name for name in ALL if name not in given]
    assert result.report.left_unrequested == left
    warned = _warnings(caplog)
    if not left:
        assert warned == []
        return
    assert len(warned) == 1, warned
    for part in left:
        assert part in warned[0] and f"{part}=" in warned[0], warned[0]
    assert "model_only=True" in warned[0]


def test_a_stateful_object_saved_but_not_given_is_named(saved, caplog):
    fsdp, opt = _setup()
    objs = _objects(fsdp)
    with caplog.at_level(logging.WARNING, logger=RESUME_LOGGER):
        result = fsdp.load_checkpoint(
            saved,
            optimizer=opt,
            grad_scaler=objs["grad_scaler"],
            ema=objs["ema"],
            stateful={"data": objs["stateful"]["data"]},
        )
    assert result.report.left_unrequested == ["stateful['counter']"]
    assert len(_warnings(caplog)) == 1 and "stateful['counter']" in _warnings(caplog)[0]


def test_model_only_loads_silently_but_still_reports(saved, caplog):
    fsdp, _opt = _setup()
    with caplog.at_level(logging.WARNING, logger=RESUME_LOGGER):
        result = fsdp.load_checkpoint(saved, model_only=True)
    assert _warnings(caplog) == []
    assert result.report.left_unrequested == ALL
    assert result.report.loaded_keys, "the model was not loaded"


def test_model_only_with_an_object_is_a_contradiction(saved):
    fsdp, opt = _setup()
    with pytest.raises(ValueError, match="model_only=True loads the model alone"):
        fsdp.load_checkpoint(saved, optimizer=opt, model_only=True)
    with pytest.raises(TypeError, match="model_only must be a bool"):
        fsdp.load_checkpoint(saved, model_only="yes")


def test_a_model_only_checkpoint_loads_without_a_warning(tmp_path, caplog):
    fsdp, _opt = _setup()
    fsdp.save_checkpoint(str(tmp_path / "m"))
    with caplog.at_level(logging.WARNING, logger=RESUME_LOGGER):
        result = fsdp.load_checkpoint(str(tmp_path / "m"))
    assert result.report.left_unrequested == [] and _warnings(caplog) == []
