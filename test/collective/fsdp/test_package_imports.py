"""The import graph of the whole package (python/paddle/distributed/fsdp), read from the source (ast): no import
circle, and nothing outside ``tools/`` imports ``tools/``.

Why (issue #42): a deferred (function-level) import does not break at import time, so a circle hidden by one
kept the layers tangled without any test noticing. Every import statement counts here: module-level and
function-level (and under ``if TYPE_CHECKING:``), ``import x`` and ``from x import y``, relative and absolute.
``from p import n`` is an edge to the module ``p.n`` when that is a module of the package, else to ``p``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3] / "python" / "paddle" / "distributed" / "fsdp"
BASE = "paddle.distributed.fsdp"
# known exceptions, which may only shrink: the PaddleFormers Trainer's HF export runs the to-hf converter and its
# presets (tools/hf_convert.py, tools/presets.py), an application of the tools rather than a layer below them
TOOLS_USERS: set[tuple[str, str]] = {
    ("integrations.paddleformers.hf_export", "tools"),
    ("integrations.paddleformers.hf_export", "tools.presets"),
    ("integrations.paddleformers.hf_export", "tools.adapter_export"),  # a LoRA model's export: its adapter (#51)
    ("integrations.paddleformers.hf_export", "tools.adapter_merge"),  # and the merged model on request (#51)
}


def modules(root: Path | None = None) -> dict[str, Path]:
    """Dotted name (``paddle.distributed.fsdp.x.y``) -> file, for every module and package of ``root``."""
    root = root or ROOT
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join([BASE, *parts])] = path
    return out


def imports_of(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """The modules of the package that ``name`` (at ``path``) imports, anywhere in the file."""

    def resolve(dotted: str) -> str | None:
        while dotted and dotted not in mods:
            dotted = dotted.rpartition(".")[0]
        return dotted or None

    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod != BASE and not mod.startswith(BASE + "."):
                continue
            for alias in node.names:
                out.add(resolve(f"{mod}.{alias.name}"))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == BASE or alias.name.startswith(BASE + "."):
                    out.add(resolve(alias.name))
    out.discard(None)
    out.discard(name)
    return out


def graph(root: Path | None = None) -> dict[str, set[str]]:
    mods = modules(root)
    return {name: imports_of(name, path, mods) for name, path in mods.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(g):
        if start in index:
            continue
        work = [(start, iter(sorted(g[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, edges = work[-1]
            for w in edges:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(g[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found, key=lambda c: (len(c), c))


def describe(g: dict[str, set[str]], component: list[str]) -> str:
    """One circle: its modules and the imports between them (package-relative names)."""
    inside = set(component)
    short = lambda m: m[len(BASE) + 1 :] or "<fsdp>"  # noqa: E731
    edges = sorted(f"{short(a)} -> {short(b)}" for a in component for b in g[a] if b in inside)
    return f"{len(component)} modules {[short(m) for m in component]}: {', '.join(edges)}"


def test_no_import_cycle_in_the_package_counting_deferred_imports():
    g = graph()
    assert len(g) > 100  # the whole package was read
    found = cycles(g)
    assert not found, "import circles (every import counts, deferred ones too):\n" + "\n".join(
        describe(g, c) for c in found
    )


def test_the_library_never_imports_the_tools():
    tools = f"{BASE}.tools"
    bad = {
        (m[len(BASE) + 1 :], d[len(BASE) + 1 :])
        for m, deps in graph().items()
        if m != tools and not m.startswith(tools + ".")
        for d in deps
        if d == tools or d.startswith(tools + ".")
    }
    assert bad == TOOLS_USERS, (
        f"modules outside tools/ that import tools/ (the CLI layer), new: {sorted(bad - TOOLS_USERS)}; "
        f"gone (delete them from TOOLS_USERS): {sorted(TOOLS_USERS - bad)}"
    )


def test_the_reader_sees_every_kind_of_import(tmp_path):
    """The graph reader itself: deferred, TYPE_CHECKING, relative, absolute, ``import x`` and package imports."""
    pkg = tmp_path / "fsdp"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .b import x\n")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub import b\n"
        "def f():\n    import paddle.distributed.fsdp.c\n"
    )
    (pkg / "sub" / "b.py").write_text("def g():\n    from ..a import f\n    from paddle.distributed.fsdp import c\n")
    (pkg / "c.py").write_text("import os\nfrom paddle.distributed.fsdp.sub import nothing_here\n")
    g = {k[len(BASE) :]: {d[len(BASE) :] for d in v} for k, v in graph(pkg).items()}
    assert g == {
        "": set(),
        ".sub": {".sub.b"},
        ".a": {".sub.b", ".c"},
        ".sub.b": {".a", ".c"},
        ".c": {".sub"},
    }
    # a -> sub.b (TYPE_CHECKING) -> a (deferred); a -> c -> sub (package) -> sub.b: one circle of four
    assert cycles(graph(pkg)) == [[f"{BASE}.a", f"{BASE}.c", f"{BASE}.sub", f"{BASE}.sub.b"]]
