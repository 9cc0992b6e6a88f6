"""The rounds of an :class:`~fabric_multimodel.Averager`'s schedule, carried out: :class:`RoundRunner` launches,
merges and checks each round the schedule's events name, and counts it in the driver's counters."""

from __future__ import annotations

import functools
import logging
import time

import torch

from fabric_multimodel.averaging.agreement import check_intact, check_stamps, stamp_count
from fabric_multimodel.averaging.driver import Driver
from fabric_multimodel.averaging.epochs import Epochs
from fabric_multimodel.comm.collectives import ProcessGroup, Traffic, describe_disagreement
from fabric_multimodel.rounds.header import Stamp
from fabric_multimodel.rounds.optimizer_state import OptimizerStateStorage
from fabric_multimodel.rounds.round import Round
from fabric_multimodel.rounds.schedule import Event

_log = logging.getLogger(__name__)


class RoundRunner:
    """The rounds of ``driver``: ``round`` across its group (one fragment at a time), ``node_round`` inside the node,
    and the optimizers' state averaged after each blocking round.

    Example::

        runner = RoundRunner(averager, built.round, built.node_round, OptimizerStateStorage(optimizers), device)
        for event in averager.schedule.at(averager.steps):
            runner.run(event)
    """

    def __init__(
        self,
        driver: Driver,
        round: Round,
        node_round: Round | None,
        optimizer_state: OptimizerStateStorage,
        device: torch.device,
        *,
        apart: bool = False,
    ) -> None:
        self.driver, self.round, self.node_round = driver, round, node_round
        self.optimizer_state, self.device = optimizer_state, device
        # The replicas trained apart in warm-up (the islands' nodes, a membership's sites): the first round of each
        # part after it is a plain mean that sets its anchor.
        self.apart = apart
        #: A live membership's epochs, whose rounds weigh each member by what it brought (None: a fixed group).
        self.epochs: Epochs | None = None
        #: The step at which the round in flight was launched (None: none in flight).
        self.launched_at: int | None = None
        self._launched_s = 0.0  # when the round in flight was launched (perf_counter)
        #: Per fragment, the step of its last blocking round: a round with no step since then changes nothing.
        self.synced_at = [0] * driver.fragments

    def run(self, event: Event) -> bool:
        """Carry out a round event of the schedule (not ``local``, which is the driver's); True when it started one."""
        if event.kind in ("round", "launch"):
            return self.round_now(event.fragment, blocking=event.kind == "round")
        if event.kind == "exchange":
            self.round.exchange()  # the round in flight to its second phase
        elif event.kind == "merge":
            self.finish_pending()
        elif event.kind == "node":
            return self._node_round_now()
        else:
            raise ValueError(f"RoundRunner.run: no round event is called {event.kind!r}.")
        return False

    def round_everything(self) -> None:
        """A blocking round of every fragment that took a step since its last round (in the local phase, of
        every fragment: each carries the step counts that tell whether the ranks stayed in step)."""
        for fragment in range(self.driver.fragments):
            # in warm-up, DDP keeps parameters identical
            if self.driver.local or self.driver.steps > self.synced_at[fragment]:
                self.round_now(fragment, blocking=True)

    def round_now(self, fragment: int, *, blocking: bool) -> bool:
        driver, round = self.driver, self.round
        label = f"averaging round {driver.rounds + 1} at step {driver.steps}"
        if driver.fragments > 1:
            label += f" (fragment {fragment + 1} of {driver.fragments})"
        warming_up = driver.steps < driver.warmup_steps
        if warming_up and not self.apart:
            # Synchronous DDP moved the parameters (identically): rounds in warm-up are plain means.
            round.anchor_parameters(round.parts[fragment])
        if self.epochs is not None:
            round.scale = self.epochs.scale(fragment)
        layout, _ = self.optimizer_state.refresh()
        stamp = Stamp(stamp_count(self._count()), layout, driver.steps > self.synced_at[fragment])
        start = time.perf_counter()
        round.launch(stamp, label=label, blocking=blocking, outer=not warming_up, part=fragment)
        # Checked while the payload crosses (a pointer per tensor, 0.13 ms for 400 on a CPU: hidden behind the
        # collective), and raised once the round ended, so that no rank leaves a collective half-issued.
        intact = round.storage.intact()
        if not blocking:
            driver.rounds += 1
            self.launched_at, self._launched_s = driver.steps, start
            check_intact(intact)  # leaving the block then discards the round in flight
            _log.debug("%s: launched", label)
            return True
        stamps = round.finish()
        driver.traffic += round.traffic  # counted once it crossed: a sparse round's size is known only then
        check_intact(intact)
        self._check_stamps(stamps, label, driver.process_group)
        self.synced_at[fragment] = driver.finished_at = driver.steps
        driver.round_s = time.perf_counter() - start
        if any(s.progress for s in stamps):
            driver.rounds += 1
            driver.traffic += self._average_optimizer_state(label)
        _log.debug("%s: %d bytes in %.3f s", label, round.traffic.bytes, time.perf_counter() - start)
        return True

    def finish_pending(self) -> None:
        """Merge the round in flight, if any."""
        if self.launched_at is None:
            return
        label = f"averaging round {self.driver.rounds} (launched at step {self.launched_at})"
        self.launched_at = None
        stamps = self.round.finish()
        self.driver.traffic += self.round.traffic
        self._check_stamps(stamps, label, self.driver.process_group)
        self.driver.finished_at = self.driver.steps
        self.driver.round_s = time.perf_counter() - self._launched_s
        _log.debug("%s: merged at step %d", label, self.driver.steps)

    def discard_pending(self) -> None:
        """Drop the round in flight, if any, as every rank does (leaving the block on an exception)."""
        if self.launched_at is not None:
            self.launched_at = None
            self.round.discard()
            self.driver.traffic += self.round.traffic

    def abandon(self) -> None:
        """A member was lost: drop the round in flight (its progress rides in the next one)."""
        self.launched_at = None
        self.round.abandon()

    def _count(self) -> int:
        """What a round's stamp counts: paced sites differ in steps, not rounds; so may a site that joined in a run's
        last period (it enters the members' next round, which may be their final sync)."""
        driver = self.driver
        return driver.rounds if driver.pace is not None or driver.membership is not None else driver.steps

    def _average_optimizer_state(self, label: str) -> Traffic:
        """After a blocking round, the optimizers' state averaged over the driver's group. With a membership, weighed
        like the round's payload, its wait abandoned once a member is lost, and a failure agreed by the site's
        processes and raised as a :class:`PeerError`, as a round's is (the round stays merged)."""
        group = self.driver.process_group
        if self.epochs is None:
            return self.optimizer_state.all_reduce_mean_(group)
        state, failing = self.optimizer_state, self.epochs.membership.failing
        average = functools.partial(state.all_reduce_mean_, group, scale=self.round.scale, abandon=failing)
        return self.epochs.agreed(average, f"{label}: averaging the optimizers' state")

    def _node_round_now(self) -> bool:
        driver, node_round = self.driver, self.node_round
        assert node_round is not None
        label = f"averaging round {driver.rounds + 1} (inside the node) at step {driver.steps}"
        layout, _ = self.optimizer_state.refresh()
        node_round.launch(Stamp(stamp_count(driver.steps), layout, True), label=label, blocking=True)
        self._check_stamps(node_round.finish(), label, driver.node_group)
        sent = node_round.traffic + self.optimizer_state.all_reduce_mean_(driver.node_group)
        driver.traffic += sent
        driver.node_traffic += sent
        driver.rounds += 1
        driver.node_rounds += 1
        return True

    def _check_stamps(self, stamps: list[Stamp], label: str, group: ProcessGroup) -> None:
        driver = self.driver
        by_rounds = group is driver.process_group and (driver.pace is not None or driver.membership is not None)
        layouts = functools.partial(describe_disagreement, self.optimizer_state.layout[1], self.device, group)
        count, paced = (driver.rounds if by_rounds else driver.steps), driver.pace is not None
        check_stamps(stamps, group, label, count=count, by_rounds=by_rounds, paced=paced, layouts=layouts)
