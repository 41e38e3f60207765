"""Unknown keywords are refused with a TypeError naming the nearest valid one, by every public function of the
package that takes ``**kwargs`` (issue 29: ``asnyc_save=True`` saved synchronously without a word).

The functions are found by walking the package, so a new catch-all without a case here fails the test. Each is
called with a misspelt keyword: TypeError naming the misspelt and the intended keyword, and nothing written.
Stock's keywords keep working: the engine accepts (and ignores) them, the stock dispatch passes them to stock.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import numpy as np
import paddle
import paddle.distributed as dist
import paddle.distributed.fsdp as fsdp_pkg
import paddle.distributed.fsdp.checkpoint as ck
import pytest
from paddle.distributed.fsdp import FullyShardFusion


def _catch_alls() -> set[str]:
    """``module:qualname`` of every public function and public-class method with a ``**kwargs`` parameter."""
    found = set()
    for info in pkgutil.walk_packages(fsdp_pkg.__path__, fsdp_pkg.__name__ + "."):
        mod = importlib.import_module(info.name)
        for name, obj in vars(mod).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                continue
            members = [(name, obj)] if inspect.isfunction(obj) else []
            if inspect.isclass(obj):
                members = [(f"{name}.{m}", f) for m, f in vars(obj).items() if not m.startswith("_")]
            for qual, fn in members:
                if inspect.isfunction(fn) and any(
                    p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values()
                ):
                    found.add(f"{mod.__name__}:{qual}")
    return found


P = "paddle.distributed.fsdp."


class _Publisher:
    def publish(self):
        raise AssertionError("a refused save must not publish")

    def is_published(self):
        return False

    def cleanup(self):
        pass


def _fsdp():
    return FullyShardFusion(paddle.nn.Linear(2, 2))


# catch-all -> (call with the misspelt keyword, the misspelt keyword, the keyword meant)
CASES = {
    P + "checkpoint.save.save:save_state_dict": (
        lambda d: ck.save_state_dict({"w": paddle.ones([2])}, d, asnyc_save=True),
        "asnyc_save",
        "async_save",
    ),
    P + "checkpoint.load.load:load_state_dict": (
        lambda d: ck.load_state_dict({"w": paddle.ones([2])}, d, verfy_checksums=False),
        "verfy_checksums",
        "verify_checksums",
    ),
    P + "checkpoint.manager:CheckpointManager.save": (
        lambda d: ck.CheckpointManager(d).save(1, {"w": paddle.ones([2])}, asnyc_save=True),
        "asnyc_save",
        "async_save",
    ),
    P + "checkpoint.manager:CheckpointManager.load_latest": (
        lambda d: ck.CheckpointManager(d).load_latest({"w": paddle.ones([2])}, strikt=False),
        "strikt",
        "strict",
    ),
    P + "checkpoint.save.save:save_and_publish": (
        lambda d: ck.save.save_and_publish({"w": paddle.ones([2])}, d, _Publisher(), asnyc_save=True),
        "asnyc_save",
        "async_save",
    ),
    P + "checkpoint.options:CheckpointOptions.replace": (
        lambda d: ck.CheckpointOptions().replace(checksun="crc32"),
        "checksun",
        "checksum",
    ),
    P + "checkpoint.stock.dispatch:save_state_dict": (
        lambda d: dist.save_state_dict({"w": paddle.ones([2])}, d, safetensor=True),
        "safetensor",
        "safetensors",
    ),
    P + "checkpoint.stock.dispatch:load_state_dict": (
        lambda d: dist.load_state_dict({"w": paddle.ones([2])}, d, unique_ids=0),
        "unique_ids",
        "unique_id",
    ),
    P + "fully_shard_fusion:FullyShardFusion.save_checkpoint": (
        lambda d: _fsdp().save_checkpoint(d, asnyc_save=True),
        "asnyc_save",
        "async_save",
    ),
    P + "comm.topology:new_group": (
        lambda d: __import__(P + "topology", fromlist=["x"]).new_group([0], backnd="gloo"),
        "backnd",
        "backend",
    ),
    P + "fully_shard_fusion:FullyShardFusion.memory_tier": (
        lambda d: _fsdp().memory_tier(durable_root=str(d), persist_evry=5),
        "persist_evry",
        "persist_every",
    ),
    P + "fully_shard_fusion:FullyShardFusion.load_checkpoint": (
        lambda d: _fsdp().load_checkpoint(d, keep_lats=1),
        "keep_lats",
        "strict",  # load_checkpoint has no keep_last: no close match, so the valid ones are listed
    ),
}


def test_every_catch_all_has_a_case():
    assert _catch_alls() == set(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_unknown_keyword_is_a_type_error_naming_the_nearest(name, tmp_path):
    call, wrong, meant = CASES[name]
    target = tmp_path / "ckpt"
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{wrong}'") as e:
        call(str(target))
    assert f"'{meant}'" in str(e.value) or f"{meant}," in str(e.value), str(e.value)
    assert not list(tmp_path.iterdir()), "a call with an unknown keyword wrote something"


def test_misspelt_async_save_is_not_a_sync_save(tmp_path):
    """The issue's case, through the manager: refused before anything is saved, and the correct spelling saves."""
    mgr = ck.CheckpointManager(str(tmp_path / "run"))
    with pytest.raises(TypeError, match="did you mean 'async_save'"):
        mgr.save(1, {"w": paddle.ones([2])}, asnyc_save=True)
    assert mgr.latest_step() is None
    mgr.save(1, {"w": paddle.ones([2])}, async_save=True).wait()
    assert mgr.latest_step() == 1


def test_stock_keywords_keep_working(tmp_path):
    """The engine accepts stock's keywords (ignored); the dispatch passes every stock keyword to stock as before."""
    sd = {"w": paddle.arange(4, dtype="float32")}
    ck.save_state_dict(sd, str(tmp_path / "e"), unique_id=0, safetensors=True, save_replicas=False)
    got = {"w": paddle.zeros([4])}
    ck.load_state_dict(got, str(tmp_path / "e"), unique_id=0, offload=False, safetensors=True, comm_method="broadcast")
    assert np.array_equal(got["w"].numpy(), sd["w"].numpy())
    dist.save_state_dict(
        sd,
        str(tmp_path / "s"),
        process_group=None,
        coordinator_rank=0,
        unique_id=None,
        async_save=False,
        safetensors=False,
        save_replicas=False,
    )
    assert any(p.suffix == ".distcp" for p in (tmp_path / "s").iterdir())  # stock's own format
    got = {"w": paddle.zeros([4])}
    dist.load_state_dict(
        got,
        str(tmp_path / "s"),
        process_group=None,
        coordinator_rank=0,
        unique_id=None,
        offload=False,
        mw_name_compatibility=True,
        aoa_config=None,
        safetensors=False,
        worker_groups=None,
        comm_method="broadcast",
    )
    assert np.array_equal(got["w"].numpy(), sd["w"].numpy())
