"""What a worker measures about its own process: resident memory now and at its peak, and the JSON it hands back."""

from __future__ import annotations

import json
import os
import resource

MIB = 1 << 20


def rss_now_mib() -> float:
    """Current resident set (VmRSS) in MiB."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def peak_rss_mib() -> float:
    """Peak resident set of this process so far (getrusage's ru_maxrss, KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_result(path: str, rank: int, result: dict) -> None:
    with open(f"{path}.rank{rank}.json", "w") as out:
        json.dump(result, out)


def threads_pinned() -> None:
    """The benchmark runs every contender on one compute thread per rank (the driver sets the variables too)."""
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, "1")
