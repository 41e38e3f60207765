"""A refused load names the same keys on every rank (#53): run by test_first_hour.py on 2 processes.

``mismatch_ranks.py DIR SEED[,SEED...]``: a model saved by FSDP, loaded into models where seeded layers have other
shapes (or dtypes) through ``fsdp.load_checkpoint`` and ``dist.load_state_dict``, and plain state dicts where each
rank requests a different wrong key. Every seed in one launch (its start-up costs more than the cases), each in
DIR/seed<SEED>; each rank reports {seed: {case: "ok" | traceback, "figures": {case: "Class: message"}}}.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import _paths  # noqa: F401  (puts launch_util on sys.path)
import numpy as np
import paddle
import paddle.distributed as dist
import paddle.distributed.fsdp.checkpoint as ck
from launch_util import report, run_cases
from paddle.distributed.fsdp import FullyShardFusion

WIDTHS = (16, 24, 8, 32, 12)


class Net(paddle.nn.Layer):
    def __init__(self, widths=WIDTHS, dtypes=None):
        super().__init__()
        dtypes = dtypes or ["float32"] * len(widths)
        self.layers = paddle.nn.LayerList(
            [paddle.nn.Linear(widths[i - 1] if i else 8, w) for i, w in enumerate(widths)]
        )
        for layer, dtype in zip(self.layers, dtypes):
            layer.to(dtype=dtype)


@dataclass
class Seeded:
    """The seed being run and its own directory (main sets it before each seed's cases)."""

    workdir: str = ""
    seed: int = 0


CURRENT = Seeded()


def _workdir() -> str:
    return CURRENT.workdir


def _rng() -> np.random.Generator:
    return np.random.default_rng(CURRENT.seed)


def _saved() -> str:
    path = os.path.join(_workdir(), "saved")
    paddle.seed(5)
    fsdp = FullyShardFusion(Net())
    fsdp.save_checkpoint(path)
    return path


def _other_shapes() -> tuple[Net, list[int]]:
    changed = sorted(_rng().choice(len(WIDTHS), size=2, replace=False).tolist())
    widths = [w + 4 if i in changed else w for i, w in enumerate(WIDTHS)]
    paddle.seed(5)
    return Net(widths), changed


def _seen(figures: dict, name: str, fn, cls) -> None:
    try:
        fn()
    except cls as e:
        figures[name] = f"{type(e).__name__}: {e}"
        return
    raise AssertionError(f"{name}: no {cls.__name__}")


def case_fsdp_load(rank, world, figures):
    path = _saved()
    model, changed = _other_shapes()
    fsdp = FullyShardFusion(model)
    _seen(figures, "fsdp_load", lambda: fsdp.load_checkpoint(path), ck.StateDictMismatchError)
    figures["fsdp_load_changed"] = changed


def case_plain_load(rank, world, figures):
    path = _saved()
    model, _ = _other_shapes()
    fsdp = FullyShardFusion(model)
    _seen(figures, "plain_load", lambda: dist.load_state_dict(fsdp.sharded_state_dict(), path), ck.ShapeMismatchError)


def case_each_rank_another_key(rank, world, figures):
    """Rank r asks for key k{r} with a wrong shape, the others right: a different first problem on each rank."""
    path = os.path.join(_workdir(), "plain")
    keys = [f"k{r}" for r in range(world)]
    ck.save_state_dict({k: paddle.ones([3, 2]) for k in keys}, path)
    state = {k: paddle.zeros([3, 2] if k != f"k{rank}" else [2, 3]) for k in keys}
    _seen(figures, "each_rank", lambda: ck.load_state_dict(state, path), ck.ShapeMismatchError)


CASES = {
    "fsdp_load": case_fsdp_load,
    "plain_load": case_plain_load,
    "each_rank": case_each_rank_another_key,
}


def main() -> None:
    if dist.get_world_size() > 1:
        dist.init_parallel_env()
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for seed in sys.argv[2].split(","):
        CURRENT.workdir, CURRENT.seed = os.path.join(sys.argv[1], f"seed{seed}"), int(seed)
        results: dict = {"figures": {}}
        out[seed] = run_cases(CASES, rank, world, results["figures"], results=results)
    report(out)


if __name__ == "__main__":
    main()
