"""Reading: one checkpoint's data objects, opened through the storage interface, read in checked byte ranges.

``FileSet`` opens the data objects of one checkpoint on demand through its ``Storage`` (io/storage.py) and
checks each one's size against the metadata. Where the backend's handle exposes an OS descriptor (``fileno()``,
``path``: LocalStorage) the reads keep their POSIX fast paths: ``preadv`` into the caller's buffer, O_DIRECT for
files not in the page cache, page-cache residency by ``mincore``. Other backends (object stores) are read with
``ReadHandle.read_into`` in large ranges, which the backend splits into parallel requests. What is read where
(windows, spans, streamed rings) is chosen in ranges.py, regions.py and streamed.py; chunk checks in chunks.py.
"""

from __future__ import annotations

import errno
import os
from collections import OrderedDict

import numpy as np

from . import checksums, libc
from .checksums import DigestFn
from .commit_record import removed_or
from .errors import CorruptCheckpointError
from .format.metadata import check_file_name
from .io.storage import ReadHandle, Storage

DEFAULT_WINDOW = 64 << 20  # read window (bounded host buffer per read)
DEFAULT_READ_SLAB = 16 << 20  # pread step of large ranges (CheckpointOptions.read_slab_bytes)
DEFAULT_CHECKSUM_THREADS = 2  # CheckpointOptions.checksum_threads
# Bytes per read of an object without a descriptor (object stores): the backend splits one read into parallel
# requests, so reads of objects are large (into the caller's buffer: no extra memory).
REMOTE_SLAB = 256 << 20
# Span reads (load) of files that are not in the page cache bypass it with O_DIRECT where the file system allows
# it: the data lands in the staging buffer straight from the device instead of being copied once more out of the
# page cache (less CPU: a 2 -> 3 rank load on 2 cores took a median 0.60 s against 0.79 s buffered). A file mostly
# in the page cache (e.g. just saved) is read buffered: O_DIRECT would go to the device (0.10 s against 0.04 s for
# 170 MB here). CheckpointOptions.odirect: "auto" (default, by mincore), True always, False never.
HAVE_ODIRECT = hasattr(os, "O_DIRECT")
CACHED_FRACTION_FOR_BUFFERED = 0.5
DIRECT_ALIGN = 4096  # offset, length and memory alignment of O_DIRECT reads
# Descriptors a reader keeps open at once (least recently used ones are closed): any number of data files can
# be read under a low RLIMIT_NOFILE.
MAX_OPEN_FILES = 64  # CheckpointOptions.max_open_files
# Bytes read, then hashed, at a time where a chunk is checked right after it is read: they are still in the CPU's
# L2 cache for the hash (a page-cache read of 1 MiB, then its hash, ran at 0.77x a plain read here; 256 KiB
# steps with a running digest of the chunk at 0.91-0.94x).
CACHE_STEP = 256 << 10


def pread_full(fd: int, buf, offset: int) -> int:
    """Read ``len(buf)`` bytes of ``fd`` at ``offset`` into ``buf`` (a contiguous buffer), over as many short
    reads as it takes; returns the bytes read, fewer only where the file ends. The one buffered read loop of the
    engine and the tools (callers name the short read in their own error)."""
    mv = memoryview(buf).cast("B")
    done = 0
    while done < len(mv):
        n = os.preadv(fd, [mv[done:]], offset + done)
        if n <= 0:
            break
        done += n
    return done


def _fileno(handle: ReadHandle) -> int | None:
    get = getattr(handle, "fileno", None)
    return get() if get is not None else None


class FileSet:
    """Open-on-demand read handles of the data objects of one checkpoint (through ``storage``; None: the local
    file system), with size checks, and the checksum function its chunks are verified with (None: reads are not
    verified)."""

    def __init__(
        self,
        root: str,
        sizes: dict[str, int],
        storage: Storage | None = None,
        digest: DigestFn | None = None,
        odirect: bool | str = "auto",
        read_slab: int = DEFAULT_READ_SLAB,
        checksum_threads: int = DEFAULT_CHECKSUM_THREADS,
        checkpoint_id: str | None = None,
        max_open: int = MAX_OPEN_FILES,
        codecs: dict[str, str] | None = None,
        chunk_bytes: int = 0,
    ):
        if storage is None:
            from .io.local import LOCAL

            storage = LOCAL
        self.storage = storage
        self.root = root
        self.checkpoint_id = checkpoint_id
        self.max_open = max(2, max_open)
        self.odirect = odirect if HAVE_ODIRECT else False
        self.read_slab = read_slab
        self.checksum_threads = checksum_threads
        self.sizes = sizes
        self.digest = digest
        self.handles: OrderedDict[str, ReadHandle] = OrderedDict()  # least recently used first
        self.bytes_read = 0
        self._direct: dict[str, int | None] = {}
        self._cached: dict[str, bool] = {}
        self.codecs = codecs or {}  # stored (compressed) data files -> codec (format/codecs.py); others raw
        self.chunk_bytes = chunk_bytes
        self._tables: dict = {}
        self.readahead = None  # decoded_read.Readahead of the stored files: settled before a handle is closed

    @classmethod
    def of(cls, root: str, md, verify: bool, options=None, storage: Storage | None = None) -> FileSet:
        """The data objects of checkpoint ``md`` at ``root`` in ``storage``; verified reads when ``verify`` and it
        has checksums; O_DIRECT and the read slab as ``options`` (a CheckpointOptions; None: the defaults)."""
        digest = checksums.digest_function(md.checksum) if verify and md.checksum != checksums.NONE else None
        tuning = {}  # no options: the constructor's defaults, CheckpointOptions' own (options.py takes them here)
        if options is not None:
            tuning = dict(
                odirect=options.odirect,
                read_slab=options.read_slab_bytes,
                checksum_threads=options.checksum_threads,
                max_open=options.max_open_files,
            )
        return cls(
            root,
            {n: f.size for n, f in md.files.items()},
            storage,
            digest,
            checkpoint_id=md.checkpoint_id,
            codecs=getattr(md, "codecs", None),
            chunk_bytes=md.chunk_bytes,
            **tuning,
        )

    @property
    def verifies(self) -> bool:
        return self.digest is not None

    def decodes(self, name: str) -> bool:
        """Whether ``name`` is a stored file read through its chunk table (its reads are checked as they are
        decoded, against the stored chunks' checksums: the piece checks of raw bytes do not apply)."""
        return name in self.codecs

    def table(self, name: str):
        """The checked chunk table of the stored file ``name`` (read with its first ``handle``)."""
        t = self._tables.get(name)
        if t is None:
            self.handle(name)
            t = self._tables[name]
        return t

    def _load_table(self, name: str, stored_size: int):
        from .format import codecs

        tname = codecs.table_name(name)
        # every row stores at least one byte (codecs.ChunkTable): no more rows than stored bytes, whatever size
        # the metadata declares for the decoded file (a declared terabyte let a table of 48 TB be read)
        rows = min(self.sizes[name], stored_size) + 1
        blob = self.storage.get(self.root, tname, limit=codecs.TABLE_ROW.itemsize * rows)
        if blob is None:
            raise removed_or(
                self.root,
                CorruptCheckpointError(f"checkpoint {self.root}: chunk table {tname} is missing"),
                self.checkpoint_id,
                self.storage,
            )
        chunk = self.chunk_bytes or self.sizes[name]
        return codecs.ChunkTable(blob, name, self.sizes[name], stored_size, chunk, self.codecs[name])

    def _open(self, name: str, flags: int = 0) -> ReadHandle:
        """A read handle of the data object ``name`` (regular files only, never blocks on a FIFO); a missing one is
        a removed checkpoint when its commit record went too (commit_record.removed_or), else corruption."""
        check_file_name(name)
        try:
            return self.storage.open_read(self.root, name)
        except FileNotFoundError:
            raise removed_or(
                self.root,
                CorruptCheckpointError(f"checkpoint {self.root}: data file {name} is missing"),
                self.checkpoint_id,
                self.storage,
            ) from None

    def _make_room(self) -> None:
        """Close least recently used handles so that one more stays within ``max_open``."""
        while len(self.handles) + sum(fd is not None for fd in self._direct.values()) >= self.max_open and self.handles:
            if self.readahead is not None:
                self.readahead.settle()  # (it may be reading the handle closed here)
            old, h = self.handles.popitem(last=False)
            h.close()
            dfd = self._direct.pop(old, None)
            if dfd is not None:
                os.close(dfd)

    def handle(self, name: str) -> ReadHandle:
        """The open, size-checked handle of ``name``."""
        h = self.handles.get(name)
        if h is not None:
            self.handles.move_to_end(name)
            return h
        self._make_room()
        h = self._open(name)
        if name in self.codecs and name not in self._tables:  # a stored file: its table, of its stored size
            try:
                self._tables[name] = self._load_table(name, h.size)
            except BaseException:
                h.close()
                raise
        want = self._tables[name].stored_size if name in self.codecs else self.sizes[name]
        if h.size != want:
            h.close()
            raise CorruptCheckpointError(
                f"checkpoint {self.root}: data file {name} has {h.size} bytes, metadata says "
                f"{want} (truncated or replaced)"
            )
        self.handles[name] = h
        return h

    def fd(self, name: str) -> int | None:
        """The OS descriptor of ``name`` (opened and size-checked), None where the backend has none or the file
        is stored through a codec (its bytes are decoded: no POSIX fast path reads them)."""
        if name in self.codecs:
            self.table(name)
            return None
        return _fileno(self.handle(name))

    def local(self, name: str) -> bool:
        """Whether ``name`` is read through an OS descriptor (the POSIX fast paths apply)."""
        return self.fd(name) is not None

    def slab(self, name: str) -> int:
        """Bytes per read of large ranges of ``name``: the read slab, larger for objects without a descriptor."""
        return self.read_slab if self.local(name) else max(self.read_slab, REMOTE_SLAB)

    def pread_into(self, name: str, buf: np.ndarray, offset: int) -> None:
        want = memoryview(buf).nbytes
        if name in self.codecs:
            from .decoded_read import read_decoded

            self.bytes_read += read_decoded(self, name, buf, offset)
            return
        h = self.handle(name)
        fd = _fileno(h)
        done = pread_full(fd, buf, offset) if fd is not None else h.read_into(offset, buf)
        if done < want:
            raise CorruptCheckpointError(
                f"checkpoint {self.root}: data file {name} ends at byte {offset + done}, expected at least {offset + want}"
            )
        self.bytes_read += done

    def mostly_cached(self, name: str) -> bool:
        """Whether most of ``name`` is in the page cache (mincore, asked once per file; False without a
        descriptor): reads of it are then memory copies, and checksums are best computed right after each chunk
        is copied, while it is in the CPU cache, instead of on helper threads from main memory later."""
        got = self._cached.get(name)
        if got is None:
            fd = self.fd(name)
            frac = libc.page_cache_fraction(fd, self.sizes[name]) if fd is not None else None
            got = self._cached[name] = frac is not None and frac >= CACHED_FRACTION_FOR_BUFFERED
        return got

    def direct_fd(self, name: str) -> int | None:
        """An O_DIRECT descriptor of ``name`` (after the size check of ``handle``), or None where unsupported."""
        if name in self.codecs:
            return None
        if name in self._direct and name in self.handles:
            self.handles.move_to_end(name)
            return self._direct[name]
        h = self.handle(name)
        fd, path = _fileno(h), getattr(h, "path", None)
        use = self.odirect if fd is not None and path is not None else False
        if use == "auto":
            cached = libc.page_cache_fraction(fd, self.sizes[name])
            use = cached is not None and cached < CACHED_FRACTION_FOR_BUFFERED
        dfd = None
        if use:
            from .format.strict_json import open_regular

            try:
                dfd = open_regular(path, os.O_DIRECT)
            except OSError:
                dfd = None
        self._direct[name] = dfd
        return dfd

    def _no_direct(self, name: str) -> None:
        fd = self._direct.get(name)
        self._direct[name] = None
        if fd is not None:
            os.close(fd)

    def pread_span(self, name: str, buf: np.ndarray, offset: int, need: int) -> None:
        """Read file bytes [offset, offset + need) into ``buf[:need]``; with O_DIRECT where possible, which reads
        all of ``buf`` (page aligned, ``offset`` and ``len(buf)`` multiples of DIRECT_ALIGN; bytes past ``need``
        or past the end of the file are not meaningful). Falls back to buffered reads."""
        fd = self.direct_fd(name)
        done = 0
        if fd is not None:
            mv = memoryview(buf).cast("B")
            try:
                while done < need:
                    n = os.preadv(fd, [mv[done:]], offset + done)
                    if n <= 0:
                        break
                    done += n
                    if n % DIRECT_ALIGN:  # end of file: an unaligned continuation is not allowed
                        break
            except OSError as e:
                if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                    raise
                self._no_direct(name)  # not supported here after all: buffered from now on
            done = min(done, need)
            self.bytes_read += done
        if done < need:
            self.pread_into(name, buf[done:need], offset + done)

    def close(self) -> None:
        if self.readahead is not None:
            self.readahead.settle()
        for h in self.handles.values():
            h.close()
        for fd in self._direct.values():
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.handles.clear()
        self._direct.clear()
