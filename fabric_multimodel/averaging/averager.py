"""The driver of averaging: the :class:`Averager`, which carries out its schedule's events in the user's loop.

How an Averager is put together (its storage and round) is :mod:`fabric_multimodel.averaging.builder`'s business, when
things happen :mod:`fabric_multimodel.rounds.schedule`'s, what a round does :mod:`fabric_multimodel.rounds.round`' and
:mod:`fabric_multimodel.rounds.outer`'s. One-off rounds and checks are in :mod:`fabric_multimodel.averaging.replicas`.
"""

from __future__ import annotations

import functools
import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch.optim import Optimizer

from fabric_multimodel.averaging.arguments import as_module_list, check_membership, check_optimizers, check_placement
from fabric_multimodel.averaging.auto_period import (
    PeriodChoice,
    agree,
    choose_overlap,
    choose_period,
    shortest_period,
    time_round,
)
from fabric_multimodel.averaging.builder import build_rounds
from fabric_multimodel.averaging.config import AveragerConfig
from fabric_multimodel.averaging.epochs import DriverHooks, Epochs
from fabric_multimodel.averaging.held_bytes import held_bytes
from fabric_multimodel.averaging.pacing import (
    Pace,
    gather_step_times,
    last_round,
    paced,
    paced_steps,
    rounds_origin,
)
from fabric_multimodel.averaging.replicas import HasDevice, Modules
from fabric_multimodel.averaging.saved_state import checked_choice, checked_counters, checked_pace, times_warmup
from fabric_multimodel.comm.collectives import (
    ProcessGroup,
    Traffic,
    broadcast_differences,
    describe_disagreement,
    group_rank,
    group_ranks,
    group_size,
)
from fabric_multimodel.ddp.models import Models
from fabric_multimodel.membership.membership import Membership
from fabric_multimodel.rounds.errors import AveragingError, PeerError
from fabric_multimodel.rounds.header import Header, Stamp
from fabric_multimodel.rounds.optimizer_state import OptimizerStateStorage
from fabric_multimodel.rounds.schedule import Event, Schedule

_log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from lightning_fabric import Fabric

_T = TypeVar("_T")


@dataclass(frozen=True)
class Replica:
    """Which replica this rank holds, of how many, and whether it writes that replica's checkpoint.

    Between rounds every averaging rank holds a replica of its own, except in the islands layout,
    where DDP keeps the processes of a node identical: one replica per node, written by the node's
    first process. See :attr:`Averager.replica`.

    Example::

        replica = averager.replica
        print(f"replica {replica.index} of {replica.count}", "(writes it)" if replica.writer else "")
    """

    index: int
    count: int
    writer: bool


class Averager:
    """Model averaging for the modules of a Fabric loop, driven by one explicit ``step()`` per iteration.

    ``step()`` calls 1..``warmup_steps`` are synchronous DDP; after them the modules issue no collective in
    forward or backward, and every ``period`` steps a round replaces the replicas by their mean (post-local SGD),
    or takes DiLoCo's outer step with their mean pseudo-gradient (``outer_optimizer``), sent in ``comm_dtype``
    (``torch.bfloat16``, or block-quantized fp8/fp4: :mod:`fabric_multimodel.comm.quantized`), overlapped with
    the next ``overlap_steps`` steps, one of ``fragments`` at a time (Streaming DiLoCo). Leaving the block
    averages, so every replica leaves identical.

    The schedule, what leaving the block does, how a drifted or non-finite round fails, DiLoCo's anchor and memory,
    overlap, fragments, mixing, islands and checkpoints, in detail: the averaging guide, "The Averager in detail".

    Args:
        fabric: the launched Fabric (only its ``device`` is read; the Trainer adapter passes its LightningModule).
        modules: a module, an iterable of modules, or the :class:`Models` of :func:`setup_models`.
        config: what the averager does, an :class:`~fabric_multimodel.AveragerConfig` (period, warm-up, DiLoCo's
            outer optimizer, payload dtype, overlap, fragments, ...); or pass its fields as keyword ``options``.
        optimizers: optimizers whose floating-point state (momentum, Adam moments) is averaged too.
        process_group: the group to average over; the default group when None.
        node_group: two-level averaging (``node_period``): the group of this rank's node.
        options: fields of :class:`~fabric_multimodel.AveragerConfig`, replacing those of ``config``.

    Example::

        with Averager(fabric, [gen, disc], period=8, warmup_steps=200, optimizers=[opt_g, opt_d]) as averager:
            for real in loader:
                ...  # D step, G step, optimizer steps
                averager.step()

        diloco = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
        with Averager(fabric, model, period=128, outer_optimizer=diloco, comm_dtype=torch.bfloat16) as averager:
            ...

        # Streaming DiLoCo: a quarter of the model every 32 steps, each merged 8 steps later
        streaming = AveragerConfig(period=128, outer_optimizer=diloco, fragments=4, overlap_steps=8)
        Averager(fabric, model, streaming)
    """

    def __init__(
        self,
        fabric: Fabric | HasDevice,
        modules: Modules,
        config: AveragerConfig | None = None,
        /,
        *,
        optimizers: Sequence[Optimizer] = (),
        process_group: ProcessGroup = None,
        node_group: ProcessGroup = None,
        membership: Membership | None = None,
        **options: Any,
    ) -> None:
        #: What this averager does: the ``config`` passed, with the keyword ``options`` replaced.
        self.config = config = AveragerConfig.build(config, options, "Averager")
        module_list = as_module_list(modules, "Averager")
        self.optimizers = check_optimizers(optimizers, "Averager")
        self._optimizer_state = OptimizerStateStorage(self.optimizers)  # what blocking rounds average with the models
        #: With a :class:`~fabric_multimodel.Membership`: the sites of the run come and go, and each round
        #: runs on the group of the epoch this site is in (``process_group`` is that group).
        self.membership = membership
        self._epochs: Epochs | None = None
        epoch = None
        if membership is not None:  # every check before this site registers, so a mistake costs the others nothing
            check_membership(config, process_group, node_group)
            placement = check_placement(module_list, self.optimizers, None, None, config, across_sites=True)
            epoch = membership.join()
            process_group = epoch.group
        else:
            placement = check_placement(module_list, self.optimizers, process_group, node_group, config)
        #: True when the modules are FSDP2 shards (``fully_shard`` inside each site): a round averages this
        #: rank's shard with the same shard of the other sites, and the sites' own reduce-scatters go on every step.
        self.sharded = placement.sharded
        #: True when the modules synchronise inside each node (DDP, or FSDP2 shards) and rounds average across nodes.
        self.islands = placement.islands
        self.warmup_steps, self.overlap_steps = config.warmup_steps, config.first_overlap
        self.average_buffers, self.node_period = config.average_buffers, config.node_period
        self.process_group, self.node_group = process_group, node_group
        names = list(modules._fields) if isinstance(modules, Models) else None
        live_sites = membership.max_sites if membership is not None else None
        built = build_rounds(
            config, module_list, placement, self.optimizers, process_group, node_group, names, live_sites
        )
        self._round, self._node_round, self._has_buffers = built.round, built.node_round, built.has_buffers
        #: The number of fragments; a round covers one.
        self.fragments = built.fragments
        self._init_timing(config, membership is not None)
        self._site = placement.site
        self._set_period(built.period)
        self._device = fabric.device
        self._ddps = [] if self.islands else list(placement.ddps)  # the DDPs switched off after warm-up
        self._ddp_settings: list[tuple[Any, bool, bool]] | None = None
        self._reset_counters()
        self._agreement = built.agreement
        # The replicas train apart in warm-up (the islands' nodes, a membership's sites): the first round of each
        # part after it is a plain mean that sets its anchor.
        self._apart = self.islands or membership is not None
        #: What the start sent across ``process_group`` (islands: the values in which the nodes' replicas differed).
        self.start_traffic = Traffic()
        # Islands: the node's processes hold one replica between them; the first one writes it.
        self._writes_replica = not self.islands or all(group_rank(ddp.process_group) == 0 for ddp in placement.ddps)
        if membership is not None and epoch is not None:
            self._epochs = Epochs(self, self._driver_hooks(), membership)
            self._epochs.enter(epoch)
        else:
            self._check_agreement(built.agreement)
            self.start_traffic = self._start_islands()

    def _init_timing(self, config: AveragerConfig, live: bool) -> None:
        """What ``period="auto"`` and ``pace="speed"`` time and hold (nothing chosen yet)."""
        #: With ``period="auto"``: what was chosen at the end of warm-up, and from what (None until then).
        self.period_choice: PeriodChoice | None = None
        #: With ``pace="speed"``: every site's local steps per round and weight, agreed at the end of warm-up.
        self.pace: Pace | None = None
        # period="auto" and pace="speed" time the warm-up: seconds between its step() calls
        self._times_warmup = times_warmup(config)
        # pace="speed": the fastest site's local steps per round ("auto" is refused with pace)
        self._fastest_period = config.period if isinstance(config.period, int) else 0
        self._step_gaps: list[float] = []
        self._last_step: float | None = None
        # pace="speed" under a membership, agreed again at each epoch: the seconds of this rank's latest steps
        # without a round, and where this site's pace began (its step at a round, and the fastest site's then)
        self._recent_gaps: deque[float] | None = deque(maxlen=32) if live and config.pace == "speed" else None
        self._pace_since: tuple[int, int] | None = None

    def _driver_hooks(self) -> DriverHooks:
        """What this Averager lends its epochs (a live membership's) beyond its public state."""
        return DriverHooks(
            round=self._round,
            device=self._device,
            site=self._site,
            fastest_period=self._fastest_period,
            check_agreement=lambda: self._check_agreement(self._agreement),
            abandon_round=self._abandon_round,
            last_round=self._last_round,
            own_step_s=self._own_step_s,
            set_pace=self._set_pace,
        )

    def _set_period(self, period: int, start: int | None = None) -> None:
        #: Local steps between rounds (with ``period="auto"``: the smallest allowed until the end of warm-up).
        self.period = period
        self.schedule = Schedule(
            period,
            self.warmup_steps if start is None else start,  # a pace agreed again: rounds every period from there
            fragments=self.fragments,
            overlap_steps=self.overlap_steps,
            node_period=self.node_period,
            phases=self._round.phases,
            ends_warmup=start is None,
        )

    def _warmup_gaps(self, option: str) -> list[float]:
        """The seconds between the warm-up's step() calls on this rank; an error (on every rank) when none was timed."""
        if not self._step_gaps:  # every rank resumed from the same counts: all raise here, before any collective
            raise RuntimeError(
                f"Averager: {option} timed no warm-up step (the run resumed at the warm-up's last step); resume"
                " from an earlier checkpoint."
            )
        return self._step_gaps

    def _choose_period(self) -> None:
        """period="auto", at the end of warm-up: time a round's payload across ``process_group`` and choose from
        it and the warm-up's steps, with the slowest rank's figures on every rank (see ``auto_period``)."""
        mine = statistics.median(self._warmup_gaps("period='auto'"))
        sent = self._round.traffic.bytes

        def across() -> tuple[float, float]:
            round_s = time_round(-(-sent // 4), torch.float32, self._device, self.process_group)
            return agree(mine, round_s, self._device, [self.process_group])

        step_s, round_s = self._across_sites(across)
        if self._site is not None:  # islands: the site's processes choose alike
            step_s, round_s = agree(step_s, round_s, self._device, [self._site])
        timed_step_s = max(step_s, 1e-6)
        if self.config.overlap_steps == "auto":
            self.overlap_steps = choose_overlap(timed_step_s, round_s)
        period = choose_period(timed_step_s, round_s, self.fragments, self.overlap_steps)
        self.period_choice = PeriodChoice(period, step_s, round_s, sent, self.overlap_steps)
        self._set_period(period)

    def _across_sites(self, collectives: Callable[[], _T]) -> _T:
        """``collectives()`` over ``process_group``; with a membership, over the next epoch's group again when a
        member is lost meanwhile."""
        return collectives() if self._epochs is None else self._epochs.across_sites(collectives)

    def _site_step_times(self) -> list[float]:
        """pace="speed", at the end of warm-up: every site's step time, its slowest process's (two collectives).
        The mean, not the median: a site held back in bursts (a CPU quota, a shared GPU) is as slow as its mean."""
        step_s = statistics.fmean(self._warmup_gaps("pace='speed'")) if self.membership is None else self._own_step_s()
        return gather_step_times(step_s, self._device, self.process_group, self._site)

    def _own_step_s(self) -> float:
        """pace="speed" under a membership: this rank's step time, the mean of its latest steps without a round (of
        the warm-up's until it has two of those); NaN when it timed none (a site that just joined)."""
        recent = self._recent_gaps
        gaps = recent if recent is not None and len(recent) >= 2 else self._step_gaps
        return statistics.fmean(gaps) if gaps else math.nan

    def _set_pace(self, pace: Pace, since: tuple[int, int] | None = None) -> None:
        """Run this site's local steps per round, and weight its rounds by them: from the end of warm-up, or from
        ``since``, a round position (this site's step and the fastest site's there; see ``last_round``)."""
        mine = group_rank(self.process_group)
        self.pace, self._pace_since = pace, since
        # periods[mine] * W / sum(periods): exactly 1.0 when every site runs the same steps
        self._round.scale = pace.periods[mine] * len(pace.periods) / sum(pace.periods)
        period = pace.periods[mine]
        if since is None:
            self._set_period(period)
        else:
            self._set_period(period, rounds_origin(since[0], self.steps, period))

    def _last_round(self) -> tuple[int, int]:
        """Paced: this site's last round position (its step and the fastest site's; see ``last_round``)."""
        since = self._pace_since or (self.warmup_steps, self.warmup_steps)  # None: the pace began at warm-up's end
        return last_round(since, self.period, self._fastest_period, self.steps)

    def local_steps(self, total: int) -> int:
        """How many ``step()`` calls this rank makes in a run of ``total`` steps of the fastest site: ``total``
        itself, except with ``pace="speed"`` after warm-up, where a slower site makes fewer, so that every site
        takes part in the same rounds (the last one when leaving the block included). No collective.

        Example::

            last = args.steps
            while step < last:
                ...
                averager.step()
                last = averager.local_steps(args.steps)  # changes once, at the end of warm-up
        """
        if self.pace is None:
            return total
        return paced_steps(total, self.warmup_steps, self.period, self._fastest_period, since=self._pace_since)

    def clock(self, step: int) -> int:
        """A count on which every site acts at the same moment (a stop, a periodic checkpoint): ``step``, this rank's
        iteration count, itself; with ``pace="speed"``, where the sites make different numbers of steps but take part
        in the same rounds, 0 in warm-up and then the fastest site's step at the last round. No collective.

        (A count of steps would tie a fast site to a slow one: a stop voted at a step and read some steps later
        would hold the fast site that close to the slow one.)

        Example::

            before, now = now, averager.clock(step)
            if now // every > before // every:  # every site crosses the same multiple after the same round
                checkpointer.save(state)
        """
        if self.config.pace != "speed":
            return step
        if self.pace is None:
            return 0
        return self.warmup_steps + max(self.pace.periods) * self.rounds

    def _reset_counters(self) -> None:
        #: ``step()`` calls so far.
        self.steps = 0
        #: Averaging rounds done (by ``step()``, ``sync()`` or leaving the block), counted at launch.
        self.rounds = 0
        #: Elements and bytes this averager sent in its rounds (per rank), node-level rounds included.
        self.traffic = Traffic()
        #: Two-level averaging: the rounds inside the node, and what they sent (part of ``rounds``/``traffic``).
        self.node_rounds = 0
        self.node_traffic = Traffic()
        #: The ``step()`` count at which the last round across ``process_group`` finished (a blocking round, or
        #: an overlapped one merged); None before the first.
        self.finished_at: int | None = None
        self._launched_at: int | None = None
        # Per fragment, the step of its last blocking round: a round with no step since then changes nothing.
        self._synced_at = [0] * self.fragments

    def _check_agreement(self, agreement: str) -> None:
        """One small collective: every rank of the group built the same tensors and options, or all raise."""
        problem = describe_disagreement(agreement, self._device, self.process_group)
        if problem:
            raise ValueError(
                "Averager: the modules' parameters (names, shapes, dtypes) or the arguments (period, warmup_steps,"
                " average_buffers, optimizers, outer_optimizer, comm_dtype, overlap_steps, check_finite,"
                " node_period, the layout, fragments, mixing) differ across ranks; build the same models and"
                f" Averager on every rank. {_shorten(problem)}"
            )

    def _start_islands(self) -> Traffic:
        """Islands: DDP made every node's replicas identical, not the nodes'. Start them all from the same
        values, as DDP does for its own group (and the anchors with them); nodes built from one seed already
        agree, and then nothing but a checksum crosses the link."""
        if not self.islands or group_size(self.process_group) == 1:
            return Traffic()
        storage = self._round.storage
        with storage.synced():
            sent = broadcast_differences(storage.buffers, storage.slots, self._device, self.process_group)
            self._round.anchor_parameters()
        return sent

    # --- the with block ------------------------------------------------------------------------

    def __enter__(self) -> Averager:
        if self._ddp_settings is not None:
            raise RuntimeError("Averager: this averager is already in use; enter its `with` block once.")
        self._ddp_settings = [(ddp, ddp.require_backward_grad_sync, ddp.broadcast_buffers) for ddp in self._ddps]
        self._apply_phase()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            if exc_type is not None:
                self._discard_pending()
            else:
                # In the local phase every rank ends with a round, needed or not (then it changes nothing):
                # it carries each rank's step() count, so a schedule that drifted apart is an error on every
                # rank instead of one rank waiting for a round nobody else starts.
                self.sync()
        finally:
            for ddp, grad_sync, broadcast_buffers in self._ddp_settings or ():
                ddp.require_backward_grad_sync = grad_sync
                ddp.broadcast_buffers = broadcast_buffers
            self._ddp_settings = None

    @property
    def local(self) -> bool:
        """True once warm-up is over: forwards and backwards of the modules communicate nothing.

        Example::

            if averager.local:
                print("local SGD phase")
        """
        return self.steps >= self.warmup_steps

    @property
    def pending(self) -> bool:
        """True while an overlapped round is in flight (launched, not yet merged).

        Example::

            if not averager.pending:
                writer.save({"model": model, "averager": averager})  # state_dict() would wait for it
        """
        return self._launched_at is not None

    @property
    def membership_wait_s(self) -> float:
        """With a membership: seconds this process spent on membership changes after its first epoch: agreements,
        groups, the state sent to a site that joined or received from a member (its own admission is part of its
        start, not counted); 0.0 without one.

        Example::

            print(f"membership_wait_s={averager.membership_wait_s:.2f}")
        """
        return self._epochs.wait_s if self._epochs is not None else 0.0

    @property
    def state_traffic(self) -> Traffic:
        """With a membership: bytes of Averager state this process received from a member when it entered an epoch
        behind the others (a site that joined), and sent to such members; per epoch entered, the last one's.

        Example::

            print(f"state_bytes={averager.state_traffic.bytes}")
        """
        return self._epochs.state_traffic if self._epochs is not None else Traffic()

    @property
    def state_bytes(self) -> int:
        """Bytes of the tensors this Averager keeps beside the modules' own: anchors, the outer optimizer's
        state, snapshots, send buffers, quantization scratch and error-feedback residuals (with FSDP2 shards,
        the copy of them that rounds work on holds memory only while they run). What averaging adds to this
        rank's memory between rounds; no collective.

        Example::

            print(f"averaging holds {averager.state_bytes / 2**20:.1f} MiB on this rank")
        """
        modules = {t.untyped_storage().data_ptr() for t in self._round.storage.tensors}
        return held_bytes([self._round, self._node_round], exclude=modules)

    @property
    def anchored(self) -> bool:
        """True when rounds keep an anchor (DiLoCo, ``comm_dtype``): a checkpoint then needs no round.

        The anchors (the global model after each fragment's last round) and the outer optimizer are
        identical on every rank by construction, so each replica saves them beside its own
        parameters and inner optimizer, with no collective (see :attr:`replica`). Plain averaging has
        no anchor: a checkpoint of one model needs :meth:`sync`, one blocking round.

        Example::

            if not averager.anchored:
                averager.sync()
        """
        return self._round.anchored

    @property
    def replica(self) -> Replica:
        """Which replica this rank holds: its position in ``process_group``, how many there are, and whether
        this rank writes it (islands: the node's first process; otherwise every rank).

        With anchored rounds each replica's writer saves its own checkpoint (see
        :func:`~fabric_multimodel.checkpoints.files.replica_path`); none of it crosses the link.

        Example::

            replica = averager.replica
            path = replica_path("checkpoint.pt", replica.index)  # checkpoint.pt, checkpoint.replica1.pt, ...
            CheckpointWriter(path, enabled=replica.writer).save({"model": model, "averager": averager})
        """
        return Replica(group_rank(self.process_group), group_size(self.process_group), self._writes_replica)

    # --- the loop's calls ----------------------------------------------------------------------

    def step(self) -> bool:
        """Count one iteration and do what the schedule says for it; True when this call started a round.

        Call it exactly once per iteration, after the optimizer steps, on every rank. With
        ``overlap_steps``, it also merges the round launched ``overlap_steps`` calls earlier.

        Example::

            opt.step(); opt.zero_grad()
            if averager.step():
                print("averaged at", averager.steps)
        """
        if self._ddp_settings is None:
            raise RuntimeError("Averager.step: call it inside `with Averager(...) as averager:`.")
        self.steps += 1
        gaps = self._step_gaps if self.steps <= self.warmup_steps else self._recent_gaps
        if self._times_warmup and gaps is not None:
            now = time.perf_counter()
            if self._last_step is not None:
                gaps.append(now - self._last_step)
            self._last_step = now
        started = False
        events = self.schedule.at(self.steps)
        if events and self.steps > self.warmup_steps:  # the gap to the next step() holds this round: not a step's time
            self._last_step = None
        if events:
            with self._round.storage.synced():
                try:
                    for event in events:
                        started |= self._actions[event.kind](event)
                except PeerError:
                    if self._epochs is None:
                        raise
                    self._epochs.recover()  # the round in flight is dropped: its progress rides in the next one
                else:
                    if self._epochs is not None and self.finished_at == self.steps and not self.pending:
                        self._epochs.at_boundary()
        if self.steps <= self.warmup_steps and not self._apart and not self._has_buffers:
            # Synchronous DDP keeps parameters identical, but each rank's forward updates its own
            # buffers after DDP's broadcast, so replicas with buffers are only identical after a round.
            self._synced_at = [self.steps] * self.fragments
        return started

    def sync(self) -> None:
        """Average now, on every rank (before evaluation or a checkpoint); replicas are identical after it.

        A round in flight is finished first. Under DiLoCo this is an outer step taken now.

        Example::

            averager.sync()
            fabric.save("ckpt.pt", {"gen": gen, "opt_g": opt_g, "averager": averager})
        """
        with self._round.storage.synced():
            while True:
                try:
                    self._finish_pending()
                    self._round_everything()
                    return
                except PeerError:
                    if self._epochs is None:
                        raise
                    self._epochs.recover()  # and the sync again, among those who are left

    # --- checkpoints ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The schedule's counters (plain ints) and, for anchored rounds, the anchor, the outer optimizer and the
        index of the replica that saved it (see :attr:`replica`).

        A round in flight is finished first, so a checkpoint never holds half a round. With fragments it also
        holds each fragment's last round step; in the islands layout, the fragments still to have their
        first round.

        Example::

            fabric.save("ckpt.pt", {"averager": averager, "gen": gen})
        """
        with self._round.storage.synced():
            self._finish_pending()
        state: dict[str, Any] = {
            "steps": self.steps,
            "rounds": self.rounds,
            "synced_at_step": min(self._synced_at),
            "elements_communicated": self.traffic.elements,
            "bytes_communicated": self.traffic.bytes,
        }
        if self.fragments > 1:
            state["fragments_synced_at"] = list(self._synced_at)
        if self.config.period == "auto":  # what was chosen
            state["period_choice"] = list(self.period_choice) if self.period_choice else None
        if self.config.pace == "speed" and self.membership is None:  # what the sites agreed (a membership: each epoch)
            state["pace"] = [list(values) for values in self.pace] if self.pace else None
        if self._times_warmup:  # the warm-up's step times measured so far
            state["warmup_step_s"] = list(self._step_gaps)
        state.update(self._round.state_dict())
        if self.anchored:
            state["replica"] = self.replica.index
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the schedule (and the anchor, the outer optimizer) from :meth:`state_dict`.

        ``fabric.load`` calls it. Counters that are not whole numbers, are negative or contradict
        each other are a ``ValueError``, nothing is changed then. With anchored rounds, a state saved
        by another replica (``replica`` differs from this rank's :attr:`replica` index: a world of
        another size, or a replica with no checkpoint of its own at that step) also sets the
        parameters to their anchors, the global model, after warm-up; so load it after the modules.

        Example::

            fabric.load("ckpt.pt", {"averager": averager, "gen": gen})
        """
        values, synced_at, saved_by = checked_counters(state_dict, self._round.state_keys, self.fragments)
        choice, gaps = checked_choice(state_dict, values["steps"], self.config, self.overlap_steps, self.fragments)
        world = group_size(self.process_group)
        pace = checked_pace(
            state_dict, values["steps"], self.config, self.membership is not None, self._fastest_period, world
        )
        try:
            self._round.load_state_dict(state_dict)
        except ValueError as error:
            raise ValueError(f"Averager.load_state_dict: {error}") from None
        self.steps, self.rounds, self._synced_at = values["steps"], values["rounds"], synced_at
        self.traffic = Traffic(values["elements_communicated"], values["bytes_communicated"])
        if self._times_warmup and self.membership is None:  # a site's own speed, not that of the member it came from
            self._step_gaps, self._last_step = gaps, None
        if self.config.period == "auto":
            self.period_choice = choice
            self.overlap_steps = choice.overlap_steps if choice else self.config.first_overlap
            self._set_period(choice.period if choice else shortest_period(self.fragments, self.overlap_steps))
        if pace is not None:
            self._set_pace(pace)
        if saved_by not in (None, self.replica.index) and self.local:
            # Another replica's checkpoint (this one has none at that step, or the world changed): start
            # from the global model, not from a copy of that replica's local progress.
            with self._round.storage.synced():
                self._round.restore_global()
        if self._ddp_settings is not None:
            self._apply_phase()

    def restore_global(self) -> None:
        """Set the averaged tensors to the global model, their anchors; no collective.

        What :meth:`load_state_dict` does for a replica resuming from another replica's checkpoint, for a
        replica whose modules were loaded from elsewhere (its own older checkpoint, say) and whose Averager
        state is the newest (see :func:`~fabric_multimodel.checkpoints.resume.resume_latest`). Anchored rounds past
        warm-up only; a fragment still to have its first round keeps its values.

        Example::

            averager.load_state_dict(newest["averager"])
            averager.restore_global()
        """
        if not self.anchored or not self.local:
            raise RuntimeError(
                "Averager.restore_global: there is no global model to restore before an anchored round"
                " (DiLoCo, comm_dtype) and the end of warm-up; load a state past warm-up first."
            )
        with self._round.storage.synced():
            self._round.restore_global()

    # --- the schedule's events -----------------------------------------------------------------

    @property
    def _actions(self) -> dict[str, Callable[[Event], bool]]:
        """What each kind of schedule event does; True for those that start a round."""
        return {
            "local": self._start_local_phase,
            "round": lambda event: self._round_now(event.fragment, blocking=True),
            "launch": lambda event: self._round_now(event.fragment, blocking=False),
            "exchange": lambda event: self._exchange(),
            "merge": lambda event: self._finish_pending(),
            "node": lambda event: self._node_round_now(),
        }

    def _start_local_phase(self, event: Event) -> bool:
        if self.config.period == "auto" and self.period_choice is None:
            self._choose_period()
        if self.config.pace == "speed" and self.pace is None:
            self._set_pace(paced(self._fastest_period, self._across_sites(self._site_step_times)))
        self._apply_phase()
        _log.info("step %d: the local phase begins, a round every %d steps", self.steps, self.period)
        if self._apart:  # the nodes or sites trained apart: their first rounds are plain means, and set the anchors
            self._round.release_anchors()
        else:  # synchronous DDP moved every replica alike: anchor them where they are
            self._round.anchor_parameters()
        return False

    def _round_everything(self) -> None:
        """A blocking round of every fragment that took a step since its last round (in the local phase, of
        every fragment: each carries the step counts that tell whether the ranks stayed in step)."""
        for fragment in range(self.fragments):
            if self.local or self.steps > self._synced_at[fragment]:  # in warm-up, DDP keeps parameters identical
                self._round_now(fragment, blocking=True)

    def _round_now(self, fragment: int, *, blocking: bool) -> bool:
        label = f"averaging round {self.rounds + 1} at step {self.steps}"
        if self.fragments > 1:
            label += f" (fragment {fragment + 1} of {self.fragments})"
        warming_up = self.steps < self.warmup_steps
        if warming_up and not self._apart:
            # Synchronous DDP moved the parameters (identically): rounds in warm-up are plain means.
            self._round.anchor_parameters(self._round.parts[fragment])
        if self._epochs is not None:
            self._round.scale = self._epochs.scale(fragment)
        # Paced sites differ in steps, not rounds; so may a site that joined in a run's last period (it enters the
        # members' next round, which may be their final sync).
        count = self.rounds if self.pace is not None or self.membership is not None else self.steps
        layout, _ = self._optimizer_state.refresh()
        stamp = Stamp(count % 16**Header.STEP_DIGITS, layout, self.steps > self._synced_at[fragment])
        start = time.perf_counter()
        self._round.launch(stamp, label=label, blocking=blocking, outer=not warming_up, part=fragment)
        # Checked while the payload crosses (a pointer per tensor, 0.13 ms for 400 on a CPU: hidden behind the
        # collective), and raised once the round ended, so that no rank leaves a collective half-issued.
        intact = self._round.storage.intact()
        self.traffic += self._round.traffic
        if not blocking:
            self.rounds += 1
            self._launched_at = self.steps
            _check_intact(intact)  # leaving the block then discards the round in flight
            _log.debug("%s: launched, %d bytes", label, self._round.traffic.bytes)
            return True
        stamps = self._round.finish()
        _check_intact(intact)
        self._check_stamps(stamps, label)
        self._synced_at[fragment] = self.steps
        self.finished_at = self.steps
        if any(s.progress for s in stamps):
            self.rounds += 1
            self.traffic += self._average_optimizer_state(label)
        _log.debug("%s: %d bytes in %.3f s", label, self._round.traffic.bytes, time.perf_counter() - start)
        return True

    def _average_optimizer_state(self, label: str) -> Traffic:
        """After a blocking round, the optimizers' state averaged over ``process_group``. With a membership, weighed
        like the round's payload, its wait abandoned once a member is lost, and a failure agreed by the site's
        processes and raised as a :class:`PeerError`, as a round's is (the round stays merged)."""
        if self._epochs is None:
            return self._optimizer_state.all_reduce_mean_(self.process_group)
        state, scale, failing = self._optimizer_state, self._round.scale, self._epochs.membership.failing
        average = functools.partial(state.all_reduce_mean_, self.process_group, scale=scale, abandon=failing)
        return self._epochs.agreed(average, f"{label}: averaging the optimizers' state")

    def _exchange(self) -> bool:
        """Move the round in flight to its second phase; starts no round."""
        self._round.exchange()
        return False

    def _node_round_now(self) -> bool:
        assert self._node_round is not None
        label = f"averaging round {self.rounds + 1} (inside the node) at step {self.steps}"
        layout, _ = self._optimizer_state.refresh()
        stamp = Stamp(self.steps % 16**Header.STEP_DIGITS, layout, True)
        self._node_round.launch(stamp, label=label, blocking=True)
        self._check_stamps(self._node_round.finish(), label, self.node_group)
        sent = self._node_round.traffic + self._optimizer_state.all_reduce_mean_(self.node_group)
        self.traffic += sent
        self.node_traffic += sent
        self.rounds += 1
        self.node_rounds += 1
        return True

    def _finish_pending(self) -> bool:
        if self._launched_at is None:
            return False
        label = f"averaging round {self.rounds} (launched at step {self._launched_at})"
        self._launched_at = None
        self._check_stamps(self._round.finish(), label)
        self.finished_at = self.steps
        _log.debug("%s: merged at step %d", label, self.steps)
        return False

    def _discard_pending(self) -> None:
        if self._launched_at is not None:
            self._launched_at = None
            self._round.discard()

    def _check_stamps(self, stamps: list[Stamp], label: str, group: ProcessGroup | None = None) -> None:
        group = group if group is not None else self.process_group
        ranks = group_ranks(group)
        mine = stamps[group_rank(group)]
        for rank, stamp in zip(ranks, stamps):
            by_rounds = self.pace is not None or self.membership is not None
            if stamp.steps != mine.steps and by_rounds and group is self.process_group:
                advice = (
                    "with pace='speed', make averager.local_steps(total) step() calls on each rank"
                    if self.pace is not None
                    else "call averager.step() once per iteration"
                )
                raise AveragingError(
                    f"{label}: this rank is at round {self.rounds + 1} but rank {rank} at round"
                    f" {_unwrap_steps(stamp.steps, self.rounds) + 1}; {advice}."
                )
            if stamp.steps != mine.steps:
                raise AveragingError(
                    f"{label}: averager.step() was called {self.steps} times on this rank but"
                    f" {_unwrap_steps(stamp.steps, self.steps)} times on rank {rank}; call it exactly once per"
                    " iteration, on every rank."
                )
        if any(stamp.layout != mine.layout for stamp in stamps):
            problem = describe_disagreement(self._optimizer_state.layout[1], self._device, group)
            raise AveragingError(
                f"{label}: the optimizers' state differs across ranks (build the same optimizer types and options,"
                f" e.g. amsgrad, on every rank). {_shorten(problem or '')}"
            )

    def _abandon_round(self) -> None:
        """A member was lost: drop the round in flight (its progress rides in the next one)."""
        self._launched_at = None
        self._round.abandon()

    def _apply_phase(self) -> None:
        for ddp, grad_sync, broadcast_buffers in self._ddp_settings or ():
            # The local phase turns off both of DDP's collectives: the gradient allreduce (what
            # no_sync() does, but for every forward in the phase) and the per-forward buffer broadcast
            # (`broadcast_buffers`, a property over `forward_sync_buffers` since torch 2.13).
            ddp.require_backward_grad_sync = grad_sync and not self.local
            ddp.broadcast_buffers = broadcast_buffers and not self.local
            if self.local and ddp.reducer._rebuild_buckets():
                # DDP rebuilds its gradient buckets once, with a broadcast, in the first forward after
                # the first synchronous backward. Doing it here, on every rank at the same step, keeps
                # that broadcast out of the local phase.
                ddp._has_rebuilt_buckets = True


def _check_intact(intact: bool) -> None:
    if not intact:
        raise RuntimeError(
            "Averager: a parameter or buffer was given new storage after the Averager was built (for"
            " example by `.to()` or `param.data = ...`); move models before building the Averager."
        )


def _unwrap_steps(digits: int, near: int) -> int:
    """The full count whose low 32 bits are ``digits``, nearest to ``near`` (the header keeps 32 bits)."""
    base = near - (near % 2**32)
    candidates = [base - 2**32 + digits, base + digits, base + 2**32 + digits]
    return min(candidates, key=lambda c: abs(c - near))


def _shorten(text: str, limit: int = 600) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
