"""The fork is activated by its install alone, and stock paddle's files are left untouched.

Each import check runs in a NEW interpreter: activation happens at start-up (the ``.pth`` file), and
what matters is what a user's fresh ``python`` sees, not this already-initialised test process.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata as metadata
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

import paddle_fsdp_fork_activate as activate

RESULT_MARKER = "@@RESULT@@"


def run_python(code: str, env: dict[str, str] | None = None, timeout: float = 180) -> Any:
    """Run ``code`` in a fresh interpreter; return the object it passed to ``emit(obj)``."""
    prelude = f"import json as _json\ndef emit(obj):\n    print({RESULT_MARKER!r} + _json.dumps(obj), flush=True)\n"
    full_env = {k: v for k, v in os.environ.items() if k != activate.DISABLE_ENV}
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, f"subprocess failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    assert "Error processing line" not in proc.stderr, proc.stderr  # a broken .pth is only a warning
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_MARKER)]
    assert lines, f"subprocess emitted no result:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[-1][len(RESULT_MARKER) :])


def _paddle_dir() -> Path:
    spec = importlib.util.find_spec("paddle")  # locates paddle without importing it
    assert spec is not None and spec.origin, "paddle is not installed"
    return Path(spec.origin).resolve().parent


def _paddle_distribution() -> metadata.Distribution:
    """The distribution that installed the `paddle` package (paddlepaddle or paddlepaddle-gpu)."""
    names = metadata.packages_distributions().get("paddle", [])
    for name in names:
        if name.lower().startswith("paddlepaddle"):
            return metadata.distribution(name)
    pytest.fail(f"no paddlepaddle* distribution provides `paddle` (found {names})")


def test_fork_and_upstream_import_in_new_interpreter() -> None:
    info = run_python(
        """
        import sys
        from paddle.distributed.fsdp import FullyShardFusion
        from paddle.distributed.fsdp import fully_shard
        import paddle.distributed as dist
        import paddle.distributed.fsdp as fsdp
        emit({
            "fsdp_file": fsdp.__file__,
            "fsdp_path": list(fsdp.__path__),
            "fusion_module": FullyShardFusion.__module__,
            "fully_shard_module": fully_shard.__module__,
            "fully_shard_file": sys.modules[fully_shard.__module__].__file__,
            "paddle_dir": __import__("os").path.dirname(__import__("paddle").__file__),
            "private_loaded": sorted(m for m in sys.modules if m.split(".")[0] == "paddle_fsdp_fork"),
        })
        """
    )
    fork_dir = Path(info["fsdp_path"][0]).resolve()
    stock_fsdp = (Path(info["paddle_dir"]) / "distributed" / "fsdp").resolve()
    assert Path(info["fsdp_file"]).resolve() == fork_dir / "__init__.py"
    assert fork_dir != stock_fsdp
    assert stock_fsdp in [Path(p).resolve() for p in info["fsdp_path"][1:]]
    assert info["fusion_module"].startswith("paddle.distributed.fsdp.")
    # upstream's fully_shard is the stock module, reached through the overlay's search path
    assert info["fully_shard_module"] == "paddle.distributed.fsdp.fully_shard"
    assert Path(info["fully_shard_file"]).resolve().parent == stock_fsdp
    assert info["private_loaded"] == []  # never loaded a second time under the private name


def test_checkpoint_api_is_redirected_to_the_fork() -> None:
    info = run_python(
        """
        import paddle.distributed as dist
        import paddle.distributed.fsdp.checkpoint.stock as fork_ckpt  # the dispatch (stock's signature)
        calls = []
        fork_ckpt.save_state_dict = lambda *a, **k: calls.append(("save", a, k)) or "saved"
        fork_ckpt.load_state_dict = lambda *a, **k: calls.append(("load", a, k)) or "loaded"
        out = [dist.save_state_dict({"w": 1}, "/ckpt", unique_id=3),
               dist.load_state_dict({"w": 2}, "/ckpt", offload=True)]
        emit({
            "out": out,
            "calls": calls,
            "marker": [getattr(dist.save_state_dict, "_paddle_fsdp_fork_wrapper", False),
                       getattr(dist.load_state_dict, "_paddle_fsdp_fork_wrapper", False)],
            "stock": [dist.save_state_dict.__wrapped_stock__.__module__,
                      dist.load_state_dict.__wrapped_stock__.__module__],
        })
        """
    )
    assert info["marker"] == [True, True]
    assert info["out"] == ["saved", "loaded"]
    assert info["calls"] == [
        ["save", [{"w": 1}, "/ckpt"], {"unique_id": 3}],
        ["load", [{"w": 2}, "/ckpt"], {"offload": True}],
    ]
    assert all(m.startswith("paddle.distributed.flex_checkpoint") for m in info["stock"]), info["stock"]


def test_private_package_name_is_refused() -> None:
    info = run_python(
        """
        try:
            import paddle_fsdp_fork
        except ImportError as exc:
            emit(str(exc))
        else:
            emit(None)
        """
    )
    assert info is not None, "importing the private package name must fail"
    assert "paddle.distributed.fsdp" in info


def test_startup_hook_is_cheap_and_lazy() -> None:
    info = run_python(
        """
        import sys, paddle_fsdp_fork_activate as a
        emit({"paddle": "paddle" in sys.modules,
              "finder_first": isinstance(sys.meta_path[0], a.ForkFinder)})
        """
    )
    assert info == {"paddle": False, "finder_first": True}


def test_disable_switch_gives_stock_paddle() -> None:
    info = run_python(
        """
        import paddle.distributed as dist, paddle.distributed.fsdp as fsdp
        emit({"file": fsdp.__file__, "paddle": __import__("paddle").__file__,
              "wrapped": hasattr(dist.save_state_dict, "__wrapped_stock__")})
        """,
        env={activate.DISABLE_ENV: "1"},
    )
    stock = Path(info["paddle"]).resolve().parent / "distributed" / "fsdp" / "__init__.py"
    assert Path(info["file"]).resolve() == stock
    assert info["wrapped"] is False


def test_stock_paddle_installation_has_no_file_from_us() -> None:
    ours = metadata.distribution("paddle-fsdp-fork")
    our_files = [str(f) for f in ours.files or []]
    assert not [f for f in our_files if f.replace("\\", "/").startswith("paddle/")], our_files

    paddle_dist = _paddle_distribution()
    site = Path(paddle_dist.locate_file("")).resolve()
    record = {str(f).replace("\\", "/"): f for f in paddle_dist.files or []}
    stock_fsdp = _paddle_dir() / "distributed" / "fsdp"
    foreign = [
        str(p.relative_to(site))
        for p in stock_fsdp.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and str(p.relative_to(site)) not in record
    ]
    assert not foreign, f"files in stock paddle/distributed/fsdp not installed by {paddle_dist.name}: {foreign}"
    fork_modules = {p.name for p in Path(activate.fork_dir()).glob("*.py")} - {"__init__.py", "fully_shard.py"}
    assert not fork_modules & {p.name for p in stock_fsdp.glob("*.py")}

    # stock sources we overlay or patch are byte-identical to what pip installed
    checked = 0
    for rel, entry in record.items():
        if not (rel.startswith("paddle/distributed/") and rel.endswith(".py")) or entry.hash is None:
            continue
        digest = hashlib.new(entry.hash.mode, (site / rel).read_bytes()).digest()
        assert base64.urlsafe_b64encode(digest).rstrip(b"=").decode() == entry.hash.value, rel
        checked += 1
    assert checked > 50, f"only {checked} recorded paddle/distributed sources found"


@pytest.mark.parametrize("version", ["3.3.1", "3.3.0", "3.3.2.post1", "0.0.0"])
def test_version_check_accepts(version: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(activate.SKIP_VERSION_CHECK_ENV, raising=False)
    assert activate.check_paddle_version(version) == version


@pytest.mark.parametrize("version", ["3.2.0", "2.6.2", "3.4.0", "4.3.1", "garbage"])
def test_version_check_rejects_with_clear_message(version: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(activate.SKIP_VERSION_CHECK_ENV, raising=False)
    with pytest.raises(ImportError, match=r"requires paddle 3\.3\.x"):
        activate.check_paddle_version(version)
    monkeypatch.setenv(activate.SKIP_VERSION_CHECK_ENV, "1")
    assert activate.check_paddle_version(version) == version


def test_fork_init_guard_refuses_private_name() -> None:
    with pytest.raises(ImportError, match=r"Import 'paddle\.distributed\.fsdp' instead"):
        activate.ensure_fork_import("paddle_fsdp_fork")


_WORKER = f"""
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})
import paddle
import paddle.distributed as dist
import paddle.distributed.fsdp as fsdp
from launch_util import report

dist.init_parallel_env()
t = paddle.to_tensor([float(dist.get_rank() + 1)])
if dist.get_world_size() > 1:
    dist.all_reduce(t)
report({{"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": float(t.numpy()[0]),
        "fsdp": fsdp.__file__, "wrapped": hasattr(dist.save_state_dict, "__wrapped_stock__")}})
"""


@pytest.mark.parametrize("nproc", [1, 2])
def test_launched_workers_see_the_fork(nproc: int, launch, tmp_path: Path) -> None:
    script = tmp_path / "activation_worker.py"
    script.write_text(_WORKER, encoding="utf-8")
    result = launch(script, nproc, timeout=300)
    fork_init = str(Path(activate.fork_dir()) / "__init__.py")
    assert sorted(result.results) == list(range(nproc))
    for rank, info in result.results.items():
        assert info["world"] == nproc and info["rank"] == rank
        assert info["sum"] == nproc * (nproc + 1) / 2
        assert Path(info["fsdp"]).resolve() == Path(fork_init).resolve()
        assert info["wrapped"] is True
