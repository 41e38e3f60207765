"""Cross-rank coordination shared by the save and load paths of the checkpoint engine.

The process group wrapper (``_Comm``: one ``all_gather_object`` per exchange, none in a single process), the
error exchange that makes all ranks fail together (``_error_payload`` / ``_raise_gathered``), the file-based
completion protocol helpers used instead of collectives (``PARTS_DIR`` markers, ``_poll``, ``_read_json``), the
save target check, the commit timeout, byte alignment of host buffers, and phase tracing
(``PADDLE_FSDP_CKPT_TRACE=1``; the switch is this module's ``_TRACE``). The protocols themselves are described in
save.py and load.py.
"""

from __future__ import annotations

import json
import os
import time

from .errors import InvalidStateDictError, SaveFailedError, rebuild_remote_error

PARTS_DIR = ".parts"
_TRACE = os.environ.get("PADDLE_FSDP_CKPT_TRACE") == "1"


class _Tracer:
    """Phase timings printed to stderr when PADDLE_FSDP_CKPT_TRACE=1 (for finding where time goes)."""

    def __init__(self, what: str):
        self.what = what
        self.t0 = self.last = time.perf_counter()
        self.marks: list[tuple[str, float]] = []

    def mark(self, name: str) -> None:
        if _TRACE:
            now = time.perf_counter()
            self.marks.append((name, now - self.last))
            self.last = now

    def done(self) -> None:
        if _TRACE:
            import sys

            parts = " ".join(f"{n}={d * 1000:.1f}ms" for n, d in self.marks)
            print(
                f"[ckpt-trace pid {os.getpid()}] {self.what}: {parts} total="
                f"{(time.perf_counter() - self.t0) * 1000:.1f}ms",
                file=sys.stderr,
                flush=True,
            )


DEFAULT_COMMIT_TIMEOUT = float(os.environ.get("PADDLE_FSDP_CKPT_COMMIT_TIMEOUT", "1800"))


# ------------------------------------------------------------------------------------------------ groups


class _Comm:
    def __init__(self, process_group):
        import paddle.distributed as dist

        self.group = process_group
        if process_group is not None:
            self.world = int(process_group.nranks)
            self.rank = int(process_group.rank)
            if self.rank < 0:
                raise InvalidStateDictError("this process is not a member of the given process_group")
        elif dist.is_initialized() and dist.get_world_size() > 1:
            self.world = dist.get_world_size()
            self.rank = dist.get_rank()
        else:
            self.world, self.rank = 1, 0

    def all_gather_object(self, obj) -> list:
        if self.world == 1:
            return [obj]
        import paddle.distributed as dist

        out: list = []
        dist.all_gather_object(out, obj, group=self.group)
        return out


def _error_payload(e: BaseException):
    if e is None:
        return None
    return (type(e).__name__, str(e))


def _raise_gathered(statuses: list, own: BaseException | None) -> None:
    """Raise on every rank if any rank failed: the own error where there is one, else the first remote one."""
    if own is not None:
        raise own
    for r, st in enumerate(statuses):
        if st is not None:
            raise rebuild_remote_error(st[0], st[1], r)


# ------------------------------------------------------------------------------------------------ file protocol


def _check_target_path(path: str) -> None:
    if not os.path.lexists(path):
        return
    if not os.path.isdir(path):
        raise InvalidStateDictError(f"cannot save to {path}: it exists and is not a directory")
    names = os.listdir(path)
    if not names:
        return
    # a checkpoint of ours is replaced atomically; entries of other tools are kept (save.py adopts them)


def _poll(cond, timeout: float, what: str):
    t0 = time.monotonic()
    delay = 0.001
    while True:
        r = cond()
        if r:
            return r
        if time.monotonic() - t0 > timeout:
            raise SaveFailedError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(delay)
        delay = min(delay * 2, 0.005)


def _read_json(path: str):
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except (OSError, ValueError):
        return None


_ALIGN = 64  # byte alignment of the pieces carved out of one host buffer


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN
