"""``pace="speed"``: each site runs as many local steps per round as its speed allows, so that all arrive together.

Every round waits for the slowest site: a site at half speed leaves a full-speed one idle half of each period.
With pacing, the fastest site runs ``period`` local steps per round and a site whose steps take ``k`` times as
long runs ``period / k`` (rounded, at least one), so both reach each round at about the same time. The sites
measure their speed in warm-up (the mean time between ``step()`` calls; a site's slowest process speaks for
it) and agree at its end with one all-gather across sites. Each site's pseudo-gradient (or parameters) then
counts in proportion to the local steps behind it: a round is the weighted mean ``sum_i w_i x_i`` with
``w_i = steps_i / sum_j steps_j``, sent as ``w_i * W * x_i`` through the same SUM-then-divide-by-``W``
collective, so the bytes on the link do not change.

Example::

    pace = paced(period=32, step_s=[0.05, 0.10])
    pace.periods  # (32, 16): the site at half speed runs half the steps
    pace.weights  # (0.667, 0.333): and counts for a third
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

from fabric_multimodel.comm.collectives import ProcessGroup, all_gather_single, group_size


class Pace(NamedTuple):
    """Per site of the averaging group (in its rank order): its local steps per round, its share of a round's
    mean, and the step times they came from."""

    periods: tuple[int, ...]
    weights: tuple[float, ...]
    step_s: tuple[float, ...]

    def __str__(self) -> str:
        sites = ", ".join(
            f"{p} steps ({1e3 * s:.1f} ms each, weight {w:.2f})"
            for p, w, s in zip(self.periods, self.weights, self.step_s)
        )
        return f"pace speed: local steps per round by site: {sites}"


def paced(period: int, step_s: Sequence[float]) -> Pace:
    """The local steps per round of each site, ``period`` for the fastest, and the weights of their rounds.

    A step time of NaN is a site that has not timed its steps yet (one that just joined a
    :class:`~fabric_multimodel.Membership`): it runs ``period``, as the fastest, until it has.

    Example::

        paced(8, [0.1, 0.1, 0.4]).periods  # (8, 8, 2)
        paced(8, [0.1, math.nan, 0.4]).periods  # (8, 8, 2)
    """
    timed = [s for s in step_s if not math.isnan(s)]
    if period < 1 or not timed or not all(math.isfinite(s) and s > 0 for s in timed):
        raise ValueError(f"paced: needs period >= 1 and positive step times; got {period}, {list(step_s)}.")
    fastest = min(timed)
    periods = tuple(period if math.isnan(s) else max(1, round(period * fastest / s)) for s in step_s)
    total = sum(periods)
    return Pace(periods, tuple(p / total for p in periods), tuple(float(s) for s in step_s))


def paced_steps(
    total: int, warmup_steps: int, period: int, fastest_period: int, *, since: tuple[int, int] | None = None
) -> int:
    """The steps of a site that runs ``period`` local steps per round in a run of ``total`` steps of the fastest
    site (``fastest_period`` per round): as many scheduled rounds (then every site has the one on leaving the
    Averager's block), and at most the share of the fastest site's steps after its last round. ``since``: a round
    position of this period, this site's step and the fastest site's there (a pace agreed again mid-run, under a
    membership; ahead of this site for one that enters at its next round); by default the end of warm-up.

    Example::

        paced_steps(100, warmup_steps=4, period=16, fastest_period=32)  # 52: 3 rounds of 16 (the fastest: 3 of 32)
        paced_steps(100, 4, 16, 32, since=(20, 36))  # 52: from step 20 (the fastest's 36), 2 rounds more
        paced_steps(30, 3, 14, 14, since=(31, 31))  # 30: the run ends before that round (the block's is next)
    """
    if since is None:
        if total <= warmup_steps:
            return total
        since = (warmup_steps, warmup_steps)
    mine, fastest = since
    if total < fastest:  # the run ends before that round: count from the one before it
        back = -(-(fastest - total) // fastest_period)
        mine, fastest = mine - back * period, fastest - back * fastest_period
    return mine + (total - fastest) * period // fastest_period


def last_round(since: tuple[int, int], period: int, fastest_period: int, steps: int) -> tuple[int, int]:
    """The last round position at or before ``steps`` of a site that runs ``period`` steps per round from the
    round position ``since``: a pair of its step and the fastest site's step there, on which every site agrees
    which round it is (``since`` may lie ahead, as for a site that enters at its next step: then the one before).

    Example::

        last_round((4, 4), period=8, fastest_period=16, steps=23)  # (20, 36)
    """
    mine, fastest = since
    done = (steps - mine) // period
    return mine + done * period, fastest + done * fastest_period


def rounds_origin(since_step: int, steps: int, period: int) -> int:
    """Where a :class:`~fabric_multimodel.rounds.schedule.Schedule` of ``period`` steps per round begins (its
    ``warmup_steps``) for its rounds to fall on ``since_step`` and every ``period`` steps from there, the next one
    after ``steps``: ``since_step`` itself when it is past, else one period before it (no round between).

    Example::

        rounds_origin(20, steps=20, period=4)  # 20: rounds at 24, 28, ...
        rounds_origin(28, steps=23, period=2)  # 26: rounds at 28, 30, ...
    """
    return since_step if since_step <= steps else since_step - period


def gather_step_times(
    step_s: float, device: torch.device, group: ProcessGroup, site: ProcessGroup = None
) -> list[float]:
    """Every site's step time, in ``group``'s rank order, on every rank: a site's slowest process speaks for it
    (one MAX allreduce over ``site`` when given), then one all-gather over ``group``."""
    return [row[0] for row in _gather_rows([step_s], device, group, site)]


def gather_pace(
    step_s: float, position: int, device: torch.device, group: ProcessGroup, site: ProcessGroup = None
) -> tuple[list[float], int]:
    """:func:`gather_step_times`, and the largest ``position`` given (under a membership: where the members' last
    round fell in the fastest site's steps, -1 from a site that has none), in the same collectives."""
    rows = _gather_rows([step_s, position], device, group, site)
    return [row[0] for row in rows], int(max(row[1] for row in rows))


def _gather_rows(
    values: list[float], device: torch.device, group: ProcessGroup, site: ProcessGroup
) -> list[list[float]]:
    mine = torch.tensor(values, dtype=torch.float64, device=device)
    if site is not None and group_size(site) > 1:
        dist.all_reduce(mine, op=dist.ReduceOp.MAX, group=site)
    everyone = torch.zeros(len(values) * group_size(group), dtype=torch.float64, device=device)
    all_gather_single(everyone, mine, group=group)
    return everyone.view(-1, len(values)).tolist()
