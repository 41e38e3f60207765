"""Emulate a bandwidth-bound link to the bench's S3 server with Linux traffic control (``tc`` on ``lo``).

Why: a real object store sits behind a network link whose bandwidth, not the client's CPU, bounds a checkpoint's
upload and download. On a small machine the local SeaweedFS is CPU-bound on the encoder's cores instead, so
compression's byte savings cannot show. An htb qdisc on loopback caps the traffic of ONE port (the bench's own S3
port, as source and as destination port) at a fixed rate per direction; every other port is left unclassified and
passes unshaped (htb ``default 0``), so S3 servers of other runs on the machine are untouched.

The root qdisc carries a fixed handle (``HANDLE``) so a leftover of an earlier, killed bench run can be recognised
and removed; a root qdisc on ``lo`` that is not ours is never replaced (a clear error instead).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import subprocess

LOG = logging.getLogger("ckpt_bench.link_shaper")

HANDLE = "1a7e"  # the bench's own root qdisc on lo
DEVICE = "lo"
UPLOAD_CLASS = f"{HANDLE}:10"  # client -> server (dport == S3 port)
DOWNLOAD_CLASS = f"{HANDLE}:20"  # server -> client (sport == S3 port)


class ShapingUnavailable(RuntimeError):
    """Traffic shaping needs root and the ``tc`` binary (iproute2)."""


def tc_binary() -> str:
    return shutil.which("tc") or ("/usr/sbin/tc" if os.path.exists("/usr/sbin/tc") else "")


def setup_commands(port: int, mbit: int, tc: str = "tc", device: str = DEVICE) -> list[list[str]]:
    """The tc commands that cap ``port`` (as dport and as sport) at ``mbit`` per direction on ``device``."""
    if not (0 < port < 65536) or mbit <= 0:
        raise ValueError(f"port {port} / rate {mbit} mbit out of range")
    # loopback sends up to 64 KiB segments (GSO): burst and quantum must hold a few of them
    cls = ["rate", f"{mbit}mbit", "ceil", f"{mbit}mbit", "burst", "256k", "cburst", "256k", "quantum", "65536"]
    cmds = [
        [tc, "qdisc", "add", "dev", device, "root", "handle", f"{HANDLE}:", "htb", "default", "0"],
        [tc, "class", "add", "dev", device, "parent", f"{HANDLE}:", "classid", UPLOAD_CLASS, "htb", *cls],
        [tc, "class", "add", "dev", device, "parent", f"{HANDLE}:", "classid", DOWNLOAD_CLASS, "htb", *cls],
    ]
    for field, flow in (("dport", UPLOAD_CLASS), ("sport", DOWNLOAD_CLASS)):
        cmds.append(
            [tc, "filter", "add", "dev", device, "parent", f"{HANDLE}:", "protocol", "ip", "prio", "1", "u32",
             "match", "ip", field, str(port), "0xffff", "flowid", flow]
        )  # fmt: skip
    return cmds


def teardown_command(tc: str = "tc", device: str = DEVICE) -> list[str]:
    return [tc, "qdisc", "del", "dev", device, "root", "handle", f"{HANDLE}:"]


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def _root_qdisc(tc: str) -> str:
    out = _run([tc, "qdisc", "show", "dev", DEVICE]).stdout
    return next((line for line in out.splitlines() if " root " in f" {line} "), "")


def _remove(tc: str) -> None:
    """Remove our qdisc if present (idempotent; never touches a root qdisc with another handle)."""
    if f" {HANDLE}: " in f" {_root_qdisc(tc)} ":
        _run(teardown_command(tc), check=False)
        LOG.info("tc: removed the bench's qdisc %s: on %s", HANDLE, DEVICE)


def require() -> str:
    """The tc binary, or ShapingUnavailable naming what is missing (checked before any phase runs)."""
    tc = tc_binary()
    if not tc:
        raise ShapingUnavailable("--s3-mbps needs the tc binary (iproute2): not found on PATH nor at /usr/sbin/tc")
    if os.geteuid() != 0:
        raise ShapingUnavailable("--s3-mbps needs root (tc qdisc add on lo); run the bench as root or drop it")
    return tc


@contextlib.contextmanager
def shaped(port: int, mbit: int):
    """Cap ``port`` on loopback at ``mbit`` per direction for the ``with`` body; always removed afterwards."""
    tc = require()
    _remove(tc)  # a leftover of an earlier bench run
    other = _root_qdisc(tc)
    if other and not other.startswith("qdisc noqueue"):
        raise ShapingUnavailable(f"lo already has a root qdisc that is not the bench's: {other!r}; not replacing it")
    cleanup = lambda: _remove(tc)  # noqa: E731
    atexit.register(cleanup)
    try:
        for cmd in setup_commands(port, mbit, tc):
            res = _run(cmd, check=False)
            if res.returncode:
                raise ShapingUnavailable(f"{' '.join(cmd)} failed: {res.stderr.strip()}")
        LOG.info(
            "tc: shaping 127.0.0.1 port %d on %s to %d mbit (%.0f MB/s) per direction (htb %s:, sport+dport); "
            "other ports unshaped",
            port, DEVICE, mbit, mbit / 8, HANDLE,
        )  # fmt: skip
        yield
    finally:
        cleanup()
        atexit.unregister(cleanup)
