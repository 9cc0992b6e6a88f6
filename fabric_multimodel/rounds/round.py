"""What an averaging round does, apart from when it happens (that is its :class:`~fabric_multimodel.Averager`'s
schedule).

A round fills a payload, allreduces it (one collective per payload buffer, launched
asynchronously) and merges the result into the replicas. Two kinds live here:

- :class:`MeanRound`: plain averaging (post-local SGD); every replica becomes the mean.
- :class:`DeltaRound`: an anchored round. It sends pseudo-gradients ``anchor - param`` (in
  ``comm_dtype`` when given) and moves the anchor by their mean; ``fabric_multimodel.rounds.outer``
  replaces that move by an outer optimizer step (DiLoCo).

Either kind runs *blocking* (``launch`` then ``finish`` at once: ``param <- global``) or, built with
``overlap=True``, *overlapped*: ``finish`` comes some local steps later and keeps the progress
made meanwhile, ``param <- global + (param - snapshot)``.

Every payload ends with a small header in which each rank writes its own ``step()`` count and
the layout of the optimizer state it averages (the other ranks write zeros), so the summed
payload tells every rank what all of them wrote: a schedule that drifted apart is an error on
every rank, found without another collective. A payload that sums to NaN or Inf (one rank's
NaN reaches all) is an error on every rank too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from fabric_multimodel.comm.collectives import ProcessGroup, Traffic, group_rank, group_size
from fabric_multimodel.comm.flat import FlatStorage, Part
from fabric_multimodel.rounds.errors import AveragingError, NonFiniteError, PeerError, listed
from fabric_multimodel.rounds.header import Header, Stamp
from fabric_multimodel.rounds.transports import Agreed, NodeSlices, SumTransport, slice_bounds


class Round:
    """The machinery every kind shares: payload buffers, header, launch, wait, checks.

    ``own_buffers`` (the kinds' keyword): send from buffers of the round's own, never from the parameters' storage,
    so that a round that fails half-way leaves the parameters as they were (a membership's rounds).

    A round covers one :class:`~fabric_multimodel.comm.flat.Part` of the flat storage at a time: the
    whole of it, or one fragment (``parts``; the send buffers are sized for the largest). Subclasses
    decide what the payload holds (:meth:`_fill`) and what the summed payload does to the replicas
    (:meth:`_merge`, :meth:`_rollback`).
    """

    def __init__(
        self,
        storage: FlatStorage,
        group: ProcessGroup,
        *,
        parts: Sequence[Part] | None = None,
        overlap: bool,
        check_finite: bool,
        comm_dtype: torch.dtype | None = None,
        in_place: bool,
        mixing: float | None = None,
        node_group: ProcessGroup = None,
    ) -> None:
        #: Overlapped merges: None keeps the local progress, ``global + (param - snapshot)``; a float ``a``
        #: mixes, ``(1 - a) * global + a * param`` (Streaming DiLoCo's rule).
        self.mixing = mixing
        self.node_group = node_group
        self.overlap = overlap
        self.check_finite = check_finite
        #: The averaged tensors, living in flat buffers; a round sent in place carries its header in
        #: their spare elements (shared by rounds over several groups: sized for the largest).
        self.storage = storage
        #: What one round covers: the whole storage, or each fragment in turn.
        self.parts = list(parts) if parts else [storage.part(range(len(storage.tensors)))]
        self.in_place = in_place and len(self.parts) == 1
        self._comm_dtype = comm_dtype
        self.regroup(group)
        #: How many phases a round's collectives take (2: a quantized round's all-to-all, then its all-gather).
        self.phases = 1
        #: What this rank's payload is multiplied by before the SUM (``pace="speed"``: its weight times the group
        #: size, so that dividing by the group size gives the weighted mean); 1 for a plain mean.
        self.scale = 1.0
        self._in_flight = False
        self._blocking = True
        self._outer = True
        self._label = ""

    def regroup(
        self,
        group: ProcessGroup,
        abandon: Callable[[], bool] | None = None,
        agree: Callable[[bool], bool] | None = None,
    ) -> None:
        """Run the next rounds over ``group`` (a membership's new epoch: another size, other peers). The header,
        the send buffers and the transports are made for it again; anchors and outer state stay. Allocates one send
        buffer's worth at most, and issues no collective; no round may be in flight. ``abandon``: see
        :func:`~fabric_multimodel.comm.collectives.wait_all`. ``agree(ok)``: whether every process of this rank's node
        finished its part (islands, FSDP2 shards), asked once per round before its result is used, so that they
        merge a round, or drop it, together.

        Example::

            averaging_round.regroup(epoch.group, membership.failing, membership.agree)
        """
        if getattr(self, "_in_flight", False):
            raise RuntimeError("Round.regroup: a round is in flight; finish or abandon it first.")
        self._abandon, self._agree = abandon, agree
        self.group = group
        self.world = group_size(group)
        #: Islands: the processes of this rank's node, which hold the same replica. Each sends its 1/D slice of
        #: a payload across the nodes, and the node's processes then exchange their slices (over the node's own
        #: links): the bytes that cross nodes fall by D. 1: the whole payload.
        self.slices = group_size(self.node_group) if self.node_group is not None and self.world > 1 else 1
        self.header = Header(group_rank(group), self.world)
        if self.in_place and self.storage.spare.numel() < self.header.size:
            raise ValueError(f"the flat storage needs {self.header.size} spare elements for a round's header.")
        self.send = self._send_buffers(self._comm_dtype)
        # Per part: what its collectives reduce, and where its header is (views made once, not per round).
        self._layouts = [self._layout(part) for part in self.parts]
        self.part = self.parts[0]  # the part of the round in flight, or of the last one
        self._payload, self._head = self._layouts[0]
        self._transports = [self._transport(part, *layout) for part, layout in zip(self.parts, self._layouts)]
        self._carrier = self._transports[0]

    # --- payload ---------------------------------------------------------------------------

    def _send_buffers(self, comm_dtype: torch.dtype | None) -> list[torch.Tensor]:
        if self.in_place:
            return self.storage.buffers
        largest = [max(part.sizes[b] for part in self.parts) for b in range(len(self.storage.buffers))]
        if comm_dtype is None:  # one buffer per storage buffer, in its own dtype; the header rides in the first
            return [
                torch.zeros(size + (self.header.size if b == 0 else 0), dtype=flat.dtype, device=flat.device)
                for b, (size, flat) in enumerate(zip(largest, self.storage.buffers))
            ]
        devices = {flat.device for flat in self.storage.buffers}
        if len(devices) > 1:
            raise ValueError(
                f"`comm_dtype` needs every averaged tensor on one device, found {sorted(map(str, devices))}."
            )
        total = max(sum(part.sizes) for part in self.parts) + self.header.size
        return [torch.zeros(total, dtype=comm_dtype, device=devices.pop())]

    def _regions(self) -> list[torch.Tensor]:
        """Per storage buffer, the part of a send buffer that carries this round's part of it."""
        sizes = self.part.sizes
        if self.in_place:
            return self.part.data
        if len(self.send) == len(sizes):
            return [s[:size] for s, size in zip(self.send, sizes)]
        regions, offset = [], 0
        for size in sizes:
            regions.append(self.send[0][offset : offset + size])
            offset += size
        return regions

    def _layout(self, part: Part) -> tuple[list[torch.Tensor], torch.Tensor]:
        """What a round of ``part`` reduces (each send buffer's used part, the header after the first one's),
        and its header."""
        sizes = part.sizes if len(self.send) == len(part.sizes) else [sum(part.sizes)]
        head = self.header.size
        # A buffer holding nothing of this part is left out; the first always carries the header.
        payload = [
            s[: size + (head if b == 0 else 0)] for b, (s, size) in enumerate(zip(self.send, sizes)) if size or not b
        ]
        return payload, self.send[0][sizes[0] : sizes[0] + head]

    def _transport(self, part: Part, payload: list[torch.Tensor], head: torch.Tensor) -> Any:
        """What carries a round of ``part`` between the ranks: by default, a SUM allreduce of each payload buffer
        (with node slices: of this rank's slice of each; the header is the tail of the first, in the last slice)."""
        if self.slices == 1:
            return self._agreed(SumTransport(payload, self.group, self.world, self._abandon))
        mine = [self._slice(t) for t in payload]
        inner = SumTransport([t for t in mine if t.numel()], self.group, self.world, self._abandon)
        return NodeSlices(self._agreed(inner), payload, self.node_group)

    def _carrier_of(self, part: int) -> Any:
        """The transport that carries the next round of ``parts[part]``."""
        return self._transports[part]

    def _agreed(self, transport: Any) -> Any:
        """``transport``, agreed by the node's processes before its result is used (see :meth:`regroup`)."""
        return transport if self._agree is None else Agreed(transport, self._agree)

    def _slice(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's slice of ``t`` among the node's processes."""
        start, end = slice_bounds(t.numel(), self.slices, group_rank(self.node_group))
        return t[start:end]

    @property
    def traffic(self) -> Traffic:
        """What the last round launched sent per rank (before: what a round of the first part sends),
        every payload element, header included."""
        return self._carrier.traffic

    @property
    def pending(self) -> bool:
        """True while a round is in flight (launched, not yet finished)."""
        return self._in_flight

    # --- what the driver asks of every kind (plain rounds keep no anchor: nothing to keep or restore) ------

    #: True when rounds keep an anchor, the global model after each part's last round, identical on every
    #: rank: a checkpoint then needs no round, and a replica can start again from the anchors.
    anchored = False
    #: What a checkpoint of this kind must hold (see :meth:`state_dict`).
    state_keys: tuple[str, ...] = ()

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds of the round beyond the driver's counters."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`; a ValueError when it does not fit these tensors."""

    def anchor_parameters(self, part: Part | None = None) -> None:
        """The replicas are identical now (synchronous DDP moved them alike): anchor them here."""

    def release_anchors(self) -> None:
        """The replicas trained apart (the islands' warm-up): each part's next round is a plain mean, which
        sets its anchor."""

    def restore_global(self) -> None:
        """Put every anchored part back at its anchor, the global model (a replica resuming from another's
        checkpoint)."""

    # --- the round ---------------------------------------------------------------------------

    def launch(self, stamp: Stamp, *, label: str, blocking: bool, outer: bool = True, part: int = 0) -> None:
        """Fill the payload of ``parts[part]`` and start its allreduce; ``blocking`` rounds are finished by
        the caller at once.

        ``outer=False`` makes an outer-optimizer round a plain mean (rounds during warm-up).
        """
        self._blocking, self._outer, self._label = blocking or not self.overlap, outer, label
        self.part = self.parts[part]
        self._payload, self._head = self._layouts[part]
        self._carrier = self._carrier_of(part)
        self._fill()
        if self.scale != 1.0:
            for region in self._regions():
                region.mul_(self.scale)
        self.header.write(self._head, stamp)
        try:
            self._carrier.start()
        except RuntimeError as error:
            raise self._peer_error(error) from error
        self._in_flight = True

    def exchange(self) -> None:
        """Move the round in flight to its second phase (a quantized round's all-gather); nothing otherwise."""
        if self._in_flight:
            try:
                self._carrier.exchange()
            except RuntimeError as error:
                raise self._peer_error(error) from error

    def finish(self) -> list[Stamp]:
        """Wait for the round in flight and merge it; returns every rank's :class:`Stamp`.

        A round in which no rank made progress changes nothing (it is the end of a block, or a
        ``sync()``, right after a round). Raises :class:`NonFiniteError` when the summed payload is
        not finite (after the rollback).
        """
        if not self._in_flight:
            return []
        self._in_flight = False
        try:
            self._carrier.finish()
        except RuntimeError as error:
            raise self._peer_error(error) from error
        finite = self._read_sum()
        rows = self.header.read(self._head.double().tolist())
        if not finite:
            names = self._nonfinite_names()
            message = self._rollback()
            raise NonFiniteError(
                f"{self._label}: NaN or Inf in what the replicas sent, in {listed(names) or 'the payload'}"
                f" (on at least one rank); {message}.",
                names,
            )
        if any(stamp.progress for stamp in rows):
            self._merge()
        else:
            self._skip()
        return rows

    def discard(self) -> None:
        """Wait for the round in flight (every rank issued it) and drop its result; replicas keep their values."""
        if not self._in_flight:
            return
        self._in_flight = False
        try:
            self._carrier.finish()
        except RuntimeError:
            pass  # the caller is already failing; a peer that is gone is its concern, not ours

    def _read_sum(self) -> bool:
        """What the round does to the summed payload first; True when it is finite (or the check is off).

        One NaN on one rank makes the sum NaN on every rank, so one read of it (a sum) tells every rank alike.
        """
        if not self.check_finite:
            return True
        total = torch.stack(
            [s.sum(dtype=torch.float32) if s.dtype == torch.float16 else s.sum() for s in self._payload]
        )
        return all(map(_isfinite, total.double().tolist()))

    def _nonfinite_names(self) -> list[str]:
        """The tensors of this round's part whose summed payload holds NaN or Inf."""
        regions, names = self._regions(), []
        for i in self.part.indices:
            b, offset, numel = self.storage.slots[i]
            start = offset - self.part.ranges[b][0]
            if not bool(torch.isfinite(regions[b][start : start + numel]).all()):
                names.append(self.storage.names[i])
        return names

    def abandon(self) -> None:
        """Drop the round in flight after its group failed, without waiting on it: the replicas keep their values
        (an anchored round's anchors too: its fill changed neither)."""
        self._in_flight = False

    def _peer_error(self, error: BaseException) -> AveragingError:
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return PeerError(f"{self._label} failed: a peer exited or is unreachable ({type(error).__name__}: {first})")

    def _fill(self) -> None:
        raise NotImplementedError

    def _merge(self) -> None:
        raise NotImplementedError

    def _skip(self) -> None:
        """Leave the replicas as they were before the round (no rank had anything to average)."""
        raise NotImplementedError

    def _rollback(self) -> str:
        """Undo what a failed round did to the replicas; returns what they hold now, for the error."""
        raise NotImplementedError


class MeanRound(Round):
    """Plain averaging: every replica becomes the mean of the replicas.

    Blocking rounds of the whole storage reduce the flat parameter buffers in place (no copy at
    all). Overlapped rounds and fragments copy the parameters into a send buffer (and overlapped
    ones into a snapshot, allocated once) and merge as ``param <- mean(snapshot) + (param - snapshot)``,
    computed as ``(param - snapshot) + mean`` so that a replica with no local progress lands
    exactly on the mean.
    """

    def __init__(
        self,
        storage: FlatStorage,
        group: ProcessGroup,
        *,
        parts: Sequence[Part] | None = None,
        overlap: bool,
        check_finite: bool,
        mixing: float | None = None,
        node_group: ProcessGroup = None,
        own_buffers: bool = False,
    ) -> None:
        super().__init__(
            storage,
            group,
            parts=parts,
            overlap=overlap,
            check_finite=check_finite,
            in_place=not overlap and not own_buffers,
            mixing=mixing,
            node_group=node_group,
        )
        self.snapshot = self.storage.mirror() if overlap else []

    def _fill(self) -> None:
        if self.in_place:
            return
        for x, region, snap in zip(self.part.data, self._regions(), self.part.of(self.snapshot or self.storage.data)):
            region.copy_(x)
            if not self._blocking:
                snap.copy_(x)

    def _read_sum(self) -> bool:
        # Whatever follows (merge, skip or rollback), the sum becomes the mean first: dividing and checking in one
        # pass over it, not two.
        return mean_(self._regions(), self.world) or not self.check_finite

    def _merge(self) -> None:
        if self.in_place:
            return
        data = self.part.data
        for x, region, snap in zip(data, self._regions(), self.part.of(self.snapshot) if self.snapshot else data):
            if self._blocking:
                x.copy_(region)
            elif self.mixing is None:
                x.sub_(snap).add_(region)
            else:
                torch.lerp(region, x, self.mixing, out=x)

    def _skip(self) -> None:
        """In place, the sum of identical replicas is already their mean (to the last bit when the world size is a
        power of two); otherwise the parameters were never touched."""

    def _rollback(self) -> str:
        if self.in_place:
            return "plain averaging has already spread them to every replica; restore a checkpoint"
        return "each replica keeps its own parameters (the round was not applied)"


def mean_(sums: Sequence[torch.Tensor], world: int) -> bool:
    """Divide each of ``sums`` (tensors summed over ``world`` ranks) by ``world`` in place; True when all are finite.

    One pass over memory where ``div_`` and then a sum make two: this is what AMP's gradient unscaling does
    (multiply by a reciprocal, flag any NaN or Inf), so it uses torch's fused kernel for it, on any device.
    Multiplying by ``1 / world`` (in float32) is exactly dividing when ``world`` is a power of two; float64 is
    divided, then summed.

    Example::

        dist.all_reduce(flat)
        if not mean_([flat], dist.get_world_size()):
            raise FloatingPointError("a rank sent NaN or Inf")
    """
    found = []
    for t in sums:
        if t.numel() and t.dtype == torch.float64:  # the fused kernel's reciprocal is float32: 2**-24 off
            t.div_(world)
            found.append(t.sum().isfinite().logical_not().reshape(1))
        elif t.numel():
            flag = torch.zeros(1, dtype=torch.float32, device=t.device)
            torch._amp_foreach_non_finite_check_and_unscale_(
                [t], flag, torch.full((1,), 1 / world, dtype=torch.float32, device=t.device)
            )
            found.append(flag)
    return not any(bool(flag.any()) for flag in found)


def _isfinite(value: float) -> bool:
    return value == value and value not in (float("inf"), float("-inf"))
