"""The README and the guides in docs/ against the code they describe.

A newcomer copies what the README shows, so every name it imports must exist and be exported (``__all__``) by the
module it is imported from, every ``paddle-fsdp-ckpt`` command and option it names must be one the CLI accepts,
and every link must lead somewhere. The README stays a front door (at most 250 lines) with CI's test command on a
line of its own (``.ci/run`` checks that line too).
"""

from __future__ import annotations

import argparse
import ast
import glob
import importlib
import inspect
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
README = REPO / "README.md"
DOCS = REPO / "docs"
MAX_README_LINES = 250
CI_TEST_LINE = 'pip install ".[cpu,test]" && python -m pytest -q test/collective/fsdp'
PACKAGE = "paddle.distributed.fsdp"
CLI = "paddle-fsdp-ckpt"

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
DOCS_MENTION = re.compile(r"(?<![\w/.])docs/[\w./*-]*[\w/*]")


def _documents() -> list[Path]:
    """The README and the guides (dated reports are records, not checked here)."""
    return [README, *sorted(DOCS.glob("*.md"))]


def _blocks(text: str, *langs: str) -> list[str]:
    return [body for lang, body in FENCE.findall(text) if lang in langs]


def _prose(text: str) -> str:
    return FENCE.sub("", text)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for line in _prose(path.read_text()).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if not m:
            continue
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _python_blocks() -> list[tuple[Path, ast.Module]]:
    out = []
    for doc in _documents():
        for i, body in enumerate(_blocks(doc.read_text(), "python")):
            try:
                out.append((doc, ast.parse(body)))
            except SyntaxError as exc:
                pytest.fail(f"{doc.name}: python block {i} does not parse: {exc}")
    return out


def _resolve(dotted: str):
    """The object named by ``dotted`` (a module, or attributes below the longest importable module)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ImportError(dotted)


def _dotted(node: ast.AST) -> str | None:
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(names)])
    return None


def test_readme_is_a_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, (
        f"README.md has {len(lines)} lines (at most {MAX_README_LINES}): move to docs/"
    )
    assert CI_TEST_LINE in lines, "README.md lost the CI test command line (.ci/run checks it)"
    first_screen = "\n".join(lines[:40])
    for must in ("pip install", "python -m paddle.distributed.launch", "It is for"):
        assert must in first_screen, f"the README's first screen lacks {must!r}"


def _exported_by(module, name: str) -> bool:
    """``name`` is part of ``module``'s public face: listed in its ``__all__``, or a subpackage or module of it.
    A name that merely happens to be importable (an internal module's function, a re-export left for old code)
    is not: a newcomer copies the import, so it must name where the project exports the thing."""
    if name in getattr(module, "__all__", ()):
        return True
    try:
        importlib.import_module(f"{module.__name__}.{name}")
    except ImportError:
        return False
    return True


def test_imports_in_code_blocks_exist():
    problems = []
    for doc, tree in _python_blocks():
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    try:
                        importlib.import_module(alias.name)
                    except ImportError as exc:
                        problems.append(f"{doc.name}: import {alias.name}: {exc}")
            elif isinstance(node, ast.ImportFrom):
                module = importlib.import_module(node.module)
                ours = node.module == PACKAGE or node.module.startswith(PACKAGE + ".")
                for alias in node.names:  # a name in __all__ may be built on first use (FSDPTrainer needs its extra)
                    if ours and not _exported_by(module, alias.name):
                        problems.append(
                            f"{doc.name}: from {node.module} import {alias.name}: not in that module's __all__"
                        )
                    elif alias.name not in getattr(module, "__all__", ()) and not hasattr(module, alias.name):
                        try:
                            importlib.import_module(f"{node.module}.{alias.name}")
                        except ImportError:
                            problems.append(f"{doc.name}: from {node.module} import {alias.name}: no such name")
    assert not problems, "\n".join(problems)


def test_package_names_in_code_blocks_exist():
    """``paddle.distributed.fsdp.x.y`` written out in code, and ``fsdp.<method>`` of a FullyShardFusion."""
    from paddle.distributed.fsdp import FullyShardFusion

    problems, checked = [], 0
    for doc, tree in _python_blocks():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            dotted = _dotted(node)
            if dotted is None:
                continue
            if dotted.startswith(PACKAGE + "."):
                checked += 1
                try:
                    _resolve(dotted)
                except (ImportError, AttributeError):
                    problems.append(f"{doc.name}: {dotted} does not exist")
            elif dotted.count(".") == 1 and dotted.startswith("fsdp."):
                checked += 1
                if not hasattr(FullyShardFusion, dotted.split(".")[1]):
                    problems.append(f"{doc.name}: FullyShardFusion has no {dotted.split('.')[1]!r}")
    assert not problems, "\n".join(problems)
    assert checked > 10  # the README's API block alone names more


def test_fully_shard_fusion_keywords_in_code_blocks_exist():
    from paddle.distributed.fsdp import FullyShardFusion

    params = set(inspect.signature(FullyShardFusion.__init__).parameters)
    problems, calls = [], 0
    for doc, tree in _python_blocks():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _dotted(node.func) == "FullyShardFusion":
                calls += 1
                problems += [f"{doc.name}: FullyShardFusion({k.arg}=...)" for k in node.keywords if k.arg not in params]
    assert calls >= 3 and not problems, problems


# FullyShardFusion's checkpoint methods take **kwargs and hand them on: the keywords they accept are these.
DELEGATES = {
    "save_checkpoint": "paddle.distributed.fsdp.state.resume.save_checkpoint",
    "load_checkpoint": "paddle.distributed.fsdp.state.resume.load_checkpoint",
    "memory_tier": "paddle.distributed.fsdp.memtier.MemoryTier.__init__",
}


def test_checkpoint_method_keywords_in_code_blocks_exist():
    accepted = {method: set(inspect.signature(_resolve(target)).parameters) for method, target in DELEGATES.items()}
    problems, calls = [], 0
    for doc, tree in _python_blocks():
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            dotted = _dotted(node.func) or ""
            method = dotted.split(".")[-1]
            if dotted.startswith("fsdp.") and method in accepted:
                calls += 1
                problems += [
                    f"{doc.name}: {dotted}({k.arg}=...)"
                    for k in node.keywords
                    if k.arg is not None and k.arg not in accepted[method]
                ]
    assert calls >= 8 and not problems, problems


def _cli_commands() -> dict[str, set[str]]:
    from paddle.distributed.fsdp.tools.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return {name: {opt for action in p._actions for opt in action.option_strings} for name, p in sub.choices.items()}


def _cli_uses(text: str) -> list[tuple[str, list[str]]]:
    """(subcommand, options) for every ``paddle-fsdp-ckpt SUB ...`` in code blocks and inline code."""
    uses = []
    for body in _blocks(text, "bash", "sh", ""):
        for line in body.splitlines():
            code = line.split("  #")[0]
            m = re.search(rf"{CLI} ([a-z][a-z-]*)(.*)", code)
            if m:
                uses.append((m.group(1), re.findall(r"(?<![\w-])--[a-z][a-z-]*", m.group(2))))
    for span in re.findall(r"`([^`]+)`", _prose(text)):  # inline code may wrap onto the next line
        m = re.match(rf"{CLI}\s(.+)", span, re.DOTALL)
        if m:  # one command, or several listed as "a | b | c"
            for part in m.group(1).split("|"):
                word = part.split()[0] if part.split() else ""
                if re.fullmatch(r"[a-z][a-z-]*", word):
                    uses.append((word, []))
    return uses


def test_cli_commands_and_options_exist():
    commands = _cli_commands()
    problems, seen = [], set()
    for doc in _documents():
        for name, options in _cli_uses(doc.read_text()):
            seen.add(name)
            if name not in commands:
                problems.append(f"{doc.name}: {CLI} {name}: no such command")
                continue
            problems += [f"{doc.name}: {CLI} {name} {o}: no such option" for o in options if o not in commands[name]]
    assert not problems, "\n".join(problems)
    assert seen == set(commands), f"commands not documented: {sorted(set(commands) - seen)}"


def test_links_resolve():
    problems = []
    for doc in _documents():
        for target in LINK.findall(_prose(doc.read_text())):
            if re.match(r"[a-z]+:", target):
                continue  # http(s), mailto: not checked offline
            file, _, anchor = target.partition("#")
            path = (doc.parent / file).resolve() if file else doc
            if not path.exists():
                problems.append(f"{doc.name}: link {target}: no such file")
            elif anchor and anchor not in _anchors(path):
                problems.append(f"{doc.name}: link {target}: no heading with that anchor in {path.name}")
    assert not problems, "\n".join(problems)


def test_docs_paths_mentioned_exist():
    """``docs/...`` written in the README, the guides, the code's comments and the tools resolve (globs too)."""
    sources = [*_documents(), REPO / "setup.py", REPO / ".ci" / "run", *REPO.glob("python/**/*.py")]
    sources += [*REPO.glob("tools/**/*.py"), *REPO.glob("test/**/*.py")]
    problems = []
    for src in sources:
        for mention in set(DOCS_MENTION.findall(src.read_text())):
            if not glob.glob(str(REPO / mention)):
                problems.append(f"{src.relative_to(REPO)}: {mention} does not exist")
    assert not problems, "\n".join(problems)


def test_every_guide_is_indexed():
    index = (DOCS / "README.md").read_text()
    missing = [p.name for p in DOCS.glob("*.md") if p.name != "README.md" and f"]({p.name})" not in index]
    assert not missing, f"docs/README.md does not list {missing}"
    linked = README.read_text()
    assert "docs/README.md" in linked


def _section(path: Path, heading: str) -> str:
    """The text of ``path`` under the heading ``heading``, to the next heading of the same or a higher level (lines
    inside code blocks, such as a shell comment, are no headings)."""
    lines, level, in_code = [], 0, False
    for line in path.read_text().splitlines(keepends=True):
        in_code ^= line.startswith("```")
        m = None if in_code else re.match(r"(#+) (.*)", line)
        if m and level and len(m.group(1)) <= level:
            break
        if level:
            lines.append(line)
        elif m and m.group(2).strip() == heading:
            level = len(m.group(1))
    assert level, f"{path.name} has no section {heading!r}"
    return "".join(lines)


def _isolated_loopback() -> list[str]:
    """``unshare`` into a network namespace of our own (its own 127.0.0.1, so the guide's fixed ports cannot meet
    another run's), or nothing when this machine does not allow it."""
    if not (shutil.which("unshare") and shutil.which("ip")):
        return []
    probe = subprocess.run(["unshare", "-rn", "ip", "link", "set", "lo", "up"], capture_output=True, timeout=30)
    return ["unshare", "-rn"] if probe.returncode == 0 else []


def test_object_storage_try_it_on_one_machine_runs_as_written(tmp_path):
    """docs/object-storage.md's "Try it on one machine" block, verbatim in bash: a local S3 server, a save and a
    load through boto3's environment, a CLI verify, the server stopped."""
    (block,) = _blocks(_section(DOCS / "object-storage.md", "Try it on one machine"), "bash")
    assert "127.0.0.1" in block and not re.search(r"\b(?!127\.)\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}\b", block)
    bindir = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}  # only what the block sets
    env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
    netns = _isolated_loopback()
    script = ("ip link set lo up\n" if netns else "") + block
    proc = subprocess.run(
        [*netns, "bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    assert "[[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]" in out.splitlines(), out + proc.stderr[-3000:]
    assert any(line.startswith("OK: s3://demo/run1/step_1: 1 tensors") for line in out.splitlines()), out
