"""The save's done/failed decision and its commit, through paddle's TCP store: no file other ranks poll.

Why: marker files on the checkpoint directory only work where every rank sees one shared file system, and a
rank killed with -9 left the others waiting for the commit timeout. Here every message of steps 2-3 of a save
(save.py) is a key in the job's TCP store (the one ``init_parallel_env`` starts, reached through a client of our
own, so the background save thread never shares a socket with the training loop), under a namespace of the
checkpoint id:

    hb/<r>       counter, +1 every ``lease/5`` s while rank r's save runs (its heartbeat thread)
    done/<r>     rank r's hand-over: JSON {"size", "header", "sums", "rank_values"}  (flag: ndone, fdone/<r>)
    fail/<r>     rank r's failure, its cause as text                              (flag: nfail, ffail/<r>)
    abort        the coordinator gave the save up, its reason                     (flag: fabort)
    committed    the coordinator published the checkpoint; published: it moved ``latest`` too

Only ``add`` (atomic, never blocks) tells whether a key is there, so a reader never waits on a key that may
never come. Every store call has a deadline (``call_deadline``: a third of the lease) and every reply is checked
(store_client.py: paddle's own client blocks forever on a store that stops answering, and believes garbage); a
call that failed on a broken connection (a reset) is retried once on a fresh one. A rank whose heartbeat counter
stops moving for ``lease`` seconds is dead (kill -9, OOM killer, SIGSTOP, a lost node): the others raise
SaveFailedError naming it. A store that does not answer (refused, silent, or not answering as the store) for
``lease`` counts as silence of the rank that hosts it (rank 0 runs the store server), named the same way.
Collective-free, so it is safe on the background thread.
"""

from __future__ import annotations

import _thread
import json
import logging
import os
import threading
import time

from ..errors import SaveFailedError
from .store_client import StoreClient, StoreError, StoreReplyError, StoreTimeoutError

logger = logging.getLogger(__name__)

POLL_START, POLL_MAX = 0.001, 0.005  # seconds between polls (doubling up to POLL_MAX)
PEER_CHECK_PAUSE = 1.0  # seconds a write skips its checks for peer failures after a failed store call


def store_endpoint() -> tuple[str, int] | None:
    """The TCP store of this job, as ``init_parallel_env`` finds it (None outside a launched job)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    ep = f"{addr}:{port}" if addr and port else os.environ.get("PADDLE_MASTER")
    if not ep:
        eps = os.environ.get("PADDLE_TRAINER_ENDPOINTS", "")
        ep = eps.split(",")[0] if eps else None
    if not ep or ":" not in ep:
        return None
    host, _, port = ep.rpartition(":")
    return host, int(port)


_clients: dict[str, StoreClient] = {}  # role -> store client (one per thread role: main, beat)
_clients_lock = threading.Lock()
CONNECT_DEADLINE = 2.0  # seconds a new store client may take to connect
STORE_ERRORS = (RuntimeError, ValueError, OSError)  # StoreError is an OSError; a fixed (paddle) store raises these
STORE_HOST = 0  # the rank whose process serves the job's TCP store (paddle's init_parallel_env: global rank 0)


def call_deadline(lease: float) -> float:
    """Seconds one store call may take: a third of the lease (0.5-5 s). A call that misses it counts as silence
    of the store's host, which the lease then judges: a store a little slow under load costs a reconnect, never
    the save; a frozen one ends the save within ``lease`` plus a deadline or two."""
    return min(5.0, max(0.5, lease / 3))


def _client(role: str) -> StoreClient:
    """This process's store client for ``role``. A client is not thread-safe: the save (one at a time per
    process) and the heartbeat thread each have their own."""
    with _clients_lock:
        c = _clients.get(role)
        if c is None:
            ep = store_endpoint()
            if ep is None:
                raise SaveFailedError(
                    "a multi-rank save needs the job's TCP store (MASTER_ADDR/MASTER_PORT or PADDLE_MASTER, set by "
                    "paddle.distributed.launch), and none is configured"
                )
            c = _clients[role] = StoreClient(ep[0], ep[1], CONNECT_DEADLINE, f"rank {STORE_HOST}")
        return c


def _drop_client(role: str, client) -> None:
    """Forget a client whose call failed (store_client.py closed it: its stream may hold an unread reply)."""
    with _clients_lock:
        if _clients.get(role) is client:
            del _clients[role]


def reset_clients() -> None:
    """Forget the store clients (tests; a forked child)."""
    with _clients_lock:
        for c in _clients.values():
            c.close()
        _clients.clear()


class _Store:
    """Store calls of one role, each within ``deadline`` seconds. A call that failed on a broken connection (a
    reset, a closed socket) is retried once on a fresh one; a timeout or a bad reply is not (the store's host is
    silent, or the endpoint is not the store: the waiting's lease judges it)."""

    def __init__(self, role: str, deadline: float, store=None):
        self.role, self.deadline, self.fixed = role, deadline, store
        self.failed_at: float | None = None  # monotonic time of the last failed call
        self.lost: str | None = None  # the store was silent for a whole lease: why (set by SaveChannel.wait)

    def call(self, method: str, *args):
        if self.lost is not None:  # the save's last words (abort, leave) cost no deadline each
            raise StoreError(f"the job's TCP store was given up: {self.lost}")
        if self.fixed is not None:  # a store object given by the caller (tools): its own calls, no deadline
            return getattr(self.fixed, method)(*args)
        for attempt in (0, 1):
            client = _client(self.role)
            try:
                out = getattr(client, method)(*args, self.deadline)
                self.failed_at = None
                return out
            except STORE_ERRORS as e:
                _drop_client(self.role, client)
                self.failed_at = time.monotonic()
                if attempt or isinstance(e, (StoreTimeoutError, StoreReplyError)):
                    raise
        raise AssertionError("unreachable")  # pragma: no cover


class SaveChannel:
    """One save's messages between its ``world`` ranks (``rank`` is this one) and the heartbeats."""

    def __init__(self, checkpoint_id: str, rank: int, world: int, coordinator: int, lease: float, store=None):
        self.ns = f"fsdp-ckpt/{checkpoint_id}/"
        self.rank, self.world, self.coordinator, self.lease = rank, world, coordinator, lease
        self._store = _Store("main", call_deadline(lease), store)
        self._beat_store = _Store("beat", call_deadline(lease), store)
        self._stop = threading.Event()
        self._seen: dict[int, tuple[int, float]] = {}  # rank -> (last counter, monotonic time it last moved)
        self._lost_since: float | None = None  # first failed store call of a run of failures
        self._ended = threading.Event()
        # not threading.Thread: its start() waits until the new thread runs (tens of ms on a busy machine), which
        # an async save's caller would pay (background.py does the same for the save thread)
        _thread.start_new_thread(self._beat, ())

    # ------------------------------------------------------------------------------------------- heartbeat
    def _beat(self) -> None:
        key = f"{self.ns}hb/{self.rank}"
        try:
            while True:
                try:
                    self._beat_store.call("add", key, 1)
                except Exception as e:  # noqa: BLE001 - the store's host died: the waiting side reports it
                    logger.debug("heartbeat: %s", e)
                if self._stop.wait(self.lease / 5):
                    return
        finally:
            self._ended.set()

    def close(self) -> None:
        """Stop the heartbeat (waits for the thread: the next save's heartbeat uses the same store client)."""
        self._stop.set()
        self._ended.wait()

    # ------------------------------------------------------------------------------------------- writes
    def _flag(self, name: str) -> None:
        self._store.call("add", self.ns + name, 1)  # a flag: a retried add counting twice is still "set"

    def _set(self, key: str, value: str) -> None:
        self._store.call("set", self.ns + key, value.encode())

    def done(self, payload: dict) -> None:
        """This rank's data object is durable: hand it over to the coordinator's commit. A store that cannot be
        reached (its host died) is left to the waiting that follows, which names the lost rank. The per-rank flag
        goes last (``_written_last``)."""
        try:
            self._set(f"done/{self.rank}", json.dumps(payload, allow_nan=False))
            self._flag("ndone")
            self._flag(f"fdone/{self.rank}")
        except STORE_ERRORS as e:
            logger.warning("rank %d could not hand its data over through the TCP store: %s", self.rank, e)

    def peer_failures(self) -> dict[int, str]:
        """``failures()`` for a check between writes: a store that cannot be reached reads as no news (the
        waiting after the write reports it)."""
        if self._store.failed_at is not None and time.monotonic() - self._store.failed_at < PEER_CHECK_PAUSE:
            return {}  # the store just failed: a write is not slowed by a call deadline at every slab
        try:
            return self.failures()
        except STORE_ERRORS:
            return {}

    # _written_last: a message is a value, a counter (the readers' one-read hint) and a per-rank flag, written in
    # that order, each call acknowledged before the next. A store that freezes between two of them (then resumes)
    # leaves the flag unset whatever else went through: the rank still counts as not having said it, so a waiting
    # coordinator keeps watching its heartbeat. The flag first and the counter lost made a resumed coordinator
    # wait on a hint for its whole commit timeout (test_frozen_save.py, after_data of rank 0).

    def fail(self, cause: str) -> None:
        """Tell every rank this one failed (best effort: a lost store already tells them)."""
        try:
            self._set(f"fail/{self.rank}", cause)
            self._flag("nfail")
            self._flag(f"ffail/{self.rank}")  # last (``_written_last``)
        except Exception as e:  # noqa: BLE001
            logger.warning("could not report the failure of rank %d to the other ranks: %s", self.rank, e)

    def abort(self, reason: str) -> None:
        try:
            self._set("abort", reason)
            self._flag("fabort")
        except Exception as e:  # noqa: BLE001
            logger.warning("could not report the abort to the other ranks: %s", e)

    def committed(self) -> None:
        """Tell the waiting ranks the checkpoint is committed. Best effort: the commit record in storage is the
        truth, which a waiting rank reads back when the store went silent (commit.py ``_wait_commit``)."""
        try:
            self._flag("committed")
        except STORE_ERRORS as e:
            logger.warning("could not tell the other ranks of the commit through the TCP store: %s", e)

    def leave(self) -> None:
        """This rank gave a failed save up (abandon.py)."""
        self._flag("nleft")
        self._flag(f"fleft/{self.rank}")  # last (``_written_last``)

    def left(self) -> int:
        """How many ranks gave the failed save up (each counted once)."""
        if self._count("nleft") < self.world:
            return 0
        return sum(1 for r in range(self.world) if self._count(f"fleft/{r}"))

    def published(self) -> None:
        """Best effort, as ``committed`` (a waiting rank reads ``latest`` back)."""
        try:
            self._flag("published")
        except STORE_ERRORS as e:
            logger.warning("could not tell the other ranks of the published pointer through the TCP store: %s", e)

    # ------------------------------------------------------------------------------------------- reads
    def _count(self, name: str) -> int:
        return int(self._store.call("add", self.ns + name, 0))

    def _get(self, key: str) -> str:
        return bytes(self._store.call("get", self.ns + key)).decode(errors="replace")

    def failures(self) -> dict[int, str]:
        """Ranks that reported a failure, with their causes."""
        if self._count("nfail") == 0:
            return {}
        return {r: self._get(f"fail/{r}") for r in range(self.world) if self._count(f"ffail/{r}")}

    def aborted(self) -> str | None:
        return self._get("abort") if self._count("fabort") else None

    def is_committed(self) -> bool:
        return self._count("committed") > 0

    def is_published(self) -> bool:
        return self._count("published") > 0

    def all_done(self) -> dict[int, dict] | None:
        """Every rank's hand-over (rank -> payload) once all ranks handed over, else None. ``ndone`` is only a
        hint (one read instead of ``world``); the per-rank flags decide."""
        if self._count("ndone") < self.world or len(self.handed_over()) < self.world:
            return None
        return {r: json.loads(self._get(f"done/{r}")) for r in range(self.world)}

    def handed_over(self) -> list[int]:
        return [r for r in range(self.world) if self._count(f"fdone/{r}")]

    def dead(self, ranks) -> list[int]:
        """Ranks among ``ranks`` whose heartbeat has not moved for ``lease`` seconds (not yet seen beating:
        counted from the first look, so a rank that died before its first beat is found too)."""
        now = time.monotonic()
        out = []
        for r in ranks:
            if r == self.rank:
                continue
            n = self._count(f"hb/{r}")
            last = self._seen.get(r)
            if last is None or n != last[0]:
                self._seen[r] = (n, now)
            elif now - last[1] > self.lease:
                out.append(r)
        return out

    # ------------------------------------------------------------------------------------------- waiting
    def wait(self, cond, timeout: float, what: str, watch) -> object:
        """Poll ``cond()`` until it returns a true value; raise SaveFailedError after ``timeout`` seconds
        (``what`` says what was awaited), or naming the ranks of ``watch`` found dead (``lease``). A store that
        cannot be reached is silence: after ``lease`` of it, the store's host (rank 0) is reported dead."""
        t0 = time.monotonic()
        delay, next_check = POLL_START, t0
        while True:
            now = time.monotonic()
            try:
                r = cond()
                if r:
                    return r
                if now >= next_check:
                    next_check = now + min(0.5, self.lease / 5)
                    gone = self.dead(watch)
                    if gone:
                        raise SaveFailedError(
                            f"rank{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} stopped responding (no "
                            f"heartbeat for {self.lease:g} s: killed or lost?)"
                        )
                self._lost_since = None
            except SaveFailedError:
                raise
            except Exception as e:  # noqa: BLE001 - the store is unreachable: its host process is gone?
                if self._lost_since is None:
                    self._lost_since = now
                elif now - self._lost_since > self.lease:
                    err = SaveFailedError(
                        f"rank {STORE_HOST} stopped responding: the job's TCP store it serves did not answer for "
                        f"{self.lease:g} s (rank {STORE_HOST} killed, frozen or lost?): {type(e).__name__}: "
                        f"{str(e).splitlines()[0][:200]}"
                    )
                    self._store.lost = self._beat_store.lost = str(err)
                    raise err from None
            if now - t0 > timeout:
                raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
            time.sleep(delay)
            delay = min(delay * 2, POLL_MAX)


class LocalChannel:
    """The channel of a one-rank save: nothing to tell anyone."""

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.world = 1

    def close(self) -> None:
        pass

    def done(self, payload: dict) -> None:
        self._payload = payload

    def fail(self, cause: str) -> None:
        pass

    def abort(self, reason: str) -> None:
        pass

    def committed(self) -> None:
        pass

    def leave(self) -> None:
        pass

    def left(self) -> int:
        return 1

    def is_committed(self) -> bool:
        return False

    def published(self) -> None:
        pass

    def failures(self) -> dict[int, str]:
        return {}

    def aborted(self) -> str | None:
        return None

    def all_done(self) -> dict[int, dict]:
        return {self.rank: self._payload}

    def handed_over(self) -> list[int]:
        return [self.rank]

    def wait(self, cond, timeout: float, what: str, watch) -> object:
        return cond()

    def peer_failures(self) -> dict[int, str]:
        return {}
