"""Shared pytest set-up for the FSDP fork's tests.

Why: every test runs against the *installed* fork (real processes import ``paddle.distributed.fsdp``
through the import hook), so the session refuses to start when the fork is missing, disabled, or an
outdated copy of this checkout — otherwise tests would silently exercise stock paddle or old code.
"""

from __future__ import annotations

import filecmp
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

TEST_DIR = Path(__file__).resolve().parent
REPO_ROOT = TEST_DIR.parents[2]
FORK_SRC = REPO_ROOT / "python" / "paddle" / "distributed" / "fsdp"
ACTIVATE_SRC = REPO_ROOT / "python" / "paddle_fsdp_fork_activate.py"

if str(TEST_DIR) not in sys.path:  # `import launch_util` from tests, whatever pytest's import mode
    sys.path.insert(0, str(TEST_DIR))

from launch_util import LaunchResult, run_launch  # noqa: E402
from s3_fixtures import fault_proxy, s3_bucket, s3_env, s3_server  # noqa: E402, F401 - S3 fixtures (real SeaweedFS)

INSTALL_HINT = 'pip install ".[cpu,test]"  (or, while developing, pip install -e ".[cpu,test]")'


def _source_files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*.py") if "__pycache__" not in p.parts}


def _stale_files(installed: Path, source: Path) -> list[str]:
    """Relative paths whose installed copy is missing, extra or different from the checkout."""
    src, inst = _source_files(source), _source_files(installed)
    stale = sorted(src ^ inst)
    stale += sorted(rel for rel in src & inst if not filecmp.cmp(source / rel, installed / rel, shallow=False))
    return stale


def _check_fork_installed() -> None:
    spec = importlib.util.find_spec("paddle_fsdp_fork_activate")
    if spec is None or not spec.origin:
        pytest.exit(
            f"paddle-fsdp-fork is not installed for {sys.executable}. From the repo root run: {INSTALL_HINT}",
            returncode=4,
        )
    import paddle_fsdp_fork_activate as activate

    if not any(isinstance(f, activate.ForkFinder) for f in sys.meta_path):
        pytest.exit(
            f"paddle-fsdp-fork is installed but not active (is {activate.DISABLE_ENV} set, or was "
            f"python started with -S?). Its .pth file must run at start-up; reinstall with: {INSTALL_HINT}",
            returncode=4,
        )
    if not FORK_SRC.is_dir():  # tests copied elsewhere: nothing to compare with
        return
    installed = Path(activate.fork_dir()).resolve()
    if installed == FORK_SRC.resolve():
        return  # editable install: the checkout itself is imported
    stale = _stale_files(installed, FORK_SRC)
    if ACTIVATE_SRC.is_file() and not filecmp.cmp(ACTIVATE_SRC, spec.origin, shallow=False):
        stale.append(ACTIVATE_SRC.name)
    if stale:
        pytest.exit(
            f"the installed paddle-fsdp-fork ({installed}) is an outdated copy of this checkout; "
            f"differing files: {', '.join(stale[:10])}{' ...' if len(stale) > 10 else ''}. "
            f"Reinstall: {INSTALL_HINT}",
            returncode=4,
        )


def pytest_sessionstart(session: pytest.Session) -> None:
    _check_fork_installed()


LaunchFn = Callable[..., LaunchResult]


@pytest.fixture
def launch(tmp_path: Path) -> LaunchFn:
    """``launch(script, nproc, args=(), timeout=600, env=None, **kw)`` with logs under ``tmp_path``.

    A relative ``script`` is taken relative to this test directory; each call gets its own log dir.
    """
    counter = 0

    def _launch(
        script: str | os.PathLike[str],
        nproc: int,
        args: Sequence[str] = (),
        timeout: float = 600,
        env: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> LaunchResult:
        nonlocal counter
        counter += 1
        path = Path(script)
        if not path.is_absolute():
            path = TEST_DIR / path
        kwargs.setdefault("log_dir", tmp_path / f"launch{counter}_{path.stem}_np{nproc}")
        return run_launch(path, nproc, args, timeout=timeout, env=env, **kwargs)

    return _launch


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fake-device",
        action="store_true",
        help="run in fake-device mode (PADDLE_FSDP_FAKE_DEVICE=1, inherited by launched workers): CPU tensors "
        "count as device memory, raw pointer reads of them raise, GPU-only collectives are emulated on gloo",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "power_loss: replays the crash states a power loss may leave (POSIX-minimal model, test_power_loss_posix.py)",
    )
    config.addinivalue_line(
        "markers",
        "host_memory_path: asserts how host tensors are read/written in place (arena, in-place reads); device "
        "memory never takes that path, so the test does not apply in --fake-device runs",
    )
    if config.getoption("--fake-device", default=False):
        os.environ["PADDLE_FSDP_FAKE_DEVICE"] = "1"  # before any test imports the fork (device options read once)


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    if not config.getoption("--fake-device", default=False):
        return
    not_applicable = pytest.mark.skip(reason="host-memory fast path: device tensors are staged instead (--fake-device)")
    for item in items:
        if "host_memory_path" in item.keywords:
            item.add_marker(not_applicable)
