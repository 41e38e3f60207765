"""The first save's exchange of the scale simulation (scale.py): each rank's part and the coordinator's.

What runs is the engine's own code of a first save (checkpoint/first_save.py) for a virtual world, in one
process: every rank packs its record descriptions into columns (``rank_columns``), the coordinator assigns the
writes of the world from all of them (``coordinate``: unpickle, numpy assignment and checks, one answer per
rank), and sampled ranks turn their answer into their own assignment and lay out their own file. The collectives
that carry the bytes (gather, broadcast, scatter: Comm.gather_bytes / scatter_bytes) are not run; their bytes
are counted: what a rank sends and receives, padding to the largest message included.
"""

from __future__ import annotations

import gc
import pickle
import time


def first_save(wires: list, samples: list[int]) -> tuple[object, dict]:
    """``(the coordinator's full assignment, figures)`` of a first save of ``wires`` (per rank, its records in
    wire form); ``samples``: the non-coordinator ranks whose own part is timed (the coordinator is rank 0)."""
    from paddle.distributed.fsdp.checkpoint import first_save as fs
    from paddle.distributed.fsdp.checkpoint import planner

    world = len(wires)
    pack_s = {}
    blobs = []
    for r, w in enumerate(wires):
        t0 = time.perf_counter()
        blobs.append(fs.rank_columns(w))
        pack_s[r] = time.perf_counter() - t0
    gc.collect()
    t0 = time.perf_counter()
    full, answers = fs.coordinate(blobs, {})
    coord_s = time.perf_counter() - t0
    assert full is not None, answers[0]
    top_in, top_out = max(map(len, blobs)), max(map(len, answers))
    own_s = []
    for r in samples:
        t0 = time.perf_counter()
        part = fs.own_assignment(r, wires[r], answers[r])
        planner.lay_out_files(part, {}, "0" * 32, r)
        own_s.append(pack_s[r] + time.perf_counter() - t0)
        assert part.writes[r] == full.writes[r]
    # before: one all_gather of every rank's pickled descriptions, padded to the longest (communication.py)
    old_bytes = world * (8 + max(len(pickle.dumps(w, protocol=pickle.HIGHEST_PROTOCOL)) for w in wires))
    return full, {
        "first_rank_s": max(own_s),  # pack + own part + own layout, worst sampled rank
        "first_coordinator_s": coord_s,  # unpickle + assign + check + answers
        "first_rank_sent_bytes": 8 + top_in + 8,  # size, then its padded columns (with their length)
        "first_rank_recv_bytes": 8 + 8 + top_out + 8,  # two broadcast sizes, its padded answer
        "first_coordinator_recv_bytes": world * (8 + top_in + 8),
        "first_old_recv_bytes": old_bytes,  # before: what every rank received
    }
