"""Keywords are checked once, by the door the caller used (issue #42): a call through any door runs exactly one
keyword check, and an unknown keyword is reported by that door, under its name, never by a layer behind it.

Why: the doors are layered (``fsdp.save_checkpoint`` -> ``state/resume.py`` -> ``CheckpointManager`` -> the
engine; ``dist.save_state_dict`` -> the engine); each layer used to check the keywords again, so a typo could be
reported by an inner function the caller never called. Inner layers now take checked input (``run_save`` with a
SaveRequest, ``run_load``). Counted by wrapping ``keywords.check_keywords`` wherever the package holds it.
"""

from __future__ import annotations

import sys

import paddle
import paddle.distributed as dist
import paddle.distributed.fsdp.checkpoint as ck
import pytest
from paddle.distributed.fsdp import FullyShardFusion, keywords
from paddle.distributed.fsdp.checkpoint import manager  # noqa: F401 - manager imported to be patched
from paddle.distributed.fsdp.checkpoint.load import load  # noqa: F401 - imported to be patched
from paddle.distributed.fsdp.checkpoint.save import save  # noqa: F401 - imported to be patched
from paddle.distributed.fsdp.checkpoint.stock import dispatch  # noqa: F401 - imported to be patched


class _Publisher:
    def publish(self):
        pass

    def is_published(self):
        return True

    def cleanup(self):
        pass


@pytest.fixture
def checks(monkeypatch) -> list[str]:
    """The names of the doors whose keyword check ran, in call order."""
    calls: list[str] = []
    real = keywords.check_keywords

    def counting(fn_name, given, valid):
        calls.append(fn_name)
        return real(fn_name, given, valid)

    for name, mod in list(sys.modules.items()):
        if name.startswith("paddle.distributed.fsdp") and getattr(mod, "check_keywords", None) is real:
            monkeypatch.setattr(mod, "check_keywords", counting)
    return calls


def _sd():
    return {"w": paddle.arange(4, dtype="float32")}


def _model():
    paddle.seed(3)
    model = paddle.nn.Linear(4, 4)
    fsdp = FullyShardFusion(model)
    opt = paddle.optimizer.AdamW(learning_rate=1e-3, parameters=model.parameters())
    fsdp.init_optimizer_state(opt)
    return fsdp, opt


def test_every_save_and_load_door_checks_its_keywords_once(tmp_path, checks):
    d = str(tmp_path / "plain")
    doors = [
        ("save_state_dict", lambda: ck.save_state_dict(_sd(), d, options=ck.CheckpointOptions())),
        ("load_state_dict", lambda: ck.load_state_dict(_sd(), d, strict=True)),
        ("save_and_publish", lambda: save.save_and_publish(_sd(), str(tmp_path / "pub"), _Publisher())),
        ("CheckpointManager.save", lambda: ck.CheckpointManager(str(tmp_path / "m")).save(1, _sd(), async_save=False)),
        ("CheckpointManager.load_latest", lambda: ck.CheckpointManager(str(tmp_path / "m")).load_latest(_sd())),
        ("save_state_dict", lambda: dist.save_state_dict(_sd(), str(tmp_path / "dist"), safetensors=True)),
        ("load_state_dict", lambda: dist.load_state_dict(_sd(), str(tmp_path / "dist"))),
    ]
    fsdp, opt = _model()
    doors += [
        ("save_checkpoint", lambda: fsdp.save_checkpoint(str(tmp_path / "f"), optimizer=opt)),
        ("load_checkpoint", lambda: fsdp.load_checkpoint(str(tmp_path / "f"), optimizer=opt)),
        ("save_checkpoint", lambda: fsdp.save_checkpoint(str(tmp_path / "root"), optimizer=opt, step=2, keep_last=1)),
        ("load_checkpoint", lambda: fsdp.load_checkpoint(str(tmp_path / "root"), optimizer=opt, strict=True)),
    ]
    for door, call in doors:
        checks.clear()
        call()
        assert checks == [door], (door, checks)


def test_an_unknown_keyword_is_reported_once_by_the_door_called(tmp_path, checks):
    d = str(tmp_path / "ck")
    fsdp, opt = _model()
    doors = {
        "save_state_dict": lambda: ck.save_state_dict(_sd(), d, asnyc_save=True),
        "load_state_dict": lambda: ck.load_state_dict(_sd(), d, strikt=True),
        "save_and_publish": lambda: save.save_and_publish(_sd(), d, _Publisher(), asnyc_save=True),
        "CheckpointManager.save": lambda: ck.CheckpointManager(d).save(1, _sd(), asnyc_save=True),
        "CheckpointManager.load_latest": lambda: ck.CheckpointManager(d).load_latest(_sd(), strikt=True),
        "save_checkpoint": lambda: fsdp.save_checkpoint(d, optimizer=opt, step=1, asnyc_save=True),
        "load_checkpoint": lambda: fsdp.load_checkpoint(d, optimizer=opt, strikt=True),
        "memory_tier": lambda: fsdp.memory_tier(opt, durable_root=d, persist_evry=5),
    }
    for door, call in doors.items():
        checks.clear()
        with pytest.raises(TypeError, match=rf"^{door}\(\) got an unexpected keyword argument"):
            call()
        assert checks == [door], (door, checks)
    for door, call in {
        "save_state_dict": lambda: dist.save_state_dict(_sd(), d, safetensors=True, asnyc_save=True),
        "load_state_dict": lambda: dist.load_state_dict(_sd(), d, strikt=True),
    }.items():  # the stock hook: stock's name, its own check, the engine's not run behind it
        checks.clear()
        with pytest.raises(TypeError, match=rf"^{door}\(\) got an unexpected keyword argument"):
            call()
        assert checks == [door], (door, checks)
