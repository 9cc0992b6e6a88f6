"""What an :class:`~fabric_multimodel.Averager` does while a live membership's sites come and go: :class:`Epochs`.

The agreement itself (who is a member, when a site is admitted or declared lost) is
``fabric_multimodel.membership.membership``'s. Here, the Averager's side of it: it enters each epoch over the epoch's
group, brings the members behind (a site that joins, a survivor that missed a round) to the newest state from
one member that holds it while the others train on, weighs each round by who brought progress to it, agrees
the pace again under ``pace="speed"``, and on a failure drops the round in flight and goes on among the
survivors.
"""

from __future__ import annotations

import dataclasses
import io
import math
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from fabric_multimodel.averaging.driver import Driver
from fabric_multimodel.averaging.pacing import Pace, gather_pace, paced
from fabric_multimodel.comm.collectives import Traffic, all_gather_single, broadcast_differences, group_rank, group_size
from fabric_multimodel.comm.relay import post_bytes, relay_bytes
from fabric_multimodel.membership.epoch import Epoch
from fabric_multimodel.membership.membership import Membership
from fabric_multimodel.rounds.errors import PeerError
from fabric_multimodel.rounds.round import Round

_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class DriverHooks:
    """What the driver lends an epoch change beyond its public state: its round and device, and the operations
    that stay the driver's own (bound methods)."""

    round: Round
    device: Any
    site: dist.ProcessGroup | None  # islands: the site's own group, on which its processes agree
    fastest_period: int  # pace="speed": the fastest site's local steps per round
    check_agreement: Callable[[], None]  # every member built the same driver, or all raise
    abandon_round: Callable[[], None]  # drop the round in flight
    last_round: Callable[[], tuple[int, int]]  # paced: this site's last round position
    own_step_s: Callable[[], float]  # paced: this rank's recent step time (NaN before one)
    set_pace: Callable[[Pace, tuple[int, int] | None], None]


class Epochs:
    """The epochs of ``membership`` that ``driver`` runs its rounds in (built by the Averager, which joins
    through it; see the elastic guide)."""

    def __init__(self, driver: Driver, hooks: DriverHooks, membership: Membership) -> None:
        self.averager, self.hooks, self.membership = driver, hooks, membership
        #: Seconds this process spent on membership changes after its first epoch (see ``Averager``).
        self.wait_s = 0.0
        #: Bytes of Averager state received or sent on entering the last epoch (see ``Averager``).
        self.state_traffic = Traffic()
        # The ranks that entered the epoch behind the others, and the fragments still to have their first round
        # in it (see _enter_epoch).
        self._welcome: tuple[frozenset[int], set[int]] = (frozenset(), set())
        self._pace_due = False  # an epoch began: agree the pace again at its first round boundary

    def agreed(self, collectives: Callable[[], _T], what: str) -> _T:
        """``collectives()``; a failure on any process of this site (a member lost) is a ``PeerError`` on all
        of them, as a round's is, so that the site moves as one."""
        failure: RuntimeError | None = None
        try:
            result = collectives()
        except RuntimeError as error:
            failure = error
        if not self.membership.agree(failure is None):
            raise PeerError(f"{what} failed: {failure or 'on another process of this site'}") from failure
        return result

    def across_sites(self, collectives: Callable[[], _T]) -> _T:
        """``collectives()`` over the epoch's group, and over the next epoch's again when a member is lost
        meanwhile."""
        while True:
            try:
                return self.agreed(collectives, "measuring across the sites")
            except PeerError:
                self.recover()

    def at_boundary(self) -> None:
        """A round finished and none is in flight: publish this site's figures for the status page (one small write,
        on process 0) and admit the sites that are waiting, if any (one store call)."""
        start, averager = time.perf_counter(), self.averager
        self.membership.publish(
            {
                "step": averager.steps,
                "rounds": averager.rounds,
                "bytes": averager.traffic.bytes,
                "wait_s": round(self.wait_s, 2),
                "round_s": round(averager.round_s, 3),
            }
        )
        epoch = self.membership.at_boundary(averager.rounds)
        if epoch is not None:
            self.enter(epoch)
        elif averager.pace is not None and (self._pace_due or any(math.isnan(s) for s in averager.pace.step_s)):
            # an epoch's first boundary, or a site that joined has not timed its steps yet: agree again
            self._repace(*self.across_sites(lambda: self._gather_pace(False)), False)
        self.wait_s += time.perf_counter() - start

    def recover(self) -> None:
        """A round failed on a peer: drop it, agree on the survivors, and go on among them (no step lost)."""
        start = time.perf_counter()
        self.hooks.abandon_round()
        self.enter(self.membership.recover())
        self.wait_s += time.perf_counter() - start

    def enter(self, epoch: Epoch) -> None:
        """Enter ``epoch``, and the next one while a member is lost as it begins."""
        while True:
            try:
                self._enter_epoch(epoch)
                return
            except PeerError:
                epoch = self.membership.recover()

    def _enter_epoch(self, epoch: Epoch) -> None:
        """Run the next rounds over ``epoch``'s group: check that its members built the same Averager, and bring
        those behind (a site that joins, a survivor that missed the last round) to the newest state, received from
        the first member that holds it, point to point (a site of several processes: by its process 0, then inside
        the site). A run's start (every member at step 0) sends instead the first member's values where they
        differ. A site's processes agree that all of them began the epoch before any goes on."""
        averager, hooks, membership = self.averager, self.hooks, self.membership
        assert epoch.group is not None
        averager.process_group = epoch.group
        hooks.round.regroup(epoch.group, membership.failing, membership.agree if membership.processes > 1 else None)
        failure: RuntimeError | None = None
        data, behind = None, False
        ranks_behind: list[int] = []
        pace_inputs: tuple[list[float], int] | None = None
        with hooks.round.storage.synced():
            try:
                try:
                    hooks.check_agreement()
                except ValueError as error:
                    if membership.token in epoch.joined:  # this new site built another Averager: it stops here
                        raise
                    raise PeerError(f"Averager: a site new in epoch {epoch.number} differs: {error}") from error
                if averager.pace is not None:  # paced sites differ in steps, not rounds; and a pace is ahead of none
                    progress = [1, averager.rounds, 0]
                else:
                    finished = -1 if averager.finished_at is None else averager.finished_at
                    progress = [0, averager.steps, finished]
                source, ranks_behind, newest = catch_up(progress, hooks.device, epoch.group)
                behind = epoch.rank in ranks_behind
                pace_inputs = self._gather_pace(behind) if newest[0] else None  # the members agreed a pace
                self.state_traffic = Traffic()
                if source is None and averager.steps == 0:
                    averager.start_traffic += self._start_members()
                elif source is not None and (membership.local_rank == 0 or averager.sharded):
                    data = self._state_bytes(source, ranks_behind, epoch.group)  # FSDP2: each process its shards
            except RuntimeError as error:  # a member was lost while the epoch began
                failure = error
            if not membership.agree(failure is None):
                reason = failure or "another process of this site lost a peer"
                raise PeerError(f"Averager: epoch {epoch.number} could not begin: {reason}") from failure
        if behind:
            if membership.processes > 1 and not averager.sharded:  # the others' copy crosses no link
                data, _ = relay_bytes([(0, rank) for rank in range(1, membership.processes)], data, hooks.device)
            assert data is not None
            traffic = averager.traffic
            averager.load_state_dict(torch.load(io.BytesIO(data), map_location=hooks.device, weights_only=False))
            averager.traffic = traffic  # what this process sent; the state's counters are the sender's
            if averager.anchored and averager.local:  # the modules start from the global model the state holds
                averager.restore_global()
            if averager.local and pace_inputs is None:  # the members trained on while the state crossed: enter
                averager.steps = averager.schedule.next_round(averager.steps) - 1  # the round they are headed for
        if pace_inputs is not None:
            self._repace(*pace_inputs, behind)
            self._pace_due = True  # with fresher times (and where a change came between rounds, its steps)
        # In the first round of each fragment in this epoch, what the members behind send weighs nothing: their
        # parameters are the state they received (the global model; before one, their own), not local progress.
        self._welcome = (frozenset(ranks_behind), set(range(averager.fragments)) if ranks_behind else set())

    def scale(self, fragment: int) -> float:
        """What this rank's payload of ``fragment``'s round is multiplied by (the round divides the sum by the group's
        size): each member's share of the steps behind the round, its local steps per round with ``pace="speed"``
        and 1 otherwise; but in the fragment's first round of the epoch, a member that entered it behind the others
        has none, and the others share its part."""
        averager = self.averager
        world, mine = group_size(averager.process_group), group_rank(averager.process_group)
        shares = list(averager.pace.periods) if averager.pace is not None else [1] * world
        behind, waiting = self._welcome
        if fragment in waiting:
            waiting.discard(fragment)
            shares = [0 if rank in behind else share for rank, share in enumerate(shares)]
        return shares[mine] * world / sum(shares)

    def _start_members(self) -> Traffic:
        """Every member at step 0: start from the first member's values where they differ (sites built from one
        seed send a checksum only), and anchor there."""
        storage = self.hooks.round.storage
        sent = broadcast_differences(storage.buffers, storage.slots, self.hooks.device, self.averager.process_group)
        self.hooks.round.anchor_parameters()
        return sent

    def _state_bytes(self, source: int, behind: list[int], group: dist.ProcessGroup) -> bytes | None:
        """The Averager's state, saved by rank ``source`` of ``group``, received on the ranks ``behind`` (returned);
        None elsewhere. The source posts it and trains on while it crosses: the ranks behind take no part in a round
        before they received it (they enter the members' next one), so it holds no one up unless it takes longer
        than the steps before that round."""
        mine, device = group_rank(group), self.hooks.device
        if mine == source:
            state = _local_shards(self.averager.state_dict())
            state.pop("error_feedback", None)  # what this rank's quantizations dropped: the others start from none
            buffer = io.BytesIO()
            torch.save(state, buffer)
            payload = buffer.getvalue()
            post_bytes(payload, behind, device, group)
            self.state_traffic = Traffic(len(payload), len(payload) * len(behind))
        elif mine in behind:
            data, size = relay_bytes([(source, mine)], None, device, self.membership.on_transfer, group=group)
            self.state_traffic = Traffic(size, size)
            return data
        return None

    # --- pace="speed", agreed again at each epoch -------------------------------------------------

    def _gather_pace(self, behind: bool) -> tuple[list[float], int]:
        """Every member's step time and the members' last round position (see :meth:`_repace`); two collectives.
        The position is where this site's last round fell in the fastest site's steps (-1 before a pace, or
        behind): what a site entering the members' next round counts from."""
        averager, hooks = self.averager, self.hooks
        position = -1 if behind or averager.pace is None else hooks.last_round()[1]
        return gather_pace(hooks.own_step_s(), position, hooks.device, averager.process_group, hooks.site)

    def _repace(self, step_s: list[float], position: int, behind: bool) -> None:
        """The pace agreed again among the members from their step times: a member runs its new steps per round from
        its last round (a change between rounds, in a ``sync()``, weighs the rounds by it at once, and the steps
        change when it is agreed again at the next boundary); a member behind (a site that joined) enters the
        members' next round as the fastest site would, at its next step, and runs ``period`` steps per round until
        it timed its steps."""
        averager, hooks = self.averager, self.hooks
        fastest = hooks.fastest_period
        pace = paced(fastest, step_s)
        if behind:
            averager.steps = position + fastest - 1
            hooks.set_pace(pace, (averager.steps + 1, averager.steps + 1))
            self._pace_due = False
            return
        since = hooks.last_round()
        if since[0] == averager.steps:
            hooks.set_pace(pace, since)
            self._pace_due = False
        else:
            averager.pace = pace


def catch_up(
    progress: Sequence[int], device: torch.device, group: dist.ProcessGroup
) -> tuple[int | None, list[int], list[int]]:
    """Which member of ``group`` holds the newest state, which are behind it, and the newest ``progress``, from each
    member's (ints of the same length on every member, compared in order: say the step, then the step of the last
    round). ``(None, [], progress)`` when every member is where the others are. One all-gather.

    Example::

        source, behind, _ = catch_up([averager.steps, averager.finished_at or -1], fabric.device, epoch.group)
    """
    mine = torch.tensor(list(progress), dtype=torch.int64, device=device)
    everyone = torch.zeros(group.size() * mine.numel(), dtype=torch.int64, device=device)
    all_gather_single(everyone, mine, group=group)
    rows = [list(row) for row in everyone.view(group.size(), -1).tolist()]
    newest = max(rows)
    behind = [rank for rank, row in enumerate(rows) if row != newest]
    return (rows.index(newest) if behind else None), behind, newest


def _local_shards(state: Any) -> Any:
    """``state`` with each DTensor (an FSDP2 shard's, placed on its site's mesh) as its local tensor: what another
    site's process holding the same shard loads (``load_state_dict`` takes either)."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return state.to_local()
    if isinstance(state, dict):
        return {key: _local_shards(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_local_shards(value) for value in state)
    return state
