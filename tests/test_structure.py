"""The house rules that keep the package livable, read from the source (docs/design.md, section 2): modules of at
most 600 lines, functions of at most 60 lines of code, class docstrings of at most 40 lines, no module importing
another's underscore names, no ``print`` outside the command lines, and named loggers. The import layers themselves
are import-linter's (``lint-imports``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fabric_multimodel"
MODULES = sorted(PACKAGE.rglob("*.py"))
#: Command-line modules: what they print is their output.
COMMAND_LINES = {
    "coordinator.py",
    "plan/planner.py",
    "sites/cli.py",
    "sites/processes.py",
    "sites/run.py",
    "status/__main__.py",
    "status/timeline.py",
}


def _name(path: Path) -> str:
    return path.relative_to(PACKAGE).as_posix()


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _code_lines(lines: list[str], node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of ``node`` that hold code: no blank line, no comment, no docstring."""
    docstring = range(0)
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        docstring = range(first.lineno, (first.end_lineno or first.lineno) + 1)
    assert node.end_lineno is not None
    return sum(
        1
        for number in range(node.lineno, node.end_lineno + 1)
        if number not in docstring and lines[number - 1].strip() and not lines[number - 1].strip().startswith("#")
    )


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_a_module_has_at_most_600_lines(path: Path) -> None:
    assert len(path.read_text().splitlines()) <= 600


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_functions_and_class_docstrings_are_short(path: Path) -> None:
    lines = path.read_text().splitlines()
    long_functions, long_docstrings = [], []
    for node in ast.walk(_tree(path)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _code_lines(lines, node) > 60:
            long_functions.append(f"{node.name} ({_code_lines(lines, node)} lines of code)")
        if isinstance(node, ast.ClassDef):
            docstring = ast.get_docstring(node, clean=False) or ""
            if len(docstring.splitlines()) > 40:
                long_docstrings.append(f"{node.name} ({len(docstring.splitlines())} lines: the rest goes to docs/)")
    assert not long_functions and not long_docstrings


@pytest.mark.parametrize("path", MODULES, ids=_name)
def test_no_module_imports_another_modules_underscore_names(path: Path) -> None:
    reaches = [
        f"{node.module}.{alias.name}"
        for node in ast.walk(_tree(path))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fabric_multimodel")
        for alias in node.names
        if alias.name.startswith("_")
    ]
    assert not reaches


@pytest.mark.parametrize("path", [p for p in MODULES if _name(p) not in COMMAND_LINES], ids=_name)
def test_the_library_prints_nothing(path: Path) -> None:
    calls = [
        node.lineno
        for node in ast.walk(_tree(path))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"
    ]
    assert not calls, f"print() at lines {calls}: log through logging.getLogger(__name__) instead"


def test_operators_can_follow_a_run_through_named_loggers() -> None:
    logging_modules = [_name(p) for p in MODULES if "logging.getLogger(__name__)" in p.read_text()]
    for expected in ("membership/membership.py", "averaging/averager.py", "checkpoints/checkpointer.py"):
        assert expected in logging_modules
    assert len(logging_modules) >= 4
    configured = [_name(p) for p in MODULES if "addHandler(" in p.read_text() or "basicConfig(" in p.read_text()]
    assert configured == ["run/cli.py"]  # configure_logging: a script's choice, never done on import
