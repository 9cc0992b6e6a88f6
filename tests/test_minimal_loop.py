"""examples/minimal_loop.py, 2 processes under `fabric run`: stopped by a SIGTERM to the launcher mid-run and started
again with the same command, it ends exactly as a run that was never stopped. And as two sites of a live membership,
started as a user starts them: the second joins the first's run and both end with the same model."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

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


def start_coordinator() -> tuple[subprocess.Popen, int]:
    port = free_port()
    command = [sys.executable, "-m", "fabric_multimodel.coordinator", "--port", str(port)]
    coordinator = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    assert coordinator.stdout is not None and "serving on port" in coordinator.stdout.readline()
    return coordinator, port


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
    joined = [out.split("resumed at step ")[1].split()[0] for _, out, _ in results if "resumed at step " in out]
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
