"""What a worker measures about its own process: resident memory now and at its peak, and the JSON it hands back."""

from __future__ import annotations

import ctypes
import ctypes.util
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


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "mallinfo2") else None


_LIBC = _libc()
if _LIBC is not None:
    _LIBC.mallinfo2.restype = _Mallinfo2


def heap_now_mib() -> dict[str, float]:
    """Where the resident memory sits now, in MiB: glibc's malloc (``mallinfo2``: heap arenas, in use and free in
    them, mmapped chunks) and the kernel's view (``/proc/self/smaps_rollup``: anonymous and file-backed resident
    pages). Empty where neither exists (not glibc / not Linux)."""
    out: dict[str, float] = {}
    if _LIBC is not None:
        info = _LIBC.mallinfo2()
        out.update(
            heap_arenas=info.arena / MIB,
            heap_in_use=info.uordblks / MIB,
            heap_free=info.fordblks / MIB,
            malloc_mmapped=info.hblkhd / MIB,
        )
    try:
        with open("/proc/self/smaps_rollup") as rollup:
            for line in rollup:
                key, _, rest = line.partition(":")
                if key in ("Rss", "Anonymous", "Shared_Clean", "Private_Clean", "Private_Dirty"):
                    out[f"smaps_{key.lower()}"] = int(rest.split()[0]) / 1024
    except OSError:
        pass
    return out


def write_result(path: str, rank: int, result: dict) -> None:
    with open(f"{path}.rank{rank}.json", "w") as out:
        json.dump(result, out)


def threads_pinned() -> None:
    """The benchmark runs every contender on one compute thread per rank (the driver sets the variables too)."""
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, "1")
