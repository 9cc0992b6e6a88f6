"""The operator's view (issue 69, first slice): the status a run's store holds, read by ``StatusReader`` and served
by ``StatusServer`` (``python -m fabric_multimodel.coordinator --status-port``) as a page and ``/status.json``, with
plain HTTP against a real coordinator and real memberships; hostile values in the store stay text."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fabric_multimodel import Averager, Membership
from fabric_multimodel.membership.figures import MAX_FIGURES, decode_figures, encode_figures
from fabric_multimodel.run.launch import free_port
from fabric_multimodel.status.page import render
from fabric_multimodel.status.record import Recorder, read_record
from fabric_multimodel.status.server import StatusServer
from fabric_multimodel.status.snapshot import MAX_TEXT, StatusReader
from fabric_multimodel.status.timeline import members_of
from tests.test_coordinator_loss import Coordinator

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def served() -> Iterator[Coordinator]:
    """A coordinator in a thread of this process (``serve``, as the command runs it)."""
    coordinator = Coordinator()
    coordinator.start()
    yield coordinator
    coordinator.stop()


def until(condition: Callable[[], Any], seconds: float = 30.0) -> Any:
    deadline = time.monotonic() + seconds
    while not (result := condition()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)
    return result


def fetch(port: int, path: str) -> tuple[int, dict[str, str], bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return answer.status, dict(answer.headers), answer.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def status_of(port: int) -> dict[str, Any]:
    code, headers, body = fetch(port, "/status.json")
    assert code == 200 and headers["Content-Type"] == "application/json", (code, body)
    return json.loads(body)


def test_two_sites_are_members_on_the_page_and_one_that_stops_beating_goes_silent(
    served: Coordinator, tmp_path: Path
) -> None:
    coordinator = served
    run = "status-two"
    a = Membership(coordinator.address, "a", run=run, timeout=5.0, heartbeat_s=0.1)
    first = a.join()
    b = Membership(coordinator.address, "b", run=run, timeout=5.0, heartbeat_s=0.1)
    thread = threading.Thread(target=b.join, daemon=True)
    thread.start()
    boundary = iter(range(1, 10_000))
    until(lambda: a.at_boundary(next(boundary)))
    thread.join(timeout=30)
    recorder = Recorder(tmp_path / "run.jsonl", every_s=0.0)
    reader = StatusReader.connect(coordinator.address, run, stale_s=1.0)
    with StatusServer(reader, poll_s=0.1, on_read=recorder) as server:
        status = until(lambda: (s := status_of(server.port))["members"] and len(s["members"]) == 2 and s)
        assert [m["site"] for m in status["members"]] == ["a", "b"] and status["epoch"] == first.number + 1
        assert [(e["epoch"], e["members"], e["joined"]) for e in status["history"]] == [
            (1, ["a#1"], ["a#1"]),
            (2, ["a#1", "b#2"], ["b#2"]),
        ]
        code, headers, page = fetch(server.port, "/")
        assert code == 200 and headers["Content-Type"] == "text/html; charset=utf-8"
        assert "script-src" not in headers["Content-Security-Policy"] and "default-src 'none'" in headers[
            "Content-Security-Policy"]  # fmt: skip
        assert "<td>a</td><td>a#1</td>" in page.decode() and "<td>b</td><td>b#2</td>" in page.decode()
        b.close()  # its heartbeat stands still, as a killed site's does
        silent = until(lambda: (s := status_of(server.port))["silent"] and s, seconds=10)
        assert [m["token"] for m in silent["members"]] == ["a#1"] and [m["token"] for m in silent["silent"]] == ["b#2"]
        assert fetch(server.port, "/nothing")[0] == 404
        store = coordinator.store(run)  # a site that died between registering and its first heartbeat
        store.set(f"join/{store.add('joins', 1)}", "c#3")
        a.at_boundary(next(boundary))  # a looks at it first ...
        time.sleep(4 * a.heartbeat_s)
        a.recover()  # ... and after a round failed, a goes on alone: b lost, c passed over
        status = until(lambda: (s := status_of(server.port))["epoch"] == first.number + 2 and s)
        assert status["history"][-1]["left"] == ["b#2"] and status["history"][-1]["after_loss"]
        assert not status["history"][-2]["after_loss"] and status["passed_over"] == ["c#3"] and not status["waiting"]
        page = fetch(server.port, "/")[2].decode()
        assert "left b#2 (lost: a round failed and the others went on)" in page and "<p id='passed_over'>" in page
    a.close(finished=True)
    recorder.close()
    members, seconds = members_of(read_record(recorder.path))
    assert [m.token for m in members] == ["a#1", "b#2"] and seconds > 0
    a_row, b_row = members
    assert a_row.lost is None and len(a_row.spans) == 1 and not a_row.spans[0][2]
    assert [silent for _, _, silent in b_row.spans] == [False, True] and b_row.lost == b_row.spans[1][0]
    assert b_row.spans[0][1] == b_row.spans[1][0] and b_row.spans[1][1] <= seconds  # one after the other
    done = subprocess.run([sys.executable, "-m", "fabric_multimodel.status.timeline", str(recorder.path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0 and "2 members" in done.stdout, done.stderr
    assert recorder.path.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_hostile_values_in_the_store_stay_bounded_text_and_the_page_escapes_them(served: Coordinator) -> None:
    coordinator = served
    store = coordinator.store("hostile")
    script = "<script>alert(1)</script>"
    store.set("id", b"\xff\xfe" + b"x" * 10_000)
    store.add("joins", 3)
    store.set("join/1", script)
    store.set("join/2", '"q\'uote"#2')
    store.set("join/3", b"\xfe" * 10_000)
    store.set("epoch/0/next", f'2|{script},"q\'uote"#2,{"y" * 10_000}')
    store.set("epoch/1/next", b"\xff not a decision")
    reader = StatusReader.connect(coordinator.address, "hostile")
    status = reader.read()
    assert status["totals"]["unreadable"] == 1 and status["epoch"] == 2 and status["members"] == []
    texts = [status["run"], *status["history"][0]["members"], *status["waiting"]]
    assert all(len(text) <= MAX_TEXT for text in texts) and script in texts
    assert "\ufffd" in status["run"] and json.loads(json.dumps(status)) == status
    page = render(status)
    assert "<script" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "&quot;q&#x27;uote&quot;#2" in page
    with StatusServer(reader, poll_s=0.1) as server:
        until(lambda: fetch(server.port, "/status.json")[0] == 200)
        assert "<script" not in fetch(server.port, "/")[2].decode()


class Unanswered:
    """A store every call to which fails, as a coordinator out of reach makes them."""

    def check(self, keys: list[str]) -> bool:
        raise RuntimeError("Connection refused (a coordinator out of reach)")

    def get(self, key: str) -> bytes:
        return self.check([key]) and b""

    def add(self, key: str, amount: int) -> int:
        return int(self.check([key]))


def test_until_the_store_answers_the_page_says_so_and_nothing_else(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="fabric_multimodel"), StatusServer(StatusReader(Unanswered())) as server:
        until(lambda: caplog.records)
        code, _, body = fetch(server.port, "/status.json")
        assert code == 503 and b"no status read yet" in body
        time.sleep(0.6)  # more failed reads: said once
    assert sum("did not answer" in r.getMessage() for r in caplog.records) == 1


def test_the_coordinator_serves_its_runs_status() -> None:
    port, page = free_port(), free_port()
    command = [sys.executable, "-m", "fabric_multimodel.coordinator", "--port", str(port), "--status-port", str(page)]
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline(), proc.stdout.readline()]
        assert f"status on http://127.0.0.1:{page}/" in lines[1], lines
        site = Membership(f"127.0.0.1:{port}", "berlin", timeout=5.0, heartbeat_s=0.1)
        site.join()
        status = until(lambda: (s := status_of(page))["members"] and s)
        assert [m["site"] for m in status["members"]] == ["berlin"] and status["run"]
        site.close(finished=True)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@given(st.dictionaries(st.from_regex(r"[a-z][a-z0-9_]{0,31}", fullmatch=True), st.one_of(
    st.integers(-(2**53), 2**53), st.floats(), st.none()), max_size=MAX_FIGURES))  # fmt: skip
def test_figures_a_site_publishes_read_back_as_they_were_and_one_not_finite_as_null(
    figures: dict[str, float | None],
) -> None:
    finite = {k: v if v is None or math.isfinite(v) else None for k, v in figures.items()}
    assert decode_figures(encode_figures(figures).encode()) == finite


@pytest.mark.parametrize(
    "value",
    [b"<script>alert(1)</script>", b'{"step": "12"}', b'{"Step": 1}', b'{"step": NaN}', b"[1, 2]", b'{"a": {"b": 1}}',
     b"\xff\xfe", b'{"step": 1, "pad": "' + b"x" * 2000 + b'"}', b'{"step": true}'],
)  # fmt: skip
def test_a_value_that_is_not_figures_is_refused(value: bytes) -> None:
    assert decode_figures(value) is None


def test_the_averager_publishes_its_figures_at_each_round_boundary_with_the_loss_a_site_reports(
    served: Coordinator,
) -> None:
    membership = Membership(served.address, "a", run="figures", timeout=5.0, heartbeat_s=0.1)
    averager = Averager(SimpleNamespace(device=torch.device("cpu")), torch.nn.Linear(4, 1), period=4,
                        membership=membership)  # fmt: skip
    reader = StatusReader.connect(served.address, "figures")
    losses = iter([0.5, 0.25])
    with averager:
        for step in range(1, 10):
            membership.report(loss=torch.tensor(next(losses) if step % 4 == 0 else 9.0, requires_grad=True))
            averager.step()
            if step == 4:
                assert reader.read()["members"][0]["figures"]["loss"] == 0.5
        figures, rounds = reader.read()["members"][0]["figures"], averager.rounds
    assert figures.pop("wait_s") >= 0 and figures.pop("round_s") >= 0
    assert figures == {"step": 8, "rounds": rounds, "bytes": 0, "loss": 0.25}
    assert rounds == 2  # one site: no peer, no bytes
    membership.report(loss=math.inf, accuracy=0.75)  # published at the next boundary, as anything reported is
    membership.publish({"step": 9})
    status = reader.read()
    assert status["members"][0]["figures"] == {"step": 9, "loss": None, "accuracy": 0.75}
    cells = "<td>9</td>" + "<td>-</td>" * 4 + "<td>not finite</td><td>accuracy=0.75</td>"
    assert cells in render(status)
    served.store("figures").set("status/a#1", b"<script>")  # what anyone reaching the port can write
    assert reader.read()["members"][0]["figures"] == {} and reader.unreadable == 1
    membership.close()


@pytest.mark.parametrize(
    ("figures", "message"),
    [({"Loss": 1.0}, "lower-case"), ({"loss": torch.ones(2)}, "one-element tensor"), ({"loss": "0.5"}, "number"),
     ({f"f{i}": 1.0 for i in range(9)}, "at most 8 figures")],
)  # fmt: skip
def test_a_figure_a_site_cannot_report_is_an_error_at_once(
    served: Coordinator, figures: dict[str, Any], message: str
) -> None:
    membership = Membership(served.address, "a", run="bad-figures", timeout=5.0)
    with pytest.raises(ValueError, match=message):
        membership.report(**figures)
    membership.close()


def test_the_status_command_serves_any_coordinators_run_and_refuses_a_bad_address(served: Coordinator) -> None:
    site = Membership(served.address, "lisbon", run="elsewhere", timeout=5.0, heartbeat_s=0.1)
    site.join()
    page = free_port()
    command = [sys.executable, "-m", "fabric_multimodel.status", "--coordinator", served.address, "--run", "elsewhere",
               "--port", str(page)]  # fmt: skip
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None and f"on http://127.0.0.1:{page}/" in proc.stdout.readline()
        assert [m["site"] for m in status_of(page)["members"]] == ["lisbon"]
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
        site.close(finished=True)
    bad = subprocess.run([*command[:4], "nowhere", *command[5:]], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 2 and "--coordinator must be host:port" in bad.stderr.strip().splitlines()[-1]


def test_the_status_command_serves_a_run_whose_coordinator_is_an_etcd_cluster(etcd: tuple[str, Any]) -> None:
    address, _ = etcd
    sites = [
        Membership(address, name, run="etcd-run", min_sites=2, timeout=10.0, heartbeat_s=0.2)
        for name in ("oslo", "rome")
    ]
    threads = [threading.Thread(target=site.join, daemon=True) for site in sites]
    for thread in threads:
        thread.start()
    page = free_port()
    command = [sys.executable, "-m", "fabric_multimodel.status", "--coordinator", address, "--run", "etcd-run",
               "--port", str(page)]  # fmt: skip
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None and f"on http://127.0.0.1:{page}/" in proc.stdout.readline()
        status = until(lambda: len((s := status_of(page))["members"]) == 2 and s)
        assert sorted(m["site"] for m in status["members"]) == ["oslo", "rome"] and status["run"]
        assert "<td>oslo</td>" in fetch(page, "/")[2].decode()
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0
        for thread, site in zip(threads, sites):
            thread.join(timeout=30)
            site.close(finished=True)


@st.composite
def records(draw: st.DrawFn) -> list[dict[str, Any]]:
    """Status lines as a Recorder writes them: members come, go silent, leave; times increase."""
    tokens = [f"s{i}#{i + 1}" for i in range(draw(st.integers(1, 4)))]
    lines, now = [], 1000.0
    for _ in range(draw(st.integers(1, 12))):
        now += draw(st.floats(0.1, 30.0))
        kinds = draw(st.lists(st.sampled_from(["in", "silent", "out"]), min_size=len(tokens), max_size=len(tokens)))
        members = {t: {"site": t.split("#")[0], "rounds": len(lines)} for t, k in zip(tokens, kinds) if k == "in"}
        lines.append({"time": now, "epoch": 1, "finished": False, "members": members,
                      "silent": [t for t, k in zip(tokens, kinds) if k == "silent"]})  # fmt: skip
    return lines


@given(records())
def test_a_records_spans_follow_each_member_in_order_and_never_overlap(record: list[dict[str, Any]]) -> None:
    members, seconds = members_of(record)
    seen = {t for line in record for t in [*line["members"], *line["silent"]]}
    assert {m.token for m in members} == seen
    for member in members:
        ends = [edge for span in member.spans for edge in span[:2]]
        assert ends == sorted(ends) and 0 <= ends[0] and ends[-1] <= seconds
        for (_, end, silent), (begin, _, again) in zip(member.spans, member.spans[1:]):
            assert end < begin or silent != again  # two spans of one kind that touch are one
        assert all(seconds_a_round > 0 for _, seconds_a_round in member.round_s)


def test_the_members_that_end_a_run_are_not_lost_when_their_heartbeats_stop() -> None:
    figures = {"site": "a", "rounds": 1}
    record = [
        {"time": 0.0, "epoch": 1, "finished": False, "members": {"a#1": figures, "b#2": figures}, "silent": []},
        {"time": 5.0, "epoch": 1, "finished": False, "members": {"a#1": figures}, "silent": ["b#2"]},
        {"time": 9.0, "epoch": 2, "finished": True, "members": {"a#1": figures}, "silent": []},
        {"time": 15.0, "epoch": 2, "finished": True, "members": {}, "silent": ["a#1"]},
    ]
    a, b = members_of(record)[0]
    assert a.lost is None and a.spans == [(0.0, 15.0, False)] and b.lost == 5.0


def test_the_timeline_command_says_what_it_cannot_draw(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "fabric_multimodel.status.timeline"]
    missing = subprocess.run([*command, str(tmp_path / "none.jsonl")], capture_output=True, text=True, cwd=ROOT)
    assert missing.returncode == 2 and "no such file" in missing.stderr.splitlines()[-1]
    (tmp_path / "empty.jsonl").write_text('not json\n{"time": 1, "members": {}}\n')
    empty = subprocess.run([*command, str(tmp_path / "empty.jsonl")], capture_output=True, text=True, cwd=ROOT)
    assert empty.returncode == 1 and "holds no member" in empty.stderr and "1 lines that are not" in empty.stderr
