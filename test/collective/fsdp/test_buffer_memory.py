"""FullyShardFusion gives memory back as units finish: at most prefetch_depth + 1 units gathered and holding a
full-size gradient buffer at any unit's backward, nothing left after backward (FSDP's own ledger of the host
blocks it maps, buffer_memory.py), and views of gathered weights that autograd keeps stay valid.

The memory this saves per rank, measured, is in docs/performance.md (tools/train_bench/run.py), not asserted here.
"""

from __future__ import annotations

import os

import numpy as np
import paddle
import pytest
from _results import assert_case_ok
from launch_util import run_launch

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "buffer_memory.py")


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_launch(WORKER, 2, timeout=300, env={"PADDLE_PG_TIMEOUT": "60000"}, log_dir=tmp_path_factory.mktemp("bm"))


@pytest.mark.parametrize("case", ["bounded", "saved_views"])
def test_two_ranks(two_ranks, case):
    assert_case_ok(two_ranks, case, 2)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16", "int64"])
@pytest.mark.parametrize("mapped", [True, False])
def test_new_block(dtype, mapped):
    """A block of every dtype: the asked size and dtype, zero when asked, writable; mapped ones are counted by
    the ledger while referenced (views included) and dropped with their last reference."""
    import gc

    from paddle.distributed.fsdp.buffer_memory import GRADIENT, BlockLedger, new_block

    ledger = BlockLedger()
    block = new_block(1000, getattr(paddle, dtype), GRADIENT, ledger, mapped=mapped, zero=True)
    assert block.shape == [1000] and block.dtype == getattr(paddle, dtype)
    assert float(block.astype("float32").abs().sum()) == 0.0
    block[3:5] = paddle.to_tensor([1, 2]).astype(block.dtype)
    view = block._slice(3, 5)
    np.testing.assert_array_equal(view.astype("float32").numpy(), [1.0, 2.0])
    expected = 1000 * block.element_size() if mapped else 0
    assert ledger.live[GRADIENT] == expected
    del block
    gc.collect()
    assert ledger.live[GRADIENT] == expected  # the view keeps it
    del view
    gc.collect()
    assert ledger.live[GRADIENT] == 0 and ledger.count[GRADIENT] == 0
    assert ledger.peak[GRADIENT] == expected
