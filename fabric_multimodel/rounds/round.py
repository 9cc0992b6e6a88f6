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

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from fabric_multimodel.comm.collectives import ProcessGroup, Traffic, group_rank, group_ranks, group_size, wait_all
from fabric_multimodel.comm.flat import FlatStorage, Part
from fabric_multimodel.comm.quantized import CODE_DTYPES, QuantizedMean
from fabric_multimodel.rounds.errors import AveragingError, NonFiniteError, PeerError, listed


class Stamp(NamedTuple):
    """What one rank writes into a round's header."""

    steps: int  # its step() count (modulo 16**8)
    layout: int  # a 16-bit fingerprint of the optimizer state it averages (0: none)
    progress: bool  # whether it took a local step since its last round


class Header:
    """Per-rank slots at the end of a payload, holding each rank's :class:`Stamp` as base-16 digits.

    Each rank writes digits into its own slots and zeros elsewhere, so after a SUM every slot holds
    one rank's digit exactly, in any floating dtype (bfloat16 holds 0..15 exactly).
    """

    STEP_DIGITS = 8
    LAYOUT_DIGITS = 4
    SLOTS = STEP_DIGITS + LAYOUT_DIGITS + 1

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self.size = world * self.SLOTS

    def write(self, slots: torch.Tensor, stamp: Stamp) -> None:
        digits = (
            _digits(stamp.steps, self.STEP_DIGITS) + _digits(stamp.layout, self.LAYOUT_DIGITS) + [int(stamp.progress)]
        )
        slots.zero_()
        start = self.rank * self.SLOTS
        slots[start : start + self.SLOTS] = torch.tensor(digits, dtype=slots.dtype)

    def read(self, values: Sequence[float]) -> list[Stamp]:
        """Every rank's stamp, from the summed slots."""
        stamps = []
        for r in range(self.world):
            digits = [round(v) for v in values[r * self.SLOTS : (r + 1) * self.SLOTS]]
            steps = _number(digits[: self.STEP_DIGITS])
            layout = _number(digits[self.STEP_DIGITS : self.STEP_DIGITS + self.LAYOUT_DIGITS])
            stamps.append(Stamp(steps, layout, bool(digits[-1])))
        return stamps


def _digits(value: int, count: int) -> list[int]:
    return [(value >> (4 * i)) & 15 for i in range(count)]


def _number(digits: Sequence[int]) -> int:
    return sum(d << (4 * i) for i, d in enumerate(digits))


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
            return self._agreed(_Sum(payload, self.group, self.world, self._abandon))
        mine = [self._slice(t) for t in payload]
        inner = _Sum([t for t in mine if t.numel()], self.group, self.world, self._abandon)
        return _NodeSlices(self._agreed(inner), payload, self.node_group)

    def _agreed(self, transport: Any) -> Any:
        """``transport``, agreed by the node's processes before its result is used (see :meth:`regroup`)."""
        return transport if self._agree is None else _Agreed(transport, self._agree)

    def _slice(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's slice of ``t`` among the node's processes."""
        start, end = _bounds(t.numel(), self.slices, group_rank(self.node_group))
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
        self._carrier = self._transports[part]
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


class DeltaRound(Round):
    """An anchored round: the payload is the pseudo-gradient ``anchor - param``, the new global state
    is ``anchor - mean(pseudo-gradient)`` (the mean of the replicas), and the anchor follows it.

    Floating-point buffers (BatchNorm statistics) ride in the same payload with an anchor that
    starts at zero, so their first round sends their values and their mean is identical on every
    rank from then on. Memory: the anchor (one copy of the tensors), plus a send buffer in
    ``comm_dtype`` when it differs from the tensors' dtype, the round is overlapped or covers
    fragments (sized for the largest), plus a snapshot (one more copy) when overlapped. All
    allocated once.

    A low-bit ``comm_dtype`` (``torch.float8_e4m3fn``, ``torch.float8_e5m2``,
    ``torch.float4_e2m1fn_x2``) sends the fp32 pseudo-gradient through a
    :class:`~fabric_multimodel.comm.quantized.QuantizedMean` per part (an all-to-all of block-quantized
    codes, the owners' means, an all-gather; the header in its exact channel), and with
    ``error_feedback`` each rank adds back what its last quantization of the part dropped.
    """

    def __init__(
        self,
        storage: FlatStorage,
        n_params: int,
        group: ProcessGroup,
        *,
        parts: Sequence[Part] | None = None,
        comm_dtype: torch.dtype | None,
        overlap: bool,
        check_finite: bool,
        mixing: float | None = None,
        error_feedback: bool = False,
        node_group: ProcessGroup = None,
        own_buffers: bool = False,
    ) -> None:
        dtypes = {flat.dtype for flat in storage.buffers}
        #: The code dtype of a quantized round (None: the payload is sent as it is, in ``comm_dtype``).
        self.code_dtype = comm_dtype if comm_dtype in CODE_DTYPES else None
        self._error_feedback = error_feedback
        if self.code_dtype is not None:
            comm_dtype = torch.float32  # the pseudo-gradient is computed in fp32 and quantized by the transport
        one_dtype = self.code_dtype is None and (comm_dtype is None or dtypes == {comm_dtype})
        in_place = not overlap and one_dtype and not own_buffers
        super().__init__(
            storage,
            group,
            parts=parts,
            overlap=overlap,
            check_finite=check_finite,
            comm_dtype=None if one_dtype else comm_dtype,
            in_place=in_place,
            mixing=mixing,
            node_group=node_group,
        )
        self.phases = 2 if self.code_dtype is not None else 1
        self.n_params = n_params
        #: The parts whose next round is their first across the islands: a plain mean that sets the anchor.
        self.fresh: set[int] = set()
        self._first: int | None = None  # the part of the round in flight when it is that part's first
        self.anchor = self.storage.mirror()
        self.snapshot = self.storage.mirror() if overlap else []
        # Per storage buffer, where its parameters end and its buffers (anchored at zero) begin.
        self._param_end = [0] * len(self.storage.sizes)
        for i in range(n_params):
            b, offset, numel = self.storage.slots[i]
            self._param_end[b] = max(self._param_end[b], offset + numel)
        self.anchor_parameters()

    def _transport(self, part: Part, payload: list[torch.Tensor], head: torch.Tensor) -> Any:
        if self.code_dtype is None:
            return super()._transport(part, payload, head)
        data = self.send[0][: sum(part.sizes)]
        mine = self._slice(data) if self.slices > 1 else data  # every slice's round carries the header
        mean = QuantizedMean(
            mine.numel(),
            self.code_dtype,
            self.send[0].device,
            group=self.group,
            exact_numel=head.numel(),
            error_feedback=self._error_feedback,
        )
        mean.abandon = self._abandon
        quantized = _Quantized(mean, mine, head)
        agreed = self._agreed(quantized)
        return agreed if self.slices == 1 else _NodeSlices(agreed, [data], self.node_group)

    anchored = True
    state_keys: tuple[str, ...] = ("anchor",)

    def regroup(
        self,
        group: ProcessGroup,
        abandon: Callable[[], bool] | None = None,
        agree: Callable[[bool], bool] | None = None,
    ) -> None:
        # Error feedback: what each part's quantization dropped is this rank's and goes on in the new group (a
        # dropped round leaves its own error there instead of the one before: both are one quantization's).
        previous = getattr(self, "_transports", []) if self._error_feedback else []
        super().regroup(group, abandon, agree)
        for transport, before in zip(self._transports, previous):
            transport.mean.keep_residual(before.mean)

    def launch(self, stamp: Stamp, *, label: str, blocking: bool, outer: bool = True, part: int = 0) -> None:
        self._first = part if part in self.fresh else None
        if self._first is not None:  # no anchor shared yet: send the parameters themselves, for a plain mean
            self._clear_anchor(self.parts[part])
            self.fresh.discard(part)
            outer = False
        super().launch(stamp, label=label, blocking=blocking, outer=outer, part=part)

    def abandon(self) -> None:
        if self.pending and self._first is not None:  # its anchor was cleared for a plain mean that did not happen
            self.fresh.add(self._first)
        super().abandon()

    def release_anchors(self) -> None:
        self.fresh = set(range(len(self.parts)))

    def restore_global(self) -> None:
        for index, part in enumerate(self.parts):
            if index not in self.fresh:
                self.restore_parameters(part)

    def anchor_parameters(self, part: Part | None = None) -> None:
        """Anchor the parameters (of ``part``, default all) where they are now (identical on every rank under DDP).

        Buffers keep their anchor: zero until the first round, then their mean, identical everywhere.
        """
        part = part or self.storage.part(range(len(self.storage.tensors)))
        with torch.no_grad():
            for anchor, x, end in zip(part.of(self.anchor), part.data, self._param_ends(part)):
                anchor[:end].copy_(x[:end])

    def restore_parameters(self, part: Part) -> None:
        """Set ``part``'s parameters to their anchor (buffers keep their values): the global model of its last round."""
        with torch.no_grad():
            for anchor, x, end in zip(part.of(self.anchor), part.data, self._param_ends(part)):
                x[:end].copy_(anchor[:end])
        if self._error_feedback:  # what it kept belongs to the replica that was replaced
            for transport in self._transports:
                transport.mean.clear_residual()

    def _clear_anchor(self, part: Part) -> None:
        """Set ``part``'s anchor to zero, so that its next round sends the parameters themselves: a plain mean
        of replicas that share no anchor yet (the first round across the islands)."""
        for anchor in part.of(self.anchor):
            anchor.zero_()

    def _param_ends(self, part: Part) -> list[int]:
        """Per buffer, where the parameters end inside ``part``'s range (the rest are buffers)."""
        return [min(max(end - start, 0), stop - start) for end, (start, stop) in zip(self._param_end, part.ranges)]

    def _fill(self) -> None:
        data = self.part.data
        for x, anchor, region, snap in zip(
            data, self.part.of(self.anchor), self._regions(), self.part.of(self.snapshot) if self.snapshot else data
        ):
            if self._blocking:
                torch.sub(anchor, x, out=x)  # the parameters are rebuilt from the anchor when the round finishes
                if not self.in_place:
                    region.copy_(x)
            else:
                snap.copy_(x)
                torch.sub(anchor, snap, out=region)

    def _merge(self) -> None:
        data = self.part.data
        snapshot = self.part.of(self.snapshot) if self.snapshot else data
        for x, region, snap in zip(data, self._regions(), snapshot):
            if not self._blocking:
                # The local progress since launch; exactly zero for a replica that made none, so that
                # it lands bitwise on the new anchor. Mixing keeps the local parameters instead.
                torch.sub(x, snap, out=snap) if self.mixing is None else snap.copy_(x)
            if not self.in_place:
                x.copy_(region)  # the summed pseudo-gradient, in the parameters' dtype, in scratch space
        self._move_anchor(data)
        for x, anchor, snap in zip(data, self.part.of(self.anchor), snapshot):
            if self._blocking:
                x.copy_(anchor)
            elif self.mixing is None:
                torch.add(anchor, snap, out=x)
            else:
                torch.lerp(anchor, snap, self.mixing, out=x)

    def _skip(self) -> None:
        if self._blocking:  # the parameters were turned into the (zero) pseudo-gradient in place
            for x, anchor in zip(self.part.data, self.part.of(self.anchor)):
                x.copy_(anchor)

    def _move_anchor(self, summed: list[torch.Tensor]) -> None:
        """Move the part's anchor by the mean pseudo-gradient (``summed`` holds the sum over ranks; scratch)."""
        alpha = 1 / self.world if self._carrier.sums else 1.0  # a quantized transport delivers the mean itself
        for anchor, total in zip(self.part.of(self.anchor), summed):
            anchor.sub_(total, alpha=alpha)

    def _buffers_part(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per buffer, the floating-point buffers' share of the part's ranges ``tensors``."""
        return [t[end:] for t, end in zip(tensors, self._param_ends(self.part))]

    def _rollback(self) -> str:
        for x, anchor in zip(self.part.data, self.part.of(self.anchor)):
            x.copy_(anchor)
        if self._error_feedback:  # what it kept came from the values that were rolled back
            self._carrier.mean.clear_residual()
        return (
            "the parameters are back at the anchor (the last averaged state; buffers that were never averaged"
            " are zero), identical on every rank"
        )

    def state_dict(self) -> dict[str, Any]:
        anchor = [a.clone() for a in self.anchor]
        # FSDP2 shards: per tensor, placed like its parameter, for torch.distributed.checkpoint to reshard.
        saved = anchor if self.storage.shards is None else self.storage.sharded(anchor)
        state: dict[str, Any] = {"anchor": saved, "fresh_fragments": sorted(self.fresh)}
        if self._error_feedback:  # this rank's own: what its quantizations dropped, per part
            state["error_feedback"] = [t.mean.state_dict()["residual"] for t in self._transports]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        anchors = state["anchor"]
        if self.storage.shards is not None and isinstance(anchors, Mapping):
            try:
                anchors = self.storage.unsharded(anchors)
            except ValueError as error:
                raise ValueError(f"the checkpoint's anchor does not match these modules: {error}") from None
        if len(anchors) != len(self.anchor) or any(a.shape != b.shape for a, b in zip(anchors, self.anchor)):
            raise ValueError("the checkpoint's anchor does not match these modules; load it into the same models.")
        fresh = state.get("fresh_fragments", [])
        if not isinstance(fresh, (list, tuple)) or not set(fresh) <= set(range(len(self.parts))):
            raise ValueError(f"`fresh_fragments` must list fragments 0..{len(self.parts) - 1}.")
        # None: the state holds no residual (saved without error feedback, or another replica's state sent to a
        # site that joined: its residuals are its own): this rank's start at zero.
        residuals = state.get("error_feedback") if self._error_feedback else []
        if (
            self._error_feedback
            and residuals is not None
            and (not isinstance(residuals, list) or len(residuals) != len(self._transports))
        ):
            raise ValueError("the checkpoint's error-feedback residuals do not match these fragments.")
        with torch.no_grad():
            for anchor, saved in zip(self.anchor, anchors):
                anchor.copy_(saved)
        self.fresh = set(fresh)
        for transport, residual in zip(self._transports, residuals or []):
            transport.mean.load_state_dict({"residual": residual})
        if residuals is None:
            for transport in self._transports:
                transport.mean.clear_residual()


class _Sum:
    """The usual transport: one asynchronous SUM allreduce per payload buffer (none with one rank, where the
    sum is the payload itself)."""

    sums = True  # after finish() the payload holds the sum over ranks (not the mean)

    def __init__(
        self, payload: list[torch.Tensor], group: ProcessGroup, world: int, abandon: Callable[[], bool] | None
    ) -> None:
        self.payload, self.group, self.world, self.abandon = payload, group, world, abandon
        self._work: list[dist.Work | None] = []

    @property
    def traffic(self) -> Traffic:
        if self.world == 1:
            return Traffic()
        return Traffic(sum(p.numel() for p in self.payload), sum(p.numel() * p.element_size() for p in self.payload))

    def start(self) -> None:
        if self.world > 1:
            self._work = [
                dist.all_reduce(s, op=dist.ReduceOp.SUM, group=self.group, async_op=True) for s in self.payload
            ]

    def exchange(self) -> None:
        pass

    def finish(self) -> None:
        work, self._work = self._work, []
        wait_all(work, self.abandon)


class _Quantized:
    """A block-quantized mean (fp8 or fp4 codes, see :mod:`fabric_multimodel.comm.quantized`): an all-to-all, then,
    at :meth:`exchange` or :meth:`finish`, an all-gather. The header rides in its exact channel."""

    sums = False  # after finish() the payload holds the mean; the header holds the exact sum

    def __init__(self, mean: QuantizedMean, payload: torch.Tensor, head: torch.Tensor) -> None:
        self.mean, self.payload, self.head = mean, payload, head
        self._sent = False

    @property
    def traffic(self) -> Traffic:
        return self.mean.traffic

    def start(self) -> None:
        self.mean.start(self.payload, self.head)
        self._sent = True

    def exchange(self) -> None:
        if self._sent:
            self._sent = False
            self.mean.exchange()

    def finish(self) -> None:
        self._sent = False
        self.mean.finish()


class _Wrapping:
    """A transport around ``inner``: what crossed and what the payload holds after it are ``inner``'s."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    @property
    def traffic(self) -> Traffic:
        return self.inner.traffic

    @property
    def sums(self) -> bool:
        return self.inner.sums

    @property
    def mean(self) -> QuantizedMean:
        return self.inner.mean


class _NodeSlices(_Wrapping):
    """Islands: ``inner`` carries this rank's slice of each payload tensor across the nodes; :meth:`finish` then
    broadcasts every slice from its owner to the node's other processes (one broadcast per slice, inside the node).
    ``traffic`` is what crossed: ``inner``'s."""

    def __init__(self, inner: Any, whole: list[torch.Tensor], node_group: ProcessGroup) -> None:
        super().__init__(inner)
        self.node_group = node_group
        owners = group_ranks(node_group)
        # Every slice of every payload tensor with the global rank that owns it (views made once, not per round).
        self._slices = [
            (t[start:end], owner)
            for t in whole
            for k, owner in enumerate(owners)
            for start, end in [_bounds(t.numel(), len(owners), k)]
            if end > start
        ]

    def start(self) -> None:
        self.inner.start()

    def exchange(self) -> None:
        self.inner.exchange()

    def finish(self) -> None:
        self.inner.finish()
        # All launched before the first wait, so the slices cross at once.
        work = [dist.broadcast(piece, src=owner, group=self.node_group, async_op=True) for piece, owner in self._slices]
        wait_all(work)


class _Agreed(_Wrapping):
    """A membership's site of several processes (islands, FSDP2 shards): each process's part of a round crosses in a
    group of its own, so one can see a peer lost where another finished. A failure of ``inner`` is kept until
    :meth:`finish`, which then asks ``agree`` whether every process of the site finished its part: the site merges
    the round, or drops it, as one (a :class:`PeerError` on each of its processes)."""

    def __init__(self, inner: Any, agree: Callable[[bool], bool]) -> None:
        super().__init__(inner)
        self.agree = agree
        self._failure: RuntimeError | None = None

    def start(self) -> None:
        self._failure = None
        self._run(self.inner.start)

    def exchange(self) -> None:
        self._run(self.inner.exchange)

    def finish(self) -> None:
        self._run(self.inner.finish)
        failure, self._failure = self._failure, None
        if not self.agree(failure is None):
            raise failure or RuntimeError("another process of this site lost a peer in this round")

    def _run(self, phase: Callable[[], None]) -> None:
        if self._failure is not None:
            return
        try:
            phase()
        except RuntimeError as error:
            self._failure = error


def _bounds(numel: int, count: int, index: int) -> tuple[int, int]:
    """Slice ``index`` of ``count`` nearly equal slices of ``numel`` elements."""
    return index * numel // count, (index + 1) * numel // count


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
