"""A process forked while the engine's thread pools and its async-save worker exist (a DataLoader worker, a forked
evaluator) loads and saves in the child: derived weights cast on the derive pool, checksums and decodes on theirs,
lossy moments on the quantizer's, an async save on the background worker. A child's derived load used to hang
forever in ``derived.cast_into`` (its work queued on a pool whose threads stayed in the parent; thread_pools.py
forgets them in a child), and its async save in ``SaveHandle.wait`` (background.py: the worker thread too);
docs/reports/2026-12-07-attack-derived-lossy.md.

One process and its forked child; the child reports through its exit status, and a watchdog in it turns a hang
into a failure with the stacks printed (``faulthandler``).
"""

from __future__ import annotations

import os
import sys

import numpy as np
import paddle
import paddle.distributed.fsdp.checkpoint as ck
import pytest
from paddle.distributed.fsdp.checkpoint import thread_pools
from paddle.distributed.fsdp.checkpoint.format import derived

N = 1 << 20  # four blocks of the derive pool: the cast of a load goes through the pool
OPTIONS = ck.CheckpointOptions(codec="byteplane-zstd", codec_threads=2, checksum_threads=2)
CHILD_DEADLINE_S = 120  # (a watchdog: the child's work takes seconds; a hang is the failure it guards against)


def _state() -> dict:
    rng = np.random.default_rng(3)
    master = rng.standard_normal(N).astype(np.float32)
    return {
        "w": paddle.to_tensor(derived.cast_bits(master, "bfloat16")),
        "w.master_weight": paddle.to_tensor(master),
        "w.moment1": paddle.to_tensor(rng.standard_normal(N).astype(np.float32)),
        "w.moment2": paddle.to_tensor(rng.random(N).astype(np.float32)),
    }


def _load_weight(path) -> np.ndarray:
    target = {"w": paddle.zeros([N], "bfloat16")}
    ck.load_state_dict(target, str(path), options=OPTIONS)
    return target["w"].view("uint16").numpy()


def _child(tmp_path, want: np.ndarray) -> None:
    import faulthandler

    faulthandler.dump_traceback_later(CHILD_DEADLINE_S, exit=True)  # a hang: stacks on stderr, exit status 1
    try:
        assert np.array_equal(_load_weight(tmp_path / "parent"), want)  # derived: cast on the derive pool
        state = _state()
        ck.save_state_dict(state, str(tmp_path / "child_async"), async_save=True, options=OPTIONS).wait()
        assert np.array_equal(_load_weight(tmp_path / "child_async"), want)
        manager = ck.CheckpointManager(str(tmp_path / "child_root"))
        manager.save(1, state, quantize_moments="int8", options=OPTIONS)  # quantized on the quantizer's pool
        whole = ck.load_full_state_dict(str(tmp_path / "child_root" / "step_00000001"))
        assert np.abs(whole["w.moment1"].numpy() - state["w.moment1"].numpy()).max() < 0.1
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
        os._exit(2)
    os._exit(0)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_loads_and_saves_with_its_own_pools(tmp_path):
    state = _state()
    want = state["w"].view("uint16").numpy().copy()
    # the parent makes every pool and the async worker: an async save, a quantized save, a derived load
    ck.save_state_dict(state, str(tmp_path / "parent"), async_save=True, options=OPTIONS).wait()
    ck.CheckpointManager(str(tmp_path / "parent_root")).save(1, state, quantize_moments="int8", options=OPTIONS)
    assert np.array_equal(_load_weight(tmp_path / "parent"), want)
    made = set(thread_pools._pools)  # {(purpose, threads)}
    assert {"derive-check", "quant", "checksum", "decode"} <= {purpose for purpose, _n in made}, made
    pid = os.fork()
    if pid == 0:
        _child(tmp_path, want)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"forked child failed or hung (status {status})"
    assert set(thread_pools._pools) == made  # the parent's pools are kept
