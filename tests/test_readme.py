"""The README says what is true: CI runs its test command, its API table names every public name, and its links lead
to files that exist."""

from __future__ import annotations

import re
from importlib import metadata
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


def _release(version: str) -> tuple[int, ...]:
    parts = [int(p) for p in version.split(".")]
    while parts and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def test_ci_pins_every_lower_bound_it_installs():
    """.ci/oldest.txt, which CI installs, pins exactly the lower bounds of the package and its test extra."""
    bounds = {}
    for requirement in metadata.requires("fabric-multimodel") or []:
        spec, _, marker = requirement.partition(";")
        if marker and 'extra == "test"' not in marker:
            continue
        name, _, version = spec.strip().partition(">=")
        assert version, f"{requirement!r}: give it a lower bound (>=), which .ci/oldest.txt then pins"
        bounds[name.strip().lower()] = _release(version.strip())
    pins = {}
    for line in (ROOT / ".ci" / "oldest.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[name.strip().lower()] = _release(version.strip())
    assert pins == bounds
    assert "torch" in pins and "lightning" in pins


def test_the_readme_names_the_versions_ci_tests():
    pins = dict(line.split("==") for line in (ROOT / ".ci" / "oldest.txt").read_text().splitlines() if "==" in line)
    assert f"torch {pins['torch']}" in README and f"Lightning {pins['lightning']}" in README


def test_every_link_of_the_readme_leads_to_a_file():
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    missing = [target for target in targets if not (ROOT / target).exists()]
    assert targets and not missing, missing
