"""PreemptionStop: a signal on one rank stops every rank at one step, in a real 2-process gloo world."""

from __future__ import annotations

import contextlib
import os
import signal
from collections import Counter
from collections.abc import Iterator

import pytest
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from fabric_multimodel.run.preemption import PreemptionStop


@contextlib.contextmanager
def count_collectives() -> Iterator[Counter]:
    """The calls into torch.distributed's collectives while inside, by name."""
    calls: Counter = Counter()
    originals = {name: getattr(dist, name) for name in ("all_reduce", "broadcast", "all_gather", "barrier")}

    def counting(name: str):
        def call(*args, **kwargs):
            calls[name] += 1
            return originals[name](*args, **kwargs)

        return call

    try:
        for name in originals:
            setattr(dist, name, counting(name))
        yield calls
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def _stop_after_signal(fabric, signalled_rank: int, at: int, every: int, lag: int, signum: int) -> tuple[int, int]:
    """Run steps until the stop is requested; ``signalled_rank`` gets ``signum`` at step ``at``. Returns the step
    every rank stopped at and the allreduces the votes issued."""
    before = signal.getsignal(signum)
    stop = PreemptionStop(signals=(signal.SIGTERM, signal.SIGUSR1), every=every, lag=lag)
    with count_collectives() as counted:
        for step in range(1, 500):
            if step == at and fabric.global_rank == signalled_rank:
                os.kill(os.getpid(), signum)
            if stop.requested(step):
                break
        stop.close()
    assert signal.getsignal(signum) is before  # the handler is put back: the world is reused
    return step, counted["all_reduce"]


@settings(max_examples=4, deadline=None)
@given(
    signalled_rank=st.integers(0, 1),
    at=st.integers(1, 60),
    every=st.integers(1, 6),
    lag=st.integers(0, 30),
    signum=st.sampled_from([signal.SIGTERM, signal.SIGUSR1]),
)
def test_a_signal_on_one_rank_stops_every_rank_at_one_step(worlds, signalled_rank, at, every, lag, signum) -> None:
    stopped = worlds(2).run(_stop_after_signal, signalled_rank, at, every, lag, signum)
    (step, votes), (other_step, other_votes) = stopped
    assert step == other_step and votes == other_votes  # the same step, every vote issued on both
    assert at < step <= at + every + lag  # the vote after the signal, read lag steps later
    assert votes == len(range(1, step, every))  # one per `every` steps until the stop, none after


def test_one_process_stops_at_its_signal_and_issues_nothing() -> None:
    stop = PreemptionStop()
    with count_collectives() as counted:
        assert not stop.requested(1)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested(2) and stop.received
        stop.close()
    assert sum(counted.values()) == 0
    assert signal.getsignal(signal.SIGTERM) != stop._handle  # put back


@pytest.mark.parametrize(("option", "value"), [("every", 0), ("lag", -1), ("every", 2.5)])
def test_bad_settings_name_the_argument(option: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"`{option}`"):
        PreemptionStop(**{option: value})  # type: ignore[arg-type]
