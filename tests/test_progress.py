"""The run's progress (fabric_multimodel.run.progress) and report (fabric_multimodel.run.report): what a person and the
benchmarks read."""

from __future__ import annotations

import logging
import math
import os
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fabric_multimodel.checkpoints.resume import Resumed
from fabric_multimodel.run.cli import configure_logging
from fabric_multimodel.run.progress import Progress, StartPhases, process_started, transfer_printer
from fabric_multimodel.run.report import final_line, parse_final_line

FINAL_KEYS = ["wall_s", "iter_ms_median", "iter_ms_mean", "comm_bytes", "comm_bytes_per_iter", "rounds"]


def _lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "fabric_multimodel.run.progress"]


def test_progress_rate_counts_from_the_step_a_run_resumed_at(monkeypatch, caplog) -> None:
    caplog.set_level("INFO", "fabric_multimodel")
    clock = iter([100.0, 102.0])  # two seconds between the start (a resume at step 50) and step 60
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    progress = Progress(total=100, start=50, every=10, enabled=True)
    progress(60, lambda: {"loss": 1.0})
    assert _lines(caplog) == ["step 60/100 loss=1.000 5 it/s"]


def test_progress_shows_the_last_step_and_a_unit_of_its_own(monkeypatch, caplog) -> None:
    caplog.set_level("INFO", "fabric_multimodel")
    clock = iter([0.0, 4.0])
    monkeypatch.setattr(time, "perf_counter", lambda: next(clock))
    progress = Progress(total=7, start=0, every=5, enabled=True, unit="tok")
    progress(3, lambda: pytest.fail("metrics are read only when a line is shown"))
    progress(7, lambda: {"loss": 0.5}, scale=1000)  # not a multiple of `every`, but the last step
    assert _lines(caplog) == ["step 7/7 loss=0.500 1,750 tok/s"]


def test_a_transfer_logs_where_enabled_only(caplog, capsys) -> None:
    caplog.set_level("INFO", "fabric_multimodel")
    transfer_printer("resume", enabled=False)(1, 2, 0.5)
    transfer_printer("resume")(1_000_000, 9_000_000, 8.12)
    assert _lines(caplog) == ["resume: 1.00 of 9.00 MB in 8.1 s"]
    assert capsys.readouterr().out == ""  # the library prints nothing: a script configures its loggers


def test_configure_logging_shows_the_library_lines_on_stdout_once(capsys) -> None:
    logger = logging.getLogger("fabric_multimodel")
    before = (list(logger.handlers), logger.level)
    try:
        configure_logging("INFO")
        configure_logging("INFO")  # a second call adds no second handler
        logging.getLogger("fabric_multimodel.run.progress").debug("hidden at INFO")
        transfer_printer("resume")(1_000_000, 9_000_000, 8.12)
        assert capsys.readouterr().out == "resume: 1.00 of 9.00 MB in 8.1 s\n"
    finally:
        logger.handlers[:], logger.level = before


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="the process's start comes from /proc")
def test_the_start_runs_from_the_process_creation() -> None:
    started = process_started()
    assert started is not None and started <= time.time() and time.time() - started < 24 * 3600
    phases = StartPhases()
    phases.mark("launch")
    assert list(phases.seconds) == ["start", "launch"] and all(s >= 0 for s in phases.seconds.values())
    assert str(phases).startswith("start=") and " launch=" in str(phases)


@given(
    steps=st.integers(1, 10**6),
    wall=st.floats(0, 1e5),
    iters=st.lists(st.floats(1e-4, 10), max_size=5),
    comm=st.integers(0, 10**12),
    rounds=st.integers(0, 10**4),
    memory=st.none() | st.integers(0, 10**11),
    waited=st.none() | st.floats(0, 1e4),
)
def test_the_final_line_reads_back(steps, wall, iters, comm, rounds, memory, waited) -> None:
    line = final_line(steps, "val_loss=1.2345", wall_s=wall, iter_seconds=iters, comm_bytes=comm, rounds=rounds,
                      state_bytes=memory, membership_wait_s=waited)  # fmt: skip
    keys = ["steps", "val_loss", *FINAL_KEYS, *(["state_bytes"] if memory is not None else [])]
    keys += ["membership_wait_s", "process_start"] if waited is not None else []
    final = parse_final_line(f"some output\n{line}\n", keys)
    assert int(final["steps"]) == steps and int(final["comm_bytes"]) == comm and int(final["rounds"]) == rounds
    assert float(final["comm_bytes_per_iter"]) == pytest.approx(comm / steps, abs=0.051)
    assert math.isnan(float(final["iter_ms_median"])) == (not iters)
    if memory is not None:
        assert int(final["state_bytes"]) == memory


def test_a_resume_says_what_travelled_and_what_was_kept() -> None:
    def resumed(own_step: int, kept: tuple[str, ...], sent: int) -> Resumed:
        return Resumed(40, 1, True, {}, {"read": 0.1, "load": 0.25}, sent, kept, own_step)

    assert resumed(40, (), 0).describe({"start": 2.0}) == "seconds: start=2.0 read=0.1 load=0.2"
    assert resumed(40, (), 1_830_000).describe().endswith("; sent 1.83 MB")
    older = resumed(20, ("optimizer",), 1_830_000).describe()
    assert older.endswith("; received 1.83 MB; kept optimizer (its own copy at step 20)")
    assert resumed(-1, ("optimizer",), 5).describe().endswith("kept optimizer (no copy: as built)")
