"""fabric_multimodel.sites: simulated sites (network namespaces) joined by a rate-limited link, for real.

Every test here makes real namespaces, veths, a bridge and tbf qdiscs (the module is skipped where the
machine cannot: not root, no iproute2, a kernel without them). Each run of a script costs 10-20 s on
2 cores (mostly imports), so the runs are module-scoped fixtures, several tests read one run, and runs
that do not time anything share the cores.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fabric_multimodel.sites import (
    Sites,
    format_rate,
    main,
    measure_link,
    parse_rate,
    preconditions,
    script_code,
    shell_code,
    socket_in,
    tbf_settings,
)

ROOT = Path(__file__).resolve().parents[1]
TASK = "tests/sites_task.py"
TIMEOUT_S = 150
MIB = 1 << 20
START = re.compile(r"^start: world=(\d+) rank=(\d+) node=(\d+) restart=(\d+) time=([\d.]+)$", re.MULTILINE)
LM_KEYS = [
    "steps", "val_loss", "val_bpb", "wall_s", "iter_ms_median", "iter_ms_mean", "comm_bytes", "comm_bytes_per_iter",
    "rounds",
]  # fmt: skip
GAN_KEYS = [
    "steps", "modes_captured", "high_quality", "wall_s", "iter_ms_median", "iter_ms_mean", "comm_bytes",
    "comm_bytes_per_iter", "rounds",
]  # fmt: skip

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or preconditions(__file__, 1, 1) is not None,
    reason=f"needs root, iproute2 and a kernel with netns/veth/bridge/tbf: {preconditions(__file__, 1, 1)}",
)


@pytest.fixture(autouse=True)
def in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the task's path, and the examples read their own folder


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
        (["--script", "tests/no_such_task.py"], "tests/no_such_task.py: no such script"),
        (["--sites", "0"], "--sites must be >= 1, got 0"),
        (["--devices", "0"], "--devices must be >= 1, got 0"),
        (["--drop-site", "0", "--at", "5"], "--drop-site must be a site in 1..1, got 0: site 0 hosts the main"),
        (["--drop-site", "2", "--at", "5"], "--drop-site must be a site in 1..1, got 2"),
        (["--drop-site", "1", "--at", "5", "--back", "5"], "--back must be later than --at (5.0), got 5.0"),
        (["--drop-site", "1"], "--drop-site needs --at SECONDS"),
        (["--at", "3"], "--at and --back need --drop-site"),
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


def test_an_existing_out_folder_is_never_overwritten(capsys, tmp_path):
    argv = ["--sites", "2", "--devices", "1", "--bandwidth", "none", "--out", str(tmp_path), "--", TASK]
    assert exit_code(argv) == 2
    assert f"{tmp_path} exists already" in capsys.readouterr().err and list(tmp_path.iterdir()) == []


@pytest.mark.skipif(shutil.which("setpriv") is None or not Path("/usr/bin/python3").exists(), reason="setpriv")
def test_not_root_is_one_line_and_exit_2():
    """As user nobody, with the system's Python (nobody cannot read this one under /root): sites.py needs only
    the standard library, so it runs as a file."""
    proc = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "/usr/bin/python3",
         "fabric_multimodel/sites.py", "--sites", "2", "--devices", "1", "--bandwidth", "10mbit", "--", TASK],
        capture_output=True, text=True, timeout=60, env={"PATH": os.environ["PATH"]},
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == "sites: error: needs root: it makes network namespaces and qdiscs (run it with sudo)\n"


def exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exit:  # argparse's errors
        return exit.code


def namespaces() -> set[str]:
    return set(subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split())
