"""period="auto": the smallest period whose rounds hide behind compute, chosen at the end of warm-up from the
measured step and link, the same on every rank, kept by checkpoints."""

from __future__ import annotations

import functools
import time

import pytest
import torch
from hypothesis import assume, example, given
from hypothesis import strategies as st
from torch import nn

from fabric_multimodel import Averager, AveragerConfig, setup_models
from fabric_multimodel.averaging.auto_period import HEADROOM, TOLERANCE, PeriodChoice, choose_overlap, choose_period
from tests.gan import collectives

NESTEROV = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
WIDTH = 16384  # a round of 0.5 MB: a few ms on loopback, beside a step of a few ms


def overhead(period: int, step_s: float, round_s: float, fragments: int, overlap: int) -> float:
    """What a period's rounds add to its compute time, as a share of it."""
    waited = max(0.0, round_s - overlap * step_s)
    return fragments * waited / (period * step_s)


@given(step_s=st.floats(1e-3, 2.0), round_s=st.floats(0.0, 60.0), overlap=st.integers(0, 16))
@example(step_s=1e-3, round_s=1e-12, overlap=0)  # a round of almost nothing still waits, without overlap
def test_the_choice_says_which_overlap_would_hide_a_round_that_waits(step_s, round_s, overlap):
    assume(abs(round_s - overlap * step_s) > 1e-6 * round_s)  # not at the edge, where rounding decides
    choice = PeriodChoice(choose_period(step_s, round_s, 4, overlap), step_s, round_s, 1000, overlap)
    waits = round_s > overlap * step_s
    assert ("would hide it" in str(choice)) == waits, str(choice)
    if waits:
        needed = choice.hiding_overlap
        assert needed * step_s >= round_s * (1 - 1e-6) and (needed - 1) * step_s < round_s
        assert f"overlap_steps >= {needed} " in str(choice)
        assert "would hide" not in str(choice._replace(overlap_steps=needed))  # with it, no advice


@given(
    step_s=st.floats(1e-4, 2.0),
    round_s=st.floats(0.0, 60.0),
    fragments=st.sampled_from([1, 2, 4, 8]),
    overlap=st.integers(0, 16),
)
@example(step_s=1e-4, round_s=17.544680017092958, fragments=1, overlap=0)  # millions of steps: a relative margin
def test_the_chosen_period_is_the_smallest_that_hides_its_rounds(step_s, round_s, fragments, overlap):
    period = choose_period(step_s, round_s, fragments, overlap)
    assert period % fragments == 0 and period // fragments > overlap  # a valid schedule

    def fits(p: int) -> bool:
        hidden = overhead(p, step_s, round_s, fragments, overlap) <= TOLERANCE * (1 + 1e-9)
        one_at_a_time = not overlap or (p / fragments) * step_s >= round_s * (1 - 1e-9)
        return hidden and one_at_a_time and p // fragments > overlap

    assert fits(period)
    assert period == fragments * (overlap + 1) or not fits(period - fragments)  # nothing smaller fits


@given(step_s=st.floats(1e-4, 2.0), round_s=st.floats(0.0, 60.0), fragments=st.sampled_from([1, 2, 4, 8]))
def test_an_overlap_chosen_from_the_link_hides_its_round_and_allows_the_shortest_period(step_s, round_s, fragments):
    overlap = choose_overlap(step_s, round_s)
    needed = HEADROOM * round_s
    assert overlap >= 1 and overlap * step_s >= needed * (1 - 1e-9)
    assert overlap == 1 or (overlap - 1) * step_s < needed * (1 + 1e-9)  # no longer than it must be
    # Hidden with room to spare, so the period is the shortest that overlap allows, and the text gives no advice.
    period = choose_period(step_s, round_s, fragments, overlap)
    assert period == fragments * (overlap + 1)
    assert "would hide" not in str(PeriodChoice(period, step_s, round_s, 1000, overlap))


@pytest.mark.parametrize(
    "options, message",
    [
        ({"period": "auto", "warmup_steps": 1}, "needs `warmup_steps` >= 2"),
        ({"period": "auto", "warmup_steps": 4, "node_period": 2}, "no `node_period`"),
        ({"period": "fast"}, "`period` must be an int"),
        ({"period": 8, "overlap_steps": "auto"}, "`overlap_steps='auto'` is chosen with the period"),
        ({"period": "auto", "warmup_steps": 4, "overlap_steps": "soon"}, "`overlap_steps` must be an int"),
    ],
)
def test_period_auto_needs_a_warmup_to_time(options, message):
    with pytest.raises((TypeError, ValueError), match=message):
        AveragerConfig(**options)


def auto_run(fabric, width: int, steps: int, options: dict):
    """Train with period="auto": what was chosen, the collectives of the step that chose it, the steps that
    started a round; then a fresh Averager loads the state and schedules the same period, with no collective."""
    torch.manual_seed(0)
    (model,) = setup_models(fabric, m=nn.Sequential(nn.Linear(4, width), nn.Linear(width, 4)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    averager = Averager(fabric, model, period="auto", **options)
    rounds, counted = [], []
    with averager:
        for step in range(1, steps + 1):
            fabric.backward(model(torch.randn(2, 4)).sum())
            optimizer.step()
            optimizer.zero_grad()
            time.sleep(0.002)  # a step of at least 2 ms: short beside a round of the model, so the period is > 1
            if step == averager.warmup_steps:
                counted = collectives(averager.step)
            elif averager.step():
                rounds.append(step)
        state = averager.state_dict()
    again = Averager(fabric, model, period="auto", **options)
    loaded = collectives(again.load_state_dict, state)
    return averager.period_choice, counted, rounds, (again.period, again.overlap_steps), loaded


@pytest.mark.parametrize("fragments, overlap_steps", [(1, 0), (2, 0), (2, "auto")])
def test_period_auto_is_chosen_once_alike_everywhere_and_resumed(worlds, fragments, overlap_steps):
    options = {"warmup_steps": 3, "outer_optimizer": NESTEROV, "fragments": fragments, "overlap_steps": overlap_steps}
    results = worlds(2).run(auto_run, WIDTH, 40, options)
    choices = {result[0] for result in results}
    assert len(choices) == 1  # every rank chose the same, from the slowest rank's figures
    ((period, step_s, round_s, sent, overlap),) = choices
    parameters = 4 * WIDTH + WIDTH + WIDTH * 4 + 4
    assert step_s >= 0.002 and round_s > 0 and 4 * parameters // (2 * fragments) < sent < 4 * parameters + 1000
    if overlap_steps == "auto":  # the overlap first, from the same figures, then the shortest period it allows
        assert overlap == choose_overlap(step_s, round_s) and period == fragments * (overlap + 1)
    else:  # blocking rounds: the choice says which overlap would hide them
        assert overlap == 0
    assert period == choose_period(step_s, round_s, fragments, overlap)
    for _, counted, rounds, resumed, loaded in results:
        # The choice: a lined-up, timed allreduce of a round's size, twice (4), and one allreduce of the figures.
        names = [name for name, _ in counted]
        assert names.count("gloo:all_reduce") == 5, counted
        assert [n for name, n in counted if n * 4 >= sent // 2] and len(counted) == 5
        spacing = period // fragments
        assert rounds == [s for s in range(4, 41) if (s - 3) % spacing == 0], (period, rounds)
        assert resumed == (period, overlap) and loaded == []


def load_choices(fabric, saved_choices: list):
    """A state whose ``period_choice`` is each of ``saved_choices`` loaded into an Averager with
    overlap_steps="auto": the period and overlap it schedules, or the error."""
    torch.manual_seed(0)
    (model,) = setup_models(fabric, m=nn.Linear(4, 4))
    options = {"period": "auto", "warmup_steps": 3, "fragments": 2, "overlap_steps": "auto"}
    state = Averager(fabric, model, **options).state_dict()
    out = []
    for saved in saved_choices:
        averager = Averager(fabric, model, **options)
        try:
            averager.load_state_dict(
                {**state, "steps": 10, "rounds": 2, "period_choice": saved, "warmup_step_s": [0.1]}
            )
            out.append((averager.period, averager.overlap_steps, averager.schedule.overlap_steps))
        except ValueError as error:
            out.append(str(error))
    return out


def test_a_chosen_overlap_is_resumed_from_the_state(worlds):
    chosen = [12, 0.01, 0.04, 1000, 5]  # period 12 = 2 fragments x (overlap 5 + 1)
    older = chosen[:4]  # saved before the overlap was part of the choice
    too_short = [8, 0.01, 0.04, 1000, 5]  # a period the overlap does not fit in
    resumed, missing, refused = worlds(2).run(load_choices, [chosen, older, too_short])[0]
    assert resumed == (12, 5, 5)
    assert "needs the chosen overlap" in missing and "found None" in missing
    assert "a multiple of 2 of at least 12" in refused
