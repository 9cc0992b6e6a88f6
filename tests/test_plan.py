"""The cost model and ``python -m fabric_multimodel.plan``: the published Streaming DiLoCo simulation reproduced, the
answers consistent with each other, the command fast and torch-free."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.scale import PUBLISHED, TARGETS, paper_settings
from fabric_multimodel.averaging.auto_period import choose_period
from fabric_multimodel.averaging.pacing import paced as paced_periods
from fabric_multimodel.plan.cost_model import (
    PAYLOADS,
    Setting,
    bandwidth_for,
    paced,
    paper,
    recommend,
    round_seconds,
    round_wait,
    run_seconds,
    utilisation,
    wire_bytes,
)
from fabric_multimodel.plan.payloads import SPARSE_CHUNK, max_bytes
from fabric_multimodel.plan.planner import format_bits, main, parse_count
from fabric_multimodel.run.report import parse_final_line

#: The one cell the model misses by more than a step of the paper's grid: 100B streaming at 99%, 13.2 Gbit/s
#: against 19.3 (the model lets each fragment's bytes leave during the whole backward; the simulator evidently not).
MISSED = {(100e9, "streaming", 0.99)}


def test_the_paper_assumptions_reproduce_the_published_simulation() -> None:
    """Every cell of Table 4 within 25% (about one step of its grid), but the one in MISSED (within 35%)."""
    misses = []
    for (params, layers, step_s), rows in PUBLISHED.items():
        settings_ = paper_settings(params, layers, step_s)
        for method, published in rows.items():
            for target, value in zip(TARGETS, published):
                got = bandwidth_for(settings_[method], target, paper(layers)) / 1e9
                bound = 0.35 if (params, method, target) in MISSED else 0.25
                if abs(got / value - 1) > bound:
                    misses.append(f"{params:.0e} {method} {target:.0%}: {got:.2f} against {value}")
    assert not misses, misses


@given(
    params=st.floats(1e5, 1e12),
    step_s=st.floats(1e-3, 10.0),
    fragments=st.sampled_from([1, 2, 4, 8]),
    overlap=st.integers(0, 8),
    sites=st.integers(2, 16),
    payload=st.sampled_from(["fp32", "bf16", "fp8", "fp4"]),
    target=st.floats(0.3, 0.995),
)
def test_the_bandwidth_for_a_target_is_the_least_that_reaches_it(
    params: float, step_s: float, fragments: int, overlap: int, sites: int, payload: str, target: float
) -> None:
    setting = Setting(params, step_s, fragments * (overlap + 2), sites, fragments=fragments, overlap_steps=overlap,
                      comm_dtype=payload)  # fmt: skip
    needed = bandwidth_for(setting, target)
    assert utilisation(setting, needed) >= target
    assert utilisation(setting, needed / 1.001) < target
    # more of the link never computes less; a lower-bit payload never needs more
    assert utilisation(setting, 2 * needed) >= utilisation(setting, needed)
    if payload != "fp4":
        assert bandwidth_for(setting.replace(comm_dtype="fp4"), target) <= needed


@settings(max_examples=40)
@given(
    step_s=st.floats(1e-3, 5.0),
    fragments=st.sampled_from([1, 2, 4, 36]),
    rate=st.floats(1e6, 1e11),
    target=st.floats(0.5, 0.99),
)
def test_a_recommendation_reaches_the_target_and_no_shorter_period_does(
    step_s: float, fragments: int, rate: float, target: float
) -> None:
    setting = Setting(1e9, step_s, fragments * 2, fragments=fragments)
    chosen = recommend(setting, rate, target)
    if chosen is None:  # nothing up to 100,000 steps: not even the fewest bytes with the longest overlap
        longest = setting.replace(period=100_000 // fragments * fragments, comm_dtype="fp4")
        assert utilisation(longest.replace(overlap_steps=longest.period // fragments - 1), rate) < target
        return
    assert chosen.fragments == fragments
    assert utilisation(chosen, rate) >= target * (1 - 1e-9)
    shorter = chosen.period - fragments
    for payload in PAYLOADS:
        for overlap in range(0, 64):
            if fragments * (overlap + 1) > shorter:
                break
            trial = setting.replace(period=shorter, overlap_steps=overlap, comm_dtype=payload)
            assert utilisation(trial, rate) < target, f"{trial} reaches {target} with a shorter period"


@given(
    step_s=st.floats(1e-3, 1.0),
    round_s=st.one_of(st.just(0.0), st.floats(1e-6, 100.0)),
    fragments=st.sampled_from([1, 2, 4]),
    overlap=st.integers(0, 16),
)
def test_period_auto_and_the_plan_agree(step_s: float, round_s: float, fragments: int, overlap: int) -> None:
    """period="auto" chooses what the cost model says reaches 1 / (1 + 5%) for the round it timed."""
    period = choose_period(step_s, round_s, fragments, overlap)
    params = 1e6
    # a link at which a round of this setting takes round_s
    setting = Setting(params, step_s, period, fragments=fragments, overlap_steps=overlap)
    rate = 8 * wire_bytes(setting) / round_s if round_s > 0 else None
    assert rate is None or math.isclose(round_seconds(setting, rate), round_s)
    assert utilisation(setting, rate) >= 1 / 1.05 * (1 - 1e-9)
    if period > fragments * (overlap + 1) and rate is not None:
        assert utilisation(setting.replace(period=period - fragments), rate) < 1 / 1.05


@given(
    periods=st.integers(1, 50),
    fragments=st.sampled_from([1, 2, 4]),
    overlap=st.integers(0, 4),
    warmup=st.integers(0, 30),
    rate=st.floats(1e5, 1e9),
)
def test_a_whole_run_is_its_steady_state_plus_its_warm_up_and_its_end(
    periods: int, fragments: int, overlap: int, warmup: int, rate: float
) -> None:
    setting = Setting(218_496, 0.015, fragments * (overlap + 1) * 2, fragments=fragments, overlap_steps=overlap)
    steps = warmup + periods * setting.period
    end = fragments * round_seconds(setting, rate)  # blocking: the end hides behind nothing
    islands = run_seconds(setting, steps, rate, warmup_steps=warmup)
    local = periods * setting.period * setting.step_s
    assert islands - end == pytest.approx(warmup * setting.step_s + local / utilisation(setting, rate))
    flat = run_seconds(setting, steps, rate, warmup_steps=warmup, warmup_crosses=True)
    synced = Setting(218_496, 0.015, None)
    assert flat - islands == pytest.approx(warmup * round_wait(synced, rate))
    assert run_seconds(setting, steps, None) == steps * setting.step_s


def test_a_low_bit_round_carries_its_block_scales() -> None:
    """Bytes per element: fp32 4, bf16 2, fp8 1 + 2/32, fp4 0.5 + 2/32 (a bf16 scale per 32); 2 sites send all
    of a payload once, 4 sites 1.5 times (a ring's 2 (W - 1) / W)."""
    base = Setting(32_000, 0.01, 8)
    for payload, per_element in (("fp32", 4), ("bf16", 2), ("fp8", 1.0625), ("fp4", 0.5625)):
        assert wire_bytes(base.replace(comm_dtype=payload)) == 32_000 * per_element
    assert wire_bytes(base.replace(sites=4)) == 1.5 * 32_000 * 4
    # synchronous DDP: one ring over all 4 processes of 2 sites, each edge leaving a site carrying 1.5x
    assert wire_bytes(base.replace(period=None, devices=2)) == 1.5 * 32_000 * 4
    assert wire_bytes(base.replace(fragments=4)) == 32_000 * 4 / 4


def test_a_sparse_round_is_priced_at_its_longest_payload_to_each_other_site() -> None:
    """A sparse round sends its payload, at most ``max_bytes``, to each of the other sites (an all-gather), per
    fragment; ``density`` below 1 with a ``comm_dtype`` or without rounds is refused."""
    base = Setting(218_496, 0.015, 128, density=1 / 64)
    payload = max_bytes(218_496, SPARSE_CHUNK, 1 / 64)
    assert wire_bytes(base) == payload and wire_bytes(base.replace(sites=4)) == 3 * payload
    assert wire_bytes(base.replace(fragments=2)) == max_bytes(109_248, SPARSE_CHUNK, 1 / 64)
    assert payload * 8 / 218_496 < 10.5 / 64 + 0.01  # about 10 bits an entry
    for bad in ({"comm_dtype": "fp8"}, {"period": None}, {"density": 0.0}):
        with pytest.raises(ValueError, match="`density`"):
            base.replace(**bad)


def test_a_density_is_recommended_only_when_no_dense_payload_reaches_the_target() -> None:
    """The LM across 4 sites, 90% of its compute, periods up to 512: at 1 Mbit/s fp4 does it; at 100 kbit/s no dense
    payload does, even overlapped all but a step, and a sparse round does."""
    setting = Setting(218_496, 0.015, 128, sites=4)
    assert recommend(setting, 1e6, 0.9, max_period=512).density == 1
    chosen = recommend(setting, 100e3, 0.9, max_period=512)
    assert chosen is not None and chosen.density < 1 and utilisation(chosen, 100e3) >= 0.9
    assert all(utilisation(setting.replace(period=512, overlap_steps=511, comm_dtype=p), 100e3) < 0.9 for p in PAYLOADS)


def test_overlap_hides_a_round_up_to_its_steps() -> None:
    setting = Setting(1e6, 0.1, 64, overlap_steps=3)
    rate = 8 * wire_bytes(setting) / 0.25  # a round of 0.25 s
    assert round_wait(setting, rate) == 0
    assert math.isclose(round_wait(setting.replace(overlap_steps=2), rate), 0.05)
    assert math.isclose(round_wait(setting.replace(overlap_steps=0), rate), 0.25)


@given(
    speeds=st.lists(st.floats(0.05, 20.0), min_size=2, max_size=6),
    period=st.integers(16, 512),
    step_s=st.floats(0.01, 5.0),
)
def test_sites_of_different_speeds_lose_compute_unless_paced_by_speed(
    speeds: list[float], period: int, step_s: float
) -> None:
    """Paced by steps, every site makes the period's steps in the slowest's time: the faster ones idle for the rest.
    Paced by speed, each makes what :func:`fabric_multimodel.averaging.pacing.paced` gives it in the fastest's time."""
    setting = Setting(params=1e9, step_s=step_s, period=period, comm_dtype="fp8")
    waited, share = paced(setting, speeds, pace="steps")
    slowest_s = step_s * max(speeds) / min(speeds)
    assert waited.step_s == pytest.approx(slowest_s) and waited.replace(step_s=step_s) == setting
    could = sum(period * slowest_s / (step_s * max(speeds) / s) for s in speeds)  # each site's steps in that time
    assert share == pytest.approx(len(speeds) * period / could) and share <= 1 + 1e-12
    assert paced(setting, speeds, pace="speed") == (setting, 1.0)
    # By speed, the steps the library's pacing gives each site fill the fastest's time, up to rounding to whole steps.
    periods = paced_periods(period, [1 / s for s in speeds]).periods
    assert sum(periods) == pytest.approx(period * sum(speeds) / max(speeds), abs=len(speeds) / 2 + 1e-9)


@pytest.mark.parametrize(
    ("speeds", "pace", "message"),
    [([1.0, 0.5], "fast", "`pace` must be 'steps' or 'speed'"), ([1.0, 0.0], "steps", "`speeds` must be positive")],
)
def test_paced_refuses_a_pace_or_speeds_it_cannot_read(speeds: list[float], pace: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        paced(Setting(params=1e9, step_s=0.1, period=100), speeds, pace)


@pytest.mark.parametrize(
    ("text", "count"), [("218496", 218_496), ("1e9", 1e9), ("1.5M", 1.5e6), ("10B", 1e10), ("2k", 2e3)]
)
def test_a_count_of_parameters_reads_as_people_write_it(text: str, count: float) -> None:
    assert parse_count(text) == count


def test_rates_read_as_people_write_them() -> None:
    assert format_bits(1.25e9) == "1.25 Gbit/s" and format_bits(7.5e5) == "750 kbit/s"
    assert format_bits(math.inf) == "never"


def test_the_command_answers_in_a_table_and_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    flags = ["--params", "1B", "--step-s", "0.1", "--period", "100", "--fragments", "8", "--overlap-steps", "1"]
    assert main([*flags, "--comm-dtype", "bf16", "--bandwidth", "10gbit", "--target", "0.95"]) == 0
    out = capsys.readouterr().out
    line = parse_final_line(out.replace("plan:", "final:"), ["utilisation", "bandwidth_bits", "round_bytes", "round_s"])
    setting = Setting(1e9, 0.1, 100, fragments=8, overlap_steps=1, comm_dtype="bf16")
    assert float(line["utilisation"]) == pytest.approx(utilisation(setting, 10e9), abs=1e-4)
    assert float(line["bandwidth_bits"]) == pytest.approx(bandwidth_for(setting, 0.95), rel=1e-5)
    assert float(line["round_bytes"]) == wire_bytes(setting)
    assert out.count("| given |") == 1
    assert main([*flags, "--bandwidth", "100mbit", "--target", "0.95", "--recommend"]) == 0
    out = capsys.readouterr().out
    assert out.count("| recommended |") == 1 and "period=" in out.splitlines()[-1]


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--step-s", "0.1", "--bandwidth", "1gbit"], "--params"),
        (["--params", "1B", "--step-s", "0.1"], "--bandwidth"),
        (["--params", "1B", "--step-s", "0.1", "--target", "1.5"], "--target"),
        (["--params", "1B", "--step-s", "0.1", "--target", "0.9", "--recommend"], "--recommend"),
        (
            [
                "--params",
                "1B",
                "--step-s",
                "0.1",
                "--target",
                "0.9",
                "--period",
                "8",
                "--fragments",
                "8",
                "--overlap-steps",
                "1",
            ],
            "--period",
        ),  # fmt: skip
        (["--params", "1B", "--step-s", "0.1", "--bandwidth", "none"], "--bandwidth"),
        (["--params", "many", "--step-s", "0.1", "--target", "0.9"], "--params"),
    ],
)
def test_bad_flags_end_on_one_line_naming_them(
    flags: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(flags)
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert named in last, last


def test_the_command_imports_no_torch() -> None:
    """What keeps ``--help`` under a second: no torch (its import alone takes seconds)."""
    done = subprocess.run([sys.executable, "-m", "fabric_multimodel.plan", "--help"], capture_output=True, text=True)
    assert done.returncode == 0 and "--recommend" in done.stdout
    probe = "import sys, fabric_multimodel.plan.planner\n"
    probe += "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True).stdout.strip() == "[]"


def test_the_scale_benchmark_prints_both_tables(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(Path(__file__).parent.parent / "benchmarks" / "scale.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    )
    written = (tmp_path / "scale.md").read_text()
    assert done.stdout.strip() == written.strip()
    published = sum(len(methods) for methods in PUBLISHED.values())
    assert written.count(" / ") >= published * len(TARGETS)  # every published cell beside the model's
    assert written.count("streaming, overlap 1, fp8") == 3  # fp8, which the paper's table lacks, at each size
    # A site at half speed: paced by steps, a share of 2/3 reaches no target; paced by speed, the fp8 row's figures.
    rows = {tuple(cell.strip() for cell in line.split("|")[1:3]): line.split("|")[3:] for line in written.splitlines()}
    for size in ("1B", "10B", "100B"):
        assert (
            rows[(size, 'the fp8 row, one site at half speed, pace="speed"')]
            == rows[(size, "streaming, overlap 1, fp8")]
        )
        assert [c.strip() for c in rows[(size, 'the fp8 row, one site at half speed, pace="steps"')]] == [
            *["never (at most 67%)"] * 3,
            "never",
            "",
        ]
