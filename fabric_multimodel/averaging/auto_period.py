"""``period="auto"``: the smallest period whose rounds hide behind compute, chosen from the measured step and link.

A period is a trade: the shorter, the closer the replicas stay (DiLoCo 32 ended 4.2% above synchronous DDP on
the LM, DiLoCo 128 13%), the longer, the less of the run waits for the link. At the end of warm-up the
:class:`~fabric_multimodel.Averager` knows both sides: how long an iteration takes (the median time between
its ``step()`` calls in warm-up) and how long one round's payload takes to cross its group (a timed allreduce
of that many bytes, the faster of two). :func:`choose_period` turns them into the smallest period whose
rounds add at most :data:`TOLERANCE` to the compute time; every rank takes the slowest rank's figures, so
every rank chooses the same.

Example::

    choose_period(step_s=0.05, round_s=0.5)                                    # 200: 10 steps of link per round
    choose_period(step_s=0.05, round_s=0.5, fragments=4, overlap_steps=16)     # 68: each quarter hides in 16 steps

With ``overlap_steps="auto"`` as well, the overlap is chosen first (:func:`choose_overlap`: the steps a round
needs, with :data:`HEADROOM` to spare), then the smallest period it allows: a slow link gets a long overlap
instead of a period longer than the run.
"""

from __future__ import annotations

import math
import time
from typing import NamedTuple

import torch
import torch.distributed as dist

from fabric_multimodel.comm.collectives import ProcessGroup, extremes, group_size
from fabric_multimodel.plan.cost_model import period_for

#: The share of the compute time that rounds may add: a period whose rounds wait longer is too short.
TOLERANCE = 0.05
#: How much longer than the timed round an overlap chosen by ``overlap_steps="auto"`` leaves room for. The timed
#: round is the faster of two on an idle link; in the run, rounds share the cores and the link with training (on
#: the LM at 10 Mbit/s, quarter-rounds timed at 175 ms and merged 16 steps, 280 ms, later still cost about 3% of
#: the wall-clock against a period twice as long). 1.5 gives that LM the overlap it was hand-tuned to: 16.
HEADROOM = 1.5


class PeriodChoice(NamedTuple):
    """What ``period="auto"`` chose and from what: the period, the step and round times (the slowest rank's),
    the bytes a round sends per rank, and the overlap the rounds had.

    A round longer than its overlap waits, and only a long period keeps that wait under the tolerance (at
    1 Mbit/s it can be longer than the run, which then averages once); the text then says which overlap hides it.

    Example::

        print(PeriodChoice(68, 0.0174, 0.1748, 207_976, overlap_steps=16))  # hidden: no advice
    """

    period: int
    step_s: float
    round_s: float
    round_bytes: int
    overlap_steps: int = 0

    @property
    def hiding_overlap(self) -> int:
        """The fewest overlap steps a round fits in, so that it waits for nothing."""
        return math.ceil(self.round_s / self.step_s * (1 - 1e-9)) if self.step_s > 0 else 0

    def __str__(self) -> str:
        text = (
            f"period auto: {self.period} ({f'overlap {self.overlap_steps}; ' if self.overlap_steps else ''}a step"
            f" {1e3 * self.step_s:.1f} ms, a round of {self.round_bytes:,} bytes"
            f" {1e3 * self.round_s:.1f} ms; rounds at most {TOLERANCE:.0%} of the compute)"
        )
        waited = self.round_s - self.overlap_steps * self.step_s
        if self.hiding_overlap > self.overlap_steps:
            text += (
                f"; each round waits {1e3 * waited:.1f} ms: overlap_steps >= {self.hiding_overlap} (or a smaller"
                " comm_dtype) would hide it"
            )
        return text


def choose_period(
    step_s: float, round_s: float, fragments: int = 1, overlap_steps: int = 0, tolerance: float = TOLERANCE
) -> int:
    """The smallest period (a multiple of ``fragments``, with ``period / fragments > overlap_steps``) whose rounds
    add at most ``tolerance`` of the compute time.

    A period of ``p`` steps computes for ``p * step_s`` and holds ``fragments`` rounds of ``round_s`` each. A
    blocking round (``overlap_steps=0``) waits all of ``round_s``; an overlapped one only what does not fit in
    its ``overlap_steps`` steps (it is waited for at its merge, so the next fragment's round never shares the
    link with it). The arithmetic is the cost model's
    (:func:`~fabric_multimodel.plan.cost_model.period_for`, which ``python -m fabric_multimodel.plan`` uses too), fed
    with what was measured.

    Example::

        choose_period(step_s=0.1, round_s=0.2)  # 40: 0.2 s of rounds in 4 s of compute is 5%
    """
    if not (step_s > 0 and round_s >= 0 and 0 < tolerance < 1):
        raise ValueError(
            f"choose_period: needs step_s > 0, round_s >= 0 and 0 < tolerance < 1; got {step_s}, {round_s},"
            f" {tolerance}."
        )
    waited = max(0.0, round_s - overlap_steps * step_s)
    return period_for(step_s, waited, fragments, overlap_steps, target=1 / (1 + tolerance))


def shortest_period(fragments: int, overlap_steps: int) -> int:
    """The shortest period a schedule allows: each fragment's round merged before the next one launches.

    Example::

        shortest_period(fragments=4, overlap_steps=16)  # 68
    """
    return fragments * (overlap_steps + 1)


def choose_overlap(step_s: float, round_s: float, headroom: float = HEADROOM) -> int:
    """``overlap_steps="auto"``: the steps a round of ``round_s`` needs to hide behind, with ``headroom`` to spare
    (at least 1). :func:`choose_period` then gives the smallest period that overlap allows.

    Example::

        choose_overlap(step_s=0.0174, round_s=0.175)  # 16: 1.5 x 175 ms in steps of 17.4 ms
    """
    if not (step_s > 0 and round_s >= 0 and headroom >= 1):
        raise ValueError(
            f"choose_overlap: needs step_s > 0, round_s >= 0 and headroom >= 1; got {step_s}, {round_s}, {headroom}."
        )
    return max(1, math.ceil(headroom * round_s / step_s - 1e-9))


def time_round(numel: int, dtype: torch.dtype, device: torch.device, group: ProcessGroup) -> float:
    """Seconds of an allreduce of ``numel`` elements of ``dtype`` over ``group``: the faster of two (the first
    also sets up connections), each after a one-element allreduce that lines the ranks up. Four collectives."""
    if group_size(group) == 1:
        return 0.0
    payload = torch.zeros(max(1, numel), dtype=dtype, device=device)
    line_up = torch.zeros(1, device=device)
    times = []
    for _ in range(2):
        dist.all_reduce(line_up, group=group)
        _synchronize(device)
        start = time.perf_counter()
        dist.all_reduce(payload, group=group)
        _synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


def agree(step_s: float, round_s: float, device: torch.device, groups: list[ProcessGroup]) -> tuple[float, float]:
    """The largest ``step_s`` and ``round_s`` over the ranks of ``groups`` (in turn: together they span every
    rank that must choose alike), in microseconds; one small allreduce per group of more than one rank."""
    values = [round(step_s * 1e6), round(round_s * 1e6)]
    for group in groups:
        values, _ = extremes(values, device, group)
    return values[0] / 1e6, values[1] / 1e6


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
