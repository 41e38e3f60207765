"""No module of ``paddle.distributed.fsdp`` is longer than 500 lines.

A newcomer reads a module whole; past a few hundred lines it holds more than one concept and its name no longer
says what is inside. A module that grows past the limit is split along its concepts (one concept per file).
"""

from __future__ import annotations

from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[3] / "python" / "paddle" / "distributed" / "fsdp"
MAX_LINES = 500


def oversized_modules(root: Path, max_lines: int = MAX_LINES) -> dict[str, int]:
    """Every ``.py`` file under ``root`` with more than ``max_lines`` lines (newline count), by relative path."""
    sizes = {str(path.relative_to(root)): path.read_bytes().count(b"\n") for path in sorted(root.rglob("*.py"))}
    return {name: lines for name, lines in sizes.items() if lines > max_lines}


def test_the_package_is_found():
    assert (PACKAGE / "__init__.py").is_file(), PACKAGE
    assert len(list(PACKAGE.rglob("*.py"))) > 50


def test_no_module_over_the_limit():
    over = oversized_modules(PACKAGE)
    assert not over, f"modules over {MAX_LINES} lines (split them along their concepts): " + ", ".join(
        f"{name} ({lines})" for name, lines in sorted(over.items())
    )


def test_the_check_names_an_offender(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "short.py").write_text("x = 1\n" * MAX_LINES)
    assert oversized_modules(tmp_path) == {str(Path("sub") / "long.py"): MAX_LINES + 1}
