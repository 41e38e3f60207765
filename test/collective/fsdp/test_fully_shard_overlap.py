"""Communication/computation overlap, proven as PyTorch FSDP2 proves it, on CPU with an emulated GPU stream.

Collectives take a known emulated delay on a stream of their own (comm_emulation.py: the data moves at issue,
the output stays NaN until the task is waited for) and units compute for a known time (sleeps that release
the GIL). Without prefetching a step takes about their sum (asserted); with it, about max(communication,
computation) (logged, not asserted: a wall-clock ratio on a shared machine). The recorded trace of gathers, reduce-scatters and unit computations equals the schedule
documented in overlap.py, written out independently in the worker. Prefetching trains bit-identically to
no prefetching and like one process, on emulated (2 ranks) and plain gloo (3 ranks) collectives; bf16
reduce-scatters round as documented; the order check runs every N-th pass only; taking back a bf16 ``.grad``
reads nothing on the host and keeps its semantics.

What the CPU proof does not show: NCCL stream semantics (events, record_stream), bandwidth, or contention
between communication and compute kernels; see docs/gpu.md for the first-GPU checklist.
"""

from __future__ import annotations

import logging
import os

import pytest
from _results import assert_case_ok
from launch_util import run_launch

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "overlap.py")
FAST_FAIL_ENV = {"PADDLE_PG_TIMEOUT": "60000"}
EMULATED = dict(FAST_FAIL_ENV, PADDLE_FSDP_EMULATE_GPU_COLLECTIVES="1")
LOG = logging.getLogger(__name__)
#: the bound the issue (#30, item 4) sets for a prefetched step, relative to max(communication, computation)
OVERLAP_BOUND = 1.15


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    return run_launch(WORKER, 2, timeout=400, env=EMULATED, log_dir=tmp_path_factory.mktemp("overlap2"))


@pytest.fixture(scope="module")
def gloo3(tmp_path_factory):
    args = ["trace", "equality", "reduce_bf16"]
    return run_launch(WORKER, 3, args, timeout=400, env=FAST_FAIL_ENV, log_dir=tmp_path_factory.mktemp("overlap3"))


@pytest.mark.parametrize("case", ["trace", "equality", "reduce_bf16", "check_interval", "take_back"])
def test_emulated_two_ranks(emulated, case):
    assert_case_ok(emulated, case, 2)


@pytest.mark.parametrize("case", ["trace", "equality", "reduce_bf16"])
def test_plain_gloo_three_ranks(gloo3, case):
    assert_case_ok(gloo3, case, 3)


@pytest.mark.parametrize("config", ["compute_bound", "comm_bound"])
def test_prefetch_overlaps_communication(emulated, config):
    """The emulated delays are really paid when nothing overlaps them (unprefetched: at least 0.95x comm + compute;
    sleeps only add up, so a loaded machine can not make this fail) and prefetching issues the same collectives.
    That prefetching hides them is kept by the schedule itself (``test_emulated_two_ranks[trace]``: every gather
    issued before the computation it overlaps); the step-time ratio (issue #30: <= 1.15x max(comm, compute)) is a
    wall-clock figure, logged here and reported, never asserted: on a shared 2-core machine it varied 2-3x."""
    assert_case_ok(emulated, "timing", 2)
    for rank in range(2):
        figures = emulated.result(rank)["timing.figures"]
        on, off = figures[f"{config}/depth1"], figures[f"{config}/depth0"]
        LOG.info(
            "rank %d %s: prefetched %.3fx max(comm, compute) (bound %.2f)",
            rank,
            config,
            on["ratio_to_max"],
            OVERLAP_BOUND,
        )
        assert off["ratio_to_sum"] >= 0.95, (rank, off)
        assert on["collectives"] == off["collectives"], (on, off)


@pytest.mark.parametrize(
    "options, match",
    [
        ({"prefetch_depth": -1}, "prefetch_depth"),
        ({"prefetch_depth": True}, "prefetch_depth"),
        ({"prefetch_depth": 1.0}, "prefetch_depth"),
        ({"reduce_dtype": "float16"}, "reduce_dtype"),
        ({"check_collective_order": -2}, "check_collective_order"),
    ],
)
def test_bad_options_are_refused(options, match):
    import paddle
    from paddle.distributed.fsdp import FullyShardFusion

    model = paddle.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=match):
        FullyShardFusion(model, **options)
    assert getattr(model, "_fsdp", None) is None and model.weight.shape == [2, 2]  # refused before any change


def test_bad_environment_is_refused(monkeypatch):
    import paddle
    from paddle.distributed.fsdp import FullyShardFusion
    from paddle.distributed.fsdp.comm.comm_emulation import DELAY_ENV, delay_from_env
    from paddle.distributed.fsdp.comm.communication import CHECK_ORDER_ENV

    monkeypatch.setenv(CHECK_ORDER_ENV, "sometimes")  # yes/on mean 1 (every pass): env_switches.py
    with pytest.raises(ValueError, match=CHECK_ORDER_ENV):
        FullyShardFusion(paddle.nn.Linear(2, 2))
    monkeypatch.setenv(DELAY_ENV, "-3")
    with pytest.raises(ValueError, match=DELAY_ENV):
        delay_from_env()
