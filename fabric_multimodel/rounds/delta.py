"""The anchored round: pseudo-gradients ``anchor - param`` averaged, and the anchor moved by their mean
(:class:`DeltaRound`); DiLoCo's outer optimizer replaces that move (:mod:`fabric_multimodel.rounds.outer`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from fabric_multimodel.comm.collectives import ProcessGroup
from fabric_multimodel.comm.flat import FlatStorage, Part
from fabric_multimodel.rounds.header import Stamp
from fabric_multimodel.rounds.round import Round
from fabric_multimodel.rounds.transports import EncodedTransport, Encoding, NodeSlices


class DeltaRound(Round):
    """An anchored round: the payload is the pseudo-gradient ``anchor - param``, the new global state
    is ``anchor - mean(pseudo-gradient)`` (the mean of the replicas), and the anchor follows it.

    Floating-point buffers (BatchNorm statistics) ride in the same payload with an anchor that
    starts at zero, so their first round sends their values and their mean is identical on every
    rank from then on. Memory: the anchor (one copy of the tensors), plus a send buffer in
    ``comm_dtype`` when it differs from the tensors' dtype, the round is overlapped or covers
    fragments (sized for the largest), plus a snapshot (one more copy) when overlapped. All
    allocated once.

    An ``encoding`` sends the fp32 pseudo-gradient through an
    :class:`~fabric_multimodel.rounds.transports.EncodedMean` per part, the header in its exact channel: a low-bit
    ``comm_dtype``'s :class:`~fabric_multimodel.comm.quantized.QuantizedMean` (block-quantized codes) or a
    ``density``'s :class:`~fabric_multimodel.comm.sparse_mean.SparseMean` (each chunk's top entries). With
    ``error_feedback`` each rank's mean keeps what its last rounds of the part did not send (checkpointed with the
    anchor, cleared when the round is rolled back or the replica replaced).
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
        encoding: Encoding | None = None,
        error_feedback: bool = False,
        node_group: ProcessGroup = None,
        own_buffers: bool = False,
    ) -> None:
        dtypes = {flat.dtype for flat in storage.buffers}
        #: Builds each part's encoded mean (None: the payload is summed as it is, in ``comm_dtype``).
        self.encoding = encoding
        self._error_feedback = error_feedback
        if encoding is not None:
            comm_dtype = torch.float32  # the pseudo-gradient is computed in fp32 and encoded by the transport
        one_dtype = encoding is None and (comm_dtype is None or dtypes == {comm_dtype})
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
        self.phases = 2 if encoding is not None else 1
        self.n_params = n_params
        #: The parts whose next round is their first across the islands: a plain mean that sets the anchor.
        self.fresh: set[int] = set()
        self._first: int | None = None  # the part of the round in flight when it is that part's first
        self._progress = True  # whether this rank made progress for the round in flight
        self._index = 0  # the part of the round in flight
        self.anchor = self.storage.mirror()
        self.snapshot = self.storage.mirror() if overlap else []
        # Per storage buffer, where its parameters end and its buffers (anchored at zero) begin.
        self._param_end = [0] * len(self.storage.sizes)
        for i in range(n_params):
            b, offset, numel = self.storage.slots[i]
            self._param_end[b] = max(self._param_end[b], offset + numel)
        self.anchor_parameters()

    def _transport(self, part: Part, payload: list[torch.Tensor], head: torch.Tensor) -> Any:
        if self.encoding is None:
            return super()._transport(part, payload, head)
        data = self.send[0][: sum(part.sizes)]
        mine = self._slice(data) if self.slices > 1 else data  # every slice's round carries the header
        mean = self.encoding(mine.numel(), self.send[0].device, self.group, head.numel())
        mean.abandon = self._abandon
        agreed = self._agreed(EncodedTransport(mean, mine, head, lambda: self._progress))
        return agreed if self.slices == 1 else NodeSlices(agreed, [data], self.node_group)

    anchored = True
    state_keys: tuple[str, ...] = ("anchor",)

    def regroup(
        self,
        group: ProcessGroup,
        abandon: Callable[[], bool] | None = None,
        agree: Callable[[bool], bool] | None = None,
    ) -> None:
        # Error feedback: what each part's mean kept is this rank's and goes on in the new group (a
        # dropped round leaves its own error there instead of the one before: both are one quantization's).
        previous = getattr(self, "_transports", []) if self._error_feedback else []
        super().regroup(group, abandon, agree)
        for transport, before in zip(self._transports, previous):
            transport.mean.keep_residual(before.mean)
        # A part's first round across replicas that trained apart sends the parameters themselves for a plain mean
        # that sets the anchor: summed as they are where the encoding cannot carry them (a sparse one).
        summed = super()._transport
        self._plain = [summed(part, *layout) for part, layout in zip(self.parts, self._layouts)]

    def _carrier_of(self, part: int) -> Any:
        carrier = super()._carrier_of(part)
        if self.encoding is not None and self._first == part and not carrier.mean.carries_parameters:
            return self._plain[part]
        return carrier

    def launch(self, stamp: Stamp, *, label: str, blocking: bool, outer: bool = True, part: int = 0) -> None:
        self._progress = stamp.progress  # what an encoded mean kept is sent only with progress (EncodedTransport)
        self._index = part
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
        alpha = 1 / self.world if self._carrier.sums else 1.0  # an encoded transport delivers the mean itself
        for anchor, total in zip(self.part.of(self.anchor), summed):
            anchor.sub_(total, alpha=alpha)

    def _buffers_part(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per buffer, the floating-point buffers' share of the part's ranges ``tensors``."""
        return [t[end:] for t, end in zip(tensors, self._param_ends(self.part))]

    def _rollback(self) -> str:
        for x, anchor in zip(self.part.data, self.part.of(self.anchor)):
            x.copy_(anchor)
        if self._error_feedback:  # what it kept came from the values that were rolled back
            self._transports[self._index].mean.clear_residual()
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
