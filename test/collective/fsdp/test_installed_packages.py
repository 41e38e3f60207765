"""The install is whole (#53): ``pip check`` is clean and every package the fork's install brought imports.

``pip check`` reads declared requirements only: pyarrow 26 installed beside numpy 1.26 (which paddleformers 0.4.1
requires) passed it while ``import pyarrow`` failed ("pyarrow requires NumPy 2.0 or newer"). So the packages
are also imported: every top-level module of every distribution the fork depends on, directly or not, with the
extras installed here, in one child interpreter.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = "paddle-fsdp-fork"
#: the fork's own modules: the import hook refuses ``import paddle_fsdp_fork`` by design (it is served as
#: paddle.distributed.fsdp, imported through paddle here)
OWN_PRIVATE = {"paddle_fsdp_fork"}


def _installed() -> dict[str, metadata.Distribution]:
    return {canonicalize_name(d.metadata["Name"]): d for d in metadata.distributions()}


def _closure() -> list[metadata.Distribution]:
    """The fork and every distribution it needs (any extra of the fork whose packages are installed; the
    extras its dependencies ask for), as installed here."""
    installed = _installed()
    todo, seen = [(canonicalize_name(ROOT), None)], {}
    while todo:
        name, extras = todo.pop()
        dist = installed.get(name)
        if dist is None or (name in seen and extras is None):
            continue
        seen[name] = dist
        for line in dist.requires or []:
            req = Requirement(line)
            wanted = canonicalize_name(req.name)
            marker_extras = ["", *(extras or ())]
            if name == canonicalize_name(ROOT):  # every extra of the fork: what is not installed is skipped
                marker_extras += dist.metadata.get_all("Provides-Extra") or []
            if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in marker_extras):
                continue
            if wanted not in seen:
                todo.append((wanted, req.extras or None))
    return list(seen.values())


def _top_level_modules(dist: metadata.Distribution) -> set[str]:
    """Importable top-level names from the distribution's RECORD: packages (``x/__init__.py``), modules
    (``x.py``) and extension modules (``x.*.so`` exporting ``PyInit_x``; a bare shared library is no module)."""
    names = set()
    for f in dist.files or []:
        parts = f.parts
        if parts[0] in ("..", "__pycache__") or parts[0].endswith((".dist-info", ".data")):
            continue
        if len(parts) == 2 and parts[1] == "__init__.py":
            names.add(parts[0])
        elif len(parts) == 1 and parts[0].endswith(".py"):
            names.add(parts[0][:-3])
        elif len(parts) == 1 and re.search(r"\.(so|pyd)$", parts[0]):
            stem = parts[0].split(".")[0]
            if f"PyInit_{stem}".encode() in f.locate().read_bytes():
                names.add(stem)
    return names - OWN_PRIVATE


def test_pip_check_is_clean():
    proc = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_installed_dependency_imports():
    dists = _closure()
    names = {d.metadata["Name"] for d in dists}
    assert {"paddle-fsdp-fork", "numpy", "safetensors", "xxhash"} <= names, sorted(names)
    modules = sorted({m for d in dists for m in _top_level_modules(d)})
    code = (
        "import importlib, json, sys\n"
        "bad = {}\n"
        f"for m in {modules!r}:\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except BaseException as e:\n"
        "        bad[m] = f'{type(e).__name__}: {e}'\n"
        "print(json.dumps(bad))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    bad = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not bad, "installed but not importable:\n" + "\n".join(f"  {m}: {e}" for m, e in sorted(bad.items()))
    assert {"numpy", "safetensors", "xxhash"} <= set(modules), modules
