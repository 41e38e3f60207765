"""Fleet's EP start-up (ep_degree=2) through ``barrier_after_new_group(reuse_identical=True)``, with faults injected
into paddle's gloo group creation from here (test code, outside the package).

argv[1], the scenario:
- ``plain``: no fault.
- ``faults``: ranks 0 and 1 fail their first gloo group ([0, 1], the EP group) as paddle does when a pair's
  listener was taken ("Connection refused"); rank 2 comes out of its second gloo group ([0, 2], moe_sharding)
  12 s late, past the 4 s probe deadline of rank 0.
- ``exhaust`` (2 ranks): both fail every attempt of their first gloo group; 2 attempts allowed, no reuse (with it
  the world's group would be reused and nothing created).

Each rank reports the package's warnings, the ranks of its groups, one all-reduce per group, and the error it raised.
"""

from __future__ import annotations

import logging
import sys
import time

import _paths  # noqa: F401  (puts launch_util on sys.path)
import paddle
import paddle.distributed as dist
import paddle.distributed.collective as collective
from launch_util import report
from paddle.distributed import fleet
from paddle.distributed.fsdp import barrier_after_new_group

ORDER = ["pp", "moe_sharding", "ep", "dp", "sharding", "sep", "cp", "mp"]
PROBE_TIMEOUT = 4.0
SLOW = 12.0
REFUSED = "[/paddle/third_party/gloo/gloo/transport/tcp/pair.cc:784] connect [127.0.0.1]:5020: Connection refused"


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _inject(scenario: str, rank: int) -> None:
    """Wrap paddle's creation of one gloo process group (called on the members of a group of 2+ ranks)."""
    real = collective._new_process_group_impl
    calls = [0]

    def faulty(*args, **kwargs):
        calls[0] += 1
        if rank in (0, 1) and (scenario == "exhaust" or (scenario == "faults" and calls[0] == 1)):
            raise RuntimeError(REFUSED)  # before the store exchange: the peer fails too, nobody waits on it
        pg = real(*args, **kwargs)
        if scenario == "faults" and rank == 2 and calls[0] == 2:
            time.sleep(SLOW)
        return pg

    collective._new_process_group_impl = faulty


def main() -> None:
    scenario = sys.argv[1]
    handler = _Warnings()
    logging.getLogger("paddle.distributed.fsdp").addHandler(handler)
    dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    _inject(scenario, rank)
    strategy = fleet.DistributedStrategy()
    strategy.hybrid_configs = {
        "dp_degree": 1,
        "mp_degree": 1,
        "pp_degree": 1,
        "sharding_degree": world,
        "ep_degree": 2,
        "moe_sharding_degree": world // 2,
        "order": ORDER,
    }
    out: dict = {"error": None}
    start = time.monotonic()
    try:
        attempts = 2 if scenario == "exhaust" else 4
        reuse = scenario != "exhaust"
        with barrier_after_new_group(reuse_identical=reuse, attempts=attempts, probe_timeout=PROBE_TIMEOUT):
            fleet.init(is_collective=True, strategy=strategy)
    except Exception as e:  # noqa: BLE001 - reported: the test checks its class and message
        out["error"] = f"{type(e).__name__}: {e}"
    out["seconds"] = time.monotonic() - start
    if out["error"] is None:
        hcg = fleet.get_hybrid_communicate_group()
        groups = {
            "sharding": hcg.get_sharding_parallel_group(),
            "ep": hcg.get_expert_parallel_group(),
            "moe_sharding": hcg.get_moe_sharding_parallel_group(),
        }
        out["ranks"], out["sums"] = {}, {}
        for name, g in groups.items():
            x = paddle.to_tensor([float(rank + 1)])
            dist.all_reduce(x, group=g)
            out["ranks"][name], out["sums"][name] = list(g.ranks), float(x)
        with barrier_after_new_group(reuse_identical=True):  # a later block reuses fleet's groups, not dropped ones
            again = dist.new_group([0, 2])
        out["reused_moe_group"] = rank not in (0, 2) or again.id == groups["moe_sharding"].id
        dist.barrier()
    out["warnings"] = handler.lines
    report(out)


if __name__ == "__main__":
    main()
