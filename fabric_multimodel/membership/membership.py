"""Live membership: sites that come and go while the others train on, with no restart.

Each site is a job of its own (its own ``fabric run`` or torchrun). The sites that train together agree, through a
store on a coordinator outside every site (``python -m fabric_multimodel.coordinator``, or an etcd cluster:
:mod:`fabric_multimodel.membership.etcd_store`), on the members of each *epoch*, and each epoch has a process group of
its own among its members (:func:`~fabric_multimodel.comm.collectives.standalone_group`). An
:class:`~fabric_multimodel.Averager` given a :class:`Membership` runs each round on its epoch's group, and moves to the
next epoch at a round boundary (a site joined) or when a round fails (a site left).

Every decision is one key of the store, written once with ``compare_set``: the first proposal wins and every member
reads the same value, so no member leads and any site may be lost, the first one included. A member is a *token*,
``<site>#<n>`` (its registration number), so a site that starts again is a new member. A site of several processes
registers once and moves as one (:meth:`Membership.agree`). The rounds never need the coordinator: a site that loses it
trains on in its epoch while changes wait (:mod:`fabric_multimodel.membership.link`), and puts the run's state back
into a coordinator that returns empty. The keys, step by step: the design notes, "Live membership".
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist

from fabric_multimodel.comm.collectives import standalone_group
from fabric_multimodel.membership.decisions import Decision, put_back
from fabric_multimodel.membership.epoch import Epoch, RunEnded
from fabric_multimodel.membership.figures import check_reported, encode_figures
from fabric_multimodel.membership.link import CoordinatorLink, Unreachable
from fabric_multimodel.membership.names import check_site_name
from fabric_multimodel.membership.signed import run_secret
from fabric_multimodel.membership.stores import check_coordinator

_log = logging.getLogger(__name__)
_T = TypeVar("_T")

#: Seconds between two polls of the store while waiting (admission, check-ins).
POLL_S = 0.05
#: What ``admit/<token>`` says to a registrant passed over as gone (its heartbeat stood still): register again.
GONE = "gone"
#: What ``join/<n>`` holds for a registration whose site wrote no name within ``3 * heartbeat_s`` of being seen (it
#: died between taking its number and writing its name): passed over. No site's name can be it.
NAMELESS = "-"


class Membership:
    """This site's membership in a run whose sites come and go: registration, the epochs it takes part in, and
    the process group of each.

    Args:
        coordinator: ``host:port`` of the store every site reaches (``python -m fabric_multimodel.coordinator``),
            or an etcd cluster's members, ``etcd://host:port,host:port,...`` (the coordinator may then lose one).
        site: this site's name (the same when it starts again); ``#`` is not allowed in it.
        device: where the group's collectives run (``fabric.device``): gloo on a CPU, NCCL on a GPU.
        min_sites: the first epoch starts when this many sites registered.
        timeout: seconds after which a collective of an epoch's group fails, the longest a survivor waits for the
            others to check in, and for the store.
        heartbeat_s: seconds between this process's heartbeats; a member whose heartbeat stood still for three of
            them is gone.
        run: the run's name: the store's keys are under it, so one coordinator can serve several runs.
        max_sites: the most members an epoch may have (sites past it wait for a place).
        on_transfer: called as ``on_transfer(bytes_done, bytes_total, seconds)`` every few seconds and at the end
            while this site receives the state of the run from a member (it joined, or missed a round).
        grace_s: how long the coordinator may be out of reach: the site trains on in its epoch meanwhile (changes
            wait), and past it stops (:attr:`coordinator_lost`, :class:`CoordinatorLost`). See the operator's guide.
        secret: the run's secret (default: ``FABRIC_MULTIMODEL_SECRET``): only sites that hold it are let in, every
            key and value in the store is signed with it (:mod:`~fabric_multimodel.membership.signed`); a wrong one
            raises :class:`~fabric_multimodel.membership.signed.WrongSecret` here.

    Build it once the site's own world started (``fabric.launch()``): a site of several processes is the default
    process group, and every site of the run must have as many.

    Example::

        membership = Membership("coordinator-host:29400", site="berlin", device=fabric.device, min_sites=2)
        with Averager(fabric, model, period=128, outer_optimizer=diloco, membership=membership) as averager:
            ...  # the loop: a site that leaves or joins costs the others a round's wait, not a restart
        membership.close()
    """

    def __init__(
        self,
        coordinator: str,
        site: str,
        *,
        device: torch.device | str = "cpu",
        min_sites: int = 1,
        timeout: float = 30.0,
        heartbeat_s: float = 0.5,
        run: str = "run",
        max_sites: int = 64,
        on_transfer: Callable[[int, int, float], None] | None = None,
        grace_s: float = 300.0,
        secret: str | bytes | None = None,
    ) -> None:
        try:
            check_coordinator(coordinator)
        except ValueError as error:
            raise ValueError(
                f"Membership: `coordinator` must be 'host:port' or 'etcd://host:port,host:port,...'; {error}."
            ) from None
        try:
            check_site_name(site)
        except ValueError as error:
            raise ValueError(f"Membership: `site`: {error}.") from None
        for name, value in (("min_sites", min_sites), ("max_sites", max_sites)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Membership: `{name}` must be a positive int, got {value!r}.")
        if min_sites > max_sites:
            raise ValueError(f"Membership: `min_sites` ({min_sites}) is more than `max_sites` ({max_sites}).")
        for name, seconds in (("timeout", timeout), ("heartbeat_s", heartbeat_s), ("grace_s", grace_s)):
            if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not seconds > 0:
                raise ValueError(f"Membership: `{name}` must be a positive number of seconds, got {seconds!r}.")
        self.site, self.min_sites, self.max_sites = site, min_sites, max_sites
        self.timeout, self.heartbeat_s = float(timeout), float(heartbeat_s)
        self.device = torch.device(device)
        self.on_transfer = on_transfer
        self.coordinator = coordinator
        #: This process's rank in its site, and the site's processes (its own world: 1 when it has none).
        self.local_rank, self.processes = (
            (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
        )
        #: Seconds the coordinator may be out of reach before this site stops.
        self.grace_s = float(grace_s)
        self._store = CoordinatorLink(coordinator, run, timeout=self.timeout, grace_s=self.grace_s,
                                      secret=run_secret(secret, warn=self.local_rank == 0))  # fmt: skip
        #: The run's id (the first epoch's proposer draws it): a coordinator back with another's keys is refused.
        self.run_id: str | None = None
        # Round boundaries this site kept its epoch at while the coordinator was lost (see at_boundary).
        self._kept_away: list[int] = []
        #: This process's token once registered, ``<site>#<n>``.
        self.token: str | None = None
        #: The epoch this process is in (None before :meth:`join`).
        self.epoch: Epoch | None = None
        #: Seconds this process spent on changes after its first epoch: agreements, waiting for survivors, groups.
        self.waited_s = 0.0
        self._decision: Decision | None = None
        #: Registrants this process has looked at: their heartbeat count then, and when (see _admissible).
        self._registrants: dict[str, tuple[int, float]] = {}
        #: Registrations this process found with no name yet, and when (see _name_of).
        self._nameless: dict[int, float] = {}
        self._reported: dict[str, float | torch.Tensor] = {}  # see report

    # --- registration and admission ---------------------------------------------------------------

    def join(self, on_wait: Callable[[float], None] | None = None) -> Epoch:
        """Register and wait to be admitted (the first ``min_sites`` sites: at once; later ones at the members'
        next round boundary); returns the first epoch this process is in, with its group made.
        ``on_wait(seconds)`` is called about every 10 s while waiting.

        Example::

            epoch = membership.join(on_wait=lambda s: print(f"waiting to be admitted: {s:.0f} s"))
        """
        return self._admit(on_wait)

    def _admit(self, on_wait: Callable[[float], None] | None = None) -> Epoch:
        """Register and wait to be admitted; a coordinator lost meanwhile (its registration with it) is waited
        for, ``grace_s`` at most, and the site registers again."""
        while True:
            try:
                return self._register(on_wait)
            except Unreachable:
                self.epoch = self._decision = None
                self._store.wait_found()
                _log.warning("site %s registers again: the coordinator was lost while it waited", self.site)

    def _register(self, on_wait: Callable[[float], None] | None = None) -> Epoch:
        start = time.perf_counter()
        processes = int(self._store.compare_set("processes", "", str(self.processes)))
        if processes != self.processes:  # on every process of the site, before it registers
            raise ValueError(
                f"Membership: this site has {self.processes} processes and the run's sites have {processes}; start"
                " every site with the same number (process i of each site averages with process i of the others)."
            )
        number = self._from_site_process_0(self._store.add("joins", 1) if self.local_rank == 0 else 0)
        self.token = f"{self.site}#{number}"
        if self._store.compare_set(f"join/{number}", "", self.token).decode() != self.token:
            _log.warning("registration %d was passed over before its name landed: registering again", number)
            return self._register(on_wait)
        self._store.start_heartbeats(lambda: f"beat/{self.token}", self.heartbeat_s, f"heartbeat-{self.site}")
        if not self._store.check(["epoch/0/next"]):  # the first epoch: the first min_sites sites with a name
            self._first_epoch(on_wait, start)
        admitted = self._poll([f"admit/{self.token}", "epoch/0/next"], on_wait, start, first_only=True)
        if admitted == "epoch/0/next":
            decision = Decision.decode(self._store.get("epoch/0/next"))
            number = 1
            if self.token not in decision.members:  # registered before the first epoch, not one of it
                self._poll([f"admit/{self.token}"], on_wait, start)
                admitted = f"admit/{self.token}"
        if admitted != "epoch/0/next":
            value = self._store.get(f"admit/{self.token}").decode()
            if value == GONE:  # its heartbeat stood still while it waited, and the members went on without it
                return self._register(on_wait)
            number = int(value)
            decision = Decision.decode(self._store.get(f"epoch/{number - 1}/next"))
        self.run_id = self._store.get("id").decode()
        return self._enter(number, decision, previous=())

    def _first_epoch(self, on_wait: Callable[[float], None] | None, start: float) -> None:
        """Propose the first epoch once ``min_sites`` registrations have a name, in their order (those that never
        wrote one passed over); any registrant may, the first proposal wins."""
        self._wait_until(self._propose_first_epoch, on_wait, start)

    def _propose_first_epoch(self) -> bool | None:
        """True once the first epoch is decided (by this proposal or another's); None while a name may still come
        or too few have one."""
        if self._store.check(["epoch/0/next"]):
            return True
        names: list[str] = []
        for number in range(1, self._store.add("joins", 0) + 1):
            name = self._name_of(number)
            if name is None:  # it may still come: wait for it
                return None
            names += [] if name == NAMELESS else [name]
            if len(names) == self.min_sites:
                self._store.compare_set("id", "", uuid.uuid4().hex)  # before the epoch: whoever reads one finds both
                self._store.compare_set("epoch/0/next", "", Decision(tuple(names), number).encode())
                return True
        return None

    def _name_of(self, number: int) -> str | None:
        """The token registration ``number`` wrote; :data:`NAMELESS` once it is passed over (no name ``3 *
        heartbeat_s`` after this process first looked); None while it may still come. Its site's own
        ``compare_set`` and the passing over cannot both win."""
        key = f"join/{number}"
        if self._store.check([key]):
            return self._store.get(key).decode()
        first_seen = self._nameless.setdefault(number, time.perf_counter())
        if time.perf_counter() - first_seen < 3 * self.heartbeat_s:
            return None
        name = self._store.compare_set(key, "", NAMELESS).decode()
        if name == NAMELESS and self.local_rank == 0:
            _log.warning("registration %d wrote no name: passed over (its site died registering?)", number)
        return name

    def _admissible(self, first: int, registered: int, room: int) -> tuple[list[str], int]:
        """The sites registered as numbers ``first..registered`` that may be admitted now (at most ``room``), and
        the last registration that accounts for. One whose heartbeat has not moved since this process first
        looked at it, and those after it, wait for a later boundary; one whose heartbeat stood still for
        ``3 * heartbeat_s`` is gone (it died while it waited) and is passed over: admitted, it would hold the
        next epoch's group ``timeout`` seconds waiting for it."""
        admitted: list[str] = []
        last, now = first - 1, time.perf_counter()
        for number in range(first, registered + 1):
            if len(admitted) == room:
                break
            token = self._name_of(number)
            if token is None:  # its name may still come: it and those after it wait for a later boundary
                break
            if token == NAMELESS:
                last = number
                continue
            count = self._store.add(f"beat/{token}", 0)
            first_count, first_seen = self._registrants.setdefault(token, (count, now))
            if count != first_count:
                admitted.append(token)
            elif now - first_seen < 3 * self.heartbeat_s:
                break
            last = number
        return admitted, last

    def _poll(
        self,
        keys: Sequence[str],
        on_wait: Callable[[float], None] | None,
        start: float,
        *,
        first_only: bool = False,
    ) -> str:
        """Wait until every key exists (``first_only``: any of them, returned)."""

        def present() -> str | None:
            found = [key for key in keys if self._store.check([key])]
            return found[0] if (found and first_only) or len(found) == len(keys) else None

        return self._wait_until(present, on_wait, start)

    def _wait_until(self, ready: Callable[[], _T | None], on_wait: Callable[[float], None] | None, start: float) -> _T:
        """``ready()`` once it is not None, asked every ``POLL_S``; :class:`RunEnded` once the run finished;
        ``on_wait(seconds)`` about every 10 s. Polls: a store wait that times out would leave the connection
        unusable."""
        reported = start
        while True:
            if self._store.check(["finished"]):
                raise RunEnded(f"Membership: the run finished before site {self.site!r} was admitted; nothing to join.")
            result = ready()
            if result is not None:
                return result
            now = time.perf_counter()
            if on_wait is not None and now - reported >= 10:
                on_wait(now - start)
                reported = now
            time.sleep(POLL_S)

    # --- changes ------------------------------------------------------------------------------------

    def at_boundary(self, index: int) -> Epoch | None:
        """At a round boundary (``index``: the same count on every member, e.g. the rounds so far): a new epoch,
        with its group made, when sites registered since this one began; else None. One ``compare_set`` on the
        store, and nothing else, when no site is waiting. While the coordinator is out of reach: None, and no store
        call (the epoch goes on; a change waits until it answers again).

        Example::

            if (epoch := membership.at_boundary(averager.rounds)) is not None:
                print("admitted", epoch.joined)
        """
        epoch, decision = self._current()
        start = time.perf_counter()
        try:
            taken = self._back(epoch, decision) if self._store.lost else None
            taken = taken or self._decide(epoch, decision, index)
        except Unreachable:
            self._kept_away.append(index)
            return None
        if taken is None:
            return None
        result = self._change(epoch, taken)
        self.waited_s += time.perf_counter() - start
        return result

    def report(self, **figures: float | torch.Tensor) -> None:
        """Figures of this site's own for the status page, beside the ones the library publishes (its step, rounds,
        bytes): the last value of each goes with the next :meth:`publish`, at a round boundary. A tensor is kept
        as it is and read there, so reporting a loss every step costs no device sync.

        Example::

            loss = loss_fn(model(x), y)
            membership.report(loss=loss)
        """
        for name, value in figures.items():
            check_reported(name, value, len(self._reported | figures))
            self._reported[name] = value.detach() if isinstance(value, torch.Tensor) else value

    def publish(self, figures: Mapping[str, float]) -> None:
        """This site's figures for the run's status page (:mod:`fabric_multimodel.status`), as of now, with what it
        last :meth:`report`-ed: its process 0 writes them, one small value, no collective; nothing while the
        coordinator is away. A ValueError for figures that are not a few numbers
        (:func:`~fabric_multimodel.membership.figures.encode_figures`).

        Example::

            membership.publish({"step": averager.steps, "rounds": averager.rounds})
        """
        if self.local_rank != 0 or self.token is None or self._store.lost:
            return
        reported = {name: float(value) for name, value in self._reported.items()}
        text = encode_figures({**reported, **figures})
        try:
            self._store.set(f"status/{self.token}", text)
        except Unreachable:  # said by the link; the next boundary publishes again
            pass

    def _decide(self, epoch: Epoch, decision: Decision, index: int) -> Decision | None:
        """Round ``index``'s decision: None to keep the epoch, else the next one."""
        registered = self._store.add("joins", 0)
        proposal = "keep"
        room = self.max_sites - len(epoch.members)
        if registered > decision.registrations and room > 0:
            new, last = self._admissible(decision.registrations + 1, registered, room)
            if new:  # one that is gone is passed over with the next one admitted
                proposal = Decision(epoch.members + tuple(new), last).encode()
        decided = self._store.compare_set(f"epoch/{epoch.number}/round/{index}", "", proposal).decode()
        if decided == "keep":
            return None
        # the round's decision is the next epoch, unless a failure elsewhere decided it first
        return Decision.decode(self._store.compare_set(f"epoch/{epoch.number}/next", "", decided))

    def _back(self, epoch: Epoch, decision: Decision) -> Decision | None:
        """Once the coordinator answers again: the run's state put back if it came back empty, and the boundaries
        this site kept its epoch at meanwhile written as kept, so that none is decided otherwise later; where another
        member had decided a change at one of them first, that change (this site follows it). ``Unreachable`` while
        the coordinator is still away."""
        if not self._store.found():
            raise Unreachable(f"the coordinator {self.coordinator} is out of reach")
        assert self.run_id is not None
        put_back(self._store, self.run_id, epoch.number, decision, self.processes, self.coordinator)
        kept, self._kept_away = self._kept_away, []
        if kept and self.local_rank == 0:
            _log.info("epoch %d went on through %d round boundaries without the coordinator", epoch.number, len(kept))
        for index in kept:
            decided = self._store.compare_set(f"epoch/{epoch.number}/round/{index}", "", "keep").decode()
            if decided != "keep":
                return Decision.decode(self._store.compare_set(f"epoch/{epoch.number}/next", "", decided))
        return None

    def recover(self) -> Epoch:
        """After a round of this epoch failed: agree with the survivors on the next epoch and make its group. A
        member left out of it (it checked in too late) registers again and waits to be admitted.

        Example::

            try:
                dist.all_reduce(tensor, group=epoch.group)
            except RuntimeError:
                epoch = membership.recover()

        A coordinator out of reach is waited for (the survivors agree through it), ``grace_s`` at most: then
        :class:`CoordinatorLost`.
        """
        while True:
            try:
                return self._recover()
            except Unreachable:
                self._store.wait_found()
                self._back(*self._current())  # a change decided meanwhile is settled by the next key, as always

    def _recover(self) -> Epoch:
        epoch, decision = self._current()
        start = time.perf_counter()
        assert self.token is not None
        if self.local_rank == 0:
            _log.warning("epoch %d failed (a member was lost): agreeing on the survivors", epoch.number)
        self._store.set(f"epoch/{epoch.number}/failing", "1")  # the others stop waiting on this epoch's collectives
        self._store.set(f"epoch/{epoch.number}/alive/{self.token}", "1")
        key = f"epoch/{epoch.number}/next"
        if not self._store.check([key]):
            alive = self._survivors(epoch)
            registered = self._store.add("joins", 0)
            room = max(self.max_sites - len(alive), 0)
            new, last = self._admissible(decision.registrations + 1, registered, room)
            proposal = Decision(tuple(alive) + tuple(new), last)
            self._store.compare_set(key, "", proposal.encode())
        result = self._change(epoch, Decision.decode(self._store.get(key)))
        self.waited_s += time.perf_counter() - start
        return result

    def failing(self) -> bool:
        """True once a member of this epoch has begun to recover from a failed round: a collective of the epoch
        that is still unfinished can then only time out (one look at the store).

        Example::

            wait_all(work, abandon=membership.failing)
        """
        epoch = self.epoch
        if epoch is None or self._store.lost:  # nobody can say: the collective's own timeout ends a wait then
            return False
        try:
            return self._store.check([f"epoch/{epoch.number}/failing"])
        except Unreachable:
            return False

    @property
    def coordinator_lost(self) -> bool:
        """True once the coordinator has been out of reach for longer than ``grace_s``: time to save a checkpoint
        and stop (:class:`~fabric_multimodel.Loop` does), and resume when it is back.

        Example::

            if membership.coordinator_lost:
                checkpointer.save(state)
                raise SystemExit(75)
        """
        return self._store.away_s() > self._store.grace_s

    @property
    def outages(self) -> list[float]:
        """Seconds of each coordinator outage this process lived through (once it answered again)."""
        return list(self._store.outages)

    def agree(self, ok: bool) -> bool:
        """True when every process of this site says ``ok`` (one all-reduce inside the site; none in a site of one
        process). A process that says not ok first marks the epoch failing, so that the other sites' waits on it
        end: a site then recovers as one, never half of it in the next epoch.

        Example::

            if not membership.agree(round_failed_here is None):
                epoch = membership.recover()
        """
        if not ok and self.epoch is not None:
            try:
                self._store.set(f"epoch/{self.epoch.number}/failing", "1")
            except Unreachable:  # the others' waits end on their own timeout
                pass
        if self.processes == 1:
            return ok
        flag = torch.tensor([0 if ok else 1], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # the site's own world: its processes live and die together
        return not bool(flag.item())

    def _from_site_process_0(self, value: int) -> int:
        """``value`` as the site's process 0 has it (one broadcast inside the site; none in a site of one)."""
        if self.processes == 1:
            return value
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.broadcast(tensor, src=0)
        return int(tensor.item())

    def _survivors(self, epoch: Epoch) -> list[str]:
        """The members of ``epoch`` that checked in, once every member whose heartbeat moves has (``timeout`` at
        most), in the epoch's order."""
        start = time.perf_counter()
        beats: dict[str, tuple[int, float]] = {}
        while True:
            now = time.perf_counter()
            checked = {m for m in epoch.members if self._store.check([f"epoch/{epoch.number}/alive/{m}"])}
            waiting = []
            for member in epoch.members:
                if member in checked:
                    continue
                count = self._store.add(f"beat/{member}", 0)
                last = beats.get(member)
                if last is None or last[0] != count:
                    beats[member] = (count, now)
                if now - beats[member][1] < 3 * self.heartbeat_s:
                    waiting.append(member)
            if not waiting or now - start >= self.timeout or self._store.check([f"epoch/{epoch.number}/next"]):
                return [m for m in epoch.members if m in checked]
            time.sleep(POLL_S)

    def _change(self, epoch: Epoch, decision: Decision) -> Epoch:
        """Move from ``epoch`` to the next, as ``decision`` says; rejoin as a new site when it leaves us out."""
        assert self.token is not None and self._decision is not None
        try:
            self._tell_registrants(epoch, decision, self._decision)
        except Unreachable:  # the group cannot be made either: this epoch fails, and waits for the coordinator
            pass
        if self.token not in decision.members:
            _log.warning("site %s was left out of epoch %d: registering again", self.site, epoch.number + 1)
            self.epoch = self._decision = None
            return self._admit()
        return self._enter(epoch.number + 1, decision, previous=epoch.members)

    def _tell_registrants(self, epoch: Epoch, decision: Decision, before: Decision) -> None:
        """Admit the sites ``decision`` takes into the epoch after ``epoch``; tell those it passed over to register
        again."""
        for token in decision.members:
            if token not in epoch.members:
                self._store.set(f"admit/{token}", str(epoch.number + 1))
        for number in range(before.registrations + 1, decision.registrations + 1):
            token = self._store.get(f"join/{number}").decode()  # written: the decision accounted for it
            if token != NAMELESS and token not in decision.members:  # passed over as gone: it registers again
                self._store.set(f"admit/{token}", GONE)
        self._store.set("epoch", str(epoch.number + 1))

    def _enter(self, number: int, decision: Decision, previous: Sequence[str]) -> Epoch:
        """Make the group of epoch ``number`` (every member calls this; ``timeout`` at most). A member that does not
        arrive fails the epoch before it began: the others recover from it."""
        assert self.token is not None
        rank = decision.members.index(self.token)
        joined = tuple(m for m in decision.members if m not in previous)
        left = tuple(m for m in previous if m not in decision.members)
        self.epoch, self._decision = Epoch(number, decision.members, rank, None, joined, left), decision
        store = self._store.prefixed(f"epoch/{number}/group/{self.local_rank}/")
        try:
            group = standalone_group(store, rank, len(decision.members), self.device, self.timeout)
        except RuntimeError:
            group = None
        if not self.agree(group is not None):  # every process of the site in the epoch, or none
            return self.recover()
        self.epoch = dataclasses.replace(self.epoch, group=group)
        if self.local_rank == 0:
            _log.info(
                "epoch %d: %d sites %s, this one rank %d (joined: %s; left: %s)",
                number,
                len(decision.members),
                ", ".join(self.epoch.sites),
                rank,
                ", ".join(joined) or "none",
                ", ".join(left) or "none",
            )
        return self.epoch

    def _current(self) -> tuple[Epoch, Decision]:
        if self.epoch is None or self._decision is None:
            raise RuntimeError("Membership: this site is in no epoch yet; call join() first.")
        return self.epoch, self._decision

    def close(self, finished: bool = False) -> None:
        """Stop the heartbeats (the others then see this site gone within ``3 * heartbeat_s``) and drop the group.
        ``finished``: this site ran the run to its end (every member ends at the same step), so sites still
        waiting to be admitted stop waiting (their :meth:`join` raises :class:`RunEnded`).

        Example::

            membership.close(finished=averager.steps == total_steps)
        """
        if finished and self.epoch is not None:
            try:
                self._store.set("finished", "1")
            except Unreachable:  # nobody can be waiting on a coordinator that is gone
                pass
        self._store.stop_heartbeats(self.heartbeat_s + 1)
        self.epoch = self._decision = None

    def __enter__(self) -> Membership:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
