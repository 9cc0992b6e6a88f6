"""How a round's payload crosses: a SUM allreduce per buffer (:class:`SumTransport`), an encoded mean
(block-quantized or sparse: :class:`EncodedTransport` around an :class:`EncodedMean`), the islands' slices broadcast
inside each node (:class:`NodeSlices`), and a site of several processes that merges or drops a round as one
(:class:`Agreed`). Each has ``start``, ``exchange``, ``finish``, ``traffic`` and ``sums`` (whether the payload then
holds the sum or the mean)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from fabric_multimodel.comm.collectives import ProcessGroup, Traffic, group_ranks, wait_all


class EncodedMean(Protocol):
    """A mean across ranks that encodes the payload on the way
    (:class:`~fabric_multimodel.comm.quantized.QuantizedMean`, :class:`~fabric_multimodel.comm.sparse_mean.SparseMean`):
    three phases, an exact channel for the header, and
    what it keeps of this rank's payload between rounds (error feedback)."""

    abandon: Callable[[], bool] | None
    #: Whether a plain mean of the parameters themselves may cross through it (a quantized code keeps each block's
    #: scale; a sparse one would keep a few entries of each chunk and zero the rest).
    carries_parameters: bool

    @property
    def traffic(self) -> Traffic: ...

    def start(self, payload: torch.Tensor, exact: torch.Tensor | None = None, *, carry: bool = True) -> None: ...

    def exchange(self) -> None: ...

    def finish(self) -> None: ...

    def clear_residual(self) -> None: ...

    def keep_residual(self, previous: Any) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


#: Builds the :class:`EncodedMean` of a round's payload: ``(numel, device, group, exact_numel)``.
Encoding = Callable[[int, torch.device, ProcessGroup, int], EncodedMean]


class SumTransport:
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


class EncodedTransport:
    """An encoded mean (:class:`EncodedMean`): launched at :meth:`start`, its second exchange at :meth:`exchange` or
    :meth:`finish`. The header rides in its exact channel. ``carry()`` says whether this rank made progress for the
    round: only then does the mean add what it kept from earlier rounds (a round no rank made progress for is not
    applied, and what it sent of that would be lost)."""

    sums = False  # after finish() the payload holds the mean; the header holds the exact sum

    def __init__(self, mean: EncodedMean, payload: torch.Tensor, head: torch.Tensor, carry: Callable[[], bool]) -> None:
        self.mean, self.payload, self.head, self.carry = mean, payload, head, carry
        self._sent = False

    @property
    def traffic(self) -> Traffic:
        return self.mean.traffic

    def start(self) -> None:
        self.mean.start(self.payload, self.head, carry=self.carry())
        self._sent = True

    def exchange(self) -> None:
        if self._sent:
            self._sent = False
            self.mean.exchange()

    def finish(self) -> None:
        self._sent = False
        self.mean.finish()


class WrappingTransport:
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
    def mean(self) -> EncodedMean:
        return self.inner.mean


class NodeSlices(WrappingTransport):
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
            for start, end in [slice_bounds(t.numel(), len(owners), k)]
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


class Agreed(WrappingTransport):
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


def slice_bounds(numel: int, count: int, index: int) -> tuple[int, int]:
    """Slice ``index`` of ``count`` nearly equal slices of ``numel`` elements."""
    return index * numel // count, (index + 1) * numel // count
