"""Memory roots are shared directories (``/dev/shm``): every path the tier opens there is checked, none followed.

Why: a memory root is writable by whoever shares the machine. A symlink planted as a copy file made the tier
truncate whatever it pointed at; a FIFO hung a restore; a job id with ``/`` or ``..`` escaped the root; two
jobs with one job id mapped the same files (SIGBUS). The rules:

* a job id is a plain name (``JOB_ID_RE``);
* the memory root and a job's directory are real directories (opened with O_NOFOLLOW | O_DIRECTORY); a job's
  directory is this user's and kept 0700 (``private=True``: created so, tightened when open to others); a
  memory root is created 0700 when absent and never changed: this user's, or root's with the sticky bit
  (``/dev/shm`` itself), writable by others only with the sticky bit (``flush-memory`` applies this rule to
  every directory it reads);
* a copy file is opened with O_NOFOLLOW | O_NONBLOCK (created relative to its directory's descriptor) and
  used only when it is a regular file of this user with one link (a symlink, FIFO, device or hard link is
  refused by name);
* one live process per job and rank: ``RankLock`` holds ``rank<N>.lock`` (flock) for the tier's life, so a
  second job with the same job id is refused by name (MemoryRootInUseError) before it maps anything.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import stat

from .errors import InvalidMemoryCopyError, MemoryRootError, MemoryRootInUseError

logger = logging.getLogger(__name__)

JOB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def check_job_id(job) -> str:
    """``job`` when it is a plain name (letters, digits, ``._-``, not starting with a dot); MemoryRootError else."""
    if not isinstance(job, str) or not JOB_ID_RE.match(job):
        raise MemoryRootError(f"job id {job!r} is not a plain name (letters, digits, '.', '_', '-'; at most 128, "
                              "not starting with '.' or '-')")  # fmt: skip
    return job


def open_dir(path: str, *, create: bool, private: bool = True) -> int:
    """A descriptor of the directory ``path`` (its last component never a symlink); created 0700 when
    ``create``. ``private`` (a job's directory, the tier's own): owned by this user, group/other access removed.
    Else (a memory root, or any directory flush-memory reads): owned by this user, or by root with the sticky
    bit (``/dev/shm`` itself), and writable by others only with the sticky bit; never changed."""
    if create:
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    try:
        fd = os.open(path, _DIR_FLAGS)
    except FileNotFoundError:
        raise MemoryRootError(f"memory root {path} does not exist") from None
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise MemoryRootError(f"memory root {path} is not a directory (a symlink or a file): refused") from None
        raise MemoryRootError(f"memory root {path} cannot be opened: {e}") from None
    try:
        _check_dir(fd, path, private)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _check_dir(fd: int, path: str, private: bool) -> None:
    st = os.fstat(fd)
    mode, sticky = stat.S_IMODE(st.st_mode), bool(st.st_mode & stat.S_ISVTX)
    owned = st.st_uid == os.geteuid()
    if not owned and (private or not (st.st_uid == 0 and sticky)):
        raise MemoryRootError(f"memory root {path} is owned by uid {st.st_uid}, not by this user (uid "
                              f"{os.geteuid()}): refused; choose another memory_root")  # fmt: skip
    if private and mode & 0o077:
        os.fchmod(fd, 0o700)
        logger.info("memory tier: %s was mode %o, now 0700", path, mode)
    elif not private and mode & 0o022 and not sticky:
        raise MemoryRootError(f"memory root {path} is writable by others (mode {mode:o}, no sticky bit): refused")


def open_file(dir_fd: int | None, name: str, flags: int, where: str, mode: int = 0o600) -> int:
    """A descriptor of the regular file ``name`` in ``dir_fd`` (or the path ``name`` when None), never through a
    symlink, never blocking on a FIFO; InvalidMemoryCopyError unless it is a regular file of this user with one
    link. Other OSErrors (a missing file) pass."""
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise InvalidMemoryCopyError(f"{where} is a symlink: refused") from None
        if e.errno == errno.ENXIO:  # a FIFO without a reader, opened for writing
            raise InvalidMemoryCopyError(f"{where} is not a regular file: refused") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidMemoryCopyError(f"{where} is not a regular file: refused")
        if st.st_uid != os.geteuid():
            raise InvalidMemoryCopyError(f"{where} is owned by uid {st.st_uid}, not by this user: refused")
        if st.st_nlink != 1:
            raise InvalidMemoryCopyError(f"{where} has {st.st_nlink} links (another name points at it): refused")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


class RankLock:
    """``<job dir>/rank<N>.lock`` held with an exclusive flock while the tier lives (released by ``close``, or by
    the kernel when the process dies): a second live process of the same job id and rank is refused by name."""

    def __init__(self, dir_path: str, rank: int):
        self.path = os.path.join(dir_path, f"rank{rank:05d}.lock")
        self._fd = -1
        dfd = open_dir(dir_path, create=True)
        try:
            name = os.path.basename(self.path)
            fd = open_file(dfd, name, os.O_RDWR | os.O_CREAT, f"lock file {self.path}")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
                os.close(fd)
                raise MemoryRootInUseError(f"memory root {dir_path} is in use by another live process (pid {holder})"
                                           f" of the same job id and rank {rank}: refused (give each job its own "
                                           "job_id / PADDLE_FSDP_JOB_ID)") from None  # fmt: skip
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            self._fd = fd
        finally:
            os.close(dfd)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    __del__ = close  # a tier dropped without close(): the lock goes with it


def hold_locks(dir_path: str, names: list[str]) -> list[int]:
    """Take every rank lock ``names`` in ``dir_path`` (flush-memory, while it reads the job's copies): the
    descriptors to close when done; MemoryRootInUseError when a live process holds one."""
    held: list[int] = []
    dfd = open_dir(dir_path, create=False, private=False)
    try:
        for name in names:
            try:
                fd = open_file(dfd, name, os.O_RDONLY, f"lock file {dir_path}/{name}")
            except (InvalidMemoryCopyError, OSError) as e:
                logger.warning("ignoring %s/%s: %s", dir_path, name, e)
                continue
            held.append(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise MemoryRootInUseError(f"{dir_path}/{name} is held by a live process: the job is running; "
                                           "flush its memory copies after it ended") from None  # fmt: skip
    except BaseException:
        for fd in held:
            os.close(fd)
        raise
    finally:
        os.close(dfd)
    return held
