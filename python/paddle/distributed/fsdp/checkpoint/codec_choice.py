"""Which chunk codec a save writes with: ``CheckpointOptions.codec`` when it names one, else (``auto``) measured.

Compressing pays when the encoder outruns the storage: the save then moves fewer bytes through the slow part and
the encode hides behind the write (the two run pipelined, encoded_write.py). So ``auto`` compares two rates:

* **encoder**: raw bytes per CPU second of one thread encoding a fixed calibration buffer (weight-like fp32 and
  bf16 values: compressible sign/exponent planes, incompressible mantissas), measured once per process on its
  first need (~20 ms), times the save's encode threads. CPU time, not wall time: a busy neighbour on a shared
  host does not make this host's encoder look slow;
* **storage**: bytes a save's data files took per second of write + fsync (local) or upload (S3), measured by
  the saves themselves (SaveJob._write through ``MeteredStorage``), remembered per backend and storage root (the
  parent of the checkpoint path: a manager's root, a bucket prefix; the MAX_ROOTS roots used last) over the last
  saves of this process. Only the time the backend spent is counted, not the time it waited for the encoder, so
  a compressed save measures the storage as a raw one does.

and compresses when ``encoder >= MARGIN * storage`` (it must pay, not tie: the calling thread's own copies and
the load's decode are not in the model). Once this process has saved at a root both ways, the model gives way to
what it predicts: the whole write's throughput (decoded bytes per wall second of the data file's write) of the
compressed saves against the raw ones: compressed when it is ``PAYS`` times the raw, raw when the raw is ``PAYS``
times the compressed, and the model's answer between (within the noise of a shared host: measured saves of the
same kind differ by 1.3-2x on this 2-core VM, so a band without a winner must not flip the choice). A model that
was wrong (e.g. a loaded host whose encoder threads get no core) is corrected by the next save. The kind not chosen
keeps its last figures (the last ``HISTORY`` writes of each kind are remembered): it is not tried again.

With no measurement yet for a root (this process's first save there), a backend's prior decides: object stores
(``Storage.compress_by_default``: S3) compress, since a PUT over a network is slower than a core's encoder
almost everywhere; a local disk saves raw. Not a probe write: a few MiB written and fsynced to time the disk
would cost every first save its time, and a small write measures the fsync's latency rather than the disk's
throughput (it would make every disk look slow). The first raw save measures the disk for free at its real size,
and it is exactly what a save did before ``auto`` measured: never slower than raw.

Every rank decides from its own figures; the coordinator's decision is taken by all (save.py sends it with the
plan exchange, like the checksum algorithm): a save's metadata.json names one codec for each file, written by
the coordinator, and stock metadata is written only for raw saves, so the ranks of one save must agree.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .format.codecs import BYTEPLANE_ZSTD, RAW, codec_named
from .io.local import LocalStorage
from .io.storage import Storage

logger = logging.getLogger(__name__)

AUTO = "auto"
CHOICES = (AUTO, RAW, BYTEPLANE_ZSTD)
MARGIN = 1.2  # encoder (all threads) over storage rate needed to compress (the model)
PAYS = 1.1  # measured save throughput of one kind over the other's that decides (both measured)
# Smaller data files time their fixed costs (open, fsync, a PUT's round trip, a loaded host's scheduling), not
# throughput: an 8 MB save to a tmpfs on a busy 2-core CI host measured "slow" and turned the next save there
# compressed. Below this, a save leaves the choice to the prior (small checkpoints gain little from compression).
MIN_MEASURED_BYTES = 64 << 20
HISTORY = 4  # saves remembered per storage root, raw and compressed each
# Storage roots remembered (least recently used forgotten): a job that saves each step under a new parent
# (``/run/step_N/model``) makes a new root per save, and the figures of each were kept for the process's life.
MAX_ROOTS = 256
CALIBRATION_ELEMENTS = 1 << 19  # 2 MiB of fp32 + 1 MiB of bf16

_lock = threading.Lock()
_storage_history: dict[tuple[str, str, bool], deque] = {}  # (*root, compressed) -> the last writes
_encode_rate: float | None = None  # raw bytes per CPU second of one encode thread
_last_choice: dict[tuple[str, str], str] = {}
_roots: OrderedDict[tuple[str, str], None] = OrderedDict()  # roots with figures, least recently used first


def _touch(root: tuple[str, str]) -> None:
    """Mark ``root`` as just used and forget the least recently used roots beyond ``MAX_ROOTS`` (under _lock)."""
    _roots[root] = None
    _roots.move_to_end(root)
    while len(_roots) > MAX_ROOTS:
        old, _ = _roots.popitem(last=False)
        _storage_history.pop((*old, False), None)
        _storage_history.pop((*old, True), None)
        _last_choice.pop(old, None)


def storage_root(storage: Storage, path: str) -> tuple[str, str]:
    """The key a save's measurements are remembered under: the backend's kind and the checkpoint's parent; on a
    local disk with the parent's device, so that another disk mounted (or linked) at the same path name starts
    from the prior, not from the figures of the disk that was there."""
    try:
        parent = storage.parent(path)
    except Exception:  # a backend without a parent for this path: the path itself
        parent = path
    if isinstance(storage, LocalStorage):
        try:
            parent = f"{parent} (device {os.stat(parent).st_dev})"
        except OSError:  # (not created yet: this process's first save there, decided by the prior anyway)
            pass
    return type(storage).__qualname__, parent


@dataclass(frozen=True)
class Write:
    """One data file's write by a save: its codec, decoded and stored bytes, the backend's seconds (write +
    fsync or upload) and the whole write's wall seconds (encode included, where it was not hidden)."""

    codec: str
    decoded: int
    stored: int
    backend_seconds: float
    wall_seconds: float


def record_write(root: tuple[str, str], write: Write) -> None:
    """Remember a save's data file ``write`` at ``root`` (too small a write is not a measurement of throughput)."""
    if write.stored < MIN_MEASURED_BYTES or write.backend_seconds <= 0 or write.wall_seconds <= 0:
        return
    with _lock:
        _storage_history.setdefault((*root, write.codec != RAW), deque(maxlen=HISTORY)).append(write)
        _touch(root)


def _seen(root: tuple[str, str]) -> list[Write]:
    """The raw and the compressed writes remembered at ``root`` (the last ``HISTORY`` of each)."""
    with _lock:
        return [*_storage_history.get((*root, False), ()), *_storage_history.get((*root, True), ())]


def storage_rate(root: tuple[str, str]) -> float | None:
    """Stored bytes per backend second of the last saves at ``root`` (all their bytes over all their time)."""
    seen = _seen(root)
    if not seen:
        return None
    return sum(w.stored for w in seen) / sum(w.backend_seconds for w in seen)


def save_rate(root: tuple[str, str], compressed: bool) -> float | None:
    """Decoded bytes per wall second of the last saves at ``root`` that were (not) compressed; None: none."""
    seen = [w for w in _seen(root) if (w.codec != RAW) == compressed]
    if not seen:
        return None
    return sum(w.decoded for w in seen) / sum(w.wall_seconds for w in seen)


def encode_rate() -> float:
    """Raw bytes per CPU second of one thread encoding byte-plane zstd (measured once per process)."""
    global _encode_rate
    if _encode_rate is None:
        rate = _calibrate()
        with _lock:
            if _encode_rate is None:
                _encode_rate = rate
    return _encode_rate


def set_encode_rate(rate: float | None) -> None:
    """Take ``rate`` (bytes per CPU second per thread) as this host's encoder, or measure again (None): the seam
    for tests and benchmarks that pose as a slower or faster host."""
    global _encode_rate
    with _lock:
        _encode_rate = rate


def forget() -> None:
    """Drop every measurement (storage history, encoder rate, logged choices)."""
    global _encode_rate
    with _lock:
        _storage_history.clear()
        _last_choice.clear()
        _roots.clear()
        _encode_rate = None


def _calibrate() -> float:
    import numpy as np

    rng = np.random.default_rng(52)
    master = (rng.standard_normal(CALIBRATION_ELEMENTS) * 0.02).astype(np.float32)
    bf16 = (master.view(np.uint32) >> 16).astype(np.uint16)
    encode = codec_named(BYTEPLANE_ZSTD).encode
    chunk = 1 << 20
    work = [(memoryview(master).cast("B"), 4), (memoryview(bf16).cast("B"), 2)]
    encode(work[0][0][:chunk], 4)  # (the encoder's first call sets itself up: not its rate)
    total = 0
    t0 = time.thread_time()
    for mv, width in work:
        for c in range(0, len(mv), chunk):
            encode(mv[c : c + chunk], width)
            total += len(mv[c : c + chunk])
    cpu = max(time.thread_time() - t0, 1e-6)
    return total / cpu


def choose_codec(chosen: str, storage: Storage, path: str, threads: int) -> str:
    """The codec a save of ``path`` to ``storage`` writes with: ``chosen`` unless ``auto``; ``auto`` measured
    (module docstring). ``threads``: the save's encode threads."""
    if chosen != AUTO:
        return codec_named(chosen).name
    root = storage_root(storage, path)
    store = storage_rate(root)
    raw_rate, compressed_rate = save_rate(root, False), save_rate(root, True)
    if store is None:
        codec = BYTEPLANE_ZSTD if getattr(storage, "compress_by_default", False) else RAW
        why = "no write measured here yet: the backend's prior"
    else:
        enc = encode_rate() * max(1, threads)
        codec = BYTEPLANE_ZSTD if enc >= MARGIN * store else RAW
        why = f"encoder {enc / 1e6:.0f} MB/s ({threads} threads) vs storage {store / 1e6:.0f} MB/s"
        if raw_rate is not None and compressed_rate is not None:
            measured = compressed_rate / raw_rate
            if measured >= PAYS or measured <= 1 / PAYS:  # a clear winner; within the band, the model's answer
                codec = BYTEPLANE_ZSTD if measured >= PAYS else RAW
            why = f"measured saves: compressed {compressed_rate / 1e6:.0f} MB/s vs raw {raw_rate / 1e6:.0f} MB/s; {why}"
    with _lock:
        changed = _last_choice.get(root) != codec
        _last_choice[root] = codec
        _touch(root)
    logger.log(logging.INFO if changed else logging.DEBUG, "codec auto at %s: %s (%s)", root[1], codec, why)
    return codec


class MeteredStorage:
    """``storage`` whose ``write_object`` counts the time the backend spends: the call's wall time less the time
    spent producing its pieces (an encoded save's generator waiting for the encoder, a piece's own producer)."""

    def __init__(self, storage: Storage):
        self._storage = storage
        self.bytes = 0  # as stored
        self.seconds = 0.0  # the backend's
        self.wall = 0.0  # the calls' in all

    def __getattr__(self, name):
        return getattr(self._storage, name)

    def write_object(self, location, name, header, pieces, chunk_bytes, digest, *, should_stop=None):
        """Storage.write_object's signature exactly (no catch-all: an unknown keyword is the caller's error)."""
        producing = [0.0]
        t0 = time.perf_counter()
        result = self._storage.write_object(
            location, name, header, _Timed(pieces, producing), chunk_bytes, digest, should_stop=should_stop
        )
        wall = time.perf_counter() - t0
        self.wall += wall
        self.seconds += wall - producing[0]
        self.bytes += int(result[0])
        return result


class _Timed:
    """Iterates ``pieces``, adding the time of each ``next`` (and of a callable piece's call) to ``producing``."""

    def __init__(self, pieces: Iterable, producing: list):
        self._pieces = pieces
        self._producing = producing

    def __iter__(self):
        it = iter(self._pieces)
        while True:
            t0 = time.perf_counter()
            try:
                piece = next(it)
            except StopIteration:
                self._producing[0] += time.perf_counter() - t0
                return
            self._producing[0] += time.perf_counter() - t0
            yield self._timed_call(piece) if callable(piece) else piece

    def _timed_call(self, produce: Callable):
        def call():
            t0 = time.perf_counter()
            try:
                return produce()
            finally:
                self._producing[0] += time.perf_counter() - t0

        return call


__all__ = [
    "AUTO",
    "CHOICES",
    "MARGIN",
    "MAX_ROOTS",
    "PAYS",
    "MeteredStorage",
    "Write",
    "choose_codec",
    "encode_rate",
    "forget",
    "record_write",
    "save_rate",
    "set_encode_rate",
    "storage_rate",
    "storage_root",
]
