"""Overlapped rounds (``overlap_steps``): the merge formula, the schedule, checkpoints, exceptions."""

from __future__ import annotations

import functools
import os
import tempfile
import time
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from fabric_multimodel import Averager, replicas_in_sync, setup_models
from tests.gan import mlp

HALF_SGD = functools.partial(torch.optim.SGD, lr=0.5)  # an outer step whose result we can compute by hand
NESTEROV = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).double() for p in module.parameters()])


def gather_mean(tensor: torch.Tensor) -> torch.Tensor:
    everyone = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, tensor)
    return torch.stack(everyone).mean(0)


def local_update(fabric, module: nn.Module, step: int) -> None:
    """A known, rank-dependent change standing in for an optimizer step."""
    with torch.no_grad():
        for i, p in enumerate(module.parameters()):
            p.add_(0.01 * (fabric.global_rank + 1) * (step % 5 + 1) * (i + 1))


# --- the merge: param <- mean(snapshot) + (param - snapshot) ---------------------------------------


def merge_matches_the_formula(fabric, period, overlap_steps, outer):
    torch.manual_seed(0)
    (m,) = setup_models(fabric, m=nn.Linear(3, 2))
    anchor = flat(m)
    errors = []
    with Averager(
        fabric, m, period=period, overlap_steps=overlap_steps, outer_optimizer=HALF_SGD if outer else None
    ) as averager:
        for step in range(1, 3 * period + overlap_steps + 1):
            local_update(fabric, m, step)
            before = flat(m)
            if averager.step():  # launched: nothing changes yet
                snapshot, mean_snapshot = before, gather_mean(before)
                assert torch.equal(flat(m), before)
            if step > period and step % period == overlap_steps:  # this step() merged
                if outer:
                    anchor = anchor - 0.5 * (anchor - mean_snapshot)  # outer SGD on the mean pseudo-gradient
                    expected = anchor + (before - snapshot)
                else:
                    expected = mean_snapshot + (before - snapshot)
                errors.append((flat(m) - expected).abs().max().item())
        in_sync_inside = bool(replicas_in_sync(fabric, m))
    return errors, in_sync_inside, bool(replicas_in_sync(fabric, m))


@pytest.mark.parametrize("size", [2, 4])
@given(period=st.integers(2, 5), overlap_steps=st.integers(1, 4), outer=st.booleans())
def test_merge_keeps_the_local_progress_made_in_flight(worlds, size, period, overlap_steps, outer):
    overlap_steps = min(overlap_steps, period - 1)
    for errors, in_sync_inside, in_sync_after in worlds(size).run(
        merge_matches_the_formula, period, overlap_steps, outer
    ):
        assert len(errors) == 3 and max(errors) < 1e-6, errors
        assert not in_sync_inside  # merged replicas keep their own progress
        assert in_sync_after  # leaving the block averages


# --- the schedule: collectives only at launch steps; sync() finishes and averages -----------------


def count_collectives(fabric, period, overlap_steps, warmup_steps, steps, outer):
    """Calls into torch.distributed per step(), counted by wrapping the functions (the profiler cannot
    follow an asynchronous collective across windows)."""
    torch.manual_seed(0)
    (m,) = setup_models(fabric, m=mlp([3, 4, 2], batch_norm=True))
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    calls: Counter = Counter()
    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather", "broadcast", "barrier")}

    def counting(name):
        def call(*args, **kwargs):
            calls[name] += 1
            return originals[name](*args, **kwargs)

        return call

    per_step = []
    try:
        for name in originals:
            setattr(dist, name, counting(name))
        averager = Averager(
            fabric,
            m,
            period=period,
            warmup_steps=warmup_steps,
            overlap_steps=overlap_steps,
            outer_optimizer=NESTEROV if outer else None,
        )
        with averager:
            for step in range(1, steps + 1):
                data = torch.Generator().manual_seed(step * 7 + fabric.global_rank)
                fabric.backward(m(torch.randn(4, 3, generator=data)).pow(2).mean())
                opt.step()
                opt.zero_grad()
                calls.clear()
                launched = averager.step()
                per_step.append((launched, dict(calls)))
            calls.clear()
            averager.sync()
            on_sync = dict(calls)
            in_sync = bool(replicas_in_sync(fabric, m))
            calls.clear()
        on_exit = dict(calls)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    return per_step, on_sync, in_sync, on_exit, averager.rounds


@given(
    period=st.integers(2, 5),
    overlap_steps=st.integers(1, 4),
    warmup_steps=st.integers(0, 3),
    steps=st.integers(1, 14),
    outer=st.booleans(),
)
def test_collectives_only_at_launch_steps(worlds, period, overlap_steps, warmup_steps, steps, outer):
    overlap_steps = min(overlap_steps, period - 1)
    per_step, on_sync, in_sync, on_exit, rounds = worlds(2).run(
        count_collectives, period, overlap_steps, warmup_steps, steps, outer
    )[0]
    launches = 0
    for number, (launched, calls) in enumerate(per_step, start=1):
        due = number > warmup_steps and (number - warmup_steps) % period == 0
        assert launched == due, (number, launched)
        assert calls == ({"all_reduce": 1} if due else {}), (number, calls)
        launches += due
    assert on_sync == {"all_reduce": 1}  # a round in flight is waited for (no new call), then one blocking round
    assert in_sync
    # In the local phase, leaving sends a round that checks the schedule (and changes nothing after
    # sync()); in warm-up, DDP kept the replicas identical and there is nothing to send.
    assert on_exit == ({"all_reduce": 1} if steps >= warmup_steps else {})
    assert rounds == launches + 1


# --- a checkpoint with a round in flight resumes exactly -------------------------------------------


def resume_with_round_in_flight(fabric, period, overlap_steps, outer, split, extra, path):
    def build():
        torch.manual_seed(0)
        (m,) = setup_models(fabric, m=mlp([3, 8, 2]))
        opt = fabric.setup_optimizers(torch.optim.SGD(m.parameters(), lr=0.05))
        averager = Averager(
            fabric, m, period=period, overlap_steps=overlap_steps, outer_optimizer=NESTEROV if outer else None
        )
        return m, opt, averager

    def run(m, opt, averager, start, stop, trace):
        for step in range(start, stop):
            data = torch.Generator().manual_seed(100 * step + fabric.global_rank)
            fabric.backward(nn.functional.mse_loss(m(torch.randn(4, 3, generator=data)), torch.zeros(4, 2)))
            opt.step()
            opt.zero_grad()
            averager.step()
            trace.append(flat(m))

    split = period * split  # the checkpoint is written right after a round's launch
    uninterrupted: list[torch.Tensor] = []
    m, opt, averager = build()
    with averager:
        run(m, opt, averager, 0, split, [])
        in_flight = averager._round.pending
        fabric.save(path, {"m": m, "opt": opt, "averager": averager})  # state_dict() finishes the round
        run(m, opt, averager, split, split + extra, uninterrupted)
    m, opt, averager = build()
    fabric.load(path, {"m": m, "opt": opt, "averager": averager})
    resumed: list[torch.Tensor] = []
    with averager:
        run(m, opt, averager, split, split + extra, resumed)
    same = len(resumed) == extra and all(torch.equal(a, b) for a, b in zip(uninterrupted, resumed))
    return in_flight, same


@given(
    period=st.integers(2, 4),
    overlap_steps=st.integers(1, 3),
    outer=st.booleans(),
    split=st.integers(1, 3),
    extra=st.integers(1, 9),
)
def test_checkpoint_with_a_round_in_flight_resumes_exactly(worlds, period, overlap_steps, outer, split, extra):
    overlap_steps = min(overlap_steps, period - 1)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt.pt")
        for in_flight, same in worlds(2).run(
            resume_with_round_in_flight, period, overlap_steps, outer, split, extra, path
        ):
            assert in_flight and same


# --- leaving by exception with a round in flight ----------------------------------------------------


def exception_with_round_in_flight(fabric, outer):
    torch.manual_seed(0)
    (m,) = setup_models(fabric, m=nn.Linear(3, 2))
    start = time.monotonic()
    try:
        with Averager(fabric, m, period=2, overlap_steps=1, outer_optimizer=NESTEROV if outer else None) as averager:
            for step in range(1, 3):
                local_update(fabric, m, step)
                averager.step()  # the second call launches a round
            in_flight = averager._round.pending
            raise KeyError("boom")
    except KeyError:
        pass
    gathered = [torch.empty_like(flat(m)) for _ in range(fabric.world_size)]
    dist.all_gather(gathered, flat(m))  # the world is still usable
    return {
        "in_flight": in_flight,
        "pending_after": averager._round.pending,
        "differ": not torch.equal(gathered[0], gathered[1]),
        "seconds": time.monotonic() - start,
        "rounds": averager.rounds,
    }


@pytest.mark.parametrize("outer", [False, True])
def test_exception_with_a_round_in_flight_issues_nothing_new_and_does_not_hang(worlds, outer):
    for result in worlds(2).run(exception_with_round_in_flight, outer):
        assert result["in_flight"] and not result["pending_after"]
        assert result["differ"]  # the round in flight was discarded: replicas keep their own parameters
        assert result["rounds"] == 1 and result["seconds"] < 30
