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
never come; a call that fails (a signal interrupting it, a reset) is retried once on a fresh connection. A rank whose heartbeat counter stops moving for ``lease`` seconds is dead (kill -9, OOM killer, a
lost node): the others raise SaveFailedError naming it. A store that cannot be reached counts as silence of
the rank that hosts it (rank 0 runs the store server). Collective-free, so it is safe on the background thread.
"""

from __future__ import annotations

import _thread
import json
import logging
import os
import socket
import threading
import time

from ..errors import SaveFailedError

logger = logging.getLogger(__name__)

POLL_START, POLL_MAX = 0.001, 0.005  # seconds between polls (doubling up to POLL_MAX)


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


_clients: dict[str, object] = {}  # role -> TCPStore client (one per thread role: main, beat)
_clients_lock = threading.Lock()
CONNECT_DEADLINE = 2.0  # seconds a new store client may take to connect (_connect)
STORE_ERRORS = (RuntimeError, ValueError, OSError)  # what paddle's TCPStore client raises on a broken connection


def _reachable(host: str, port: int) -> bool:
    """A plain connect with a short timeout: paddle's client would retry a dead address for a long time."""
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _client(role: str):
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
            if not _reachable(*ep):
                raise ConnectionRefusedError(f"the job's TCP store at {ep[0]}:{ep[1]} does not answer")
            before = _socket_fds()
            c = _clients[role] = _connect(ep)
            _no_delay(_socket_fds() - before, ep[1])
        return c


def _connect(ep: tuple[str, int]):
    """A store client of ``ep``, or ConnectionRefusedError after ``CONNECT_DEADLINE`` seconds.

    Why a deadline of our own: the probe above can succeed while the store's process is being killed (the kernel
    still completes handshakes on its listening socket), and paddle's client then retries the dead address every
    3 s for its whole timeout, far past the save's commit timeout and the launcher's teardown (seen in CI: a
    survivor of its coordinator's kill -9 stuck in that loop). The connect runs on a helper thread; one that misses
    the deadline is left to paddle's own timeout and its client is never used."""
    import paddle.base.core as core

    box: dict[str, object] = {}
    done = threading.Event()

    def connect() -> None:
        try:
            box["client"] = core.TCPStore(ep[0], ep[1], False, 0, 60)
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            box["error"] = e
        finally:
            done.set()

    _thread.start_new_thread(connect, ())
    if not done.wait(CONNECT_DEADLINE):
        raise ConnectionRefusedError(
            f"the job's TCP store at {ep[0]}:{ep[1]} accepted no client within {CONNECT_DEADLINE:.0f} s"
        )
    if "error" in box:
        raise box["error"]
    return box["client"]


def _socket_fds() -> set[int]:
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:  # not Linux: the client keeps Nagle's algorithm (correct, ~40 ms a request)
        return set()
    out = set()
    for n in names:
        try:
            if os.readlink(f"/proc/self/fd/{n}").startswith("socket:"):
                out.add(int(n))
        except OSError:
            pass
    return out


def _no_delay(fds: set[int], port: int) -> None:
    """TCP_NODELAY on the new client sockets to the store. Why: paddle's client sends a request in several small
    writes and waits for the reply, so Nagle's algorithm against the server's delayed ACK costs ~40 ms a request
    (measured: 40-44 ms an ``add``; 0.05 ms with TCP_NODELAY). The option is set on a duplicate descriptor of the
    same socket."""
    for fd in fds:
        try:
            sk = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sk.type == socket.SOCK_STREAM and sk.getpeername()[1] == port:
                sk.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (OSError, IndexError, TypeError):
            pass
        finally:
            sk.close()


def _drop_client(role: str, client) -> None:
    """Forget a client whose connection failed: a request interrupted half way (EINTR from a signal, a reset)
    leaves its reply in the stream, and every later answer would be the previous request's."""
    with _clients_lock:
        if _clients.get(role) is client:
            del _clients[role]


def reset_clients() -> None:
    """Forget the store clients (tests; a forked child)."""
    with _clients_lock:
        _clients.clear()


class _Store:
    """Store calls of one role, each retried once on a fresh connection (never a half-answered stream)."""

    def __init__(self, role: str, store=None):
        self.role, self.fixed = role, store

    def call(self, method: str, *args):
        for attempt in (0, 1):
            client = self.fixed if self.fixed is not None else _client(self.role)
            try:
                return getattr(client, method)(*args)
            except STORE_ERRORS:
                if self.fixed is not None or attempt:
                    raise
                _drop_client(self.role, client)
        raise AssertionError("unreachable")  # pragma: no cover


class SaveChannel:
    """One save's messages between its ``world`` ranks (``rank`` is this one) and the heartbeats."""

    def __init__(self, checkpoint_id: str, rank: int, world: int, coordinator: int, lease: float, store=None):
        self.ns = f"fsdp-ckpt/{checkpoint_id}/"
        self.rank, self.world, self.coordinator, self.lease = rank, world, coordinator, lease
        self._store = _Store("main", store)
        self._beat_store = _Store("beat", store)
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
        reached (its host died) is left to the waiting that follows, which names the lost rank."""
        try:
            self._set(f"done/{self.rank}", json.dumps(payload, allow_nan=False))
            self._flag(f"fdone/{self.rank}")
            self._flag("ndone")
        except STORE_ERRORS as e:
            logger.warning("rank %d could not hand its data over through the TCP store: %s", self.rank, e)

    def peer_failures(self) -> dict[int, str]:
        """``failures()`` for a check between writes: a store that cannot be reached reads as no news (the
        waiting after the write reports it)."""
        try:
            return self.failures()
        except STORE_ERRORS:
            return {}

    def fail(self, cause: str) -> None:
        """Tell every rank this one failed (best effort: a lost store already tells them)."""
        try:
            self._set(f"fail/{self.rank}", cause)
            self._flag(f"ffail/{self.rank}")
            self._flag("nfail")
        except Exception as e:  # noqa: BLE001
            logger.warning("could not report the failure of rank %d to the other ranks: %s", self.rank, e)

    def abort(self, reason: str) -> None:
        try:
            self._set("abort", reason)
            self._flag("fabort")
        except Exception as e:  # noqa: BLE001
            logger.warning("could not report the abort to the other ranks: %s", e)

    def committed(self) -> None:
        self._flag("committed")

    def leave(self) -> None:
        """This rank gave a failed save up (abandon.py)."""
        self._flag(f"fleft/{self.rank}")
        self._flag("nleft")

    def left(self) -> int:
        """How many ranks gave the failed save up (each counted once)."""
        if self._count("nleft") < self.world:
            return 0
        return sum(1 for r in range(self.world) if self._count(f"fleft/{r}"))

    def published(self) -> None:
        self._flag("published")

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
                    raise SaveFailedError(
                        f"the job's TCP store (served by rank 0) cannot be reached for {self.lease:g} s (rank 0 "
                        f"killed or lost?): {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    ) from None
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
