"""Cross-check of the power-loss recorder (posix_crash.py) with ``strace -f -y``: both sides summed to the same
counts per call and path (bytes written per file), so a call the recorder's wrappers miss is found."""

from __future__ import annotations

import os
import re

STRACE_CALLS = "openat,creat,mkdir,mkdirat,rename,renameat,renameat2,link,linkat,unlink,unlinkat,rmdir,fsync,fdatasync,write,writev,pwrite64,pwritev,pwritev2,ftruncate,truncate"  # fmt: skip


def recorder_summary(calls: list[tuple], base: str) -> dict:
    """{event: count} of a Recorder's calls; ("bytes", path) counts bytes written."""
    out: dict = {}
    paths: dict[int, str] = {}

    def add(key, n=1):
        out[key] = out.get(key, 0) + n

    def r(p):
        return os.path.relpath(p, base)

    for c in calls:
        kind = c[0]
        if kind == "open":
            paths[c[1]] = c[2]
            if c[3]:
                add(("create", r(c[2])))
        elif kind == "write":
            add(("bytes", r(paths[c[1]])), len(c[3]))
        elif kind == "truncate":
            add(("ftruncate", r(paths[c[1]]), c[2]))
        elif kind == "fsync":
            add(("fsync", r(paths[c[1]])))
        elif kind in ("mkdir", "unlink", "rmdir"):
            add((kind, r(c[1])))
        elif kind in ("rename", "exchange", "link"):
            add((kind, r(c[1]), r(c[2])))
    return out


_LINE = re.compile(r"^(\d+)\s+(.*)$")
_CALL = re.compile(r"^(\w+)\((.*)\)\s+=\s+(-?\d+)")
_FD = re.compile(r"^(?:AT_FDCWD|\d+)<([^>]*)>$")


def _args(text: str) -> list[str]:
    """Top-level arguments of a strace call (strings kept quoted, brackets and braces nested)."""
    out, depth, cur, quoted, esc = [], 0, "", False, False
    for ch in text:
        if quoted:
            cur += ch
            esc = ch == "\\" and not esc
            if ch == '"' and not esc:
                quoted = False
            continue
        if ch == '"':
            quoted = True
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
            continue
        cur += ch
    out.append(cur.strip())
    return out


def strace_summary(text: str, base: str) -> dict:
    """The same counts from ``strace -f -y -o`` output, for successful calls on paths under ``base``."""
    out: dict = {}
    pending: dict[str, str] = {}
    base = os.path.abspath(base)

    def mine(p):
        return p is not None and (p == base or p.startswith(base + os.sep))

    def path(fd_arg, name_arg=None):
        d = _FD.match(fd_arg)
        if name_arg is None:
            return d.group(1) if d else None
        name = name_arg.strip('"')
        return name if name.startswith("/") else os.path.join(d.group(1), name) if d else None

    def add(key, n=1):
        out[key] = out.get(key, 0) + n

    def r(p):
        return os.path.relpath(p, base)

    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        pid, rest = m.groups()
        if rest.endswith("<unfinished ...>"):
            pending[pid] = rest[: -len("<unfinished ...>")].rstrip()
            continue
        if rest.startswith("<..."):
            rest = pending.pop(pid, "") + rest.split("resumed>", 1)[1]
        c = _CALL.match(rest)
        if not c or int(c.group(3)) < 0:
            continue
        name, a = c.group(1), _args(c.group(2))
        if name == "openat" and "O_CREAT" in a[2]:
            p = path(a[0], a[1])
            if mine(p):
                add(("create", r(p)))
        elif name in ("write", "writev", "pwrite64", "pwritev", "pwritev2"):
            p = path(a[0])
            if mine(p):
                add(("bytes", r(p)), int(c.group(3)))
        elif name == "ftruncate" and mine(path(a[0])):
            add(("ftruncate", r(path(a[0])), int(a[1])))
        elif name in ("fsync", "fdatasync") and mine(path(a[0])):
            add(("fsync", r(path(a[0]))))
        elif name in ("mkdir", "rmdir", "unlink"):
            p = a[0].strip('"')
            if mine(p):
                add((name, r(p)))
        elif name in ("mkdirat", "unlinkat"):
            p = path(a[0], a[1])
            if mine(p):
                add(("mkdir" if name == "mkdirat" else "rmdir" if "AT_REMOVEDIR" in a[2] else "unlink", r(p)))
        elif name in ("rename", "link"):
            s, d = a[0].strip('"'), a[1].strip('"')
            if mine(s) or mine(d):
                add((name, r(s), r(d)))
        elif name in ("renameat", "renameat2", "linkat"):
            s, d = path(a[0], a[1]), path(a[2], a[3])
            if mine(s) or mine(d):
                kind = "link" if name == "linkat" else "exchange" if "RENAME_EXCHANGE" in rest else "rename"
                add((kind, r(s), r(d)))
    return out
