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


@pytest.mark.parametrize("case", ["bounded", "default_depth", "saved_views"])
def test_two_ranks(two_ranks, case):
    assert_case_ok(two_ranks, case, 2)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16", "int64"])
@pytest.mark.parametrize("mapped", [True, False])
def test_new_block(dtype, mapped):
    """A block of every dtype: the asked size and dtype, zero when asked, writable; mapped ones are counted by
    the ledger while referenced (views included) and dropped with their last reference."""
    import gc

    from paddle.distributed.fsdp.devices.buffer_memory import GRADIENT, BlockLedger, new_block

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


class _Branchy(paddle.nn.Layer):
    """Two units; the second one is skipped on odd steps (its parameters get no gradient there)."""

    def __init__(self) -> None:
        super().__init__()
        self.units = paddle.nn.LayerList([paddle.nn.Linear(6, 6) for _ in range(2)])

    def forward(self, x, step: int):
        x = paddle.tanh(self.units[0](x))
        if step % 2 == 0:
            x = self.units[1](x)
        return (x * x).mean()


@pytest.mark.parametrize("set_to_zero", [True, False])
def test_clear_grad_frees_gradient_shards_and_trains_as_before(set_to_zero):
    """``opt.clear_grad()`` frees the gradient shards (nothing mapped, ``.grad`` None) and training is what a plain
    model does in both modes: zeroed gradients of a parameter unused in a step are still stepped (AdamW decays it),
    dropped ones are not."""
    from paddle.distributed.fsdp import FullyShardFusion

    def make():
        paddle.seed(5)
        model = _Branchy()
        return model, paddle.optimizer.AdamW(0.05, parameters=model.parameters(), weight_decay=0.5)

    ref, ref_opt = make()
    model, opt = make()
    fsdp = FullyShardFusion(model, ["Linear"])
    rng = np.random.default_rng(0)
    for step in range(4):
        x = rng.standard_normal([3, 6]).astype("float32")
        for m, o in ((ref, ref_opt), (model, opt)):
            m(paddle.to_tensor(x), step).backward()
            o.step()
            o.clear_grad(set_to_zero=set_to_zero)
        assert fsdp.memory_account()["mapped_blocks"] == 0, fsdp.memory_account()
        assert all(p.grad is None for p in model.parameters())
        mine = fsdp.full_parameters()
        for key, value in ref.state_dict().items():
            np.testing.assert_array_equal(mine[key].numpy(), value.numpy(), err_msg=f"step {step}: {key}")
