"""The training runtime's packages (issue #53; docs/internals.md has the map): imports go one way, down the floors
below, read from the source (test_package_imports.py's reader: every import, deferred and TYPE_CHECKING ones too);
every ``from paddle.distributed.fsdp... import name`` of the package resolves; the old import paths that users and
upstream code use are the moved modules themselves.

Why: a deferred import with a wrong path fails only when its code runs (``full_parameters``, a save, the EP
layout check...), and a package that imports a higher one brings the runtime's tangle back one folder up.
"""

from __future__ import annotations

import ast
import functools
import importlib
import sys

import pytest
from test_package_imports import BASE, ROOT, graph, modules

# floor of each top-level name under fsdp/ (a package or a root module): a module may import its own package and
# any lower floor, never a higher floor nor another package of its own floor
FLOORS: dict[str, int] = {
    "keywords": 0,  # stdlib only: the catch-all keyword checker
    "env_switches": 0,  # stdlib only: the one parser of the package's environment switches
    "sampler": 0,  # public (docs/resume-state.md): resumable data order, numpy only
    "devices": 1,  # where bytes live and how they cross host <-> device
    "comm": 2,  # who talks to whom and every collective
    "buffers": 3,  # which params share a buffer, the buffer at run time
    "checkpoint": 3,  # save/ and load/ (test_checkpoint_layers.py has its inner rules)
    "step": 4,  # when things happen in a step; the optimizer and Layer wrappers
    "state": 5,  # whole-parameter and state views of the model
    "memtier": 6,  # the memory tier (host copies of the training state)
    "fully_shard_fusion": 7,  # the public wrapper, where upstream Paddle has it
    "tools": 7,  # the CLI
    "integrations": 8,  # PaddleFormers
    "": 9,  # fsdp/__init__.py: the public names
}
# known exceptions, which may only shrink: (importer, imported) fsdp-relative module names
UPWARD: set[tuple[str, str]] = {
    # a new group's outcome is agreed through the job's TCP store with checkpoint's store client (deferred);
    # to go: the store client moves below comm/
    ("comm.group_startup", "checkpoint.save.channel"),
    ("comm.group_startup", "checkpoint.save.store_client"),
}
RUNTIME_PACKAGES = ("devices", "comm", "buffers", "step")
# the old paths kept (fsdp/__init__.py MOVED_MODULES): every module that was at its old place on main before the
# move, where it lives now (user code, upstream code and earlier tests import them)
OLD_PATHS = {
    **{m: f"buffers.{m}" for m in ("fused_buffer", "fused_layout", "lazy_init", "memory_account", "param_grouping")},
    **{m: f"comm.{m}" for m in ("comm_emulation", "communication", "expert_comm", "expert_parallel", "hybrid_comm")},
    "topology": "comm.topology",
    **{m: f"devices.{m}" for m in ("buffer_memory", "device", "device_rules", "device_streams", "heap_trim")},
    "host_mappings": "devices.host_mappings",
    "checkpoint.keywords": "keywords",
    "full_params": "state.full_params",
    "sharded_model": "state.sharded_model",
    **{m: f"step.{m}" for m in ("gradient_sync", "hooks", "layer_integration", "optimizer_integration", "overlap")},
}


def _short(m: str) -> str:
    return m[len(BASE) + 1 :] if m != BASE else ""


def _top(m: str) -> str:
    return m.split(".")[0]


def test_every_top_level_name_has_a_floor():
    tops = {_top(_short(m)) for m in modules()}
    assert tops == set(FLOORS), f"no floor: {sorted(tops - set(FLOORS))}; gone: {sorted(set(FLOORS) - tops)}"
    for pkg in RUNTIME_PACKAGES:
        assert (ROOT / pkg / "__init__.py").is_file(), pkg
    loose = sorted(p.name for p in ROOT.glob("*.py"))
    assert loose == [
        "__init__.py",
        "env_switches.py",
        "fully_shard_fusion.py",
        "keywords.py",
        "sampler.py",
    ], loose


def test_imports_go_down_the_floors_one_way():
    bad = set()
    for m, deps in graph().items():
        a = _short(m)
        for d in deps:
            b = _short(d)
            if _top(a) == _top(b) and a != "":
                continue
            if b == "" or FLOORS[_top(b)] >= FLOORS[_top(a)]:
                bad.add((a, b))
    assert bad == UPWARD, f"imports up or sideways, new: {sorted(bad - UPWARD)}; gone: {sorted(UPWARD - bad)}"


def test_the_package_graph_has_no_circle_outside_the_listed_exceptions():
    """Folded to top-level names (a package is one node), the graph without UPWARD has no circle."""
    edges = {(_top(_short(m)), _top(_short(d))) for m, deps in graph().items() for d in deps}
    edges -= {(_top(a), _top(b)) for a, b in UPWARD}
    edges = {(a, b) for a, b in edges if a != b}
    order = sorted(FLOORS, key=FLOORS.get)
    rank = {n: i for i, n in enumerate(order)}
    assert all(FLOORS[b] < FLOORS[a] for a, b in edges if a != ""), sorted(edges, key=lambda e: rank[e[0]])


def _bound_names(path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            names |= {e.value for e in ast.walk(node.value) if isinstance(e, ast.Constant)}  # lazy (__getattr__)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.If | ast.Try):
            for sub in ast.walk(node):
                if isinstance(sub, ast.Import | ast.ImportFrom):
                    names |= {(a.asname or a.name).split(".")[0] for a in sub.names}
                elif isinstance(sub, ast.FunctionDef | ast.ClassDef):
                    names.add(sub.name)
                elif isinstance(sub, ast.Assign):
                    names |= {n.id for t in sub.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    return names


def test_every_import_of_the_package_resolves():
    """Every ``from <fsdp module> import name`` (deferred ones too) names a module or a top-level name of it."""
    mods = modules()
    stock = {f"{BASE}.fully_shard"}  # stock paddle's module, through the overlay
    bad = []
    for name, path in mods.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                frm = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                frm = node.module or ""
            if not (frm == BASE or frm.startswith(BASE + ".")) or frm in stock:
                continue
            if frm not in mods:
                bad.append(f"{_short(name)}: no module {frm}")
                continue
            bound = _bound_names(mods[frm])
            for a in node.names:
                full = f"{frm}.{a.name}"
                if full not in mods and full not in stock and a.name not in bound and a.name != "*":
                    bad.append(f"{_short(name)}: {frm} has no {a.name}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("old", sorted(OLD_PATHS))
def test_an_old_import_path_is_the_moved_module(old):
    fsdp = importlib.import_module(BASE)
    new = importlib.import_module(f"{BASE}.{OLD_PATHS[old]}")
    assert importlib.import_module(f"{BASE}.{old}") is new
    assert sys.modules[f"{BASE}.{old}"] is new
    assert functools.reduce(getattr, old.split("."), fsdp) is new  # an attribute of its old parent package too
    assert new.__name__ == f"{BASE}.{OLD_PATHS[old]}"  # one module: loggers and monkeypatch see the same object
    ns: dict = {}
    exec(f"from {BASE}.{old} import *", ns)  # noqa: S102
    public = {n for n in dir(new) if not n.startswith("_")}
    assert public and set(ns) - {"__builtins__"} >= (set(getattr(new, "__all__", public)) & public)
    assert fsdp.MOVED_MODULES == OLD_PATHS


def test_the_public_names_and_the_documented_errors_import():
    fsdp = importlib.import_module(BASE)
    for name in fsdp.__all__:
        assert getattr(fsdp, name) is not None, name
    assert {"CollectiveOrderError", "ShardedStateDictError", "UnsupportedUnitOutputError"} <= set(fsdp.__all__)
    from paddle.distributed.fsdp.fully_shard_fusion import FullyShardFusion

    assert fsdp.FullyShardFusion is FullyShardFusion
    assert (ROOT / "fully_shard_fusion.py").is_file()  # where upstream Paddle has it (the overlay's first dir)
