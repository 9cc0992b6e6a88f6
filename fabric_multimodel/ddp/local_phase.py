"""DDP's collectives switched off for an Averager's local phase, and put back as they were when it ends."""

from __future__ import annotations

from collections.abc import Iterable

from torch.nn.parallel import DistributedDataParallel


class LocalPhase:
    """The DDP wrappers an Averager trains locally after warm-up: :meth:`enter` notes their settings, :meth:`apply`
    switches their collectives off (or on, in warm-up), :meth:`exit` puts the settings back.

    Example::

        phase = LocalPhase(ddps)
        phase.enter()
        phase.apply(local=True)  # forward and backward communicate nothing
        ...
        phase.exit()
    """

    def __init__(self, ddps: Iterable[DistributedDataParallel]) -> None:
        self.ddps = list(ddps)
        self._settings: list[tuple[DistributedDataParallel, bool, bool]] | None = None

    @property
    def entered(self) -> bool:
        """True between :meth:`enter` and :meth:`exit`."""
        return self._settings is not None

    def enter(self) -> None:
        self._settings = [(ddp, ddp.require_backward_grad_sync, ddp.broadcast_buffers) for ddp in self.ddps]

    def apply(self, local: bool) -> None:
        """Switch the collectives off when ``local``, or back to their settings; nothing outside enter/exit."""
        for ddp, grad_sync, broadcast_buffers in self._settings or ():
            # The local phase turns off both of DDP's collectives: the gradient allreduce (what
            # no_sync() does, but for every forward in the phase) and the per-forward buffer broadcast
            # (`broadcast_buffers`, a property over `forward_sync_buffers` since torch 2.13).
            ddp.require_backward_grad_sync = grad_sync and not local
            ddp.broadcast_buffers = broadcast_buffers and not local
            if local and ddp.reducer._rebuild_buckets():
                # DDP rebuilds its gradient buckets once, with a broadcast, in the first forward after
                # the first synchronous backward. Doing it here, on every rank at the same step, keeps
                # that broadcast out of the local phase.
                ddp._has_rebuilt_buckets = True

    def exit(self) -> None:
        for ddp, grad_sync, broadcast_buffers in self._settings or ():
            ddp.require_backward_grad_sync = grad_sync
            ddp.broadcast_buffers = broadcast_buffers
        self._settings = None
