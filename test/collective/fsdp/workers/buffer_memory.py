"""Buffer memory (buffer_memory.py): gathered units and gradient buffers are given back as units finish.

Usage: buffer_memory.py   Each rank reports {case: "ok" | traceback, "<case>.figures": {...}}.

Live mapped blocks are read from FSDP's ledger right before every unit's backward (a hook registered after
FSDP's own, so the unit is gathered and earlier units reduced), after backward and after the optimizer step.
"""

from __future__ import annotations

import traceback

import _paths  # noqa: F401  (puts launch_util on sys.path)
import numpy as np
import paddle
import paddle.distributed as dist
from launch_util import report
from paddle.distributed.fsdp import FullyShardFusion

DIM, UNITS, ROWS, STEPS = 16, 5, 8, 3


class Unit(paddle.nn.Layer):
    """Pre-norm MLP block; ``transposed`` multiplies by views of its weights (``w.T``), which autograd keeps
    for backward: views of the gathered block that outlive the release of the unit after its forward."""

    def __init__(self, transposed: bool = False) -> None:
        super().__init__()
        self.transposed = transposed
        self.norm = paddle.nn.LayerNorm(DIM)
        self.up = paddle.nn.Linear(DIM, 4 * DIM)
        self.down = paddle.nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        h = self.norm(x)
        if self.transposed:
            h = paddle.nn.functional.gelu(paddle.matmul(h, self.up.weight.T, transpose_y=True) + self.up.bias)
            return x + paddle.matmul(h, self.down.weight.T, transpose_y=True) + self.down.bias
        return x + self.down(paddle.nn.functional.gelu(self.up(h)))


class Net(paddle.nn.Layer):
    def __init__(self, transposed: bool = False) -> None:
        super().__init__()
        self.units = paddle.nn.LayerList([Unit(transposed) for _ in range(UNITS)])
        self.head = paddle.nn.LayerNorm(DIM)  # a root parameter: gathered for the whole forward and backward

    def forward(self, x):
        for unit in self.units:
            x = unit(x)
        return self.head(x).pow(2).mean()


def batches(world: int):
    rng = np.random.default_rng(5)
    return [rng.standard_normal([ROWS * world, DIM]).astype("float32") for _ in range(STEPS)]


def build(transposed: bool, depth: int | None):
    """The model (FSDP-wrapped unless ``depth`` is None) and its optimizer: AdamW, SGD for comparisons with one
    process (AdamW's normalisation magnifies rounding differences of near-zero gradients)."""
    paddle.seed(7)
    model = Net(transposed)
    fsdp = FullyShardFusion(model, ["Unit"], prefetch_depth=depth) if depth is not None else None
    if transposed:
        return model, fsdp, paddle.optimizer.SGD(0.1, parameters=model.parameters())
    return model, fsdp, paddle.optimizer.AdamW(1e-2, parameters=model.parameters(), weight_decay=0.01)


def unit_and_root_bytes(fsdp) -> tuple[int, int]:
    """Largest unit buffer and the root's buffer, in bytes (gathered and gradient blocks are this size)."""
    units = [b.layout.padded_numel * 4 for b in fsdp.buffers if b.layout.slots[0].key.startswith("units.")]
    root = [b.layout.padded_numel * 4 for b in fsdp.buffers if not b.layout.slots[0].key.startswith("units.")]
    assert len(units) == UNITS and len(root) == 1, [b.layout.name for b in fsdp.buffers]
    return max(units), root[0]


def held(fsdp) -> dict:
    """Bytes held now by kind. Host memory: the mapped blocks alive (the ledger: whoever references them). A
    device (fake-device mode: paddle's allocator, no ledger): what the buffers reference."""
    account = fsdp.memory_account()
    if fsdp.buffers[0]._maps_blocks:
        return {**dict(fsdp.blocks.live), "blocks": account["mapped_blocks"]}
    return {
        "gathered": account["gathered_units"],
        "gradient": account["gradient_buffers"],
        "gradient_shard": account["gradient_shard"],
    }


def watch(model, fsdp, samples: list) -> None:
    def post(layer, inputs, output):
        if not output.stop_gradient:
            output.register_hook(lambda grad: samples.append(("backward", held(fsdp))))

    for unit in model.units:
        unit.register_forward_post_hook(post)


def case_bounded(rank: int, world: int) -> dict:
    """Before each unit's backward at most prefetch_depth + 1 units are gathered and hold a gradient buffer (plus
    the root's); after backward only the gradient shards are left, after ``opt.clear_grad()`` nothing."""
    figures = {}
    for depth in (0, 1, 2):
        model, fsdp, opt = build(False, depth)
        unit, root = unit_and_root_bytes(fsdp)
        samples: list = []
        watch(model, fsdp, samples)
        for x in batches(world):
            model(paddle.to_tensor(x[rank * ROWS : (rank + 1) * ROWS])).backward()
            samples.append(("after backward", held(fsdp)))
            opt.step()
            opt.clear_grad()
            samples.append(("after step", held(fsdp)))
        during = [live for where, live in samples if where == "backward"]
        assert len(during) == UNITS * STEPS, len(during)
        shards = sum(b.layout.shard_numel * 4 for b in fsdp.buffers)
        for where, live in samples:
            if where == "backward":
                assert live["gathered"] <= (depth + 1) * unit + root, (depth, where, live, unit, root)
                assert live["gradient"] <= (depth + 1) * unit + root, (depth, where, live, unit, root)
                assert live.get("blocks", 0) <= 2 * (depth + 2) + len(fsdp.buffers), (depth, where, live)
            elif where == "after backward":  # only the gradient shards, which opt.step() reads
                assert live["gathered"] == live["gradient"] == 0 and live["gradient_shard"] == shards, (depth, live)
            else:  # opt.clear_grad() freed the gradient shards
                assert not any(live.values()), (depth, where, live)
        # gathers did happen (world > 1): the bounds above are not met by measuring nothing
        assert max(live["gathered"] for live in during) >= unit, during
        figures[f"depth{depth}"] = {"peak": dict(fsdp.blocks.peak), "unit": unit, "root": root}
        if fsdp.buffers[0]._maps_blocks:  # the ledger's peaks, between the samples too
            peak = fsdp.blocks.peak
            assert peak["gathered"] <= (depth + 1) * unit + root, (depth, peak)
            assert unit <= peak["gradient"] <= (depth + 1) * unit + root, (depth, peak)
            if fsdp.comm.emulation is None:  # gloo finishes reductions inside the call: none waits in the queue
                assert peak["gradient"] <= unit + root, (depth, peak)
    return figures


def case_default_depth(rank: int, world: int) -> dict:
    """On plain gloo (collectives finish inside the call) the default prefetch_depth is 0: at most one unit (plus
    the root) gathered at any moment, the ledger's peak included; the emulated GPU stream keeps 1 (overlap.py)."""
    paddle.seed(7)
    model = Net()
    fsdp = FullyShardFusion(model, ["Unit"])
    opt = paddle.optimizer.AdamW(1e-2, parameters=model.parameters(), weight_decay=0.01)
    plain_gloo = fsdp.comm.completes_inside_call
    assert fsdp.schedule.depth == (0 if plain_gloo else 1), (plain_gloo, fsdp.schedule.depth)
    unit, root = unit_and_root_bytes(fsdp)
    samples: list = []
    watch(model, fsdp, samples)
    for x in batches(world):
        model(paddle.to_tensor(x[rank * ROWS : (rank + 1) * ROWS])).backward()
        opt.step()
        opt.clear_grad()
    bound = (fsdp.schedule.depth + 1) * unit + root
    assert max(live["gathered"] for _, live in samples) >= unit, samples
    for _, live in samples:
        assert live["gathered"] <= bound, (live, unit, root)
    if fsdp.buffers[0]._maps_blocks:
        assert fsdp.blocks.peak["gathered"] <= bound, (fsdp.blocks.peak, unit, root)
    return {"depth": fsdp.schedule.depth, "peak": dict(fsdp.blocks.peak)}


def case_saved_views(rank: int, world: int) -> dict:
    """Autograd keeps views of gathered weights past their unit's release: their block must stay what it was
    (a reused block would feed another unit's weights to the backward). FSDP trains like one process, and every
    block is given back once backward is over."""
    data = batches(world)
    ref, _, ref_opt = build(True, None)
    for x in data:
        ref(paddle.to_tensor(x)).backward()
        ref_opt.step()
        ref_opt.clear_grad()
    model, fsdp, opt = build(True, 1)
    losses = []
    for x in data:
        loss = model(paddle.to_tensor(x[rank * ROWS : (rank + 1) * ROWS]))
        loss.backward()
        account = fsdp.memory_account()
        assert account["mapped_gathered"] == account["mapped_gradient"] == 0, account
        opt.step()
        opt.clear_grad()
        assert fsdp.memory_account()["mapped_blocks"] == 0, fsdp.memory_account()
        assert all(p.grad is None for p in model.parameters())  # freed, as stock stage 3's clear_grad frees
        losses.append(float(loss))
    mine = fsdp.full_parameters()
    for key, value in ref.state_dict().items():
        np.testing.assert_allclose(mine[key].numpy(), value.numpy(), rtol=1e-5, atol=1e-6, err_msg=key)
    return {"losses": losses}


CASES = {"bounded": case_bounded, "default_depth": case_default_depth, "saved_views": case_saved_views}


def main() -> None:
    dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {}
    for name, case in CASES.items():
        try:
            out[f"{name}.figures"] = case(rank, world)
            out[name] = "ok"
        except Exception:  # noqa: BLE001 - reported per case
            out[name] = traceback.format_exc()
    report(out)


if __name__ == "__main__":
    main()
