"""examples/minimal_loop.py, 2 processes under `fabric run`: stopped by a SIGTERM to the launcher mid-run and started
again with the same command, it ends exactly as a run that was never stopped. And as two sites of a live membership,
started as a user starts them: the second joins the first's run and both end with the same model."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fabric_multimodel.checkpoints.files import read_checkpoint
from fabric_multimodel.run.launch import free_port, stop_process_tree
from fabric_multimodel.run.report import parse_final_line

ROOT = Path(__file__).resolve().parents[1]
FABRIC = Path(sys.executable).parent / "fabric"
KEYS = ("steps", "val_loss", "wall_s", "comm_bytes", "rounds")
STEPS = 200
SITE_STEPS = 1500  # the second site joins after a few hundred (607 when written): it starts as the first does
TIMEOUT_S = 300


def start(out: Path) -> subprocess.Popen:
    cmd = [str(FABRIC), "run", "--accelerator", "cpu", "--devices", "2", "--main-port", str(free_port())]
    cmd += ["examples/minimal_loop.py", "--steps", str(STEPS), "--out", str(out)]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("LT_", "TORCHELASTIC_"))}
    return subprocess.Popen(cmd, cwd=ROOT, env=clean, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT_S)
    finally:
        stop_process_tree(proc)
    return proc.returncode, stdout, stderr


def start_coordinator_on(port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "fabric_multimodel.coordinator", "--port", str(port)]
    coordinator = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert coordinator.stdout is not None and "serving on port" in coordinator.stdout.readline()
    return coordinator


def start_coordinator() -> tuple[subprocess.Popen, int]:
    port = free_port()
    return start_coordinator_on(port), port


def start_site(site: str, port: int, out: Path, steps: int = SITE_STEPS) -> subprocess.Popen:
    """Site ``site`` of a live membership, a plain `python` process of its own, started as a user starts one."""
    cmd = [sys.executable, "examples/minimal_loop.py", "--steps", str(steps), "--out", str(out)]
    cmd += ["--coordinator", f"127.0.0.1:{port}"]
    env = {**os.environ, "SITE": site}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def start_sites(folder: Path) -> tuple[subprocess.Popen, list[subprocess.Popen]]:
    """The coordinator and two sites: the first to register starts the run alone, the second joins it at a round
    boundary."""
    coordinator, port = start_coordinator()
    return coordinator, [start_site(site, port, folder / site) for site in ("a", "b")]


@pytest.mark.slow
def test_a_run_stopped_by_sigterm_and_started_again_ends_as_one_never_stopped(tmp_path: Path) -> None:
    whole, stopped = start(tmp_path / "whole"), start(tmp_path / "stopped")
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not (tmp_path / "stopped" / "checkpoint.pt").exists():  # the first round's checkpoint: mid-run
            assert stopped.poll() is None and time.monotonic() < deadline, stopped.communicate()
            time.sleep(0.05)
        stopped.send_signal(signal.SIGTERM)  # to the launcher, which passes it on to its processes
        code, out, err = finish(stopped)
    finally:
        stop_process_tree(stopped)
    assert code != 0 and "stopped by SIGTERM at step " in out, out[-2000:] + err[-3000:]
    at = int(out.split("stopped by SIGTERM at step ")[1].split(";")[0])
    assert 0 < at < STEPS
    code, again, err = finish(start(tmp_path / "stopped"))  # the same command
    assert code == 0 and f"resumed at step {at} from " in again, again[-2000:] + err[-3000:]
    code, uninterrupted, err = finish(whole)
    assert code == 0, uninterrupted[-2000:] + err[-3000:]
    expected, resumed = parse_final_line(uninterrupted, KEYS), parse_final_line(again, KEYS)
    for key in ("steps", "val_loss", "comm_bytes", "rounds"):
        assert resumed[key] == expected[key], (key, resumed, expected)


@pytest.mark.slow
def test_a_site_joins_a_run_under_way_and_both_end_with_the_same_model(tmp_path: Path) -> None:
    coordinator, sites = start_sites(tmp_path)
    try:
        results = [finish(site) for site in sites]
    finally:
        for proc in [*sites, coordinator]:
            stop_process_tree(proc)
    for code, out, err in results:
        assert code == 0, out[-2000:] + err[-3000:]
    finals = [parse_final_line(out, KEYS) for _, out, _ in results]
    assert finals[0]["steps"] == finals[1]["steps"] == str(SITE_STEPS), finals
    assert finals[0]["val_loss"] == finals[1]["val_loss"] and finals[0]["rounds"] == finals[1]["rounds"], finals
    joined = [out.split("joined the run at step ")[1].split()[0] for _, out, _ in results if "joined the run" in out]
    assert len(joined) == 1 and int(joined[0]) > 0, [out[-1000:] for _, out, _ in results]  # the second site


@pytest.mark.slow
def test_a_site_with_a_bad_name_stops_in_one_line_and_the_next_site_trains_as_one_alone(tmp_path: Path) -> None:
    coordinator, port = start_coordinator()
    try:
        code, out, err = finish(start_site("x" * 10_000, port, tmp_path / "bad"))
        lines = err.strip().splitlines()
        assert code == 2 and "SITE='xxxx" in lines[-1] and "1 to 64 letters" in lines[-1], err[-2000:]
        assert "Traceback" not in err and len(lines[-1]) < 300
        code, out, err = finish(start_site("a", port, tmp_path / "a", steps=STEPS))
    finally:
        stop_process_tree(coordinator)
    assert code == 0, out[-2000:] + err[-3000:]
    assert parse_final_line(out, KEYS)["steps"] == str(STEPS)  # alone from step 0: nobody was ahead of it
    assert "resumed at step" not in out


class Site:
    """A live site of the minimal loop whose output goes to files (read while it runs)."""

    def __init__(self, name: str, port: int, folder: Path, steps: int, *extra: str) -> None:
        self.log = folder / f"{name}.log"
        folder.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "examples/minimal_loop.py", "--steps", str(steps), "--out", str(folder / name)]
        cmd += ["--coordinator", f"127.0.0.1:{port}", *extra]
        with self.log.open("w") as log:
            env = {**os.environ, "SITE": name}
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)

    @property
    def output(self) -> str:
        return self.log.read_text()

    def finish(self) -> int:
        try:
            return self.proc.wait(timeout=TIMEOUT_S)
        finally:
            stop_process_tree(self.proc)


def three_sites(port: int, folder: Path, steps: int, *extra: str) -> list[Site]:
    """Three live sites, started together (the run waits for all three); returned once they train in one epoch."""
    sites = [Site(name, port, folder, steps, "--min-sites", "3", *extra) for name in ("a", "b", "c")]
    deadline = time.monotonic() + TIMEOUT_S
    while not all(re.search(r"epoch \d+: 3 sites", site.output) for site in sites):
        assert all(site.proc.poll() is None for site in sites) and time.monotonic() < deadline, sites[0].output
        time.sleep(0.1)
    return sites


def clean(site: Site) -> None:
    """No traceback, Python's or torch's C++ one, in a site's output."""
    assert "Traceback" not in site.output and "frame #" not in site.output, site.output[-3000:]


LIVE_STEPS = 1500


@pytest.mark.slow
def test_three_sites_train_on_through_the_coordinators_restart_and_end_with_the_same_model(tmp_path: Path) -> None:
    port = free_port()
    coordinator = start_coordinator_on(port)
    sites: list[Site] = []
    try:
        sites = three_sites(port, tmp_path, LIVE_STEPS)
        coordinator.kill()  # SIGKILL: its store is gone
        coordinator.wait()
        time.sleep(3)
        assert all(site.proc.poll() is None for site in sites)  # training on without it
        coordinator = start_coordinator_on(port)  # on the same port, empty
        codes = [site.finish() for site in sites]
    finally:
        for proc in [*(site.proc for site in sites), coordinator]:
            stop_process_tree(proc)
    for site, code in zip(sites, codes):
        assert code == 0, site.output[-3000:]
        assert "lost (" in site.output and "back after" in site.output, site.output[-3000:]
        clean(site)
    finals = [parse_final_line(site.output, KEYS) for site in sites]
    assert {f["val_loss"] for f in finals} == {finals[0]["val_loss"]} and finals[0]["steps"] == str(LIVE_STEPS)
    assert sum("came back empty: put back run" in site.output for site in sites) >= 1


@pytest.mark.slow
def test_invited_sites_train_and_a_site_with_a_wrong_secret_stops_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 70: two sites holding FABRIC_MULTIMODEL_SECRET train and end as one model; a third with a wrong one
    exits non-zero within 30 s with one line naming the secret, and the two never notice."""
    port = free_port()
    monkeypatch.setenv("FABRIC_MULTIMODEL_SECRET", "the run's secret, a long random string")
    coordinator = start_coordinator_on(port)
    sites = [Site(name, port, tmp_path, LIVE_STEPS, "--min-sites", "2") for name in ("a", "b")]
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not all(re.search(r"epoch \d+: 2 sites", site.output) for site in sites):
            assert all(site.proc.poll() is None for site in sites) and time.monotonic() < deadline, sites[0].output
            time.sleep(0.1)
        monkeypatch.setenv("FABRIC_MULTIMODEL_SECRET", "a guess")
        start = time.monotonic()
        intruder = Site("c", port, tmp_path, LIVE_STEPS, "--min-sites", "2")
        code = intruder.finish()
        lines = intruder.output.strip().splitlines()
        assert code != 0 and time.monotonic() - start < 30, intruder.output[-2000:]
        assert lines[-1] == "site c: FABRIC_MULTIMODEL_SECRET is not the secret of run 'run': this site was not let in"
        clean(intruder)
        codes = [site.finish() for site in sites]
    finally:
        for proc in [*(site.proc for site in sites), coordinator]:
            stop_process_tree(proc)
    for site, code in zip(sites, codes):
        assert code == 0 and "epoch 2" not in site.output, site.output[-3000:]  # nobody joined, nobody left
        clean(site)
    finals = [parse_final_line(site.output, KEYS) for site in sites]
    assert finals[0]["val_loss"] == finals[1]["val_loss"] and finals[0]["steps"] == str(LIVE_STEPS), finals


@pytest.mark.slow
def test_sites_stop_past_the_grace_and_the_same_commands_resume_them(tmp_path: Path) -> None:
    """The coordinator killed for good: every site saves and stops in one line; then the coordinator and the same
    commands again: every site resumes from its own checkpoint, at the step it stopped, and ends the run."""
    port = free_port()
    coordinator = start_coordinator_on(port)
    sites: list[Site] = []
    try:
        sites = three_sites(port, tmp_path, LIVE_STEPS, "--grace", "3")
        coordinator.kill()
        coordinator.wait()
        codes = [site.finish() for site in sites]
        outputs = [site.output for site in sites]
        stopped = [int(re.findall(r"stopped by a lost coordinator .* at step (\d+)", out)[0]) for out in outputs]
        coordinator = start_coordinator_on(port)
        again = [Site(name, port, tmp_path, LIVE_STEPS, "--min-sites", "3") for name in ("a", "b", "c")]
        again_codes = [site.finish() for site in again]
    finally:
        for proc in [*(site.proc for site in sites), coordinator]:
            stop_process_tree(proc)
    assert codes == [143, 143, 143], [out[-2000:] for out in outputs]
    for site, at, code in zip(again, stopped, again_codes):
        assert code == 0 and f"resumed at step {at} from " in site.output, site.output[-3000:]
        assert parse_final_line(site.output, KEYS)["steps"] == str(LIVE_STEPS)
        clean(site)


@pytest.mark.slow
def test_a_run_killed_whole_resumes_from_each_sites_checkpoint_and_ends_as_one(tmp_path: Path) -> None:
    """Every site and the coordinator SIGKILLed mid-run, then the same commands: each site resumes from its own
    newest checkpoint (not from step 0, not a joiner's step), and the three end at the run's step with one model."""
    port = free_port()
    coordinator = start_coordinator_on(port)
    sites: list[Site] = []
    try:
        sites = three_sites(port, tmp_path, LIVE_STEPS)
        time.sleep(3)
        for proc in [*(site.proc for site in sites), coordinator]:
            proc.kill()
            proc.wait()
        saved = {name: read_checkpoint(tmp_path / name / f"checkpoint.site-{name}.pt")["step"] for name in "abc"}
        assert all(0 < step < LIVE_STEPS for step in saved.values()), saved
        coordinator = start_coordinator_on(port)
        sites = [Site(name, port, tmp_path, LIVE_STEPS, "--min-sites", "3") for name in "abc"]
        codes = [site.finish() for site in sites]
    finally:
        for proc in [*(site.proc for site in sites), coordinator]:
            stop_process_tree(proc)
    for site, code in zip(sites, codes):
        assert code == 0 and f"resumed at step {saved[site.log.stem]} from " in site.output, site.output[-3000:]
        clean(site)
    finals = [parse_final_line(site.output, KEYS) for site in sites]
    assert {f["val_loss"] for f in finals} == {finals[0]["val_loss"]} and finals[0]["steps"] == str(LIVE_STEPS)
