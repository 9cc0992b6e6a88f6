"""The status page in a real browser (issue 69): a coordinator with ``--status-port`` and two live sites of
examples/minimal_loop.py, as a user starts them; headless Chromium (Debian's ``chromium``, driven by Playwright) with
JavaScript off renders both sites, and the page asks for nothing but itself even with its Content-Security-Policy
bypassed; a site killed with SIGKILL leaves ``members`` within 10 s and the history says when it left.

CI installs ``chromium`` (``.ci/run``); the quick suite tests the JSON and the HTML with plain HTTP
(tests/test_status.py). ``STATUS_SCREENSHOT=docs/status_page.png python -m pytest tests/test_status_browser.py -m
slow`` also writes the README's picture of the page.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fabric_multimodel.run.launch import free_port, stop_process_tree
from tests.test_minimal_loop import ROOT, Site

pytestmark = pytest.mark.slow
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
STEPS = 1_000_000  # the sites train until the test stops them


def status_of(port: int) -> tuple[dict[str, Any], float]:
    """``/status.json`` and the seconds it took to answer."""
    start = time.perf_counter()
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status.json", timeout=5) as answer:
        body = answer.read()
    return json.loads(body), time.perf_counter() - start


def until(condition: Any, seconds: float, what: str) -> Any:
    deadline = time.monotonic() + seconds
    while not (result := condition()):
        assert time.monotonic() < deadline, f"timed out after {seconds} s waiting for {what}"
        time.sleep(0.1)
    return result


@pytest.fixture
def coordinator() -> Iterator[tuple[int, int]]:
    """A coordinator serving its run's status page: (its port, the page's port)."""
    port, page = free_port(), free_port()
    command = [sys.executable, "-m", "fabric_multimodel.coordinator", "--port", str(port), "--status-port", str(page)]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None and "serving on port" in proc.stdout.readline()
        assert f"status on http://127.0.0.1:{page}/" in proc.stdout.readline()
        yield port, page
    finally:
        stop_process_tree(proc)


def test_chromium_renders_both_sites_and_sees_a_killed_one_leave(coordinator: tuple[int, int], tmp_path: Path) -> None:
    assert CHROMIUM, "the browser test needs Debian's chromium (apt-get install chromium); CI installs it"
    from playwright.sync_api import expect, sync_playwright

    port, page_port = coordinator
    sites = [Site(name, port, tmp_path, STEPS, "--min-sites", "2") for name in ("a", "b")]
    try:
        status = until(lambda: len((s := status_of(page_port)[0])["members"]) == 2 and s, 240, "two members")
        assert sorted(m["site"] for m in status["members"]) == ["a", "b"], status
        until(lambda: all(m["figures"] for m in status_of(page_port)[0]["members"]), 60, "figures from both")
        seconds = statistics.median(status_of(page_port)[1] for _ in range(5))
        assert seconds <= 0.1, f"/status.json answered in {seconds * 1000:.0f} ms (median of 5)"
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            # No script and no CSP: whatever the page itself would fetch is seen below.
            context = browser.new_context(java_script_enabled=False, bypass_csp=True, viewport={"width": 1100,
                                          "height": 640})  # fmt: skip
            page = context.new_page()
            asked: list[str] = []
            page.on("request", lambda request: asked.append(request.url))
            page.goto(f"http://127.0.0.1:{page_port}/")
            members = page.locator("#members")
            for site in ("a", "b"):
                expect(members.get_by_role("cell", name=site, exact=True)).to_have_count(1)
            expect(members).to_contain_text("loss")
            token = next(m["token"] for m in status["members"] if m["site"] == "b")
            killed = time.monotonic()
            sites[1].proc.send_signal(signal.SIGKILL)
            until(lambda: token not in [m["token"] for m in status_of(page_port)[0]["members"]], 10, "b out")
            left = time.monotonic() - killed
            training = page.locator("#members tr:not(.silent)", has_text=token)  # the page reloads every 2 s
            expect(training).to_have_count(0, timeout=10_000)
            history = until(
                lambda: [e for e in status_of(page_port)[0]["history"] if token in e["left"]], 120, "b in the history"
            )
            assert history[0]["after_loss"] and history[0]["seen"] >= time.time() - 130, history
            expect(page.locator("#timeline + ul")).to_contain_text(f"left {token} (lost", timeout=10_000)
            page.screenshot(path=os.environ.get("STATUS_SCREENSHOT") or tmp_path / "status_page.png", full_page=True)
            local = f"http://127.0.0.1:{page_port}/"
            assert asked and all(url.startswith(local) for url in asked), asked
            browser.close()
        assert left <= 10, left
    finally:
        for site in sites:
            stop_process_tree(site.proc)
