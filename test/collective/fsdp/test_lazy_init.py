"""Models larger than one device (2 and 3 gloo ranks): built under paddle.LazyGuard or with parameters in host
memory, they wrap into shards bit-equal to an eagerly built model's; the lazy wrap's peak host memory is bounded
by one unit plus the rank's shards. Also run with --fake-device (host parameters copied into device shards)."""

from __future__ import annotations

import logging
import os
from types import SimpleNamespace

import pytest
from _results import assert_case_ok
from launch_util import run_launch

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "lazy_init.py")
CASES = ["lazy_equals_eager", "lazy_peak_memory", "host_params_device_shards"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return {n: run_launch(WORKER, n, log_dir=tmp_path_factory.mktemp(f"lazy{n}")) for n in (2, 3)}


@pytest.mark.parametrize("nproc", [2, 3])
@pytest.mark.parametrize("case", CASES)
def test_lazy_and_host_built_models(runs, nproc, case):
    """lazy_equals_eager: TinyLM under LazyGuard (a parameter created after a sublayer but listed before it)
    equals the eager build bit for bit, and the random stream after wrapping is where the eager build leaves it.
    lazy_peak_memory: 12 units of 1 MiB; peak host bytes allocated while building lazily and wrapping <= 1.25 x
    (largest unit + this rank's shards), while the eager build peaks at >= the whole model, which exceeds that
    bound. host_params_device_shards: parameters in host memory are copied into (fake-)device shards."""
    assert_case_ok(runs[nproc], case, nproc)
    if case == "lazy_peak_memory":
        logging.getLogger(__name__).info("figures (rank 0, %d ranks): %s", nproc, runs[nproc].result(0)["figures"])


class _Place:
    def __init__(self, name: str, host: bool) -> None:
        self.name, self.host = name, host

    def is_cpu_place(self) -> bool:
        return self.host

    def is_cuda_pinned_place(self) -> bool:
        return False

    def __str__(self) -> str:
        return self.name


def test_check_same_place_accepts_host_parameters_for_device_shards():
    import paddle
    from paddle.distributed.fsdp.devices.device import check_same_place

    if os.environ.get("PADDLE_FSDP_FAKE_DEVICE"):
        pytest.skip("real places only: in fake-device mode host memory is decided by allocation (see the worker)")
    gpu0, gpu1 = _Place("Place(gpu:0)", False), _Place("Place(gpu:1)", False)
    cpu_param = paddle.zeros([2])
    assert check_same_place("w", cpu_param, gpu0) is True  # built on the CPU: copied into the device shard
    assert check_same_place("w", cpu_param, cpu_param.place) is False
    with pytest.raises(ValueError, match=r"'w' is on Place\(gpu:1\).*shards onto Place\(gpu:0\)"):
        check_same_place("w", SimpleNamespace(place=gpu1), gpu0)
    with pytest.raises(ValueError, match="shards onto"):  # a device parameter for host shards
        check_same_place("w", SimpleNamespace(place=gpu0), cpu_param.place)
