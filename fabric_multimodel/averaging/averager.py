"""The driver of averaging: the :class:`Averager`, which carries out its schedule's events in the user's loop.

How an Averager is put together (its storage and round) is :mod:`fabric_multimodel.averaging.builder`'s business, when
things happen :mod:`fabric_multimodel.rounds.schedule`'s, what a round does :mod:`fabric_multimodel.rounds.round`' and
:mod:`fabric_multimodel.rounds.outer`'s. One-off rounds and checks are in :mod:`fabric_multimodel.averaging.replicas`.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch.optim import Optimizer

from fabric_multimodel.averaging.agreement import check_agreement
from fabric_multimodel.averaging.arguments import as_module_list, check_membership, check_optimizers, check_placement
from fabric_multimodel.averaging.auto_period import PeriodChoice, agree, time_round
from fabric_multimodel.averaging.builder import build_rounds
from fabric_multimodel.averaging.cadence import Cadence
from fabric_multimodel.averaging.config import AveragerConfig
from fabric_multimodel.averaging.epochs import DriverHooks, Epochs
from fabric_multimodel.averaging.held_bytes import held_bytes
from fabric_multimodel.averaging.pacing import Pace, gather_step_times, paced
from fabric_multimodel.averaging.replicas import HasDevice, Modules, Replica
from fabric_multimodel.averaging.runner import RoundRunner
from fabric_multimodel.averaging.saved_state import checked_choice, checked_counters, checked_pace
from fabric_multimodel.comm.collectives import ProcessGroup, Traffic, broadcast_differences, group_rank, group_size
from fabric_multimodel.ddp.local_phase import LocalPhase
from fabric_multimodel.ddp.models import Models
from fabric_multimodel.membership.membership import Membership
from fabric_multimodel.rounds.errors import PeerError
from fabric_multimodel.rounds.optimizer_state import OptimizerStateStorage
from fabric_multimodel.rounds.schedule import Schedule

_log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from lightning_fabric import Fabric

_T = TypeVar("_T")


class Averager:
    """Model averaging for the modules of a Fabric loop, driven by one explicit ``step()`` per iteration.

    ``step()`` calls 1..``warmup_steps`` are synchronous DDP; after them the modules issue no collective in
    forward or backward, and every ``period`` steps a round replaces the replicas by their mean (post-local SGD),
    or takes DiLoCo's outer step with their mean pseudo-gradient (``outer_optimizer``), sent in ``comm_dtype``
    (``torch.bfloat16``, or block-quantized fp8/fp4: :mod:`fabric_multimodel.comm.quantized`) or, with ``density``
    below 1, as each chunk's largest entries plus what was not sent before (SparseLoCo:
    :mod:`fabric_multimodel.comm.sparse_mean`), overlapped with the next ``overlap_steps`` steps, one of
    ``fragments`` at a time (Streaming DiLoCo). Leaving the block averages, so every replica leaves identical.

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

        Averager(fabric, model, period=128, density=1 / 64)  # SparseLoCo: about 1/200 of fp32's bytes
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
        #: With a :class:`~fabric_multimodel.Membership`: the sites of the run come and go, and each round
        #: runs on the group of the epoch this site is in (``process_group`` is that group).
        self.membership = membership
        self._epochs: Epochs | None = None
        if membership is not None:  # every check before this site registers, so a mistake costs the others nothing
            check_membership(config, process_group, node_group)
            placement = check_placement(module_list, self.optimizers, None, None, config, across_sites=True)
        else:
            placement = check_placement(module_list, self.optimizers, process_group, node_group, config)
        #: True when the modules are FSDP2 shards (``fully_shard`` inside each site): a round averages this
        #: rank's shard with the same shard of the other sites, and the sites' own reduce-scatters go on every step.
        self.sharded = placement.sharded
        #: True when the modules synchronise inside each node (DDP, or FSDP2 shards) and rounds average across nodes.
        self.islands = placement.islands
        self.warmup_steps = config.warmup_steps
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
        #: When the rounds fall: the period, the schedule, ``period="auto"``'s choice and ``pace="speed"``'s pace.
        self.cadence = Cadence(config, self.fragments, self._round.phases, built.period, membership is not None)
        self._site = placement.site
        self._device = fabric.device
        self._phase = LocalPhase([] if self.islands else placement.ddps)  # the DDPs switched off after warm-up
        self._reset_counters()
        self._agreement = built.agreement
        #: True once :meth:`leave` was called: leaving the ``with`` block then makes no round.
        self.leaving = False
        self._apart = self.islands or membership is not None  # the replicas train apart in warm-up
        state = OptimizerStateStorage(self.optimizers)  # what blocking rounds average with the models
        self._runner = RoundRunner(self, built.round, built.node_round, state, self._device, apart=self._apart)
        #: What the start sent across ``process_group`` (islands: the values in which the nodes' replicas differed).
        self.start_traffic = Traffic()
        # Islands: the node's processes hold one replica between them; the first one writes it.
        self._writes_replica = not self.islands or all(group_rank(ddp.process_group) == 0 for ddp in placement.ddps)
        if membership is None:
            self._check_agreement(built.agreement)
            self.start_traffic = self._start_islands()

    def join(self) -> None:
        """With a membership: register, wait to be admitted, and enter the first epoch, where the members behind
        (this site, or those it is ahead of) receive the newest state; nothing otherwise, or once joined. The ``with``
        block calls it: a site resumes its own checkpoint before, so that its progress counts when the members
        compare theirs (:class:`~fabric_multimodel.RunEnded` for a site that comes after the run ended).

        Example::

            checkpointer.resume(state)  # this site's own newest checkpoint
            averager.join()  # the run's newest state, if another site holds a newer one
        """
        if self.membership is None or self._epochs is not None:
            return
        epoch = self.membership.join()
        self.process_group = epoch.group
        self._epochs = self._runner.epochs = Epochs(self, self._driver_hooks(), self.membership)
        self._epochs.enter(epoch)

    def _driver_hooks(self) -> DriverHooks:
        """What this Averager lends its epochs (a live membership's) beyond its public state."""
        return DriverHooks(
            round=self._round,
            device=self._device,
            site=self._site,
            fastest_period=self.cadence.fastest_period,
            check_agreement=lambda: self._check_agreement(self._agreement),
            abandon_round=self._runner.abandon,
            last_round=lambda: self.cadence.last_round(self.steps),
            own_step_s=lambda: self.cadence.step_s(live=True),
            set_pace=self._set_pace,
        )

    def _choose_period(self) -> None:
        """period="auto", at the end of warm-up: time a round's payload across ``process_group`` and choose from
        it and the warm-up's steps, with the slowest rank's figures on every rank (see ``auto_period``)."""
        mine = statistics.median(self.cadence.warmup_gaps("period='auto'"))
        sent = self._round.traffic.bytes

        def across() -> tuple[float, float]:
            round_s = time_round(-(-sent // 4), torch.float32, self._device, self.process_group)
            return agree(mine, round_s, self._device, [self.process_group])

        step_s, round_s = self._across_sites(across)
        if self._site is not None:  # islands: the site's processes choose alike
            step_s, round_s = agree(step_s, round_s, self._device, [self._site])
        self.cadence.choose(step_s, round_s, sent)

    def _across_sites(self, collectives: Callable[[], _T]) -> _T:
        """``collectives()`` over ``process_group``; with a membership, over the next epoch's group again when a
        member is lost meanwhile."""
        return collectives() if self._epochs is None else self._epochs.across_sites(collectives)

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
        return self.cadence.local_steps(total)

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
        return self.cadence.clock(step, self.rounds)

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
        #: an overlapped one merged); None before the first. ``round_s``: its seconds, launch to merge.
        self.finished_at: int | None = None
        self.round_s = 0.0

    def _check_agreement(self, agreement: str) -> None:
        check_agreement(agreement, self._device, self.process_group)

    def _site_step_times(self) -> list[float]:
        """pace="speed", at the end of warm-up: every site's step time, its slowest process's (two collectives)."""
        step_s = self.cadence.step_s(live=self.membership is not None)
        return gather_step_times(step_s, self._device, self.process_group, self._site)

    def _set_pace(self, pace: Pace, since: tuple[int, int] | None = None) -> None:
        """Run this site's local steps per round, and weight its rounds by them (see ``Cadence.set_pace``)."""
        self._round.scale = self.cadence.set_pace(pace, group_rank(self.process_group), self.steps, since)

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
        if self._phase.entered:
            raise RuntimeError("Averager: this averager is already in use; enter its `with` block once.")
        self.join()
        self._phase.enter()
        self._phase.apply(self.local)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            if exc_type is not None or self.leaving:
                self._runner.discard_pending()
            else:
                # In the local phase every rank ends with a round, needed or not (then it changes nothing):
                # it carries each rank's step() count, so a schedule that drifted apart is an error on every
                # rank instead of one rank waiting for a round nobody else starts.
                self.sync()
        finally:
            self._phase.exit()

    @property
    def period(self) -> int:
        """Local steps between rounds (with ``period="auto"``: the smallest allowed until the end of warm-up)."""
        return self.cadence.period

    @property
    def overlap_steps(self) -> int:
        """Steps an overlapped round is in flight (with ``overlap_steps="auto"``: chosen at the end of warm-up)."""
        return self.cadence.overlap_steps

    @property
    def schedule(self) -> Schedule:
        """When each round is launched, exchanged and merged: ``averager.schedule.next_round(averager.steps)``."""
        return self.cadence.schedule

    @property
    def period_choice(self) -> PeriodChoice | None:
        """With ``period="auto"``: what was chosen at the end of warm-up, and from what (None until then)."""
        return self.cadence.period_choice

    @property
    def pace(self) -> Pace | None:
        """With ``pace="speed"``: every site's local steps per round and weight, agreed at the end of warm-up."""
        return self.cadence.pace

    @pace.setter
    def pace(self, pace: Pace | None) -> None:  # a membership agrees it again at each epoch
        self.cadence.pace = pace

    def leave(self) -> None:
        """This live site stops here on its own (a signal, a lost coordinator): leaving the ``with`` block then makes
        no round (the other sites are in rounds of their own; they see it gone). :class:`~fabric_multimodel.Loop`
        calls it when it stops a site under a membership.

        Example::

            if membership.coordinator_lost:
                checkpointer.save(state)
                averager.leave()
                break
        """
        self.leaving = True

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
        return self._runner.launched_at is not None

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
        if not self._phase.entered:
            raise RuntimeError("Averager.step: call it inside `with Averager(...) as averager:`.")
        self.steps += 1
        events = self.schedule.at(self.steps)
        self.cadence.time_step(self.steps, round_due=bool(events))
        started = False
        if events:
            with self._round.storage.synced():
                try:
                    for event in events:
                        if event.kind == "local":
                            self._start_local_phase()
                        else:
                            started |= self._runner.run(event)
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
            self._runner.synced_at = [self.steps] * self.fragments
        return started

    def sync(self) -> None:
        """Average now, on every rank (before evaluation or a checkpoint); replicas are identical after it.

        A round in flight is finished first. Under DiLoCo this is an outer step taken now.

        Example::

            averager.sync()
            fabric.save("ckpt.pt", {"gen": gen, "opt_g": opt_g, "averager": averager})
        """
        self.join()
        with self._round.storage.synced():
            while True:
                try:
                    self._runner.finish_pending()
                    self._runner.round_everything()
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
            self._runner.finish_pending()
        synced_at = self._runner.synced_at
        state: dict[str, Any] = {
            "steps": self.steps,
            "rounds": self.rounds,
            "synced_at_step": min(synced_at),
            "elements_communicated": self.traffic.elements,
            "bytes_communicated": self.traffic.bytes,
        }
        if self.fragments > 1:
            state["fragments_synced_at"] = list(synced_at)
        state.update(self.cadence.state_dict(live=self.membership is not None))
        state.update(self._round.state_dict())
        if self.anchored and self.membership is None:  # a live site's rank changes with its epochs: not a name
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
            state_dict, values["steps"], self.config, self.membership is not None, self.cadence.fastest_period, world
        )
        try:
            self._round.load_state_dict(state_dict)
        except ValueError as error:
            raise ValueError(f"Averager.load_state_dict: {error}") from None
        self.steps, self.rounds, self._runner.synced_at = values["steps"], values["rounds"], synced_at
        self.traffic = Traffic(values["elements_communicated"], values["bytes_communicated"])
        self.cadence.load(choice, gaps, live=self.membership is not None)
        if pace is not None:
            self._set_pace(pace)
        if saved_by not in (None, self.replica.index) and self.local:
            # Another replica's checkpoint (this one has none at that step, or the world changed): start
            # from the global model, not from a copy of that replica's local progress.
            with self._round.storage.synced():
                self._round.restore_global()
        self._phase.apply(self.local)

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

    def _start_local_phase(self) -> None:
        """The end of warm-up: choose the period, agree the pace, switch DDP off, anchor."""
        if self.config.period == "auto" and self.period_choice is None:
            self._choose_period()
        if self.config.pace == "speed" and self.pace is None:
            step_times = self._across_sites(self._site_step_times)
            self._set_pace(paced(self.cadence.fastest_period, step_times))
        self._phase.apply(self.local)
        _log.info("step %d: the local phase begins, a round every %d steps", self.steps, self.period)
        if self._apart:  # the nodes or sites trained apart: their first rounds are plain means, and set the anchors
            self._round.release_anchors()
        else:  # synchronous DDP moved every replica alike: anchor them where they are
            self._round.anchor_parameters()
