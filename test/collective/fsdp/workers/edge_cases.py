"""Edge cases of FullyShardFusion on N ranks; each rank reports {case: "ok" | traceback}.

Cases: more ranks than elements, opt.step() before any backward, unused parameters, two instances side
by side (a model and its EMA copy) and one after another, and (with --fleet) fleet's sharding group.
"""

from __future__ import annotations

import sys
import traceback

import _paths  # noqa: F401  (puts launch_util on sys.path)
import numpy as np
import paddle
import paddle.distributed as dist
from launch_util import report
from models import global_batches, local_part, make_model
from paddle.distributed.fsdp import FullyShardFusion
from training import train


class Tiny(paddle.nn.Layer):
    """Two elements of weight in all: fewer than ranks in a 3-rank world."""

    def __init__(self) -> None:
        super().__init__()
        self.w = self.create_parameter([2], default_initializer=paddle.nn.initializer.Constant(0.5))

    def forward(self, x):
        return (x * self.w).sum()


class Pair(paddle.nn.Layer):
    """One FSDP unit whose buffer holds a used and an unused Linear: the buffer never completes."""

    def __init__(self) -> None:
        super().__init__()
        self.used = paddle.nn.Linear(4, 4)
        self.unused = paddle.nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)


class WithUnused(paddle.nn.Layer):
    def __init__(self) -> None:
        super().__init__()
        self.pair = Pair()

    def forward(self, x):
        return self.pair(x).mean()


def case_more_ranks_than_elements(rank, world):
    x = paddle.to_tensor([1.0, 2.0])
    ref = Tiny()
    opt_ref = paddle.optimizer.SGD(0.1, parameters=ref.parameters())
    ref(x).backward()
    opt_ref.step()
    model = Tiny()
    fsdp = FullyShardFusion(model)
    opt = paddle.optimizer.SGD(0.1, parameters=model.parameters())
    model(x).backward()
    opt.step()
    np.testing.assert_array_equal(fsdp.full_parameters()["w"].numpy(), ref.w.numpy())


def case_step_before_backward(rank, world):
    model = make_model(3)
    fsdp = FullyShardFusion(model, ["Block"])
    before = {k: v.numpy() for k, v in fsdp.full_parameters().items()}
    opt = paddle.optimizer.AdamW(0.1, parameters=model.parameters())
    opt.step()
    opt.clear_grad()
    after = fsdp.full_parameters()
    for key, value in before.items():
        np.testing.assert_array_equal(after[key].numpy(), value, err_msg=key)


def case_unused_parameters(rank, world):
    paddle.seed(5)
    ref = WithUnused()
    paddle.seed(5)
    model = WithUnused()
    fsdp = FullyShardFusion(model, fsdp_unit_layers=["Pair"])
    x = paddle.to_tensor(np.arange(8 * 4, dtype="float32").reshape([8, 4]) / 10)
    opt_ref = paddle.optimizer.Adam(0.1, parameters=ref.parameters())
    opt = paddle.optimizer.Adam(0.1, parameters=model.parameters())
    for _ in range(2):
        ref(x).backward()
        opt_ref.step()
        opt_ref.clear_grad()
        model(paddle.to_tensor(local_part(x.numpy(), rank, world))).backward()
        opt.step()
        opt.clear_grad()
    full = fsdp.full_parameters()
    for key, param in ref.named_parameters():
        np.testing.assert_allclose(full[key].numpy(), param.numpy(), rtol=1e-5, atol=1e-6, err_msg=key)
    assert all(p.grad is None for p in model.pair.unused.parameters()), "an unused parameter got a gradient"


def case_two_instances(rank, world):
    """A model and an EMA copy live side by side; a third model is built after them."""
    ref = make_model(11)
    train(ref, paddle.optimizer.Adam(0.01, parameters=ref.parameters()), global_batches(2, 12), 0, 1)
    model, ema = make_model(11), make_model(11)
    fsdp, fsdp_ema = FullyShardFusion(model, ["Block"]), FullyShardFusion(ema, ["Block"])
    opt = paddle.optimizer.Adam(0.01, parameters=model.parameters())
    train(model, opt, global_batches(2, 12), rank, world)
    with paddle.no_grad():  # EMA update on the local pieces: both models share one layout
        for p, q in zip(model.parameters(), ema.parameters()):
            q.scale_(0.5)
            q.add_(p * 0.5)
    full, full_ema = fsdp.full_parameters(), fsdp_ema.full_parameters()
    init = make_model(11)
    for key, param in ref.named_parameters():
        np.testing.assert_allclose(full[key].numpy(), param.numpy(), rtol=1e-5, atol=1e-6, err_msg=key)
        expected = 0.5 * dict(init.named_parameters())[key].numpy() + 0.5 * param.numpy()
        np.testing.assert_allclose(full_ema[key].numpy(), expected, rtol=1e-5, atol=1e-6, err_msg=key)
    third = make_model(11)
    fsdp_third = FullyShardFusion(third, ["Block"])
    train(third, paddle.optimizer.Adam(0.01, parameters=third.parameters()), global_batches(2, 12), rank, world)
    for key, value in fsdp_third.full_parameters().items():
        np.testing.assert_allclose(value.numpy(), full[key].numpy(), rtol=1e-5, atol=1e-6, err_msg=key)


def case_sharding_group(rank, world):
    """Under fleet (``--fleet``), FSDP shards over the hybrid group's sharding group."""
    from paddle.distributed import fleet

    model = make_model(13)
    fsdp = FullyShardFusion(model, ["Block"])
    if getattr(fleet.fleet, "_hcg", None) is not None:
        group = fleet.get_hybrid_communicate_group().get_sharding_parallel_group()
        assert fsdp.comm.group is group, "FSDP did not pick fleet's sharding group"
    assert fsdp.world_size == world
    ref = make_model(13)
    train(ref, paddle.optimizer.SGD(0.1, parameters=ref.parameters()), global_batches(2, 12), 0, 1)
    train(model, paddle.optimizer.SGD(0.1, parameters=model.parameters()), global_batches(2, 12), rank, world)
    full = fsdp.full_parameters()
    for key, param in ref.named_parameters():
        np.testing.assert_allclose(full[key].numpy(), param.numpy(), rtol=1e-5, atol=1e-6, err_msg=key)


def case_object_exchange(rank, world):
    """The one-shot object exchange: small objects in one round, a mix of small and large (a second round on
    every rank, decided by the length headers), an empty object and None; over the FSDP group (fleet's
    sharding group under --fleet)."""
    from paddle.distributed.fsdp.comm.communication import OBJECT_BLOCK_BYTES

    fsdp = FullyShardFusion(Tiny())
    comm = fsdp.comm
    assert comm.all_gather_object(("r", rank)) == [("r", r) for r in range(world)]
    big = lambda r: bytes([r]) * (OBJECT_BLOCK_BYTES * (r + 1))  # noqa: E731
    mixed = comm.all_gather_object(big(rank) if rank % 2 else {"rank": rank})
    assert mixed == [big(r) if r % 2 else {"rank": r} for r in range(world)], [type(m) for m in mixed]
    assert comm.all_gather_object(None) == [None] * world
    assert comm.all_gather_object(b"") == [b""] * world
    assert comm.all_gather_object([rank] * 2000) == [[r] * 2000 for r in range(world)]


CASES = {
    "object_exchange": case_object_exchange,
    "more_ranks_than_elements": case_more_ranks_than_elements,
    "step_before_backward": case_step_before_backward,
    "unused_parameters": case_unused_parameters,
    "two_instances": case_two_instances,
    "sharding_group": case_sharding_group,
}


def main() -> None:
    world = dist.get_world_size()
    if "--fleet" in sys.argv:
        from paddle.distributed import fleet

        strategy = fleet.DistributedStrategy()
        strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": 1, "pp_degree": 1, "sharding_degree": world}
        from paddle.distributed.fsdp import barrier_after_new_group

        with barrier_after_new_group(reuse_identical=True):  # paddle 3.3.1's gloo new_group race (expert-parallel.md)
            fleet.init(is_collective=True, strategy=strategy)
    elif world > 1:
        dist.init_parallel_env()
    rank = dist.get_rank()
    results = {}
    for name, case in CASES.items():
        try:
            case(rank, world)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
    report(results)


if __name__ == "__main__":
    main()
