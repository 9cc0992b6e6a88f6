"""pace="speed": a slower site runs fewer local steps per round, in proportion to its speed measured in warm-up;
every site takes part in the same rounds, and a round weights each site by the steps behind it."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from fabric_multimodel import Averager, AveragerConfig, replicas_in_sync, setup_models
from fabric_multimodel.averaging.pacing import gather_step_times, last_round, paced, paced_steps, rounds_origin
from fabric_multimodel.rounds.schedule import Schedule
from tests.gan import collectives

WARMUP, PERIOD = 4, 8
SLEEP_S = (0.01, 0.04)  # rank 1's steps take 4 times as long: about 2 local steps per round to rank 0's 8


@given(period=st.integers(1, 512), step_s=st.lists(st.floats(1e-4, 10.0), min_size=1, max_size=8))
def test_the_fastest_site_runs_the_period_and_the_others_in_proportion(period, step_s):
    pace = paced(period, step_s)
    assert pace.periods[step_s.index(min(step_s))] == period
    assert all(1 <= p <= period for p in pace.periods)
    for (s_a, p_a), (s_b, p_b) in zip(zip(step_s, pace.periods), zip(step_s[1:], pace.periods[1:])):
        assert (s_a <= s_b) <= (p_a >= p_b)  # slower never runs more steps
    assert sum(pace.weights) == pytest.approx(1.0)
    assert all(w == pytest.approx(p / sum(pace.periods)) for w, p in zip(pace.weights, pace.periods))


def rounds_of(steps: int, warmup: int, period: int) -> int:
    """The rounds a site takes part in over ``steps`` step() calls: its schedule's, and past warm-up the one on
    leaving the Averager's block."""
    schedule = Schedule(period, warmup)
    scheduled = sum(any(e.kind == "round" for e in schedule.at(s)) for s in range(1, steps + 1))
    return scheduled + (steps >= warmup)


@given(
    fastest=st.integers(1, 64),
    data=st.data(),
    warmup=st.integers(0, 20),
    total=st.integers(1, 400),
)
def test_paced_steps_take_part_in_the_same_rounds_as_the_fastest_site(fastest, data, warmup, total):
    period = data.draw(st.integers(1, fastest))
    steps = paced_steps(total, warmup, period, fastest)
    assert steps <= total
    assert rounds_of(steps, warmup, period) == rounds_of(total, warmup, fastest)


@given(fastest=st.integers(2, 24), data=st.data(), warmup=st.integers(2, 8), total=st.integers(30, 300))
def test_a_pace_agreed_again_keeps_every_site_in_the_same_rounds(fastest, data, warmup, total):
    """Under a membership the sites agree their pace again at some rounds, and a site may join after one (entering
    the next round as the fastest would, at its next step, with the fastest's steps per round): every site still
    takes part in the same rounds to the end of the run, and the fastest makes the run's steps."""
    scheduled = (total - warmup) // fastest  # the run's rounds; the last site joins after one, when there is one
    sites = data.draw(st.integers(2, 3)) if scheduled else 2

    def periods() -> list[int]:  # site 0 stays the fastest
        return [fastest] + [data.draw(st.integers(1, fastest)) for _ in range(sites - 1)]

    changes = {r: periods() for r in data.draw(st.sets(st.integers(1, 12), max_size=3))}
    joins = data.draw(st.integers(1, scheduled)) if scheduled else None  # after the last: the block's round next
    start = periods()
    rounds_made = []
    for site in range(sites):
        period, since, rounds, steps = start[site], (warmup, warmup), 0, 0
        schedule = Schedule(period, warmup)
        if site == sites - 1 and joins:  # it enters after round `joins`, a step before the fastest site's next round
            period, rounds, steps = fastest, joins, warmup + (joins + 1) * fastest - 1
            since = (steps + 1, steps + 1)
            schedule = Schedule(period, rounds_origin(since[0], steps, period), ends_warmup=False)
        while steps < paced_steps(total, warmup, period, fastest, since=since):
            steps += 1
            if any(e.kind == "round" for e in schedule.at(steps)):
                rounds += 1
                if rounds in changes:
                    since, period = last_round(since, period, fastest, steps), changes[rounds][site]
                    assert since[0] == steps
                    schedule = Schedule(period, rounds_origin(since[0], steps, period), ends_warmup=False)
        rounds_made.append(rounds)
        if site == 0:
            assert steps == total
    assert len(set(rounds_made)) == 1, rounds_made


def test_a_site_that_joins_after_the_last_round_makes_no_step_before_the_blocks_round():
    """Found by the test above in CI (fastest 14, warm-up 3, 30 steps: one round, at 17): a site that joins after it
    enters at step 30, a step before a round at 31 the run never has; it ends there, so that its next round is the
    members' on leaving the block."""
    assert paced_steps(30, 3, 14, 14, since=(31, 31)) == 30
    assert paced_steps(30, 3, 7, 14, since=(24, 31)) == 23  # at half the pace: its virtual round at 17 + 6


@pytest.mark.parametrize(
    ("options", "mentions"),
    [
        ({"pace": "fast"}, "`pace` must be 'steps'"),
        ({"pace": "speed", "warmup_steps": 1}, "`warmup_steps` >= 2"),
        ({"pace": "speed", "warmup_steps": 4, "fragments": 2}, "no `fragments`, `overlap_steps`"),
        ({"pace": "speed", "warmup_steps": 4, "overlap_steps": 1}, "no `fragments`, `overlap_steps`"),
        ({"pace": "speed", "warmup_steps": 4, "comm_dtype": torch.float8_e4m3fn}, "low-bit `comm_dtype`"),
        ({"pace": "speed", "warmup_steps": 4, "period": "auto"}, "a number `period`"),
    ],
)
def test_pace_mistakes_name_the_option(options, mentions):
    with pytest.raises(ValueError, match=mentions.replace("(", r"\(")):
        AveragerConfig(**({"period": 8} | options))


def sites_of_one(fabric):
    """Two ranks as two sites of one process each (DDP inside each, so the warm-up does not cross sites)."""
    sites = [dist.new_group([0]), dist.new_group([1])]
    return sites[fabric.global_rank]


def paced_run(fabric, options: dict, total: int):
    """Each rank adds its own constant to the parameters every step (rank r: r + 1), its steps slowed by its sleep;
    returns the pace, the steps it made, the rounds, the final parameter and whether the replicas agree."""
    torch.manual_seed(0)
    (model,) = setup_models(fabric, m=nn.Linear(3, 1, bias=False), process_group=sites_of_one(fabric))
    start = model.weight.detach().clone()
    increment = float(fabric.global_rank + 1)
    steps, last, clocks = 0, total, []
    with Averager(fabric, model, period=PERIOD, warmup_steps=WARMUP, pace="speed", **options) as averager:
        while steps < last:
            time.sleep(SLEEP_S[fabric.global_rank])
            with torch.no_grad():
                model.weight.add_(increment)
            steps += 1
            if averager.step():
                clocks.append(averager.clock(steps))
            last = averager.local_steps(total)
    in_sync = bool(replicas_in_sync(fabric, model))
    found = {"pace": averager.pace, "steps": steps, "rounds": averager.rounds, "in_sync": in_sync, "clocks": clocks}
    found |= {"moved": (model.weight.detach() - start).flatten().tolist()}
    found["gather"] = collectives(gather_step_times, 0.01, fabric.device, None, None)
    # A checkpoint keeps the pace: a fresh Averager that loads it runs this site's steps per round at once.
    state = averager.state_dict()
    again = Averager(fabric, model, period=PERIOD, warmup_steps=WARMUP, pace="speed", **options)
    again.load_state_dict(state)
    found["resumed"] = (again.pace, again.period, again.local_steps(total))
    other = Averager(fabric, model, period=2 * PERIOD, warmup_steps=WARMUP, pace="speed", **options)
    try:
        other.load_state_dict(state)
    except ValueError as error:
        found["refused"] = str(error)
    return found


@pytest.mark.parametrize("options", [{}, {"comm_dtype": torch.float32}], ids=["mean", "deltas"])
def test_a_slow_site_runs_fewer_steps_and_counts_for_them(worlds, options):
    total = WARMUP + 2 * PERIOD + 3  # two rounds and the one when leaving the block
    runs = worlds(2).run(paced_run, options, total)
    fast, slow = runs
    assert fast["pace"] == slow["pace"]  # agreed
    periods, weights = fast["pace"].periods, fast["pace"].weights
    assert periods[0] == PERIOD and 1 <= periods[1] < PERIOD, fast["pace"]
    assert fast["steps"] == total and slow["steps"] == paced_steps(total, WARMUP, periods[1], PERIOD) < total
    assert fast["rounds"] == slow["rounds"] == 3 and fast["in_sync"] and slow["in_sync"]
    # after each round both sites read the same clock: the fastest site's step there
    assert fast["clocks"] == slow["clocks"] == [WARMUP + PERIOD, WARMUP + 2 * PERIOD]
    # Each round is the mean of the sites weighted by their local steps per round (the last one's too): after the
    # last, both replicas moved by the weighted sum of what each site moved (its steps times its increment).
    assert weights == pytest.approx((periods[0] / sum(periods), periods[1] / sum(periods)))
    moved = weights[0] * fast["steps"] * 1.0 + weights[1] * slow["steps"] * 2.0
    assert fast["moved"] == pytest.approx([moved] * 3, rel=1e-6)
    # The agreement: one all-gather of one value per site (sites of one process: no MAX inside the site).
    assert fast["gather"] == [("gloo:all_gather", 1)], fast["gather"]
    for run in runs:
        assert run["resumed"] == (run["pace"], run["pace"].periods[runs.index(run)], run["steps"])
        assert "`pace` was agreed by 2 sites with another period" in run["refused"]
