"""POSIX-minimal crash states of a real save: record its file-system calls in-process, then build and replay the
states a power loss may leave.

Recording wraps the ``os`` calls the engine's local backend makes (open, write/writev/pwrite, ftruncate, fsync,
mkdir, rename/replace, link, unlink/rmdir, and ``libc.renameat2_exchange``) while one process saves; only paths
under ``base`` are kept. ``Trace.check_complete`` compares the model's end state with the real directory tree, so
a call the recorder missed shows up as a mismatch rather than as a state that was never explored.

The model (what POSIX promises, not what ext4 does): a directory-entry change (create, mkdir, link, rename,
unlink, rmdir) is durable once its directory is fsynced after it; file data once the file is fsynced after it.
At a crash point every durable operation is applied, and every other one is kept or lost independently (a lost
create makes a later rename of it impossible, a directory is removed only when empty); a kept non-durable write
may be torn at a 512-byte boundary. Hard links are materialized as copies.
"""

from __future__ import annotations

import os
import random
import threading
from dataclasses import dataclass, field

from paddle.distributed.fsdp.checkpoint import libc

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR


@dataclass
class Inode:
    kind: str  # "file" or "dir"
    data: bytearray = field(default_factory=bytearray)
    entries: dict = field(default_factory=dict)


class Recorder:
    """Wraps os.* (via pytest's monkeypatch) and records the calls on paths under ``base``."""

    def __init__(self, base: str, monkeypatch, skip_fsync=None, exchange: bool = True):
        self.base = os.path.abspath(base)
        self.calls: list[tuple] = []
        self.fds: dict[int, str] = {}
        self.pos: dict[int, int] = {}
        self.lock = threading.RLock()
        self.skip_fsync = skip_fsync  # mutation checks: a predicate(path) whose fsync is not done
        self.exchange = exchange  # False: RENAME_EXCHANGE refused (the two-rename publish)
        self.initial = snapshot(self.base)
        self._wrap(monkeypatch)

    def _mine(self, path) -> str | None:
        if isinstance(path, int):
            return None
        p = os.path.abspath(os.fsdecode(path))
        return p if p == self.base or p.startswith(self.base + os.sep) else None

    def _at(self, path, dir_fd):
        if dir_fd is not None and not os.path.isabs(os.fsdecode(path)):
            parent = self.fds.get(dir_fd)
            return None if parent is None else os.path.join(parent, os.fsdecode(path))
        return self._mine(path)

    def mark(self, label: str) -> int:
        with self.lock:
            self.calls.append(("mark", label))
            return len(self.calls)

    def _wrap(self, mp) -> None:
        real = {n: getattr(os, n) for n in ("open", "close", "write", "writev", "pwrite", "pwritev", "ftruncate",
                                            "fsync", "fdatasync", "mkdir", "rename", "replace", "link", "unlink",
                                            "remove", "rmdir")}  # fmt: skip
        rec = self

        def o_open(path, flags, mode=0o777, *, dir_fd=None):
            p = rec._at(path, dir_fd)
            existed = p is not None and os.path.lexists(p)
            fd = real["open"](path, flags, mode, dir_fd=dir_fd)
            if p is not None:
                with rec.lock:
                    rec.fds[fd], rec.pos[fd] = p, 0
                    rec.calls.append(("open", fd, p, not existed, bool(flags & os.O_TRUNC and flags & _WRITE_FLAGS)))
            return fd

        def o_close(fd):
            with rec.lock:
                rec.fds.pop(fd, None)
            return real["close"](fd)

        def writer_of(name, positional):
            def w(fd, data, *off):
                n = real[name](fd, data, *off)
                if fd in rec.fds:
                    bufs = [data] if name in ("write", "pwrite") else list(data)
                    blob = b"".join(bytes(memoryview(b).cast("B")) for b in bufs)[:n]
                    with rec.lock:
                        at = off[0] if positional else rec.pos[fd]
                        if not positional:
                            rec.pos[fd] += n
                        rec.calls.append(("write", fd, at, blob))
                return n

            return w

        def o_ftruncate(fd, size):
            real["ftruncate"](fd, size)
            if fd in rec.fds:
                with rec.lock:
                    rec.calls.append(("truncate", fd, size))

        def sync_of(name):
            def s(fd):
                path = rec.fds.get(fd)
                if path is not None and rec.skip_fsync is not None and rec.skip_fsync(path):
                    return None
                r = real[name](fd)
                if path is not None:
                    with rec.lock:
                        rec.calls.append(("fsync", fd))
                return r

            return s

        def path_op(name, kind):
            def f(path, *a, dir_fd=None, **k):
                p = rec._at(path, dir_fd)
                r = real[name](path, *a, dir_fd=dir_fd, **k)
                if p is not None:
                    with rec.lock:
                        rec.calls.append((kind, p))
                return r

            return f

        def two_path_op(name, kind):
            def f(src, dst, *a, src_dir_fd=None, dst_dir_fd=None, **k):
                s, d = rec._at(src, src_dir_fd), rec._at(dst, dst_dir_fd)
                r = real[name](src, dst, *a, src_dir_fd=src_dir_fd, dst_dir_fd=dst_dir_fd, **k)
                if s is not None or d is not None:
                    with rec.lock:
                        rec.calls.append((kind, s, d))
                return r

            return f

        real_exchange = libc.renameat2_exchange

        def exchange(a, b):
            ok = rec.exchange and real_exchange(a, b)
            if ok and rec._mine(a) is not None:
                with rec.lock:
                    rec.calls.append(("exchange", rec._mine(a), rec._mine(b)))
            return ok

        mp.setattr(os, "open", o_open)
        mp.setattr(os, "close", o_close)
        for name, positional in (("write", False), ("writev", False), ("pwrite", True), ("pwritev", True)):
            mp.setattr(os, name, writer_of(name, positional))
        mp.setattr(os, "ftruncate", o_ftruncate)
        mp.setattr(os, "fsync", sync_of("fsync"))
        mp.setattr(os, "fdatasync", sync_of("fdatasync"))
        mp.setattr(os, "mkdir", path_op("mkdir", "mkdir"))
        for name in ("unlink", "remove"):
            mp.setattr(os, name, path_op(name, "unlink"))
        mp.setattr(os, "rmdir", path_op("rmdir", "rmdir"))
        mp.setattr(os, "rename", two_path_op("rename", "rename"))
        mp.setattr(os, "replace", two_path_op("replace", "rename"))
        mp.setattr(os, "link", two_path_op("link", "link"))
        mp.setattr(libc, "renameat2_exchange", exchange)


def snapshot(base: str) -> dict:
    """{relative path: bytes or None (a directory)} of the tree under ``base``."""
    out = {}
    for dirpath, _dirnames, filenames in os.walk(base):
        rel = os.path.relpath(dirpath, base)
        if rel != ".":
            out[rel] = None
        for n in filenames:
            with open(os.path.join(dirpath, n), "rb") as f:
                out[os.path.normpath(os.path.join(rel, n))] = f.read()
    return out


class Model:
    """Inodes and directory entries; inode 0 is ``base``."""

    def __init__(self, initial: dict):
        self.inodes: dict[int, Inode] = {0: Inode("dir")}
        for rel in sorted(initial, key=lambda r: r.count(os.sep)):
            parent, name = self.lookup_parent(rel)
            i = len(self.inodes)
            self.inodes[i] = Inode("dir") if initial[rel] is None else Inode("file", bytearray(initial[rel]))
            self.inodes[parent].entries[name] = i

    def lookup_parent(self, rel: str) -> tuple[int, str]:
        parts = [p for p in rel.split(os.sep) if p and p != "."]
        node = 0
        for p in parts[:-1]:
            node = self.inodes[node].entries[p]
        return node, parts[-1]

    def rel(self, base: str, path: str) -> str:
        return os.path.relpath(path, base)

    def node(self, i: int, kind: str = "dir") -> Inode:
        """Inode ``i``; one whose creation was lost still exists, unreachable (empty)."""
        if i not in self.inodes:
            self.inodes[i] = Inode(kind)
        return self.inodes[i]

    def apply(self, op: tuple) -> None:
        kind = op[0]
        if kind == "add":
            _, d, name, i, ikind = op
            self.node(i, ikind)
            self.node(d).entries.setdefault(name, i)
        elif kind == "rename":
            _, d1, n1, d2, n2, i = op
            e1, e2 = self.node(d1).entries, self.node(d2).entries
            target = e2.get(n2)
            if e1.get(n1) != i or (target is not None and target != i and self.node(target).entries):
                return
            del e1[n1]
            e2[n2] = i
        elif kind == "exchange":
            _, d1, n1, i1, d2, n2, i2 = op
            e1, e2 = self.node(d1).entries, self.node(d2).entries
            if e1.get(n1) == i1 and e2.get(n2) == i2:
                e1[n1], e2[n2] = i2, i1
        elif kind == "remove":
            _, d, name, i = op
            entries = self.node(d).entries
            if entries.get(name) == i and not self.node(i).entries:
                del entries[name]
        elif kind == "write":
            _, i, off, data = op
            buf = self.node(i, "file").data
            if len(buf) < off:
                buf.extend(bytes(off - len(buf)))
            buf[off : off + len(data)] = data
        elif kind == "truncate":
            _, i, size = op
            buf = self.node(i, "file").data
            del buf[size:]
            buf.extend(bytes(size - len(buf)))

    def materialize(self, dest: str) -> None:
        def walk(i: int, path: str) -> None:
            for name, j in self.inodes[i].entries.items():
                p = os.path.join(path, name)
                if self.inodes[j].kind == "dir":
                    os.mkdir(p)
                    walk(j, p)
                else:
                    with open(p, "wb") as f:
                        f.write(self.inodes[j].data)

        os.makedirs(dest)
        walk(0, dest)

    def tree(self) -> dict:
        out = {}

        def walk(i: int, rel: str) -> None:
            for name, j in self.inodes[i].entries.items():
                r = os.path.join(rel, name) if rel else name
                out[r] = None if self.inodes[j].kind == "dir" else bytes(self.inodes[j].data)
                if self.inodes[j].kind == "dir":
                    walk(j, r)

        walk(0, "")
        return out


@dataclass
class Op:
    action: tuple  # what Model.apply does
    dirs: tuple = ()  # directories whose fsync makes an entry change durable
    inode: int | None = None  # the file whose fsync makes a write durable
    what: str = ""  # for reports: the call, with paths relative to base


class Trace:
    """The recorded calls as model operations, with the inode each touches (resolved in program order)."""

    def __init__(self, rec: Recorder):
        self.base = rec.base
        self.initial = rec.initial
        self.ops: list[Op] = []
        self.fsyncs: list[tuple[int, int]] = []  # (position in ops, inode)
        self.marks: dict[str, int] = {}
        live = Model(rec.initial)

        def r(path: str) -> str:
            return os.path.relpath(path, self.base)

        fd_inode: dict[int, int] = {}
        fd_path: dict[int, str] = {}

        def lookup(path: str) -> int | None:
            node = 0
            for p in [p for p in os.path.relpath(path, self.base).split(os.sep) if p != "."]:
                node = live.inodes[node].entries.get(p)
                if node is None:
                    return None
            return node

        def parent(path: str) -> tuple[int, str]:
            return lookup(os.path.dirname(path)), os.path.basename(path)

        def emit(action, dirs=(), inode=None, what=""):
            live.apply(action)
            self.ops.append(Op(action, dirs, inode, what))

        for call in rec.calls:
            kind = call[0]
            if kind == "mark":
                self.marks[call[1]] = len(self.ops)
            elif kind == "open":
                _, fd, path, created, trunc = call
                if created:
                    d, name = parent(path)
                    emit(("add", d, name, len(live.inodes), "file"), (d,), what=f"create {r(path)}")
                fd_inode[fd], fd_path[fd] = lookup(path), r(path)
                if trunc and not created:
                    emit(("truncate", fd_inode[fd], 0), inode=fd_inode[fd], what=f"truncate {r(path)}")
            elif kind == "write":
                _, fd, off, data = call
                emit(
                    ("write", fd_inode[fd], off, data), inode=fd_inode[fd], what=f"write {len(data)} B to {fd_path[fd]}"
                )
            elif kind == "truncate":
                _, fd, size = call
                emit(("truncate", fd_inode[fd], size), inode=fd_inode[fd], what=f"ftruncate {fd_path[fd]} to {size}")
            elif kind == "fsync":
                self.fsyncs.append((len(self.ops), fd_inode[call[1]]))
            elif kind == "mkdir":
                d, name = parent(call[1])
                emit(("add", d, name, len(live.inodes), "dir"), (d,), what=f"mkdir {r(call[1])}")
            elif kind == "link":
                d, name = parent(call[2])
                emit(("add", d, name, lookup(call[1]), "file"), (d,), what=f"link {r(call[1])} -> {r(call[2])}")
            elif kind == "unlink" or kind == "rmdir":
                d, name = parent(call[1])
                emit(("remove", d, name, lookup(call[1])), (d,), what=f"{kind} {r(call[1])}")
            elif kind == "rename":
                (d1, n1), (d2, n2) = parent(call[1]), parent(call[2])
                emit(("rename", d1, n1, d2, n2, lookup(call[1])), (d1, d2), what=f"rename {r(call[1])} -> {r(call[2])}")
            elif kind == "exchange":
                (d1, n1), (d2, n2) = parent(call[1]), parent(call[2])
                a, b = lookup(call[1]), lookup(call[2])
                emit(("exchange", d1, n1, a, d2, n2, b), (d1, d2), what=f"exchange {r(call[1])} <-> {r(call[2])}")
        self.end_tree = live.tree()

    def check_complete(self) -> None:
        """The model's end state is the real tree: no call that changes the tree went unrecorded."""
        real = snapshot(self.base)
        assert self.end_tree == real, sorted(set(self.end_tree.items()) ^ set(real.items()), key=str)[:5]

    def durable(self, k: int) -> list[bool]:
        """Per operation before crash point ``k``: durable by the POSIX-minimal model."""
        out = []
        for j, op in enumerate(self.ops[:k]):
            need = set(op.dirs) if op.dirs else {op.inode}
            done = {i for pos, i in self.fsyncs if j < pos <= k}
            out.append(need <= done)
        return out

    def state(self, k: int, rng: random.Random, keep: float) -> tuple[Model, list[str]]:
        """A crash state at point ``k``: durable operations applied; each other one kept with probability
        ``keep`` (a kept write torn at a 512 B boundary one time in four). Returns (model, what was lost)."""
        model = Model(self.initial)
        lost = []
        for op, is_durable in zip(self.ops[:k], self.durable(k)):
            action = op.action
            if not is_durable:
                if rng.random() >= keep:
                    lost.append(op.what)
                    continue
                if action[0] == "write" and len(action[3]) > 512 and rng.random() < 0.25:
                    cut = rng.randrange(1, (len(action[3]) + 511) // 512) * 512
                    action = (*action[:3], action[3][:cut])
                    lost.append(f"{op.what} (torn at {cut})")
            model.apply(action)
        return model, lost
