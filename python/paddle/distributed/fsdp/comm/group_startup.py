"""Creating a process group that survives a failed gloo handshake: bounded attempts, agreed through the store.

Why: paddle 3.3.1's bundled gloo gives each pair of a new group a listening socket that takes the first
connection it gets and checks no peer identity; the addresses are swapped through the job's TCP store under the
group id. On 4 loaded CPU processes, fleet's EP start-up failed in most launches here (figures and causes:
docs/reports/ep-startup-2026-12-07.md): a connecting side gets "Connection refused", a listening side waits until
gloo's TIMEOUT (minutes), or a group reads an address of the wrong size ("address.cc:30 ... 136 vs 45"). Paddle
raises on one rank and leaves the others waiting; nothing retries.

Each attempt here: every rank calls paddle's ``new_group`` (a fresh group id, so fresh store keys and fresh
sockets) under a deadline (a handshake waiting for a connection that never comes otherwise blocks for gloo's own
timeout, minutes); the members of a group that came up run one barrier of that group under a deadline (a pair
connected to the wrong socket never completes one); then every rank reports "ok" or its error under a key of the
job's store, through a store client of its own (an abandoned handshake may still use paddle's), and waits for
every rank's report. A call past its deadline is left running on its helper thread until gloo gives up. All ok: the group is used. Any failure: every rank drops that group
and tries again. After ``attempts`` failed attempts every rank raises :class:`GroupCreationError` naming the
group's ranks and each failing rank's error.
"""

from __future__ import annotations

import _thread
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import paddle.distributed as dist

logger = logging.getLogger(__name__)

ATTEMPTS = 4  # tries of one group before GroupCreationError
CREATE_TIMEOUT = 60.0  # s one rank's paddle new_group may take (healthy: about a second under load here)
PROBE_TIMEOUT = 30.0  # s the members of a new group wait for its first barrier
AGREE_TIMEOUT = 600.0  # s a rank waits for every rank's report: longer than gloo's own handshake timeout
_REPORT_CHARS = 400  # of a rank's error kept in the store and in the message
_POLL_MAX = 0.05
STORE_CALL_DEADLINE = 30.0  # s one call to the job's store may take (a frozen store host: a named error)


class GroupCreationError(RuntimeError):
    """A process group did not come up within the allowed attempts (every rank raises it, naming the group's
    ranks and each failing rank's error)."""


_creations = [0]  # groups created through here by this process: the same sequence on every rank (collective)
_dropped: set[int] = set()  # ids of the groups of failed attempts, still in paddle's group map: never to be reused
_dropped_lock = threading.Lock()


def dropped_group_ids() -> frozenset[int]:
    """Ids of groups that paddle registered during a failed attempt (they may not work)."""
    with _dropped_lock:
        return frozenset(_dropped)


def _group_ids() -> set[int]:
    from paddle.distributed.collective import _get_group_map

    return set(_get_group_map())


def _within(fn: Callable[[], Any], timeout: float) -> tuple[Any, BaseException | None, bool]:
    """``(result, error, finished)`` of ``fn()`` run on a helper thread for at most ``timeout`` s (paddle's gloo
    calls release the GIL while they wait). An unfinished call is left to gloo's own timeout; a group it still
    returns then is recorded as dropped."""
    box: dict[str, Any] = {}
    done = threading.Event()

    def run() -> None:
        try:
            result = fn()
            with _dropped_lock:
                box["result"] = result
                if box.get("abandoned") and getattr(result, "id", None) is not None:
                    _dropped.add(result.id)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e
        finally:
            done.set()

    _thread.start_new_thread(run, ())
    finished = done.wait(timeout)
    with _dropped_lock:
        box["abandoned"] = not finished
        return box.get("result"), box.get("error"), finished


def _probe(group: Any, timeout: float) -> str:
    """'ok' when one barrier of ``group`` completes within ``timeout`` s on this member, else why not."""
    pg = getattr(group, "process_group", None)
    if pg is None or getattr(group, "nranks", 1) < 2 or getattr(group, "rank", -1) < 0:
        return "ok"
    _result, error, finished = _within(pg.barrier, timeout)
    if not finished:
        return f"its first barrier did not complete within {timeout:.0f} s"
    if error is not None:
        return f"its first barrier failed: {type(error).__name__}: {error}"
    return "ok"


def _agree(key: str, status: str, timeout: float, what: str) -> dict[int, str]:
    """Every rank's status for ``key`` (this rank's included), through the job's store; GroupCreationError naming
    the silent ranks when not every rank reported within ``timeout`` s, or naming the store when it does not
    answer a call within ``STORE_CALL_DEADLINE`` s (its host frozen or gone: every call has a deadline)."""
    from ..checkpoint.save.channel import CONNECT_DEADLINE, STORE_HOST, store_endpoint
    from ..checkpoint.save.store_client import StoreClient, StoreError

    ep = store_endpoint()
    if ep is None:
        raise GroupCreationError(f"{what}: no job TCP store is configured (MASTER_ADDR/MASTER_PORT or PADDLE_MASTER)")
    rank, world, call = dist.get_rank(), dist.get_world_size(), STORE_CALL_DEADLINE
    store = None
    try:
        store = StoreClient(ep[0], ep[1], CONNECT_DEADLINE, f"rank {STORE_HOST}")
        store.set(f"{key}/status{rank}", status[:_REPORT_CHARS].encode(), call)
        store.add(f"{key}/flag{rank}", 1, call)
        store.add(f"{key}/count", 1, call)
        deadline, delay = time.monotonic() + timeout, 0.001
        while store.add(f"{key}/count", 0, call) < world:
            if time.monotonic() > deadline:
                silent = [r for r in range(world) if store.add(f"{key}/flag{r}", 0, call) == 0]
                raise GroupCreationError(
                    f"{what}: rank(s) {silent} did not report within {timeout:.0f} s (stuck in paddle's new_group, "
                    f"or dead); rank {rank} gives up"
                )
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX)
        return {r: store.get(f"{key}/status{r}", call).decode(errors="replace") for r in range(world)}
    except StoreError as e:
        raise GroupCreationError(f"{what}: rank {rank} could not report through the job's TCP store: {e}") from e
    finally:
        if store is not None:
            store.close()


def check_options(
    attempts: int,
    create_timeout: float = CREATE_TIMEOUT,
    probe_timeout: float = PROBE_TIMEOUT,
    agree_timeout: float = AGREE_TIMEOUT,
) -> None:
    """ValueError naming the option unless ``attempts`` is a positive int and every timeout a positive number."""
    if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
        raise ValueError(f"attempts must be a positive int, got {attempts!r}")
    timeouts = {"create_timeout": create_timeout, "probe_timeout": probe_timeout, "agree_timeout": agree_timeout}
    for name, value in timeouts.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


def create_group(
    create: Callable[[], Any],
    ranks: Sequence[int] | None,
    *,
    attempts: int = ATTEMPTS,
    create_timeout: float = CREATE_TIMEOUT,
    probe_timeout: float = PROBE_TIMEOUT,
    agree_timeout: float = AGREE_TIMEOUT,
) -> Any:
    """``create()`` (paddle's ``new_group`` for ``ranks``; every rank calls this with the same ranks, in the same
    order, as ``new_group`` requires) until every rank's attempt came up, at most ``attempts`` times. Also a
    barrier of the world: no rank starts its next group before every rank finished this one."""
    check_options(attempts, create_timeout=create_timeout, probe_timeout=probe_timeout, agree_timeout=agree_timeout)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return create()
    _creations[0] += 1
    what = f"new_group({list(ranks) if ranks is not None else 'world'})"
    failed: dict[int, str] = {}
    for attempt in range(1, attempts + 1):
        before = _group_ids()
        group, error, finished = _within(create, create_timeout)
        if not finished:
            status = f"paddle's new_group did not return within {create_timeout:.0f} s"
        elif isinstance(error, Exception):  # paddle raises RuntimeError (gloo) or ValueError: this rank's failure
            status = f"{type(error).__name__}: {error}"
        elif error is not None:  # KeyboardInterrupt, SystemExit: not a handshake failure
            raise error
        else:
            status = _probe(group, probe_timeout)
        reports = _agree(f"fsdp/new_group/{_creations[0]}/{attempt}", status, agree_timeout, what)
        failed = {r: s for r, s in reports.items() if s != "ok"}
        if failed:
            with _dropped_lock:
                _dropped.update(_group_ids() - before)
        else:
            if attempt > 1:
                logger.warning("%s came up at attempt %d of %d", what, attempt, attempts)
            return group
        logger.warning(
            "%s: attempt %d of %d failed (%s); every rank drops it and tries again with a new group id",
            what,
            attempt,
            attempts,
            "; ".join(f"rank {r}: {s}" for r, s in sorted(failed.items())),
        )
    raise GroupCreationError(
        f"{what} failed {attempts} attempts (paddle's gloo handshake); last attempt: "
        + "; ".join(f"rank {r}: {s}" for r, s in sorted(failed.items()))
    )
