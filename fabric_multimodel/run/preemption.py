"""A clean stop when the scheduler preempts: its signal on any rank stops every rank at the same step.

A scheduler sends SIGTERM (Kubernetes, torchrun's agent, SLURM at the time limit; ``--signal=USR1@90`` sends
SIGUSR1 ahead of it) to some processes, not necessarily all at once. A rank that stopped alone would leave
the others waiting in the next round or allreduce; :class:`PreemptionStop` makes the ranks agree on the step
at which all of them stop, so the loop can write its checkpoint there and leave with nothing half-issued.

Every ``every`` steps each rank launches a vote (one allreduce of one int on a gloo group of its own, so it
never queues behind a round in flight) and reads the vote it launched ``lag`` steps earlier: every rank stops
at the same step, at most ``every + lag`` steps after the signal, and a read almost never waits, even for
a vote that crosses a slow link. A live site (``Membership``) is a world of its own: its processes stop
together, and the other sites see it leave.

Example::

    stop = PreemptionStop()
    for step in range(start, total):
        ...
        if stop.requested(step):
            fabric.save(path, state)  # every rank at the same step
            break
    stop.close()
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from fabric_multimodel.comm.collectives import new_group


class PreemptionStop:
    """Agree, across the ranks of the default process group, on the step at which to stop once any of them got
    one of ``signals``.

    Args:
        signals: what the scheduler sends (the handlers are installed from the main thread, and put back by
            :meth:`close`).
        every: steps between two votes.
        lag: steps between a vote's launch and its reading (room for it to cross a busy link).

    Example::

        stop = PreemptionStop(signals=(signal.SIGTERM, signal.SIGUSR1))
        if stop.requested(averager.steps):
            ...
    """

    def __init__(self, signals: Sequence[int] = (signal.SIGTERM,), *, every: int = 4, lag: int = 24) -> None:
        for name, value in (("every", every), ("lag", lag)):
            if isinstance(value, bool) or not isinstance(value, int) or value < (1 if name == "every" else 0):
                raise ValueError(f"PreemptionStop: `{name}` must be an int >= {int(name == 'every')}, got {value!r}.")
        #: True once this process got one of the signals (or :meth:`request` was called).
        self.received = False
        #: The signal's name once this process got one (``"SIGTERM"``).
        self.signal: str | None = None
        self.every, self.lag = every, lag
        # The votes in flight, oldest first: (the step it was launched at, the flag, its allreduce).
        self._votes: list[tuple[int, torch.Tensor, Any]] = []
        self._next_vote: int | None = None
        several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        # gloo whatever the training's backend: the flags are a few bytes on the CPU, read on the CPU.
        self._group = new_group(range(dist.get_world_size()), backend="gloo") if several else None
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in signals:
                self._previous[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.received, self.signal = True, signal.Signals(signum).name

    def request(self) -> None:
        """Ask for the stop as a signal would (say, the coordinator is lost): every rank stops at one step.

        Example::

            if membership.coordinator_lost:
                stop.request()
        """
        self.received = True

    def requested(self, now: int) -> bool:
        """Call it once per step on every rank, with a count every rank shares (the step); True, on every rank at
        the same ``now``, once any rank got a signal.

        Example::

            if stop.requested(step):
                save(step)
        """
        if self._group is None:
            return self.received
        verdict = bool(self._votes) and self._votes[0][0] + self.lag <= now and self._count() > 0
        if not verdict and (self._next_vote is None or now >= self._next_vote):
            self._next_vote = now + self.every
            flag = torch.tensor([int(self.received)])
            self._votes.append((now, flag, dist.all_reduce(flag, group=self._group, async_op=True)))
        return verdict

    def close(self) -> None:
        """Wait for the votes in flight (every rank launched them: nothing is left half-issued), and put the
        signals' previous handlers back.

        Example::

            stop.close()
        """
        while self._votes:
            self._count()
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _count(self) -> int:
        _, flag, work = self._votes.pop(0)
        work.wait()
        return int(flag.item())
