"""fabric_multimodel.sites: simulated sites (network namespaces) joined by a rate-limited link, for real.

Every test here makes real namespaces, veths, a bridge and tbf qdiscs (the module is skipped where the
machine cannot: not root, no iproute2, a kernel without them), and checks that nothing of a run is left.
A run costs 10-20 s of 2 cores (mostly imports), so the runs are module-scoped fixtures, several tests
read one run, runs that time nothing share the cores, and the times at which sites are dropped scale
with how long the first run took to start.
"""

from __future__ import annotations

import functools
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fabric_multimodel.averaging.pacing import paced_steps
from fabric_multimodel.run.report import parse_final_line
from fabric_multimodel.sites import (
    FAILURE_GRACE_S,
    STOP_GRACE_S,
    Drop,
    Join,
    Sites,
    SitesError,
    SitesResult,
    format_rate,
    main,
    measure_link,
    parse_rate,
    preconditions,
    run_sites,
    script_code,
    shell_code,
    socket_in,
    tbf_settings,
)
from fabric_multimodel.sites.cpu import CPU_CONTROLLER
from fabric_multimodel.sites.network import CONGESTION_CONTROL
from fabric_multimodel.sites.processes import coordinator_command
from fabric_multimodel.status.record import read_record
from fabric_multimodel.status.timeline import members_of

ROOT = Path(__file__).resolve().parents[1]
TASK = str(ROOT / "tests" / "sites_task.py")
# The command line. The tool needs only the standard library, and importing it imports neither torch nor Lightning
# (seconds of CPU per start).
TOOL = [sys.executable, "-m", "fabric_multimodel.sites"]
TIMEOUT_S = 150
MIB = 1 << 20
SIGNALS = (signal.SIGTERM, signal.SIGINT)
START = re.compile(r"^start: world=(\d+) rank=(\d+) node=(\d+) restart=(\d+) time=([\d.]+)$", re.MULTILINE)
LM_KEYS = [
    "steps", "val_loss", "val_bpb", "wall_s", "iter_ms_median", "iter_ms_mean", "comm_bytes", "comm_bytes_per_iter",
    "rounds", "state_bytes",
]  # fmt: skip
GAN_KEYS = [
    "steps", "modes_captured", "high_quality", "wall_s", "iter_ms_median", "iter_ms_mean", "comm_bytes",
    "comm_bytes_per_iter", "rounds", "state_bytes",
]  # fmt: skip

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or preconditions(__file__, 1, 1) is not None,
    reason=f"needs root, iproute2 and a kernel with netns/veth/bridge/tbf: {preconditions(__file__, 1, 1)}",
)


def leftovers(run_id: str) -> list[str]:
    """What a run left behind: its namespaces, and live processes whose command line or environment names it."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    found = [f"namespace {line.split()[0]}" for line in names.splitlines() if run_id in line]
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            text = (entry / "cmdline").read_bytes() + (entry / "environ").read_bytes()
        except OSError:
            continue
        if run_id.encode() in text:
            found.append(f"process {entry.name}: {(entry / 'cmdline').read_bytes()[:200]!r}")
    return found


def starts(log: Path) -> list[dict[str, float]]:
    keys = ("world", "rank", "node", "restart", "time")
    return [dict(zip(keys, map(float, m.groups()))) for m in START.finditer(log.read_text())]


def tail(*paths: Path) -> str:
    return "\n".join(f"--- {p.name}:\n{p.read_text()[-3000:]}" for p in paths if p.exists())


def report(result) -> str:
    return f"{result}\n" + tail(*(p for pair in result.logs for p in pair), result.out / "sites.log")


# --- rates, the link and the network: no scripts ----------------------------------------------------


@pytest.mark.parametrize(
    ("text", "bits"),
    [("10mbit", 10**7), ("100mbit", 10**8), ("1gbit", 10**9), ("500kbit", 5 * 10**5), ("2500000", 2_500_000),
     ("1.5Mbit", 1_500_000), ("none", None), ("NONE", None)],
)  # fmt: skip
def test_parse_rate_reads_the_documented_forms(text, bits):
    assert parse_rate(text) == bits


@given(st.integers(1, 100), st.sampled_from(["kbit", "mbit", "gbit", "", "bit"]))
def test_parse_rate_reads_any_number_in_any_unit(number, unit):
    scale = {"": 1, "bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}[unit]
    if 8_000 <= number * scale <= 100 * 10**9:
        assert parse_rate(f"{number}{unit}") == number * scale
        assert parse_rate(format_rate(number * scale)) == number * scale
    else:
        with pytest.raises(ValueError, match="outside"):
            parse_rate(f"{number}{unit}")


@given(
    st.one_of(
        st.text(alphabet="abcdefghijklmnopqrstuvwxyz -_/", min_size=1).filter(lambda t: t.strip().lower() != "none"),
        st.integers(1, 10**4).map(lambda n: f"{n}mbps"),
        st.integers(1, 10**4).map(lambda n: f"-{n}mbit"),
        st.integers(1, 10**4).map(lambda n: f"{n} mbit"),
        st.floats(0.01, 1e6).map(lambda x: f"{x:.2f}"),  # a fraction of a bit per second
    )
)
def test_parse_rate_refuses_anything_else_naming_the_forms(text):
    with pytest.raises(ValueError, match="10mbit, 1gbit"):
        parse_rate(text)


def test_tbf_burst_is_a_millisecond_and_the_queue_200ms_with_floors():
    def settings(bits: int) -> dict[str, str]:
        args = tbf_settings(bits)
        return dict(zip(args[::2], args[1::2]))

    assert settings(10**9) == {"rate": "1000000000bit", "burst": "125000", "limit": "25000000"}
    assert settings(10**7) == {"rate": "10000000bit", "burst": "3028", "limit": "262144"}


def test_script_code_reads_the_workers_code_from_the_launchers_report():
    report_text = "Root Cause (first observed failure):\n[0]:\n  rank      : 1\n  exitcode  : -9 (pid: 7)  (SIGKILL)"
    assert script_code(1, report_text) == -9
    assert script_code(1, "no report") == 1 and script_code(2, report_text) == 2
    assert shell_code(-9) == 137 and shell_code(3) == 3


@pytest.mark.slow
def test_link_is_limited_each_way_and_traffic_inside_a_site_is_not():
    """10 mbit between sites (TCP payload: ~95.7% of it, the rest is headers); inside a site, traffic to the
    site's own address (as between the processes of one site) goes over lo: 64 MB in well under a second (it
    would take 54 s at 10 mbit), and the site's eth0 qdisc sends none of it."""

    def sent_bytes(sites: Sites) -> int:
        out = subprocess.run(
            ["tc", "-s", "-n", sites.namespaces[0], "qdisc", "show", "dev", "eth0"], capture_output=True, text=True
        ).stdout
        return int(re.search(r"Sent (\d+) bytes", out)[1])

    with Sites(2, parse_rate("10mbit")) as sites:
        up, down = measure_link(sites, 0, 1, seconds=1.0), measure_link(sites, 1, 0, seconds=1.0)
        before = sent_bytes(sites)
        inside = transfer_seconds(sites.namespaces[0], sites.addresses[0], 64 * MIB)
        assert sent_bytes(sites) - before < 64 * 1024
        run_id = sites.run_id
        for namespace in sites.namespaces:  # not the host's (bbr ran two-way exchanges at 1.23-1.28x the rate)
            command = ["ip", "netns", "exec", namespace, "sysctl", "-n", "net.ipv4.tcp_congestion_control"]
            assert subprocess.run(command, capture_output=True, text=True).stdout.strip() == CONGESTION_CONTROL
    assert 9.0 < up < 10.0 and 9.0 < down < 10.0, (up, down)
    assert inside < 1.0, inside
    assert leftovers(run_id) == []


def transfer_seconds(namespace: str, address: str, size: int) -> float:
    """Seconds to send ``size`` bytes over TCP from ``namespace`` to ``address`` in the same namespace."""
    with socket_in(namespace) as server, socket_in(namespace) as client:
        server.bind((address, 0))
        server.listen(1)
        client.connect(server.getsockname())
        connection, _ = server.accept()
        sender = threading.Thread(target=client.sendall, args=(bytes(size),))
        start = time.perf_counter()
        sender.start()
        with connection:
            received, buffer = 0, bytearray(1 << 20)
            while received < size:
                received += connection.recv_into(buffer)
        sender.join()
        return time.perf_counter() - start


def test_sites_removes_what_it_made_when_making_it_fails():
    sites = Sites(2, parse_rate("10mbit"))
    subprocess.run(["ip", "netns", "add", sites.namespaces[1]], check=True)  # in the way of the second site
    with pytest.raises(OSError, match="netns add"):
        with sites:
            pass
    assert leftovers(sites.run_id) == []


# --- clear errors, before anything is made ------------------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--bandwidth", "10mbps"], "argument --bandwidth: '10mbps' is not a rate: use 500kbit, 10mbit, 1gbit"),
        (["--script", "no_such_task.py"], "no_such_task.py: no such script"),
        (["--sites", "0"], "--sites must be >= 1, got 0"),
        (["--devices", "0"], "--devices must be >= 1, got 0"),
        (["--drop-site", "0", "--at", "5"], "--drop-site must be a site in 1..1, got 0: site 0 hosts the main"),
        (["--drop-site", "2", "--at", "5"], "--drop-site must be a site in 1..1, got 2"),
        (["--drop-site", "1", "--at", "5", "--back", "5"], "--back must be later than --at (5.0), got 5.0"),
        (["--drop-site", "1"], "--drop-site needs --at SECONDS"),
        (["--at", "3"], "--at, --back and --seen need --drop-site"),
        (["--join-site", "1"], "--join-site and --join-at go together"),
        (["--cpu", "2:0.5"], "--cpu 2:0.5: the site must be in 0..1"),
        (["--cpu", "1:1.5"], "--cpu 1:1.5: the share must be in 0.01..1 (of one core per process)"),
        (["--cpu", "half"], "argument --cpu: 'half' is not SITE:SHARE, as in 1:0.5"),
        (["--join-site", "1", "--join-at", "5"], "--join-site needs --launcher torchrun"),
        (["--join-site", "2", "--join-at", "5"], "--join-site must be a site in 1..1, got 2"),
        (["--launcher", "torchrun", "--join-site", "1", "--join-at", "0"], "--join-at must be > 0 seconds, got 0"),
        (["--churn", "60:20"], "--churn needs --launcher live"),
        (["--launcher", "torchrun", "--sites", "1", "--churn", "60:20"], "or torchrun with 2 sites or more"),
        (["--launcher", "live", "--churn", "20:60"], "--churn EVERY:DOWN needs 0 < DOWN < EVERY seconds, got 20:60"),
        (["--launcher", "live", "--churn", "soon"], "argument --churn: 'soon' is not EVERY:DOWN in seconds"),
        (["--launcher", "live", "--drop-site", "2", "--at", "5"], "--drop-site must be a site in 0..1, got 2"),
    ],
)
def test_bad_settings_are_one_line_and_exit_2(flags, message, capsys, tmp_path):
    settings = {"--sites": "2", "--devices": "1", "--bandwidth": "10mbit", "--out": str(tmp_path / "run")}
    script, extra = TASK, []
    for flag, value in zip(flags[::2], flags[1::2]):
        if flag == "--script":
            script = value
        elif flag in settings:
            settings[flag] = value
        else:
            extra += [flag, value]
    extra += flags[len(flags) // 2 * 2 :]
    before = namespaces()
    assert exit_code([*(item for pair in settings.items() for item in pair), *extra, "--", script]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err
    assert namespaces() == before and not (tmp_path / "run").exists()


def test_a_live_run_may_take_another_coordinator_command(tmp_path):
    """A peer's coordinator (torchft's Lighthouse, in benchmarks/elastic.py) runs where ours would, on the port the
    sites are given; other launchers have no coordinator to replace."""
    net = Sites(3, None)
    command = coordinator_command(net, 29400, ["lighthouse", "--bind", "[::]:{port}"])
    assert command == [*net.exec_prefix(2), "lighthouse", "--bind", "[::]:29400"]
    assert coordinator_command(net, 29400)[-4:] == ["-m", "fabric_multimodel.coordinator", "--port", "29400"]
    before = namespaces()
    with pytest.raises(SitesError, match="a coordinator command needs the live launcher"):
        run_sites(TASK, sites=2, devices=1, bandwidth=None, out=tmp_path / "run", coordinator=["lighthouse"])
    assert namespaces() == before and not (tmp_path / "run").exists()


def test_an_existing_out_folder_is_never_overwritten(capsys, tmp_path):
    argv = ["--sites", "2", "--devices", "1", "--bandwidth", "none", "--out", str(tmp_path), "--", TASK]
    assert exit_code(argv) == 2
    assert f"{tmp_path} exists already" in capsys.readouterr().err and list(tmp_path.iterdir()) == []


@pytest.mark.skipif(shutil.which("setpriv") is None or not Path("/usr/bin/python3").exists(), reason="setpriv")
def test_not_root_is_one_line_and_exit_2():
    """As user nobody, with the system's Python (nobody cannot read this one under /root): the tool needs only
    the standard library, and the package imports nothing else until a name is used. The package and the task are
    copied where nobody can read them (a checkout may lie in a folder only root reads, as a clone into `mktemp -d`
    does)."""
    readable = Path(tempfile.mkdtemp(prefix="fmm-nobody-"))
    try:
        readable.chmod(0o755)
        shutil.copytree(ROOT / "fabric_multimodel", readable / "fabric_multimodel")
        task = shutil.copy(TASK, readable)
        proc = subprocess.run(
            ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3", "-m",
             "fabric_multimodel.sites", "--sites", "2", "--devices", "1", "--bandwidth", "10mbit", "--", task],
            capture_output=True, text=True, timeout=60, env={"PATH": os.environ["PATH"], "PYTHONPATH": str(readable)},
        )  # fmt: skip
    finally:
        shutil.rmtree(readable)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == "sites: error: needs root: it makes network namespaces and qdiscs (run it with sudo)\n"


def exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exit:  # argparse's errors
        return exit.code


def namespaces() -> set[str]:
    return set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())


# --- runs of the task script: fabric run, 2 sites x 1 process -------------------------------------------


def run_task(out: Path, *flags: str, **options) -> SitesResult:
    options = {"sites": 2, "devices": 1, "bandwidth": "none", "stream": False, "timeout": TIMEOUT_S, **options}
    return run_sites(TASK, list(flags), out=out, **options)


def formed_after(result: SitesResult) -> float:
    """Seconds from the scripts' start to site 0's first ``start:`` line (imports and rendezvous)."""
    return starts(result.logs[0][0])[0]["time"] - result.started


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SitesResult | dict]:
    """Three rounds of runs, by what they need from the machine.

    1. Alone: 2 allreduces of 2 MiB, unlimited. How long its world takes to form tells the third round how slow
       this machine is right now.
    2. At once (they mostly import and wait; torchrun sites start faster than `fabric run`'s): a run whose site 1
       exits 3, two runs of the tool as a process, sent SIGTERM and SIGINT, the allreduces between 2 processes of
       one site behind 1 mbit, and a run that times out after 3 s.
    3. At once (they mostly wait: on the link, on torch elastic's rendezvous): the 2 allreduces at 20 mbit, then
       the task loops until site 1 is dropped; torchrun agents whose site 1 is dropped and started again
       (``elastic``, timed from the first run's start-up); torchrun agents whose site 1, at half a core, joins late
       (``joined``).
    """
    allreduces, base = ["--reps", "2", "--bytes", str(2 * MIB)], tmp_path_factory.mktemp("runs")
    results: dict[str, SitesResult | dict] = {"unlimited": run_task(base / "unlimited", *allreduces)}
    failing, behind_1mbit = ["--fail-node", "1", "--code", "3"], {"bandwidth": "1mbit", "launcher": "torchrun"}
    forever = ["--until", str(time.time() + 600)]
    results |= at_once(
        failing=lambda: run_task(base / "failing", *failing, launcher="torchrun", max_restarts=0),
        single=lambda: run_task(base / "single", *allreduces, sites=1, devices=2, **behind_1mbit),
        timeout=lambda: run_task(base / "timeout", *forever, launcher="torchrun", timeout=3),
        **{sig.name: functools.partial(signal_the_tool, base / sig.name, sig) for sig in SIGNALS},
    )
    formed = formed_after(results["unlimited"])
    # Site 1 is dropped once its allreduces (1.7 s on the link) are done, however slowly this round starts.
    drop = Drop(1, at=3.0, seen="allreduced:")
    limited = functools.partial(run_task, base / "limited", *allreduces, *forever, bandwidth="20mbit", drop=drop)
    later = at_once(limited=limited, elastic=lambda: elastic_run(base, formed), joined=lambda: joined_run(base))
    return results | later


def at_once(**jobs: Callable[[], Any]) -> dict[str, Any]:
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = {name: pool.submit(job) for name, job in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


def allreduce_seconds(result: SitesResult) -> float:
    (line,) = [line for line in result.logs[0][0].read_text().splitlines() if line.startswith("allreduce:")]
    return float(line.rsplit("seconds=", 1)[1])


@pytest.mark.slow
def test_a_site_at_half_a_core_gets_at_most_half_a_core_and_its_cgroup_is_removed(joined):
    """The quota is the promise: site 1's busy loop gets at most half a core of CPU time, however busy the machine
    (other load can only lower it); unlimited, one process on 2 cores gets nearly a whole one."""
    slower = joined
    assert slower.code == 0, report(slower)
    shares = [float(re.findall(r"spin: node=\d+ share=([\d.]+)", out.read_text())[-1]) for out, _ in slower.logs]
    assert shares[1] <= 0.56, shares  # 50 ms of each 100 ms period, and the clocks' granularity
    assert "site 1 at 50% of a core per process" in (slower.out / "sites.log").read_text()
    assert not [p for p in CPU_CONTROLLER.iterdir() if p.name.startswith(f"fmm{slower.run_id}")]


@pytest.mark.slow
def test_a_run_across_two_sites_ends_0_and_keeps_every_sites_logs(runs):
    result = runs["unlimited"]
    assert result.code == 0 and result.codes == (0, 0), report(result)
    assert [s["world"] for s in starts(result.logs[0][0]) + starts(result.logs[1][0])] == [2, 2]
    assert "final: world=2" in result.logs[0][0].read_text() and "final:" not in result.logs[1][0].read_text()
    assert all(path.is_file() for pair in result.logs for path in pair)
    assert result.measured_mbit_s > 1000  # veths and a bridge, no limit
    log = (result.out / "sites.log").read_text()
    assert f"sites: run {result.run_id}: 2 x 1 processes, link unlimited each way, measured " in log
    assert leftovers(result.run_id) == []


@pytest.mark.slow
def test_a_limited_link_takes_bytes_over_rate_and_an_unlimited_one_far_less(runs):
    """Gloo's allreduce of N bytes between 2 ranks sends N bytes each way (half in its reduce-scatter, half
    in its all-gather), so 2 allreduces of 2 MiB move 4 MiB each way: 1.68 s at 20 mbit."""
    limited, unlimited = runs["limited"], runs["unlimited"]
    assert 18.0 < limited.measured_mbit_s < 20.0, report(limited)
    expected = 2 * 2 * MIB * 8 / 20e6
    assert 0.7 * expected <= allreduce_seconds(limited) <= 2.5 * expected, report(limited)
    assert allreduce_seconds(unlimited) * 5 < allreduce_seconds(limited)


@pytest.mark.slow
def test_gloo_between_the_processes_of_one_site_is_not_limited(runs):
    """4 MiB each way would take 34 s at 1 mbit; gloo binds to eth0's address, the site's own, which the kernel
    routes over lo. One site: nothing to measure, and the line says so."""
    result = runs["single"]
    assert result.code == 0 and result.measured_mbit_s is None, report(result)
    assert [s["world"] for s in starts(result.logs[0][0])] == [2, 2]
    assert allreduce_seconds(result) < 1.0, report(result)
    log = (result.out / "sites.log").read_text()
    assert "1 x 2 processes, link 1mbit each way; one site: no link to measure" in log
    assert leftovers(result.run_id) == []


@pytest.mark.slow
def test_a_failing_site_gives_its_scripts_code_and_the_others_are_stopped(runs):
    """Site 1's script exits 3 once connected (its launcher itself exits 1; its report names the 3); site 0
    sleeps on, and is stopped FAILURE_GRACE_S later (SIGTERM, then SIGKILL after STOP_GRACE_S)."""
    result = runs["failing"]
    assert result.code == 3 and result.codes[1] == 3 and result.stopped == (0,), report(result)
    assert result.ended[0] - result.ended[1] < FAILURE_GRACE_S + STOP_GRACE_S + 1, report(result)
    assert leftovers(result.run_id) == []


@pytest.mark.slow
def test_a_timeout_stops_everything_and_is_code_124(runs):
    result = runs["timeout"]
    assert result.timed_out and result.code == 124 and result.stopped == (0, 1), report(result)
    assert 3 < result.wall_s < 3 + STOP_GRACE_S + 2, report(result)
    assert "sites: timed out after 3 s; stopping every site" in (result.out / "sites.log").read_text()
    assert leftovers(result.run_id) == []


@pytest.mark.slow
def test_a_dropped_site_is_killed_at_its_time_and_the_survivor_fails_at_once(runs):
    """`fabric run` worlds are static: site 0's next allreduce fails as soon as site 1's processes are gone, and
    the tool exits with its code (the run at 20 mbit, dropped once its timed allreduces are done: at the first look
    after both its time and site 1's line)."""
    result = runs["limited"]
    assert "allreduced: rank=1" in result.logs[1][0].read_text(), report(result)
    assert starts(result.logs[0][0]) and starts(result.logs[0][0])[0]["time"] - result.started < result.dropped_at
    assert result.drop.at <= result.dropped_at and result.back_at is None, report(result)
    assert result.codes == (1, -9) and result.code == 1 and result.stopped == (), report(result)
    # Well before the task's 60 s process-group timeout: the lost peer, not a timeout, ended it (under 8 s on a quiet
    # machine, 10.5 s once beside a 4-process benchmark on the same 2 cores).
    assert result.ended[0] - result.dropped_at < 30, report(result)
    assert f"sites: dropped site 1 at {result.dropped_at:.1f} s" in (result.out / "sites.log").read_text()
    assert leftovers(result.run_id) == []


# --- the tool itself, as a process: SIGTERM and Ctrl-C -------------------------------------------------------


def signal_the_tool(out: Path, sig: int) -> dict:
    """Run the tool as a process (torchrun sites) and send it ``sig`` once site 0's worker runs: its exit code,
    the seconds from the signal to its exit, its output and its run id. For SIGINT, the tool starts with SIGINT
    ignored, as every background job of a non-interactive shell does (``python -m pytest tests &`` in a script):
    an explicit SIGINT must still stop it (it ran to its timeout once)."""
    command = [
        *TOOL, "--sites", "2", "--devices", "1", "--bandwidth", "100mbit", "--launcher", "torchrun",
        "--out", str(out), "--timeout", str(TIMEOUT_S), "--", TASK, "--until", str(time.time() + 600),
    ]  # fmt: skip
    ignored = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sig == signal.SIGINT else None
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=ignored)
    return signal_when_started(proc, sig)


def signal_when_started(proc: subprocess.Popen, sig: int) -> dict:
    lines, signalled_at = [], None
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("start:") and signalled_at is None:
                proc.send_signal(sig)
                signalled_at = time.monotonic()
        proc.wait(timeout=30)
    finally:
        end_the_tool(proc)
    run_id = re.search(r"^sites: run (\w+):", "".join(lines), re.MULTILINE)
    return {
        "code": proc.returncode,
        "seconds": time.monotonic() - signalled_at if signalled_at else None,
        "stdout": "".join(lines),
        "stderr": proc.stderr.read(),
        "run_id": run_id[1] if run_id else None,
    }


def end_the_tool(proc: subprocess.Popen) -> None:
    """If the tool still runs (a test failed), SIGTERM it, so that it removes what it made; SIGKILL is the last
    resort."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sig", "code", "word"),
    [(signal.SIGTERM, 143, "terminated"), (signal.SIGINT, 130, "interrupted")],
    ids=["SIGTERM", "SIGINT"],
)
def test_a_signal_to_the_tool_stops_every_site_and_removes_the_network(runs, sig, code, word):
    outcome = runs[sig.name]
    assert outcome["run_id"] and outcome["seconds"] is not None, outcome
    assert outcome["code"] == code, outcome
    assert outcome["stderr"].strip().splitlines()[-1] == f"sites: {word}; every site stopped and the network removed"
    assert outcome["seconds"] < STOP_GRACE_S + 5, outcome
    assert leftovers(outcome["run_id"]) == []


# --- the real examples across 2 sites x 1 process, through the command line ------------------------------


@pytest.fixture(scope="module")
def examples(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int, str, str, str | None, Path]]:
    """examples/lm_fabric.py (DiLoCo with fp8 pseudo-gradients and error feedback, FSDP2 inside each site of 2
    processes, a sharded checkpoint at step 3, after each round and at the end) and examples/gan_fabric.py (local
    SGD paced by speed, one process per site), 6 steps each, at 100 mbit, both at once: the LM by the command line
    (stdout: the tool's lines and site 0's output), the GAN by ``run_sites`` (site 0's stdout log); then the LM
    resumed (--resume auto with a run folder per site, site 1's empty). (exit
    code, output, errors, run id, run folder or sites' logs) by name."""
    base = tmp_path_factory.mktemp("examples")
    schedule = ["--steps", "6", "--period", "3", "--warmup-steps", "2", "--checkpoint-every", "0"]
    lm = [str(ROOT / "examples" / "lm_fabric.py"), *schedule, "--outer", "nesterov", "--log-every", "3"]
    lm += ["--comm-dtype", "float8_e4m3fn", "--error-feedback"]  # each process's residuals in its site's folder
    lm += ["--eval-batches", "1", "--shard", "node", "--checkpoint-every", "3", "--checkpoint-rounds"]
    lm += ["--out", str(base / "lm")]
    gan = [*schedule, "--pace", "speed", "--out", str(base / "gan")]
    tool = [*TOOL, "--sites", "2", "--devices", "2", "--bandwidth", "100mbit", "--timeout", str(TIMEOUT_S)]
    tool += ["--out", str(base / "lm-sites"), "--", *lm]
    # The example imports fabric_multimodel: this checkout's, as the tests do.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(tool, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        result = run_sites(
            ROOT / "examples" / "gan_fabric.py", gan, sites=2, devices=1, bandwidth="100mbit",
            out=base / "gan-sites", timeout=TIMEOUT_S, stream=False,
        )  # fmt: skip
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S + 30)
    finally:
        end_the_tool(proc)
    # The sharded run resumed up to step 9 with --resume auto, each site its own run folder (no shared disk): site
    # 0's a copy of the run's without site 1's folder, site 1's empty (site 1 receives site 0's folder over the link
    # and starts from its anchors). (--resume FOLDER with FSDP2: test_example's sharded resume, in one world.)
    shutil.copytree(base / "lm", base / "lm-auto0", ignore=shutil.ignore_patterns("checkpoint.replica1"))
    resumes = {"auto": ["--resume", "auto", "--out", str(base / "lm-auto{site}")]}
    started = {}
    for name, flags in resumes.items():
        resume = [*TOOL, "--sites", "2", "--devices", "2", "--bandwidth", "none", "--timeout", str(TIMEOUT_S)]
        resume += ["--out", str(base / f"lm-{name}-sites"), "--", *lm, "--steps", "9", *flags]
        started[name] = subprocess.Popen(
            resume, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    resumed = {}
    try:
        for name, run in started.items():
            out, err = run.communicate(timeout=TIMEOUT_S + 30)
            resumed[name] = (run.returncode, out, err, None, base / f"lm-{name}-sites")
    finally:
        for run in started.values():
            end_the_tool(run)
    lm_run = re.match(r"sites: run (\w+):", stdout)
    gan_errors = tail(*result.logs[0], *result.logs[1])
    return {
        "lm": (proc.returncode, stdout, stderr, lm_run[1] if lm_run else None, base / "lm"),
        **resumed,
        "gan": (result.code, result.logs[0][0].read_text(), gan_errors, result.run_id, base / "gan"),
    }


@pytest.mark.slow
@pytest.mark.parametrize(("name", "keys"), [("lm", LM_KEYS), ("gan", GAN_KEYS)])
def test_the_examples_train_across_two_sites(examples, name, keys):
    """Warm-up steps 1-2 synchronous, a round at step 5, and one on leaving the local steps at 6 (the GAN, paced:
    a site measured slower makes fewer steps, in the same two rounds)."""
    code, stdout, stderr, run_id, folder = examples[name]
    assert code == 0, f"{stdout[-3000:]}\n{stderr[-3000:]}"
    final = parse_final_line(stdout, keys)
    assert int(final["rounds"]) == 2 and int(final["comm_bytes"]) > 0, final
    paced = re.search(r"^pace speed: local steps per round by site: (\d+) steps .*, (\d+) steps ", stdout, re.M)
    if name == "gan":
        assert paced and max(int(paced[1]), int(paced[2])) == 3, stdout[-3000:]
        assert int(final["steps"]) == paced_steps(6, 2, int(paced[1]), 3), final
    else:
        assert not paced and int(final["steps"]) == 6, final
    quality = float(final["val_loss"]) if name == "lm" else int(final["modes_captured"].split("/")[0])
    assert math.isfinite(quality) and quality >= 0, final
    if name == "lm":  # the command line: its lines around site 0's output
        assert stdout.startswith("sites: run ") and " 2 x 2 processes, link 100mbit each way, measured " in stdout
        assert stdout.strip().splitlines()[-1].startswith("sites: exit 0 after ")
        assert "layout=islands (FSDP2 inside each node, rounds of its shards across nodes)" in stdout
        assert int(final["state_bytes"]) > 0
        assert "checkpoints after rounds: 1 sharded saves, training thread " in stdout  # at step 5
        # Each site wrote its own sharded checkpoint, complete, and nothing temporary is left beside them.
        assert sorted(p.name for p in folder.glob("checkpoint*")) == ["checkpoint", "checkpoint.replica1"]
        assert all((folder / name / ".metadata").is_file() for name in ("checkpoint", "checkpoint.replica1"))
        assert not list(folder.glob(".checkpoint*"))
    assert run_id and leftovers(run_id) == []


@pytest.mark.slow
@pytest.mark.parametrize("name", ["auto"])
def test_a_sharded_run_resumes_from_its_sites_folders(examples, name):
    """--resume auto, each site its own run folder and site 1's empty: site 1 receives site 0's Averager state
    over the link and starts from its anchors. The
    schedule and the byte counts go on from step 6 (rounds at 5 and on leaving at 6, then at 8 and on leaving
    at 9)."""
    code, stdout, stderr, _, logs = examples[name]
    assert code == 0, f"{stdout[-3000:]}\n{stderr[-3000:]}"
    if name == "auto":  # site 0's lines reach the tool's stdout; site 1's are in its log
        own = re.escape(str(logs.parent / "lm-auto0" / "checkpoint"))
        sent = re.search(
            rf"--resume auto: step 6 from {own} \(its own; sent ([\d.]+) MB to sites without one\)", stdout
        )
        assert sent and float(sent[1]) > 0, stdout[-3000:]
        received = re.search(
            r"--resume auto: step 6 from site 0 over the link \(([\d.]+) MB in [\d.]+ s: it starts from the anchors\)",
            (logs / "site1.out").read_text(),
        )
        assert received and received[1] == sent[1]
        assert (logs.parent / "lm-auto1" / "checkpoint.replica1" / ".metadata").is_file()
        assert "checkpoints after rounds: 1 sharded saves" in stdout, stdout[-3000:]  # at step 8
    final = parse_final_line(stdout, LM_KEYS)
    first = parse_final_line(examples["lm"][1], LM_KEYS)
    assert int(final["steps"]) == 9 and int(final["rounds"]) == 4, final
    assert int(final["comm_bytes"]) > int(first["comm_bytes"]) > 0
    run_id = re.match(r"sites: run (\w+):", stdout)
    assert run_id and leftovers(run_id[1]) == []


# --- torchrun: elastic agents, a site lost and back ---------------------------------------------------------


def elastic_run(base: Path, formed: float) -> SitesResult:
    """torchrun agents on 2 sites; site 1 is dropped once the world runs and started again once site 0 runs
    alone. The task loops until shortly after the drop, in the full world only: a smaller world goes on until
    torch elastic restarts it into a larger one, and the last world ends after a few rounds. The times scale
    with how long the first run's world took to form (torchrun's start about half of `fabric run`'s, and two
    other runs start beside it)."""
    at = round(max(10.0, 1.5 * formed + 3))
    back = round(at + 9 + 0.25 * formed)  # a world of 1 forms ~8 s after the drop: heartbeats, last call, start
    until = time.time() + at + 4
    flags = ["--until", str(until), "--world", "2"]
    return run_task(base / "elastic", *flags, launcher="torchrun", drop=Drop(1, at, back))


def joined_run(base: Path) -> SitesResult:
    """torchrun agents on 2 sites; site 1 starts only once site 0's world of 1 runs: a new site joining, and a
    slower one (half a core), its busy loop timed in the world of 2."""
    # Site 0 alone forms a world of 1 after its start and the last call, later while other runs start beside it.
    late = Join(1, at=1.0, seen="start: world=1")
    flags = ["--until", str(time.time() + 5), "--world", "2", "--spin", "1.5"]
    return run_task(base / "joined", *flags, launcher="torchrun", join=late, cpu={1: 0.5})


@pytest.fixture(scope="module")
def elastic(runs: dict[str, SitesResult | dict]) -> SitesResult:
    return runs["elastic"]


@pytest.fixture(scope="module")
def joined(runs: dict[str, SitesResult | dict]) -> SitesResult:
    return runs["joined"]


@pytest.mark.slow
def test_torchrun_a_site_that_joins_late_grows_the_world(joined):
    """Site 0's agent starts a world of 1, then restarts its worker into a world of 2 when site 1's agent arrives;
    site 1 starts once, in the world of 2."""
    assert joined.code == 0 and joined.codes == (0, 0), report(joined)
    zero, one = (starts(out) for out, _ in joined.logs)
    assert [s["world"] for s in zero] == [1, 2] and [s["world"] for s in one] == [2], report(joined)
    alone, grown = (s["time"] - joined.started for s in zero)
    assert joined.joined_at is not None and alone < joined.joined_at < grown, report(joined)
    assert "site 1 joined at" in (joined.out / "sites.log").read_text()
    assert leftovers(joined.run_id) == []


@pytest.mark.slow
def test_torchrun_agents_rendezvous_across_the_sites_and_train(elastic):
    assert elastic.code == 0 and elastic.codes == (0, 0), report(elastic)
    first = [starts(out)[0] for out, _ in elastic.logs]
    assert [s["world"] for s in first] == [2, 2], report(elastic)
    assert all(s["time"] - elastic.started < elastic.dropped_at for s in first), report(elastic)
    assert "final: world=2" in elastic.logs[0][0].read_text()


@pytest.mark.slow
def test_torchrun_after_a_drop_the_world_shrinks_and_grows_back(elastic):
    """Site 0's agent restarts its worker (a peer died) into a world of 1, then into a world of 2 when site 1's
    agent is back; site 1 starts twice, both times in a world of 2."""
    zero, one = (starts(out) for out, _ in elastic.logs)
    assert [s["world"] for s in zero] == [2, 1, 2] and [s["world"] for s in one] == [2, 2], report(elastic)
    shrunk, grown = (s["time"] - elastic.started for s in zero[1:])
    assert elastic.dropped_at < shrunk < elastic.back_at < grown, report(elastic)
    print(
        f"torchrun: dropped at {elastic.dropped_at:.1f} s, world of 1 {shrunk - elastic.dropped_at:.1f} s later;"
        f" back at {elastic.back_at:.1f} s, world of 2 {grown - elastic.back_at:.1f} s later;"
        f" run {elastic.wall_s:.1f} s"
    )
    assert leftovers(elastic.run_id) == []


# --- live membership: every site a world of its own, the coordinator in a namespace of its own -----------------

MEMBERSHIP_KEYS = [*LM_KEYS, "membership_wait_s", "process_start"]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> SitesResult:
    """3 sites x 1 at 10 mbit, the LM example with streaming DiLoCo and fp8 rounds; site 0 is dropped once the
    three train together (its first `membership:` line) and started again 4 s later."""
    out = tmp_path_factory.mktemp("live") / "run"
    flags = [
        "--steps", "3000", "--batch-size", "2", "--d-model", "32", "--layers", "1", "--heads", "2",
        "--eval-batches", "2", "--log-every", "1000", "--checkpoint-every", "0", "--period", "16",
        "--warmup-steps", "0", "--outer", "nesterov", "--fragments", "2", "--overlap-steps", "2",
        "--comm-dtype", "float8_e4m3fn", "--timeout", "20", "--min-sites", "3", "--out", str(out.parent / "site{site}"),
    ]  # fmt: skip
    options = {"sites": 3, "devices": 1, "bandwidth": "10mbit", "stream": False, "timeout": 240, "launcher": "live"}
    drop = Drop(0, at=1.0, back=5.0, seen="membership: epoch=1")
    return run_sites(ROOT / "examples" / "lm_fabric.py", flags, out=out, drop=drop, **options)


@pytest.fixture(scope="module")
def live_sparse(tmp_path_factory: pytest.TempPathFactory) -> SitesResult:
    """The same three live sites at 1 mbit with sparse rounds (``--density 1/64``, no outer optimizer: SparseLoCo);
    site 0 dropped once the three train together and started again 4 s later."""
    out = tmp_path_factory.mktemp("live_sparse") / "run"
    flags = [
        "--steps", "3000", "--batch-size", "2", "--d-model", "32", "--layers", "1", "--heads", "2",
        "--eval-batches", "2", "--log-every", "1000", "--checkpoint-every", "0", "--period", "16",
        "--warmup-steps", "0", "--fragments", "2", "--overlap-steps", "2", "--density", "1/64",
        "--timeout", "20", "--min-sites", "3", "--out", str(out.parent / "site{site}"),
    ]  # fmt: skip
    options = {"sites": 3, "devices": 1, "bandwidth": "1mbit", "stream": False, "timeout": 300, "launcher": "live"}
    drop = Drop(0, at=1.0, back=5.0, seen="membership: epoch=1")
    return run_sites(ROOT / "examples" / "lm_fabric.py", flags, out=out, drop=drop, **options)


@pytest.mark.slow
def test_live_sparse_sites_at_1mbit_lose_a_site_take_it_back_and_end_as_one_model(live_sparse):
    """Issue 68's live run: the killed site comes back with the newest state (an empty accumulator of its own), the
    run completes, and every site ends with the same model."""
    assert live_sparse.code == 0 and live_sparse.codes == (0, 0, 0), report(live_sparse)
    outputs = [out.read_text() for out, _ in live_sparse.logs]
    finals = [parse_final_line(text, MEMBERSHIP_KEYS) for text in outputs]
    assert {f["steps"] for f in finals} == {"3000"} and len({f["val_loss"] for f in finals}) == 1, finals
    assert "density=0.015625" in outputs[1] and "site 0 back at" in (live_sparse.out / "sites.log").read_text()
    assert [e["joined"] for e in membership_lines(outputs[1])][-1] == "0", outputs[1][-3000:]
    assert leftovers(live_sparse.run_id) == []


def membership_lines(text: str) -> list[dict[str, str]]:
    return [
        dict(f.split("=", 1) for f in line.split()[1:]) for line in text.splitlines() if line.startswith("membership:")
    ]


@pytest.mark.slow
def test_live_sites_train_on_when_the_first_site_is_lost_and_take_it_back(live):
    """No site restarts but the dropped one; the survivors re-form the group within seconds, the returning site
    joins them with the newest state, and all three end with the same model."""
    assert live.code == 0 and live.codes == (0, 0, 0), report(live)
    outputs = [out.read_text() for out, _ in live.logs]
    finals = [parse_final_line(text, MEMBERSHIP_KEYS) for text in outputs]
    assert {f["steps"] for f in finals} == {"3000"} and len({f["val_loss"] for f in finals}) == 1, finals
    for site in (1, 2):
        epochs = membership_lines(outputs[site])
        first = epochs[0]["sites"].split(",")
        survivors = ",".join(s for s in first if s != "0")
        assert sorted(first) == ["0", "1", "2"]
        assert [(e["sites"], e["left"], e["joined"]) for e in epochs[1:]] == [
            (survivors, "0", "-"),
            (f"{survivors},0", "-", "0"),
        ], outputs[site][-3000:]
        assert float(finals[site]["membership_wait_s"]) < 5.0
        # the survivors' processes are the ones that started the run: one final line, one process start each
        assert outputs[site].count("final:") == 1
    assert "site 0 back at" in (live.out / "sites.log").read_text()
    assert float(finals[0]["process_start"]) > live.started + live.back_at - 1  # site 0's second process ended it
    members, _ = members_of(read_record(live.out / "status.jsonl"))  # the coordinator's record, and its picture
    zeros = [m for m in members if m.token.startswith("0#")]
    assert len(zeros) == 2 and zeros[0].lost is not None and zeros[1].joined is not None, members
    assert zeros[1].joined > zeros[0].lost and all(m.loss for m in members if m is not zeros[0]), members
    assert live.timeline is not None and live.timeline.read_bytes()[:4] == b"\x89PNG"
    assert leftovers(live.run_id) == []
