"""When an :class:`~fabric_multimodel.Averager` acts: a pure schedule of what happens at each ``step()``.

The schedule knows nothing of tensors or processes. Given the ``step()`` count it returns the
:class:`Event` s of that step, in the order the Averager carries them out; the Averager executes
them. Every rank computes the same events from the same count, which is what keeps their
collectives in step without talking about it.

- ``step()`` calls 1..``warmup_steps``: synchronous training, no event; the last one ends the
  warm-up (``local``).
- After that, with ``F`` fragments, fragment ``f`` (0-based) has its round at local steps
  ``(f + 1) * period / F + k * period``: one fragment at a time, evenly spread, so a round sends
  ``1/F`` of the model; ``F = 1`` is a round of everything every ``period`` steps.
- With ``overlap_steps = d``, a round is launched at its step and merged ``d`` steps later (one
  fragment in flight at a time, since ``d < period / F``). A round whose collectives come in two
  phases (``phases=2``: a quantized round's all-to-all, then its all-gather) moves to its second
  phase ``d // 2`` steps after the launch, when ``d >= 2``.
- Two-level averaging: a round inside the node every ``node_period`` local steps, except where a
  round across the world falls.
- With ``ends_warmup=False`` the schedule begins in the local phase: ``warmup_steps`` only places
  the rounds (a pace agreed again mid-run starts a new schedule there), and no step ends a warm-up.

Example::

    schedule = Schedule(period=8, warmup_steps=2, fragments=2, overlap_steps=1)
    schedule.at(2)  # (Event('local'),)
    schedule.at(6)  # (Event('launch', fragment=0, first=True),)
    schedule.at(7)  # (Event('merge', fragment=0),)
"""

from __future__ import annotations

from typing import NamedTuple


class Event(NamedTuple):
    """One thing the Averager does at a step.

    ``kind`` is one of ``local`` (warm-up ends: local steps begin), ``round`` (a blocking round of
    ``fragment``), ``launch`` (an overlapped round of ``fragment`` starts), ``exchange`` (its second
    phase starts), ``merge`` (it is merged), ``node`` (a blocking round inside the node). ``first``
    marks a fragment's first round after warm-up.
    """

    kind: str
    fragment: int = 0
    first: bool = False


class Schedule:
    """The events of every ``step()`` count, for a period, warm-up, fragments, overlap and two levels.

    Arguments must already be valid (the :class:`~fabric_multimodel.Averager` checks them and names
    the argument in its errors); here only their consistency is asserted.

    Example::

        schedule = Schedule(period=4, warmup_steps=1)
        [steps for steps in range(1, 10) if schedule.at(steps)]  # [1, 5, 9]
    """

    def __init__(
        self,
        period: int,
        warmup_steps: int = 0,
        *,
        fragments: int = 1,
        overlap_steps: int = 0,
        node_period: int | None = None,
        phases: int = 1,
        ends_warmup: bool = True,
    ) -> None:
        assert period >= 1 and warmup_steps >= 0 and fragments >= 1 and period % fragments == 0
        assert 0 <= overlap_steps < period // fragments and phases in (1, 2)
        assert node_period is None or (period % node_period == 0 and fragments == 1 and not overlap_steps)
        self.period, self.warmup_steps, self.fragments = period, warmup_steps, fragments
        self.overlap_steps, self.node_period, self.phases = overlap_steps, node_period, phases
        self.ends_warmup = ends_warmup
        #: Local steps between the rounds of two consecutive fragments.
        self.spacing = period // fragments

    def offset(self, fragment: int) -> int:
        """The local step of ``fragment``'s first round.

        Example::

            Schedule(period=8, fragments=4).offset(1)  # 4
        """
        return (fragment + 1) * self.spacing

    def round_at(self, local_steps: int) -> int | None:
        """The fragment whose round falls on this local step (0 or fewer: none), or None.

        Example::

            Schedule(period=8, fragments=2).round_at(12)  # 0
        """
        if local_steps < self.spacing or local_steps % self.spacing:
            return None
        return (local_steps // self.spacing - 1) % self.fragments

    def next_round(self, steps: int) -> int:
        """The ``step()`` count of the first round (or launch) after ``steps``, in the local phase.

        Example::

            Schedule(period=8, warmup_steps=2, fragments=2).next_round(7)  # 10
        """
        local = max(steps - self.warmup_steps, 0)
        return self.warmup_steps + (local // self.spacing + 1) * self.spacing

    def at(self, steps: int) -> tuple[Event, ...]:
        """What happens at the ``steps``-th ``step()`` call, in order.

        Example::

            Schedule(period=4, warmup_steps=2).at(6)  # (Event('round', fragment=0, first=True),)
        """
        local = steps - self.warmup_steps
        if local < 0:
            return ()
        if local == 0:
            return (Event("local"),) if steps > 0 and self.ends_warmup else ()
        events = []
        delay = self.overlap_steps
        if delay:
            launched = self.round_at(local - delay)
            if launched is not None:
                events.append(Event("merge", launched))
            half = delay // 2
            if self.phases == 2 and half:
                exchanging = self.round_at(local - half)
                if exchanging is not None:
                    events.append(Event("exchange", exchanging))
        fragment = self.round_at(local)
        if fragment is not None:
            first = local == self.offset(fragment)
            events.append(Event("launch" if delay else "round", fragment, first))
        elif self.node_period and local % self.node_period == 0:
            events.append(Event("node"))
        return tuple(events)
