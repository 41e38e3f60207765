"""Group layouts on 4 ranks: the ones FullyShardFusion refuses; each rank reports {case: "ok" | traceback}.

Every group is created with a barrier after it (paddle's gloo ``new_group`` otherwise fails "Connection
refused" with 4 processes): fleet.init runs inside ``topology.barrier_after_new_group``.
"""

from __future__ import annotations

import traceback

import _paths  # noqa: F401  (puts launch_util on sys.path)
import paddle
import paddle.distributed as dist
from launch_util import report
from models import make_model
from paddle.distributed import fleet
from paddle.distributed.fsdp import FullyShardFusion, UnsupportedGroupLayoutError
from paddle.distributed.fsdp.topology import barrier_after_new_group


def expect_refused(make_group_or_none, match: str) -> None:
    """FullyShardFusion refuses the layout by name, and leaves the model unwrapped."""
    model = make_model(5)
    before = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    try:
        FullyShardFusion(model, ["Block"], group=make_group_or_none)
    except UnsupportedGroupLayoutError as e:
        assert match in str(e), f"{match!r} not in: {e}"
    else:
        raise AssertionError(f"layout accepted; expected a refusal mentioning {match!r}")
    assert getattr(model, "_fsdp", None) is None, "a refused model was wrapped"
    for key, value in model.state_dict().items():
        assert value.shape == list(before[key].shape), f"{key} changed shape after a refusal"


def case_refuse_fleet_dp_x_sharding(rank, world):
    """The issue's case: fleet dp_degree=2 x sharding_degree=2 (this launch's fleet.init)."""
    expect_refused(None, "dp_degree=2 x sharding_degree=2")


def case_refuse_partial_group(rank, world):
    """An explicit sharding group of 2 of the 4 ranks: the halves would never average gradients."""
    expect_refused(fleet.get_hybrid_communicate_group().get_sharding_parallel_group(), "2 of the 4 ranks")


def case_accept_whole_world(rank, world):
    """Sharding over every rank stays accepted (the global group, passed explicitly)."""
    from paddle.distributed.collective import _get_global_group

    fsdp = FullyShardFusion(make_model(5), ["Block"], group=_get_global_group())
    assert fsdp.world_size == 4 and fsdp.group_layout.replicate_group is None


CASES = {
    "refuse_fleet_dp_x_sharding": case_refuse_fleet_dp_x_sharding,
    "refuse_partial_group": case_refuse_partial_group,
    "accept_whole_world": case_accept_whole_world,
}


def main() -> None:
    world = dist.get_world_size()
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {"dp_degree": 2, "mp_degree": 1, "pp_degree": 1, "sharding_degree": 2}
    with barrier_after_new_group():
        fleet.init(is_collective=True, strategy=strategy)
    rank = dist.get_rank()
    paddle.seed(1)
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
