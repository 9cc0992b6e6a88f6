"""Streaming rounds (``fragments``): one fragment per round, its payload, its merge, sync, resume, bad input.

Real gloo worlds of 2 and 4 ranks. The model here is an MLP whose parameters split into fragments
at tensor boundaries; collectives are counted by wrapping ``torch.distributed``.
"""

from __future__ import annotations

import copy
import functools
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from fabric_multimodel import Averager, replicas_in_sync, setup_models
from fabric_multimodel.rounds.fragments import fragment_indices
from fabric_multimodel.rounds.header import Header
from tests.gan import mlp
from tests.worlds import errors_of, in_step

HALF_SGD = functools.partial(torch.optim.SGD, lr=0.5)  # an outer step we can compute by hand
NESTEROV = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
SIZES = [3, 6, 5, 2]  # 6 parameter tensors: 18, 6, 30, 5, 10, 2 elements


def model() -> nn.Module:
    torch.manual_seed(0)
    return mlp(SIZES)


def tensors_of(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone().double() for p in module.parameters()]


def gather_mean(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    out = []
    for t in tensors:
        everyone = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, t.contiguous())
        out.append(torch.stack(everyone).mean(0))
    return out


def local_update(fabric, module: nn.Module, step: int) -> None:
    """A known, rank-dependent change standing in for an optimizer step."""
    with torch.no_grad():
        for i, p in enumerate(module.parameters()):
            p.add_(0.01 * (fabric.global_rank + 1) * (step % 5 + 1) * (i + 1))


# --- the split -----------------------------------------------------------------------------------


@given(sizes=st.lists(st.integers(1, 50), min_size=1, max_size=12), data=st.data())
def test_an_int_splits_into_runs_of_consecutive_tensors_of_about_equal_size(sizes, data):
    count = data.draw(st.integers(1, len(sizes)))
    params = [torch.zeros(n) for n in sizes]
    groups = fragment_indices(params, [str(i) for i in range(len(sizes))], count)
    assert [i for group in groups for i in group] == list(range(len(sizes)))  # in module order, each once
    assert len(groups) == count and all(groups)
    # Each cut is the tensor boundary nearest to its share of the elements (given the cuts before it).
    total = sum(sizes)
    for k in range(1, count):
        cut = groups[k][0]
        done = sum(sizes[:cut])
        low, high = groups[k - 1][0] + 1, len(sizes) - (count - k)
        best = min(abs(sum(sizes[:j]) - k * total / count) for j in range(low, high + 1))
        assert abs(done - k * total / count) == best


# --- the schedule in a real world: which fragment, when, how many bytes ----------------------------


def fragment_payloads(fabric, period, fragments, overlap_steps, warmup_steps, steps, outer):
    (m,) = setup_models(fabric, m=model())
    calls: list[tuple[int, int]] = []  # (step, elements) of every all_reduce
    original = dist.all_reduce
    step_now = [0]

    def counting(tensor, *args, **kwargs):
        calls.append((step_now[0], tensor.numel()))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        averager = Averager(
            fabric,
            m,
            period=period,
            warmup_steps=warmup_steps,
            fragments=fragments,
            overlap_steps=overlap_steps,
            outer_optimizer=NESTEROV if outer else None,
        )
        calls.clear()
        with averager:
            for step in range(1, steps + 1):
                if step > warmup_steps:  # in warm-up, DDP keeps the replicas identical
                    local_update(fabric, m, step)
                step_now[0] = step
                averager.step()
            step_now[0] = -1  # leaving the block
        sizes = [sum(averager._round.parts[f].sizes) for f in range(averager.fragments)]
    finally:
        dist.all_reduce = original
    return calls, sizes, averager.traffic.bytes, bool(replicas_in_sync(fabric, m))


@pytest.mark.parametrize("size", [2, 4])
@given(
    fragments=st.integers(1, 4),
    periods=st.integers(1, 3),
    overlap=st.integers(0, 3),
    warmup_steps=st.integers(0, 3),
    cycles=st.integers(1, 2),
    outer=st.booleans(),
)
def test_each_round_sends_one_fragment_at_its_step(
    worlds, size, fragments, periods, overlap, warmup_steps, cycles, outer
):
    period = fragments * periods
    overlap = min(overlap, period // fragments - 1)
    steps = warmup_steps + cycles * period
    calls, sizes, sent, in_sync = worlds(size).run(
        fragment_payloads, period, fragments, overlap, warmup_steps, steps, outer
    )[0]
    header = Header.SLOTS * size
    scheduled = [
        (s, ((s - warmup_steps) // (period // fragments) - 1) % fragments)
        for s in range(warmup_steps + 1, steps + 1)
        if (s - warmup_steps) % (period // fragments) == 0
    ]
    # Only the scheduled rounds, each its fragment and the header (warm-up's gradients go through DDP's
    # C++ reducer, which this wrapper does not see: the Averager itself sends nothing in warm-up).
    assert [(s, n) for s, n in calls if s >= 0] == [(s, sizes[f] + header) for s, f in scheduled]
    # Leaving the block: a round of every fragment, each its own size.
    assert [n for s, n in calls if s < 0] == [n + header for n in sizes]
    assert sum(sizes) == sum(p.numel() for p in model().parameters())
    assert sent == 4 * sum(n for _, n in calls)
    assert in_sync


# --- the merge, fragment by fragment ---------------------------------------------------------------


def merges_match_the_formulas(fabric, period, fragments, overlap_steps, mixing):
    (m,) = setup_models(fabric, m=model())
    averager = Averager(
        fabric,
        m,
        period=period,
        fragments=fragments,
        overlap_steps=overlap_steps,
        outer_optimizer=HALF_SGD,
        mixing=mixing,
    )
    groups = fragment_indices(list(m.parameters()), [str(i) for i in range(6)], fragments)
    spacing = period // fragments
    anchor = tensors_of(m)
    errors, launched = [], {}
    with averager:
        for step in range(1, 2 * period + overlap_steps + 1):
            local_update(fabric, m, step)
            before = tensors_of(m)
            if averager.step():
                fragment = (step // spacing - 1) % fragments
                merged = fragment, before, gather_mean(before)
                if overlap_steps:  # launched: nothing changes until the merge
                    launched[step + overlap_steps] = merged
                    assert all(torch.equal(a, b) for a, b in zip(tensors_of(m), before))
                    continue
            elif step in launched:
                merged = launched.pop(step)
            else:
                continue
            fragment, snapshot, mean_snapshot = merged
            for i, (a, b, s, ms) in enumerate(zip(tensors_of(m), before, snapshot, mean_snapshot)):
                if i not in groups[fragment]:  # the other fragments: untouched by this round
                    errors.append((a - b).abs().max().item())
                    continue
                anchor[i] = anchor[i] - 0.5 * (anchor[i] - ms)  # outer SGD on the fragment's mean pseudo-gradient
                if not overlap_steps:
                    expected = anchor[i]
                elif mixing is None:
                    expected = anchor[i] + (b - s)
                else:
                    expected = (1 - mixing) * anchor[i] + mixing * b
                errors.append((a - expected).abs().max().item())
    return max(errors), bool(replicas_in_sync(fabric, m))


@pytest.mark.parametrize("size", [2, 4])
@given(
    fragments=st.integers(2, 3),
    periods=st.integers(1, 2),
    overlap=st.integers(0, 2),
    mixing=st.sampled_from([None, 0.0, 0.5]),
)
def test_a_fragment_round_moves_its_fragment_only_by_the_formula(worlds, size, fragments, periods, overlap, mixing):
    period = fragments * periods * 2
    overlap = min(overlap, period // fragments - 1)
    mixing = mixing if overlap else None
    for error, in_sync in worlds(size).run(merges_match_the_formulas, period, fragments, overlap, mixing):
        assert error < 1e-6 and in_sync


# --- sync() and checkpoints: every fragment at once, bitwise resume anywhere in the cycle -----------


def resume_mid_cycle(fabric, period, fragments, overlap_steps, split, extra, outer):
    def build():
        (m,) = setup_models(fabric, m=model())
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
        options = {"outer_optimizer": NESTEROV} if outer else {}
        averager = Averager(
            fabric, m, period=period, warmup_steps=2, fragments=fragments, overlap_steps=overlap_steps, **options
        )
        return m, opt, averager

    def run(m, opt, averager, start, stop, trace):
        for step in range(start, stop):
            data = torch.Generator().manual_seed(100 * step + fabric.global_rank)
            fabric.backward(nn.functional.mse_loss(m(torch.randn(4, 3, generator=data)), torch.zeros(4, 2)))
            opt.step()
            opt.zero_grad()
            averager.step()
            trace.append(tensors_of(m))

    m, opt, averager = build()
    uninterrupted: list = []
    with averager:
        run(m, opt, averager, 0, split, [])
        averager.sync()
        synced = bool(replicas_in_sync(fabric, m))
        saved = copy.deepcopy({"m": m.state_dict(), "opt": opt.state_dict(), "averager": averager.state_dict()})
        run(m, opt, averager, split, split + extra, uninterrupted)
    m, opt, averager = build()
    m.load_state_dict(saved["m"])
    opt.load_state_dict(saved["opt"])
    averager.load_state_dict(saved["averager"])
    resumed: list = []
    with averager:
        run(m, opt, averager, split, split + extra, resumed)
    same = all(torch.equal(a, b) for x, y in zip(uninterrupted, resumed) for a, b in zip(x, y))
    return synced, same and len(resumed) == extra


@pytest.mark.parametrize("size", [2, 4])
@given(
    fragments=st.integers(2, 3),
    overlap=st.integers(0, 1),
    split=st.integers(3, 14),
    extra=st.integers(1, 10),
    outer=st.booleans(),
)
def test_sync_makes_replicas_identical_and_resumes_bitwise_at_any_point_of_the_cycle(
    worlds, size, fragments, overlap, split, extra, outer
):
    period = 2 * fragments
    for synced, same in worlds(size).run(resume_mid_cycle, period, fragments, overlap, split, extra, outer):
        assert synced and same


# --- groups chosen by the user ---------------------------------------------------------------------


def strided_groups(fabric):
    (m,) = setup_models(fabric, m=model())
    layers = [layer for layer in m.module if isinstance(layer, nn.Linear)]
    groups = [[layers[0], layers[2]], [layers[1]]]  # strided, as with transformer blocks
    averager = Averager(fabric, m, period=4, fragments=groups, outer_optimizer=NESTEROV)
    order = [p.shape for p in averager._round.params]  # the outer optimizer sees the modules' order
    with averager:
        for step in range(1, 9):
            local_update(fabric, m, step)
            averager.step()
    return order == [p.shape for p in m.parameters()], [sum(part.sizes) for part in averager._round.parts]


def test_a_list_of_groups_sets_the_fragments(worlds):
    for in_module_order, sizes in worlds(2).run(strided_groups):
        assert in_module_order
        assert sizes == [18 + 6 + 10 + 2, 30 + 5]


# --- bad input: clear errors on every rank, before any collective ---------------------------------


def bad_fragments(fabric):
    (m,) = setup_models(fabric, m=model())
    layers = [layer for layer in m.module if isinstance(layer, nn.Linear)]
    calls = {
        "period not a multiple": lambda: Averager(fabric, m, period=6, fragments=4),
        "overlap too long": lambda: Averager(fabric, m, period=8, fragments=4, overlap_steps=2),
        "too many": lambda: Averager(fabric, m, period=7, fragments=7),
        "empty group": lambda: Averager(fabric, m, period=4, fragments=[layers, []]),
        "overlapping groups": lambda: Averager(fabric, m, period=4, fragments=[layers[:2], layers[1:]]),
        "missing": lambda: Averager(fabric, m, period=4, fragments=[layers[:1], layers[1:2]]),
        "foreign": lambda: Averager(fabric, m, period=4, fragments=[layers, [nn.Linear(1, 1)]]),
        "not a count": lambda: Averager(fabric, m, period=4, fragments="2"),
        "with optimizers": lambda: Averager(
            fabric, m, period=4, fragments=2, optimizers=[torch.optim.SGD(m.parameters(), lr=0.1)]
        ),
        "mixing without overlap": lambda: Averager(fabric, m, period=4, mixing=0.5),
        "mixing out of range": lambda: Averager(fabric, m, period=4, overlap_steps=1, mixing=1.5),
    }
    return errors_of(calls), in_step()


def test_bad_fragments_are_clear_errors_on_every_rank(worlds):
    expected = {
        "period not a multiple": "must be a multiple of the number of fragments (4)",
        "overlap too long": "smaller than period / fragments (2)",
        "too many": "more than the 6 parameter tensors",
        "empty group": "`fragments[1]` holds no parameter",
        "overlapping groups": "is in both `fragments[0]` and `fragments[1]`",
        "missing": "parameters in no group of `fragments`: 4.weight, 4.bias",
        "foreign": "not among the averaged modules' parameters",
        "not a count": "`fragments` must be an int >= 1 or a list of parameter groups",
        "with optimizers": "`optimizers` cannot be combined with `fragments`",
        "mixing without overlap": "set `overlap_steps` too",
        "mixing out of range": "`mixing` must be a number in [0, 1]",
    }
    for errors, check in worlds(2).run(bad_fragments):
        assert check == 2  # no rank was left inside a collective
        for case, words in expected.items():
            assert errors[case] is not None and words in errors[case][1], (case, errors[case])


def count_calls(fabric):
    """Rounds of a 3-fragment Averager: which collectives, once per fragment round."""
    (m,) = setup_models(fabric, m=model())
    calls: Counter = Counter()
    original = dist.all_reduce

    def counting(*args, **kwargs):
        calls["all_reduce"] += 1
        return original(*args, **kwargs)

    with Averager(fabric, m, period=6, fragments=3) as averager:
        dist.all_reduce = counting
        try:
            for step in range(1, 7):
                local_update(fabric, m, step)
                averager.step()
        finally:
            dist.all_reduce = original
        in_the_period = averager.rounds
    # Leaving: a round of each fragment; the last one's (just averaged at step 6) changes nothing, uncounted.
    return dict(calls), in_the_period, averager.rounds


def test_a_period_of_fragments_is_one_collective_per_fragment(worlds):
    for calls, rounds, after in worlds(2).run(count_calls):
        assert calls == {"all_reduce": 3} and rounds == 3 and after == 5
