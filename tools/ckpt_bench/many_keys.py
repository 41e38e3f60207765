"""The many-keys phase: the per-key cost of the engine's bookkeeping, on a state of many small tensors.

Why: a mixture of experts has ~10^5 keys (experts x layers x (parameter + optimizer states)); there the cost of a
save or load is the Python work per key and per piece (records, plans, the metadata of every piece, tiny reads),
not the bytes. Each rank holds a flat 64-float piece of each of ``--keys`` tensors (as FSDP records them); the
phase times a save and a load of them (in this process, after a barrier, to the slowest rank) and reports the
seconds per key.
"""

from __future__ import annotations

import os
import shutil

PIECE_FLOATS = 64  # floats per rank per key (256 bytes): the data is negligible, the bookkeeping is all


def many_small_records(n: int, rank: int, world: int, fill: bool) -> dict:
    """``n`` flat records of ``PIECE_FLOATS * world`` floats, this rank's piece of each (the key index, or 0)."""
    import paddle
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    out = {}
    total = PIECE_FLOATS * world
    lo = PIECE_FLOATS * rank
    for i in range(n):
        key = f"experts.{i}.weight"
        t = paddle.full([PIECE_FLOATS], float(i) if fill else 0.0, dtype="float32")
        out[key] = ShardedWeight(
            key=key,
            local_tensor=t,
            local_shape=(total,),
            global_shape=(total,),
            global_offset=(0,),
            is_flattened=True,
            flattened_range=slice(lo, lo + PIECE_FLOATS),
        )
    return out


def run_many_keys(comm, keys: int, repeats: int, work: str, options) -> dict:
    """Save and load ``keys`` small records ``repeats`` times: {"keys", "save_s", "load_s"} (slowest rank)."""
    from paddle.distributed.fsdp.checkpoint import load_state_dict, save_state_dict

    src = many_small_records(keys, comm.rank, comm.world, fill=True)
    dst = many_small_records(keys, comm.rank, comm.world, fill=False)
    out: dict = {"keys": keys, "world": comm.world, "save_s": [], "load_s": []}
    for rep in range(repeats):
        path = os.path.join(work, f"many_keys_{rep}")
        _, t, _ = comm.timed(save_state_dict, src, path, options=options)
        out["save_s"].append(t)
        _, t, _ = comm.timed(load_state_dict, dst, path, options=options)
        out["load_s"].append(t)
        probe = [dst[f"experts.{i}.weight"].local_tensor for i in range(0, keys, max(1, keys // 7))]
        if any(float(p[0]) != float(i) for p, i in zip(probe, range(0, keys, max(1, keys // 7)))):
            raise SystemExit("many-keys phase: the loaded values differ from the saved ones")
        comm.barrier()
        if comm.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
        comm.barrier()
    return out


def summary(res: dict, torch_res: dict | None = None) -> str:
    """One line for the report: medians, microseconds per key, and torch DCP's figures when measured."""
    from statistics import median

    n = res["keys"]
    s, ld = median(res["save_s"]), median(res["load_s"])
    line = (
        f"many small keys: {n} keys x {res['world']} ranks ({PIECE_FLOATS * 4} B per rank each), medians of "
        f"{len(res['save_s'])}: save {s:.3f} s ({s / n * 1e6:.0f} us per key), load {ld:.3f} s "
        f"({ld / n * 1e6:.0f} us per key)"
    )
    if torch_res:
        ts, tl = median(torch_res["save_s"]), median(torch_res["load_s"])
        line += f"; torch DCP save {ts:.3f} s ({ts / s:.2f}x ours), load {tl:.3f} s ({tl / ld:.2f}x ours)"
    return line
