"""The checkpoint package's layers, checked by parsing its imports (ast, every import statement of a file): what
must never import what, no import cycle, module and function sizes. Why: issue #31 drew these rules; a test keeps them from regressing. Where the
code does not meet a rule yet, the exceptions are listed here by name: the list may only shrink (a new
violation fails, and so does a listed one that is gone: then delete it from the list).
"""

from __future__ import annotations

import ast
from pathlib import Path

from paddle.distributed.fsdp.checkpoint.process_state import PROCESS_STATE
from process_reset import reset_process_state
from test_package_imports import graph as package_graph

PKG = Path(__file__).resolve().parents[3] / "python" / "paddle" / "distributed" / "fsdp" / "checkpoint"
BASE = "paddle.distributed.fsdp.checkpoint"
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80  # code lines: the signature and the docstring do not count

# known exceptions (issue #31, not yet done): format/ still reads through the reader, and two files are large
FORMAT_EXCEPTIONS: set[tuple[str, str]] = set()
LARGE_MODULES: set[str] = set()
LONG_FUNCTIONS: set[str] = set()
# checkpoint/ by phase (issue #42): save/ and load/ import the shared modules one level up, never each other; a
# shared module imports neither, except these, which sit above both phases (the public face re-exports the doors,
# the manager runs saves and loads, stock's dispatch routes
# paddle's own API to the doors). The list may only shrink.
PHASES = ("save", "load")
PHASE_ORCHESTRATORS: set[str] = {"", "manager", "stock.dispatch"}


def _modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        rel = p.relative_to(PKG).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _imports(name: str, path: Path) -> set[str]:
    """Modules of the package (and outside names under paddle.distributed.fsdp) that ``name`` imports."""
    tree = ast.parse(path.read_text())
    pkg = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - node.level + 1] if node.level > 1 else pkg
                mod = ".".join(base + ([node.module] if node.module else []))
                # `from . import retry` imports the submodule; a name that is not a module resolves to `mod` below
                for a in node.names:
                    out.add(f"{mod}.{a.name}".strip("."))
            elif node.module and node.module.startswith("paddle.distributed.fsdp"):
                out.add("@" + node.module)
        elif isinstance(node, ast.Import):
            out.update("@" + a.name for a in node.names if a.name.startswith("paddle.distributed.fsdp"))
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    g = {}
    for name, path in mods.items():
        deps = set()
        for imp in _imports(name, path):
            if imp.startswith("@") or imp.startswith(".."):
                deps.add(imp)
                continue
            while imp and imp not in mods:
                imp = imp.rpartition(".")[0]
            if imp and imp != name:
                deps.add(imp)
        g[name] = deps
    return g


def _outside(name: str, path: Path) -> set[str]:
    """Imports that climb out of checkpoint/ (``..x`` relative ones), as fsdp-relative module names."""
    tree = ast.parse(path.read_text())
    depth = len(name.split(".")) if path.name != "__init__.py" else len(name.split(".")) + 1
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level >= depth + (0 if path.name == "__init__.py" else 1):
            out.add(node.module or "")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("paddle.distributed.fsdp."):
            rest = node.module[len("paddle.distributed.fsdp.") :]
            if not rest.startswith("checkpoint"):
                out.add(rest)
    return out


FLOOR_LEAVES = ("errors", "gc_pause", "cores", "thread_pools")  # below format/: import nothing of the package


def test_format_is_the_floor():
    g = _graph()
    assert not [(m, g[m]) for m in FLOOR_LEAVES if {d for d in g[m] if not d.startswith("@")}]
    bad = {
        (m, d)
        for m, deps in g.items()
        if m.startswith("format")
        for d in deps
        if not d.startswith("format") and d not in FLOOR_LEAVES and not d.startswith("@")
    }
    assert bad == FORMAT_EXCEPTIONS, f"new: {sorted(bad - FORMAT_EXCEPTIONS)}; gone: {sorted(FORMAT_EXCEPTIONS - bad)}"


def test_io_knows_no_protocol_and_the_engine_never_imports_stock():
    g = _graph()
    protocol = ("save", "load", "commit", "markers", "manager", "verify", "background", "channel", "stock")
    for m, deps in g.items():
        if m.startswith("io"):
            assert not [d for d in deps if d.split(".")[0] in protocol], (m, deps)
        if not m.startswith("stock") and m != "":
            assert not [d for d in deps if d == "stock" or d.startswith("stock.")], (m, deps)


def test_checkpoint_never_imports_state_or_the_training_core():
    allowed = {"devices", "comm", "env_switches", "keywords"}  # env_switches, keywords: stdlib only (issue #53)
    for name, path in _modules().items():
        out = {o.split(".")[0] for o in _outside(name, path)} - {""}
        assert out <= allowed, (name, out)


def test_no_import_cycle():
    """No circle among checkpoint/'s modules, counting every import (deferred, function-level ones too: issue #42);
    test_package_imports.py checks the same over the whole package, absolute imports included."""
    g = {m: {d for d in deps if not d.startswith("@")} for m, deps in _graph().items()}
    seen, stack, cycles = set(), [], []

    def visit(m):
        if m in stack:
            cycles.append(stack[stack.index(m) :] + [m])
            return
        if m in seen:
            return
        seen.add(m)
        stack.append(m)
        for d in sorted(g[m] & set(g)):
            visit(d)
        stack.pop()

    for m in sorted(g):
        visit(m)
    assert not cycles, cycles


def _phase_graph() -> dict[str, set[str]]:
    """checkpoint/'s modules (package-relative, the package itself "") -> the checkpoint modules each imports,
    read by test_package_imports.py's reader: every import, deferred and absolute ones too."""
    rel = lambda m: m[len(BASE) + 1 :] if m != BASE else ""  # noqa: E731
    inside = lambda m: m == BASE or m.startswith(BASE + ".")  # noqa: E731
    return {rel(m): {rel(d) for d in deps if inside(d)} for m, deps in package_graph().items() if inside(m)}


def _phase_of(module: str) -> str | None:
    top = module.split(".")[0]
    return top if top in PHASES else None


def test_save_and_load_import_the_shared_modules_never_each_other():
    g = _phase_graph()
    assert set(PHASES) <= set(g), "checkpoint/save/ and checkpoint/load/ are packages"
    bad = set()
    for m, deps in g.items():
        for d in deps:
            here, there = _phase_of(m), _phase_of(d)
            if there is None or there == here or (here is None and m in PHASE_ORCHESTRATORS):
                continue
            bad.add((m, d))
    assert not bad, f"imports across the phases (save/ <-> load/) or from a shared module into one: {sorted(bad)}"
    idle = {m for m in PHASE_ORCHESTRATORS if not any(_phase_of(d) for d in g.get(m, ()))}
    assert not idle, f"listed in PHASE_ORCHESTRATORS but import no phase (delete them from the list): {sorted(idle)}"


def test_a_shared_module_is_used_beyond_one_phase():
    """A top-level module of checkpoint/ that only one phase imports belongs in that phase's package."""
    g = package_graph()
    mods = [m for m in _phase_graph() if m and "." not in m and m not in PHASES]
    one_phase = {}
    for m in mods:
        users = {u for u, deps in g.items() if f"{BASE}.{m}" in deps}
        phases = {_phase_of(u[len(BASE) + 1 :]) if u.startswith(BASE + ".") else None for u in users}
        if users and len(phases) == 1 and None not in phases:
            one_phase[m] = phases.pop()
    assert not one_phase, f"shared modules only one phase uses (move them into it): {one_phase}"


def test_module_and_function_sizes():
    big, long = set(), set()
    for name, path in _modules().items():
        text = path.read_text()
        if text.count("\n") > MAX_MODULE_LINES:
            big.add(name)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                body = node.body
                if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                    body = body[1:]  # the docstring does not count, nor does the signature
                if node.end_lineno - body[0].lineno + 1 > MAX_FUNCTION_LINES:
                    long.add(f"{name}.{node.name}")
    assert big == LARGE_MODULES, f"new: {sorted(big - LARGE_MODULES)}; gone: {sorted(LARGE_MODULES - big)}"
    assert long == LONG_FUNCTIONS, f"new: {sorted(long - LONG_FUNCTIONS)}; gone: {sorted(LONG_FUNCTIONS - long)}"


def test_process_state_list_names_real_attributes_and_reset_runs():
    import importlib

    for module, attrs, _what, _how in PROCESS_STATE:
        mod = importlib.import_module(f"{BASE}.{module}")
        for attr in attrs.split(" / "):
            assert hasattr(mod, attr), (module, attr)
    from paddle.distributed.fsdp.checkpoint.save import save

    save._assignments.put(b"x", object())
    reset_process_state()
    assert save._assignments.names() == ()
