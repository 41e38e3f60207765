#!/usr/bin/env python3
"""Memory tier benchmark (issue 34): a MemoryTier save against a memcpy of the state, a restore from memory and
from the peer copy against a cold load from disk, and the tier's host memory (ckpt_bench/memtier.py).

Usage::

    python -m paddle.distributed.launch --nproc_per_node 2 tools/bench_memtier.py --size-gib 1 --json mt.json
"""

from __future__ import annotations

import argparse

from ckpt_bench.memtier import main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size-gib", type=float, default=1.0, help="params + AdamW state in all (GiB, default 1)")
    p.add_argument("--dim", type=int, default=2048, help="Linear(dim, dim) per block (default 2048)")
    p.add_argument("--repeats", type=int, default=3, help="repetitions of every phase (default 3)")
    p.add_argument("--seed", type=int, default=2024)
    p.add_argument("--dir", default=None, help="directory for the disk checkpoint (default: a temp dir in /tmp)")
    p.add_argument("--shm-root", default="/dev/shm/paddle-fsdp-memtier-bench", help="memory root of the tier")
    p.add_argument("--json", default=None, help="write the results to this JSON file")
    return p.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
