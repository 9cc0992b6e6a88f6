"""When an :class:`~fabric_multimodel.Averager`'s rounds fall: its period and their :class:`Schedule`, what
``period="auto"`` chose and the pace ``pace="speed"`` agreed, and the times of the ``step()`` calls both are
measured from. The collectives that measure and agree are the Averager's; what they decide is kept here."""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from typing import Any

from fabric_multimodel.averaging.auto_period import PeriodChoice, choose_overlap, choose_period, shortest_period
from fabric_multimodel.averaging.config import AveragerConfig
from fabric_multimodel.averaging.pacing import Pace, last_round, paced_steps, rounds_origin
from fabric_multimodel.averaging.saved_state import times_warmup
from fabric_multimodel.rounds.schedule import Schedule


class Cadence:
    """The period, the schedule and the pace of one Averager, and the step times behind them.

    Example::

        cadence = Cadence(AveragerConfig(period=8, warmup_steps=4), fragments=1, phases=1, period=8, live=False)
        cadence.schedule.next_round(4)  # 12
    """

    def __init__(self, config: AveragerConfig, fragments: int, phases: int, period: int, live: bool) -> None:
        self.config, self.fragments, self.phases = config, fragments, phases
        self.warmup_steps, self.overlap_steps = config.warmup_steps, config.first_overlap
        #: With ``period="auto"``: what was chosen at the end of warm-up, and from what (None until then).
        self.period_choice: PeriodChoice | None = None
        #: With ``pace="speed"``: every site's local steps per round and weight, agreed at the end of warm-up.
        self.pace: Pace | None = None
        # pace="speed": the fastest site's local steps per round ("auto" is refused with pace)
        self.fastest_period = config.period if isinstance(config.period, int) else 0
        # where this site's pace began (its step at a round, and the fastest site's then); None: at warm-up's end
        self.pace_since: tuple[int, int] | None = None
        # period="auto" and pace="speed" time the warm-up: seconds between its step() calls
        self.times_warmup = times_warmup(config)
        self.warmup_gaps_s: list[float] = []
        self._last_step: float | None = None
        # pace="speed" under a membership, agreed again at each epoch: the seconds of the latest steps without a round
        self._recent_gaps: deque[float] | None = deque(maxlen=32) if live and config.pace == "speed" else None
        self.set_period(period)

    def set_period(self, period: int, start: int | None = None) -> None:
        """Rounds every ``period`` steps from the end of warm-up, or from ``start`` (a pace agreed again)."""
        self.period = period
        self.schedule = Schedule(
            period,
            self.warmup_steps if start is None else start,
            fragments=self.fragments,
            overlap_steps=self.overlap_steps,
            node_period=self.config.node_period,
            phases=self.phases,
            ends_warmup=start is None,
        )

    def time_step(self, steps: int, round_due: bool) -> None:
        """The ``steps``-th ``step()`` call is now; a round due at it is not a step's time (not timed)."""
        gaps = self.warmup_gaps_s if steps <= self.warmup_steps else self._recent_gaps
        if self.times_warmup and gaps is not None:
            now = time.perf_counter()
            if self._last_step is not None:
                gaps.append(now - self._last_step)
            self._last_step = now
        if round_due and steps > self.warmup_steps:
            self._last_step = None

    def warmup_gaps(self, option: str) -> list[float]:
        """The seconds between the warm-up's step() calls on this rank; an error (on every rank) when none was timed."""
        if not self.warmup_gaps_s:  # every rank resumed from the same counts: all raise here, before any collective
            raise RuntimeError(
                f"Averager: {option} timed no warm-up step (the run resumed at the warm-up's last step); resume"
                " from an earlier checkpoint."
            )
        return self.warmup_gaps_s

    def step_s(self, live: bool) -> float:
        """pace="speed": this rank's step time. The mean, not the median: a site held back in bursts (a CPU quota, a
        shared GPU) is as slow as its mean. Under a membership (``live``), the mean of its latest steps without a
        round (of the warm-up's until it has two of those); NaN when it timed none (a site that just joined)."""
        if not live:
            return statistics.fmean(self.warmup_gaps("pace='speed'"))
        recent = self._recent_gaps
        gaps = recent if recent is not None and len(recent) >= 2 else self.warmup_gaps_s
        return statistics.fmean(gaps) if gaps else math.nan

    def choose(self, step_s: float, round_s: float, sent: int) -> None:
        """period="auto": choose from the slowest rank's step and round seconds (see ``auto_period``)."""
        timed_step_s = max(step_s, 1e-6)
        if self.config.overlap_steps == "auto":
            self.overlap_steps = choose_overlap(timed_step_s, round_s)
        period = choose_period(timed_step_s, round_s, self.fragments, self.overlap_steps)
        self.period_choice = PeriodChoice(period, step_s, round_s, sent, self.overlap_steps)
        self.set_period(period)

    def set_pace(self, pace: Pace, mine: int, steps: int, since: tuple[int, int] | None = None) -> float:
        """Run site ``mine``'s local steps per round: from the end of warm-up, or from ``since``, a round position
        (this site's step and the fastest site's there; see ``last_round``). Returns what its rounds weigh it by:
        ``periods[mine] * W / sum(periods)``, exactly 1.0 when every site runs the same steps."""
        self.pace, self.pace_since = pace, since
        period = pace.periods[mine]
        self.set_period(period, None if since is None else rounds_origin(since[0], steps, period))
        return pace.periods[mine] * len(pace.periods) / sum(pace.periods)

    def last_round(self, steps: int) -> tuple[int, int]:
        """Paced: this site's last round position (its step and the fastest site's; see ``last_round``)."""
        since = self.pace_since or (self.warmup_steps, self.warmup_steps)
        return last_round(since, self.period, self.fastest_period, steps)

    def local_steps(self, total: int) -> int:
        """See :meth:`Averager.local_steps <fabric_multimodel.Averager.local_steps>`."""
        if self.pace is None:
            return total
        return paced_steps(total, self.warmup_steps, self.period, self.fastest_period, since=self.pace_since)

    def clock(self, step: int, rounds: int) -> int:
        """See :meth:`Averager.clock <fabric_multimodel.Averager.clock>`."""
        if self.config.pace != "speed":
            return step
        if self.pace is None:
            return 0
        return self.warmup_steps + max(self.pace.periods) * rounds

    def state_dict(self, live: bool) -> dict[str, Any]:
        """What a checkpoint keeps of it: the choice, the pace (a membership's is agreed at each epoch instead) and
        the warm-up's step times so far."""
        state: dict[str, Any] = {}
        if self.config.period == "auto":
            state["period_choice"] = list(self.period_choice) if self.period_choice else None
        if self.config.pace == "speed" and not live:
            state["pace"] = [list(values) for values in self.pace] if self.pace else None
        if self.times_warmup:
            state["warmup_step_s"] = list(self.warmup_gaps_s)
        return state

    def load(self, choice: PeriodChoice | None, gaps: list[float], live: bool) -> None:
        """A checkpoint's choice and step times, checked (``saved_state``); a site's own speed, not that of the
        member it came from, under a membership."""
        if self.times_warmup and not live:
            self.warmup_gaps_s, self._last_step = gaps, None
        if self.config.period == "auto":
            self.period_choice = choice
            self.overlap_steps = choice.overlap_steps if choice else self.config.first_overlap
            self.set_period(choice.period if choice else shortest_period(self.fragments, self.overlap_steps))
