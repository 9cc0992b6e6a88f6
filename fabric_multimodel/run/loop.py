"""The run-level parts of a loop the user writes: where this rank's loop ends, when it writes a checkpoint and
when it stops on a scheduler's signal, each at a moment every rank (and every site) shares: :class:`Loop`.

Written by hand, each part is a trap that hangs or loses a run: a rank that stops alone leaves the others waiting
in the next round; with ``pace="speed"`` the sites make different numbers of steps, so a stop or a periodic
checkpoint counted in steps would fall between one site's round and another's, and each site's loop ends at its
own step (``averager.local_steps``); a site that joins a running run (a ``Membership``) starts at the others'
step; a checkpoint of replicas that differ (plain averaging between rounds) needs a round first.

Example::

    loop = Loop(averager, steps=1000, checkpointer=checkpointer, state=lambda: {"model": model, "step": loop.step})
    with averager:
        for step in loop:  # 1, 2, ... to loop.last; the checkpoints and the stop are taken between iterations
            ...  # forward, backward, optimizer steps
            averager.step()
    print(loop.close())
    if loop.stopped:
        raise SystemExit(143)
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fabric_multimodel.run.preemption import PreemptionStop

if TYPE_CHECKING:
    from fabric_multimodel.averaging.averager import Averager
    from fabric_multimodel.checkpoints.checkpointer import Checkpointer
    from fabric_multimodel.membership.membership import Membership


class Loop:
    """Iterate over this rank's steps of a run of ``steps`` steps (the fastest site's, with ``pace="speed"``), and
    between two iterations write the checkpoints and stop as the run asks.

    Args:
        averager: the run's Averager (None: plain DDP, or a single process). Call its ``step()`` once per iteration.
        steps: the run's steps.
        checkpointer: where checkpoints go (none written without it).
        state: what a checkpoint holds, called when one is written (put ``loop.step`` in it to resume from there).
        checkpoint_every: a checkpoint each time the clock passes a multiple of it (0: none); it waits for the
            round in flight to be merged.
        checkpoint_rounds: a checkpoint after each round that ends with none in flight (anchored rounds send
            nothing for it, and a replica restarted alone finds its own).
        stop: what stops the run on a scheduler's signal (True: SIGTERM; False: nothing; or a
            :class:`~fabric_multimodel.run.preemption.PreemptionStop` of your own): every rank stops at one step, where
            no round is in flight, after writing a checkpoint. A live site whose coordinator stays out of reach past
            its grace stops the same way (:attr:`stop_reason` says which).
        start: the step this rank resumes after (default: ``averager.steps``, which a resume or a join sets: build
            the Loop after resuming).

    Example::

        loop = Loop(averager, args.steps, checkpointer=checkpointer, state=lambda: state | {"step": loop.step},
                    checkpoint_every=500, checkpoint_rounds=True)
        with averager:
            for step in loop:
                ...
                averager.step()
        checkpointer.save(state | {"step": loop.step})  # leaving the block averaged: no round needed
        loop.close()
    """

    def __init__(
        self,
        averager: Averager | None,
        steps: int,
        *,
        checkpointer: Checkpointer | None = None,
        state: Callable[[], Mapping[str, Any]] | None = None,
        checkpoint_every: int = 0,
        checkpoint_rounds: bool = False,
        stop: PreemptionStop | bool = True,
        start: int | None = None,
    ) -> None:
        for name, value, least in (("steps", steps, 0), ("checkpoint_every", checkpoint_every, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"Loop: `{name}` must be an int >= {least}, got {value!r}.")
        if checkpointer is not None and state is None:
            raise ValueError("Loop: a `checkpointer` needs `state`, a callable returning what a checkpoint holds.")
        self.averager, self.total, self.checkpointer, self._state = averager, steps, checkpointer, state
        self.checkpoint_every, self.checkpoint_rounds = checkpoint_every, checkpoint_rounds
        #: This rank's iterations so far.
        self.step = start if start is not None else (averager.steps if averager is not None else 0)
        #: True once the run stopped on a signal (after its checkpoint, in :attr:`saved`).
        self.stopped = False
        #: What stopped it, as in "stopped by SIGTERM" (None while it runs).
        self.stop_reason: str | None = None
        #: Where the last checkpoint written between two iterations went (None before one).
        self.saved: Path | None = None
        self._stop = PreemptionStop() if stop is True else stop or None
        self._stopping = False
        self._now = self.clock
        self._checkpoint_due = False
        self._closed = False

    @property
    def clock(self) -> int:
        """The count on which every site acts at the same moment (see ``Averager.clock``): the step, or with
        ``pace="speed"`` the fastest site's step at the last round."""
        return self.averager.clock(self.step) if self.averager is not None else self.step

    @property
    def paced(self) -> bool:
        """True when the sites run at their own pace and end at different steps."""
        return self.averager is not None and self.averager.config.pace == "speed"

    @property
    def last(self) -> int:
        """The step at which this rank's loop ends: ``steps``, or with ``pace="speed"`` after warm-up this site's
        last step (see ``Averager.local_steps``; it changes at the end of warm-up, and under a membership when the
        members agree their pace again)."""
        return self.averager.local_steps(self.total) if self.averager is not None else self.total

    def __iter__(self) -> Iterator[int]:
        if self.averager is not None and self.averager.membership is not None:  # a site joins in the with block
            self.step = max(self.step, self.averager.steps)
        while self.step < self.last and not self.stopped:
            yield self.step + 1
            self._count()
            self._between_steps()

    def _count(self) -> None:
        averager = self.averager
        if averager is None:
            self.step += 1
        elif averager.steps <= self.step:
            raise RuntimeError(
                f"Loop: the Averager counted no step in iteration {self.step + 1}; call averager.step() once in"
                " each iteration of the loop."
            )
        else:  # a site behind (one that joined, a survivor that missed a round) takes the others' step
            self.step = averager.steps

    def _between_steps(self) -> None:
        averager = self.averager
        in_flight = averager is not None and averager.pending
        if self.checkpoint_rounds and averager is not None and averager.finished_at == self.step and not in_flight:
            self._save(after_round=True)
        before, self._now = self._now, self.clock
        # A paced site's last step can be another site's round, after which that one acts: all act alike there.
        final = self.step == self.last and not self.paced
        if self._stop is not None and not self._stopping and not final:
            membership = averager.membership if averager is not None else None
            if membership is not None and membership.coordinator_lost:
                self._stop.request()  # the site's processes agree on the step, as on a signal
            self._stopping = self._stop.requested(self._now)
            if self._stopping:
                self.stop_reason = _reason(membership, self._stop.signal)
        every = self.checkpoint_every
        self._checkpoint_due |= bool(every) and self._now // every > before // every
        if final or in_flight:  # stop and save where nothing is in flight: the run resumed goes on as it would have
            return
        if self._stopping or self._checkpoint_due:
            self._save()
            self.stopped, self._checkpoint_due = self._stopping, False
            if self.stopped:
                self._leave()

    def _save(self, *, after_round: bool = False) -> None:
        if self.checkpointer is None or self._state is None:
            return
        if after_round:
            self.checkpointer.after_round(self._state())
            self.saved = self.checkpointer.own_path
            return
        alone = self._stopping and self.averager is not None and self.averager.membership is not None
        if self.averager is not None and not self.checkpointer.local and not alone:  # a live site stops on its own
            self.averager.sync()  # every replica (and its optimizer's state) equal to the one that is written
        self.saved = self.checkpointer.save(self._state())

    def save(self, reason: str | None = None) -> Path | None:
        """Write a checkpoint of ``state()`` now, with no round, and stop there when ``reason`` is given: after the
        Averager's block ended on an error that leaves each replica whole (a live site's
        :class:`~fabric_multimodel.CoordinatorLost`); the path it went to (None without a checkpointer).

        Example::

            except CoordinatorLost as error:
                loop.save(reason=str(error))
        """
        if reason is not None:
            self.stopped, self.stop_reason = True, reason
            self._leave()
        if self.checkpointer is None or self._state is None:
            return None
        self.saved = self.checkpointer.save(self._state())
        return self.saved

    def _leave(self) -> None:
        """A live site stops on its own: leaving the Averager's block makes no round (the other sites go on)."""
        if self.averager is not None and self.averager.membership is not None:
            self.averager.leave()

    def close(self) -> str:
        """After the Averager's block: wait for the stop's votes in flight, tell the membership whether the run ended
        (a site still waiting to be admitted stops waiting), and land the checkpoint written in the background;
        returns what the round checkpoints cost (see ``Checkpointer.close``), or "".

        Example::

            print(loop.close())
        """
        if self._closed:
            return ""
        self._closed = True
        if self._stop is not None:
            self._stop.close()
        membership = self.averager.membership if self.averager is not None else None
        if membership is not None:
            membership.close(finished=not self.stopped)
        return self.checkpointer.close() if self.checkpointer is not None else ""


def _reason(membership: Membership | None, received: str | None) -> str:
    """Why a stop was agreed, as in "stopped by ...": the coordinator out of reach, or a scheduler's signal."""
    if membership is not None and membership.coordinator_lost:
        return f"a lost coordinator ({membership.coordinator} out of reach past its {membership.grace_s:.0f} s grace)"
    return received or "a signal to another process"
