"""The reserved prefix ``__fsdp__.`` (checkpoint/format/reserved.py) in model, buffer and optimizer keys (issue #50
item 7): refused at save time by every door that builds a resume state (state/resume_state.py ``build``), named,
before anything is written; a checkpoint that holds such a tensor anyway (saved before the refusal) is not
dropped silently by a strict load. One process: the keys are the same on every rank.
"""

from __future__ import annotations

import os

import paddle
import pytest
from paddle.distributed.fsdp import FullyShardFusion
from paddle.distributed.fsdp.checkpoint.errors import ReservedKeyError, UnexpectedKeyError
from paddle.distributed.fsdp.state import resume_state


class _Net(paddle.nn.Layer):
    """A linear layer, plus optionally a sublayer named ``reserved_name`` (holding a weight and/or a buffer)."""

    def __init__(self, reserved_name: str | None, weight: bool = True, buffer: bool = False) -> None:
        super().__init__()
        self.body = paddle.nn.Linear(4, 4)
        if reserved_name is not None:
            inner = paddle.nn.Linear(4, 4) if weight else paddle.nn.Layer()
            if buffer:
                inner.register_buffer("counts", paddle.ones([3]), persistable=True)
            self.add_sublayer(reserved_name, inner)

    def forward(self, x):
        return self.body(x)


def _fsdp(net: paddle.nn.Layer, trainable: bool = True):
    paddle.seed(1)
    fsdp = FullyShardFusion(net)
    opt = paddle.optimizer.AdamW(learning_rate=1e-3, parameters=net.parameters())
    fsdp.init_optimizer_state(opt)
    return fsdp, opt


@pytest.mark.parametrize(
    "weight,buffer,with_opt,says",
    [
        (True, False, True, "parameters key '__fsdp__.bias' (and 1 more)"),
        (True, False, False, "parameters key '__fsdp__.bias'"),
        (False, True, False, "buffers key '__fsdp__.counts'"),
        (True, True, True, "parameters key '__fsdp__.bias'"),
    ],
)
def test_a_sublayer_named_fsdp_is_refused_at_save_naming_the_key(tmp_path, weight, buffer, with_opt, says):
    fsdp, opt = _fsdp(_Net("__fsdp__", weight=weight, buffer=buffer))
    for door in ("dir", "root"):
        path = str(tmp_path / door)
        kwargs = dict(optimizer=opt if with_opt else None, step=3 if door == "root" else None)
        with pytest.raises(ReservedKeyError, match=r"starts with the reserved prefix '__fsdp__\.'") as err:
            fsdp.save_checkpoint(path, **kwargs)
        assert says in str(err.value)
        assert not os.path.exists(path) or not os.listdir(path), f"{door}: something was written"


def test_the_optimizer_keys_are_checked_too(tmp_path, monkeypatch):
    """Optimizer state keys derive from parameter keys; a reserved one is named as an optimizer key even when the
    parameters' check is bypassed (the check runs per item)."""
    fsdp, opt = _fsdp(_Net("__fsdp__"))
    real = resume_state._refuse_reserved
    monkeypatch.setattr(resume_state, "_refuse_reserved", lambda item, rec: item == "optimizer" and real(item, rec))
    with pytest.raises(ReservedKeyError, match=r"optimizer key '__fsdp__\.bias\.\w+'"):
        fsdp.save_checkpoint(str(tmp_path / "c"), optimizer=opt)


def test_similar_names_are_not_reserved(tmp_path):
    for name in ("fsdp", "__fsdp", "_fsdp__", "x__fsdp__"):
        fsdp, opt = _fsdp(_Net(name))
        fsdp.save_checkpoint(str(tmp_path / name), optimizer=opt)
        fsdp.load_checkpoint(str(tmp_path / name), optimizer=opt)


def test_a_reserved_tensor_saved_before_the_refusal_is_not_dropped_silently(tmp_path, monkeypatch, caplog):
    """A checkpoint written without the check holds ``__fsdp__.bias`` and ``.weight``: a strict load into a model without that
    sublayer names it (UnexpectedKeyError, as for any foreign key), a non-strict load lists it."""
    monkeypatch.setattr(resume_state, "_refuse_reserved", lambda item, records: None)
    fsdp, opt = _fsdp(_Net("__fsdp__"))
    fsdp.save_checkpoint(str(tmp_path / "old"), optimizer=opt)
    monkeypatch.undo()
    plain, plain_opt = _fsdp(_Net(None))
    with pytest.raises(UnexpectedKeyError, match=r"__fsdp__\.bias"):
        plain.load_checkpoint(str(tmp_path / "old"), optimizer=plain_opt)
    with caplog.at_level("WARNING"):
        plain.load_checkpoint(str(tmp_path / "old"), optimizer=plain_opt, strict=False)
    assert "not in the model" in caplog.text and "__fsdp__.weight" in caplog.text
