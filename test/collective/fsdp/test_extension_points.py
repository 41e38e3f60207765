"""Extension points check what they are given and name the extension (issue #50 item 6): storage layers
(``io.backends.add_storage_layer``), backend factories (``io.register_backend``), the trace hook
(``CheckpointOptions.trace_hook``). One process: what is checked is per process.
"""

from __future__ import annotations

import logging
import os

import paddle
import paddle.distributed.fsdp.checkpoint as ck
import pytest
from fault_storage import FaultStorage
from paddle.distributed.fsdp.checkpoint.errors import ExtensionError
from paddle.distributed.fsdp.checkpoint.io import backends
from paddle.distributed.fsdp.checkpoint.io.local import LOCAL


@pytest.fixture(autouse=True)
def _no_layers_left():
    before = list(backends._layers)
    yield
    backends._layers[:] = before


def _save(path) -> None:
    ck.save_state_dict({"x": paddle.ones([4])}, str(path))


def _returns_none(storage):
    return None


class _ReturnsText:
    def __init__(self, storage):
        self.storage = storage

    def __new__(cls, storage):
        return "not a storage"


def _raises(storage):
    raise KeyError("no credentials for the metrics sink")


@pytest.mark.parametrize(
    "layer,says",
    [
        (lambda s: None, "<lambda> returned NoneType"),
        (_returns_none, "_returns_none returned NoneType"),
        (_ReturnsText, "_ReturnsText returned str"),
        (_raises, "_raises raised KeyError"),
    ],
)
def test_a_layer_returning_the_wrong_thing_is_named_before_any_storage_call(tmp_path, layer, says):
    backends.add_storage_layer(layer)
    with pytest.raises(ExtensionError, match=says) as err:
        _save(tmp_path / "c")
    assert "storage layer test_extension_points." in str(err.value)
    assert not os.path.exists(tmp_path / "c"), "the save touched storage through a broken layer"
    backends.remove_storage_layer(layer)
    _save(tmp_path / "c")
    assert ck.read_metadata(str(tmp_path / "c")) is not None


@pytest.mark.parametrize("not_callable", [None, 42, "FaultStorage", FaultStorage(LOCAL)])
def test_a_layer_that_is_not_callable_is_refused_at_registration(not_callable):
    with pytest.raises(ExtensionError, match="storage layer must be callable"):
        backends.add_storage_layer(not_callable)
    assert not_callable not in backends._layers


def test_the_same_layer_added_twice_wraps_once(tmp_path):
    for _ in range(3):
        backends.add_storage_layer(FaultStorage)
    storage = backends.backend_for(str(tmp_path))
    assert type(storage) is FaultStorage and storage.inner is LOCAL, "wrapped more than once"
    _save(tmp_path / "c")
    backends.remove_storage_layer(FaultStorage)
    assert backends.backend_for(str(tmp_path)) is LOCAL, "one remove must undo the repeated adds"


def test_two_different_layers_both_wrap_in_order(tmp_path):
    class Outer(FaultStorage):
        pass

    backends.add_storage_layer(FaultStorage)
    backends.add_storage_layer(Outer)
    storage = backends.backend_for(str(tmp_path))
    assert type(storage) is Outer and type(storage.inner) is FaultStorage and storage.inner.inner is LOCAL


def test_backend_factories_are_checked_and_named(tmp_path):
    with pytest.raises(ExtensionError, match="backend factory for 'memx://' must be callable"):
        backends.register_backend("memx", LOCAL)
    backends.register_backend("memx", lambda: "a bucket name")
    try:
        with pytest.raises(
            ExtensionError, match=r"backend factory for 'memx://' test_extension_points\..*returned str"
        ):
            backends.backend_for("memx://bucket/ckpt")
    finally:
        backends._schemes.pop("memx", None)


def test_trace_hook_is_checked_and_a_raising_one_is_named_without_failing_the_save(tmp_path, caplog):
    with pytest.raises(ExtensionError, match="trace_hook must be callable"):
        ck.CheckpointOptions(trace_hook="print")

    def broken_hook(record):
        raise RuntimeError("dashboard down")

    with caplog.at_level(logging.WARNING):
        ck.save_state_dict(
            {"x": paddle.ones([4])}, str(tmp_path / "c"), options=ck.CheckpointOptions(trace_hook=broken_hook)
        )
    assert "broken_hook raised RuntimeError: dashboard down" in caplog.text
    out = {"x": paddle.zeros([4])}
    ck.load_state_dict(out, str(tmp_path / "c"))
    assert out["x"].numpy().tolist() == [1.0] * 4
