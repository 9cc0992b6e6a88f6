"""The documentation pages build, every warning an error: a broken link or reference, a docstring that does not parse,
a page missing from the table of contents all fail here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_docs_build_with_no_warning(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "sphinx", "-E", "-W", "--keep-going", "-n", "-q", "-b", "html"]
    built = subprocess.run([*command, str(ROOT / "docs"), str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-4000:]
    for page in ("index", "reference", "design", "benchmarks", "guides/elastic"):
        assert (tmp_path / f"{page}.html").is_file(), page
    assert "membership_wait_s" in (tmp_path / "reference.html").read_text()  # the docstrings made it in
