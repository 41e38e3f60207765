"""The checkpoint's helper threads are sized by this rank's share of the node's cores, not the node's (cores.py).

A 64-core, 8-rank GPU node is simulated by posing the process's CPU affinity (``os.sched_getaffinity``) and the
launcher's ``PADDLE_LOCAL_SIZE``; everything else is the real code path."""

from __future__ import annotations

import os

import pytest
from paddle.distributed.fsdp.checkpoint import cores, encoded_write, quant_threads
from paddle.distributed.fsdp.checkpoint.format import derived


@pytest.fixture
def node(monkeypatch):
    """``pose(cores, ranks)``: this process may run on ``cores`` cores, the launcher started ``ranks`` here."""

    def pose(n_cores: int, ranks: str | None) -> None:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(n_cores)))
        if ranks is None:
            monkeypatch.delenv("PADDLE_LOCAL_SIZE", raising=False)
        else:
            monkeypatch.setenv("PADDLE_LOCAL_SIZE", ranks)

    return pose


@pytest.mark.parametrize(
    "n_cores, ranks, share, helpers",
    [
        (64, "8", 8, 7),  # a GPU node: 8 ranks, each 8 cores, 7 helper threads (not 63 each)
        (64, None, 64, 63),  # one process alone on the node
        (64, "1", 64, 63),
        (2, "2", 1, 1),  # this machine's 2-rank tests: one thread, as before
        (2, None, 2, 1),
        (6, "4", 1, 1),  # fewer cores than ranks per core: at least one
        (64, "0", 64, 63),  # not a rank count: the launcher's variable ignored
        (64, " 8 ", 8, 7),
        (64, "eight", 64, 63),
        (64, "-8", 64, 63),
    ],
)
def test_helper_threads_follow_the_ranks_share_of_the_node(node, n_cores, ranks, share, helpers):
    node(n_cores, ranks)
    assert cores.core_share() == share
    assert cores.helper_threads() == helpers
    assert encoded_write.default_threads() == helpers  # encode, and codec auto's encoder rate (x threads)
    assert quant_threads.thread_count(0) == helpers  # quantize / dequantize moments
    assert quant_threads.thread_count(3) == 3  # an explicit codec_threads wins


def test_the_derived_check_pool_is_the_ranks_share(node):
    node(64, "8")
    assert derived._pool()._max_workers == 8


def test_without_an_affinity_call_every_core_counts(node, monkeypatch):
    node(64, "4")
    monkeypatch.delattr(os, "sched_getaffinity")  # (macOS, Windows)
    monkeypatch.setattr(os, "cpu_count", lambda: 32)
    assert cores.core_share() == 8
