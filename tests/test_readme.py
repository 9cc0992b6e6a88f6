"""The README says what is true: CI runs its test command, and its API table names every public name."""

from __future__ import annotations

import re
from pathlib import Path

import fabric_multimodel

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_ci_runs_exactly_the_readme_test_command():
    commands = [line for line in README.splitlines() if line.startswith("python") and line.endswith("pytest tests -q")]
    assert len(commands) == 1, commands
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert commands[0] in ci
    assert commands[0].startswith("python -m pip install -e '.[test]' && ")  # one line: it sets up what it needs


def test_the_api_table_names_every_public_name():
    table = "\n".join(line for line in README.splitlines() if line.startswith("| `"))
    named = set(re.findall(r"\w+", table))
    missing = [name for name in fabric_multimodel.__all__ if name not in named]
    assert not missing, f"public names missing from the README's API table: {missing}"
