"""The first save's exchange on real ranks (first_save.py): run by test_first_save.py on 3 processes.

``first_save.py DIR``: records refused by the coordinator's assignment (a dtype on one rank, a gap) fail on every
rank with the same named error and leave nothing at the path, whichever rank coordinates; a good save through a
coordinator other than rank 0 loads back whole; the same records under another coordinator take the first-save
exchange again (its memo entry names the coordinator), and once more under the same one do not.
Each rank reports {case: "ok" | traceback, "figures": {case: the error message it saw}}.
"""

from __future__ import annotations

import os
import sys

import _paths  # noqa: F401  (puts launch_util on sys.path)
import numpy as np
import paddle
import paddle.distributed.fsdp.checkpoint as ck
from launch_util import worker_main
from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight
from paddle.distributed.fsdp.checkpoint.save import save as save_mod

N = 30  # elements of "w", split in equal thirds


def _state(rank: int, world: int, dtype: str = "float32", stop: int | None = None) -> dict:
    a, b = rank * N // world, (rank + 1) * N // world if stop is None else stop
    t = paddle.to_tensor(np.arange(a, b, dtype=np.float32)).astype(dtype)
    w = ShardedWeight("w", t, [N], [N], [0], is_flattened=True, flattened_range=slice(a, b))
    return {"w": w, "bias": paddle.full([4], 2.0), "step": 5}


def _refused(rank, world, figures, name, state, coordinator, match):
    path = os.path.join(sys.argv[1], name)
    try:
        ck.save_state_dict(state, path, coordinator_rank=coordinator)
    except ck.InvalidStateDictError as e:
        assert match in str(e), e
        figures[name] = str(e)
    else:
        raise AssertionError(f"rank {rank}: the save of bad records did not raise")
    left = [n for n in os.listdir(sys.argv[1]) if n.startswith(name)]
    assert not left, left


def case_dtype_on_one_rank(rank, world, figures):
    dtype = "float64" if rank == world - 1 else "float32"
    _refused(rank, world, figures, "dtype", _state(rank, world, dtype), 1, "dtype float32 on rank 0")


def case_gap(rank, world, figures):
    stop = N // world - 2 if rank == 0 else None  # rank 0 holds two elements less: a gap before rank 1's
    _refused(rank, world, figures, "gap", _state(rank, world, stop=stop), world - 1, "cover 28 of 30")


def case_good_saves_and_memo(rank, world, figures):
    calls = []
    real = save_mod.exchange_assignment
    save_mod.exchange_assignment = lambda *a: calls.append(1) or real(*a)
    try:
        for i, coordinator in enumerate((1, 0, 0)):
            ck.save_state_dict(_state(rank, world), os.path.join(sys.argv[1], f"good{i}"), coordinator_rank=coordinator)
    finally:
        save_mod.exchange_assignment = real
    assert len(calls) == 2, f"first-save exchanges: {len(calls)} (expected: coordinator 1, then 0, then memo)"
    for i in range(3):
        full = ck.load_full_state_dict(os.path.join(sys.argv[1], f"good{i}"))
        assert np.array_equal(full["w"].numpy(), np.arange(N, dtype=np.float32))
        assert np.array_equal(full["bias"].numpy(), np.full(4, 2.0, np.float32))


CASES = {
    "dtype_on_one_rank": case_dtype_on_one_rank,
    "gap": case_gap,
    "good_saves_and_memo": case_good_saves_and_memo,
}

if __name__ == "__main__":
    worker_main(CASES)
