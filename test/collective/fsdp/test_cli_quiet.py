"""``paddle-fsdp-ckpt`` for a first-time user (#53): help without importing paddle, and no noise that is not about
the user's checkpoint (paddle's ccache notice, botocore's INFO lines) unless ``-v``.

The installed console script is run in a child with ``python -X importtime``: its import log lists every module the
child imported, so "paddle was not imported" is read from the child itself, not inferred from a time.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from paddle.distributed.fsdp.tools.cli import build_parser

SCRIPT = Path(sys.executable).parent / "paddle-fsdp-ckpt"


def _subcommands() -> list[str]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    return sorted(sub.choices)


def _imported(importtime_log: str) -> set[str]:
    """Module names in a ``-X importtime`` log (lines ``import time: self | cumulative | name``)."""
    names = set()
    for line in importtime_log.splitlines():
        if line.startswith("import time:") and line.count("|") == 2:
            names.add(line.rsplit("|", 1)[1].strip())
    return names


def _run_script(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-X", "importtime", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def _heavy(names: set[str]) -> set[str]:
    return {n for n in names if n.split(".")[0] in ("paddle", "numpy", "boto3", "botocore")}


def test_console_script_is_the_light_launcher():
    from importlib.metadata import entry_points

    import paddle_fsdp_fork_cli

    eps = [ep for ep in entry_points(group="console_scripts") if ep.name == "paddle-fsdp-ckpt"]
    assert eps and eps[0].value == "paddle_fsdp_fork_cli:main" and eps[0].load() is paddle_fsdp_fork_cli.main
    assert SCRIPT.exists(), SCRIPT


@pytest.mark.parametrize("args", [["--help"], *([c, "--help"] for c in _subcommands())], ids=" ".join)
def test_help_answers_without_importing_paddle(args):
    proc = _run_script(*args)
    assert proc.returncode == 0, proc.stderr[-2000:]
    usage = "usage: paddle-fsdp-ckpt" + (f" {args[0]}" if len(args) == 2 else "")
    assert proc.stdout.startswith(usage), proc.stdout[:300]
    imported = _imported(proc.stderr)
    assert "paddle_fsdp_fork_cli" in imported  # the log is real: the launcher itself is listed
    assert not _heavy(imported), sorted(_heavy(imported))
    assert "Warning" not in "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("import time"))


@pytest.mark.parametrize(
    "args, needle",
    [([], "usage:"), (["verify"], "the following arguments are required"), (["no-such-command"], "invalid choice")],
)
def test_usage_errors_answer_without_importing_paddle(args, needle):
    proc = _run_script(*args)
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr[-2000:]
    assert not _heavy(_imported(proc.stderr))


def test_the_launcher_hands_commands_to_the_tool_with_one_copy_of_each_module(tmp_path):
    """A command that parses runs the real tool; no fork module stays loaded under the launcher's private root."""
    code = (
        "import sys, paddle_fsdp_fork_cli as c\n"
        f"rc = c.main(['inspect', {str(tmp_path / 'missing')!r}])\n"
        "left = [m for m in sys.modules if m.startswith('_paddle_fsdp_ckpt_parser')]\n"
        "print(rc, 'paddle.distributed.fsdp.tools.cli' in sys.modules, left)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.stdout.split() == ["2", "True", "[]"], proc.stdout + proc.stderr[-2000:]
    assert "no such" in proc.stderr.lower() or "not" in proc.stderr.lower(), proc.stderr


def _small_checkpoint(path: str) -> None:
    import paddle
    from paddle.distributed.fsdp.checkpoint import save_state_dict

    rng = np.random.default_rng(53)
    save_state_dict({"w": paddle.to_tensor(rng.standard_normal((4, 5)).astype(np.float32))}, path)


NOISE = ("ccache", "UserWarning", "warnings.warn", "botocore", "Found credentials")


def _tool_noise(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if any(word in line for word in NOISE)]


def test_commands_on_a_local_checkpoint_print_no_foreign_warning(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    _small_checkpoint(ckpt)
    for args in (["verify", ckpt], ["inspect", ckpt]):
        proc = subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        assert proc.stderr == "", proc.stderr
    if shutil.which("ccache") is None:  # paddle's notice is filtered, not every warning: -v shows it again
        proc = subprocess.run([str(SCRIPT), "verify", "-v", ckpt], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0 and "ccache" in proc.stderr, proc.stderr


def test_commands_on_s3_print_no_botocore_lines(tmp_path, s3_bucket, s3_env):
    url = f"s3://{s3_bucket}/quiet/ckpt"
    _small_checkpoint(url)
    env = dict(os.environ)  # s3_env put the test server's endpoint and credentials into the environment
    for args in (["verify", url], ["inspect", url]):
        proc = subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr
        assert not _tool_noise(proc.stderr), proc.stderr
    proc = subprocess.run([str(SCRIPT), "verify", "-v", url], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "Found credentials" in proc.stderr, proc.stderr  # shown with -v: only the default is quiet


def test_a_command_without_the_fork_is_one_line(tmp_path):
    """The overlay switched off (or paddle missing): the command says so in one line, not a traceback; --help
    still answers."""
    env = dict(os.environ, PADDLE_FSDP_FORK_DISABLE="1")
    proc = subprocess.run([str(SCRIPT), "verify", str(tmp_path)], capture_output=True, text=True, timeout=300, env=env)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("paddle-fsdp-ckpt")]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(lines) == 1 and "PADDLE_FSDP_FORK_DISABLE" in lines[0], proc.stderr[-2000:]
    proc = subprocess.run([str(SCRIPT), "--help"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and proc.stdout.startswith("usage: paddle-fsdp-ckpt"), proc.stderr
