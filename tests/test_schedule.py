"""The schedule on its own: which fragment rounds, launches, exchanges and merges at which step (no processes)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from fabric_multimodel.rounds.schedule import Event, Schedule


@st.composite
def schedules(draw) -> Schedule:
    fragments = draw(st.integers(1, 6))
    period = fragments * draw(st.integers(1, 8))
    overlap = draw(st.integers(0, period // fragments - 1))
    two_level = not overlap and fragments == 1 and draw(st.booleans())
    node_period = draw(st.sampled_from([d for d in range(1, period + 1) if period % d == 0])) if two_level else None
    return Schedule(
        period,
        draw(st.integers(0, 20)),
        fragments=fragments,
        overlap_steps=overlap,
        node_period=node_period,
        phases=draw(st.sampled_from([1, 2])),
        ends_warmup=draw(st.booleans()),  # False: a schedule begun in the local phase (a pace agreed again)
    )


def timeline(schedule: Schedule, steps: int) -> list[tuple[int, Event]]:
    return [(step, event) for step in range(1, steps + 1) for event in schedule.at(step)]


@settings(max_examples=300, deadline=None)
@given(schedule=schedules(), cycles=st.integers(1, 4))
def test_every_fragment_rounds_once_per_period_at_its_offset(schedule, cycles):
    steps = schedule.warmup_steps + cycles * schedule.period
    starts = [(s, e) for s, e in timeline(schedule, steps) if e.kind in ("round", "launch")]
    local = [s - schedule.warmup_steps for s, _ in starts]
    # One round every period / F local steps, fragments in turn: fragment f at (f + 1) * period / F + k * period.
    assert local == [schedule.spacing * (i + 1) for i in range(cycles * schedule.fragments)]
    assert [e.fragment for _, e in starts] == [i % schedule.fragments for i in range(len(starts))]
    for s, e in starts:
        assert (s - schedule.warmup_steps - schedule.offset(e.fragment)) % schedule.period == 0
        assert e.first == (s - schedule.warmup_steps == schedule.offset(e.fragment))
        assert e.kind == ("launch" if schedule.overlap_steps else "round")


@settings(max_examples=300, deadline=None)
@given(schedule=schedules(), cycles=st.integers(1, 4))
def test_an_overlapped_round_is_merged_after_its_delay_one_in_flight_at_a_time(schedule, cycles):
    steps = schedule.warmup_steps + cycles * schedule.period + schedule.overlap_steps
    in_flight: tuple[int, int] | None = None  # (fragment, launched at)
    exchanged = False
    for step, event in timeline(schedule, steps):
        if event.kind == "launch":
            assert in_flight is None, "one fragment in flight at a time"
            in_flight, exchanged = (event.fragment, step), False
        elif event.kind == "exchange":
            assert in_flight is not None and in_flight[0] == event.fragment and not exchanged
            assert step == in_flight[1] + schedule.overlap_steps // 2 and schedule.phases == 2
            exchanged = True
        elif event.kind == "merge":
            assert in_flight is not None and in_flight[0] == event.fragment
            assert step == in_flight[1] + schedule.overlap_steps
            assert exchanged == (schedule.phases == 2 and schedule.overlap_steps >= 2)
            in_flight = None
    assert in_flight is None


@settings(max_examples=200, deadline=None)
@given(schedule=schedules(), extra=st.integers(0, 50))
def test_warmup_is_silent_and_ends_once(schedule, extra):
    events = timeline(schedule, schedule.warmup_steps + extra)
    warmup = [(s, e) for s, e in events if s <= schedule.warmup_steps]
    ends = schedule.warmup_steps and schedule.ends_warmup
    assert warmup == ([(schedule.warmup_steps, Event("local"))] if ends else [])
    assert all(e.kind != "local" for s, e in events if s > schedule.warmup_steps)


@settings(max_examples=200, deadline=None)
@given(schedule=schedules(), cycles=st.integers(1, 3))
def test_node_rounds_fall_between_the_world_rounds(schedule, cycles):
    steps = schedule.warmup_steps + cycles * schedule.period
    nodes = [s - schedule.warmup_steps for s, e in timeline(schedule, steps) if e.kind == "node"]
    every = schedule.node_period
    expected = [t for t in range(1, cycles * schedule.period + 1) if every and t % every == 0 and t % schedule.period]
    assert nodes == expected


def test_one_fragment_is_todays_schedule():
    schedule = Schedule(period=4, warmup_steps=2)
    assert [(s, e.kind) for s, e in timeline(schedule, 14)] == [
        (2, "local"),
        (6, "round"),
        (10, "round"),
        (14, "round"),
    ]
    streaming = Schedule(period=8, warmup_steps=0, fragments=4, overlap_steps=1)
    assert [(s, e.kind, e.fragment) for s, e in timeline(streaming, 9)] == [
        (2, "launch", 0), (3, "merge", 0), (4, "launch", 1), (5, "merge", 1), (6, "launch", 2), (7, "merge", 2),
        (8, "launch", 3), (9, "merge", 3),
    ]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(schedule=schedules(), steps=st.integers(0, 100))
def test_next_round_is_the_first_round_or_launch_after_a_step(schedule, steps):
    """Where a site that received the others' state at ``steps`` enters their next round."""
    horizon = steps + schedule.warmup_steps + 2 * schedule.period
    later = [s for s, e in timeline(schedule, horizon) if s > steps and e.kind in ("round", "launch")]
    assert schedule.next_round(steps) == later[0]
