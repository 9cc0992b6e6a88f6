"""The optimizers' statistics (Adam's moments) that a plain round averages along with the parameters.

Adam keeps two tensors per parameter, so a round of a 400-tensor model averages 800 more. Packed into a
staging buffer and copied back every round, that cost more than the round itself (three times one
allreduce of the same elements, on 2 CPU ranks); :class:`OptimizerStateStorage` keeps them in flat storage
instead, so a round reduces them in place, as it does the parameters.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch.optim import Optimizer

from fabric_multimodel.comm.collectives import ProcessGroup, Traffic, all_reduce_mean_, fingerprint
from fabric_multimodel.comm.flat import FlatStorage, local_part


def optimizer_state(optimizers: Sequence[Optimizer]) -> list[torch.Tensor]:
    """Floating-point state tensors in a rank-independent order; the step counter is not a statistic.

    Example::

        adam.step()
        moments = optimizer_state([adam])  # exp_avg, exp_avg_sq of each parameter, in parameter order
    """
    return [value for _, value in _labelled(optimizers)]


def _labelled(optimizers: Sequence[Optimizer]) -> list[tuple[tuple[int, str], torch.Tensor]]:
    """:func:`optimizer_state`, each tensor with its parameter's index in its group and its key."""
    found = []
    for opt in optimizers:
        for group in opt.param_groups:
            for i, p in enumerate(group["params"]):
                state = opt.state.get(p)
                if not state:
                    continue
                for key in sorted(state):
                    value = state[key]
                    if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point():
                        found.append(((i, key), value))
    return found


class OptimizerStateStorage:
    """The optimizers' floating state, re-homed into flat buffers (one per device and dtype) so that averaging
    it is one in-place allreduce per buffer.

    Optimizers make their state lazily, at their first step, and replace it in ``load_state_dict``: each
    :meth:`refresh` checks that the state tensors are still the ones in the buffers, and moves them there
    again when they are not. An FSDP2 parameter's state is a DTensor whose local shard FSDP owns:
    that state is copied into the buffers and back around the allreduce instead.

    Example::

        state = OptimizerStateStorage([adam])
        adam.step()
        fingerprint, _ = state.refresh()  # Adam made its moments: they move into flat buffers
        state.all_reduce_mean_()  # and are the mean over the ranks now
    """

    def __init__(self, optimizers: Sequence[Optimizer]) -> None:
        self.optimizers = list(optimizers)
        self._storage: FlatStorage | None = None
        self._layout = (0, "")

    def refresh(self) -> tuple[int, str]:
        """Re-home the state tensors when the optimizers made or replaced any since the last call; returns
        :attr:`layout`."""
        from torch.distributed.tensor import DTensor

        labelled = _labelled(self.optimizers)
        values = [t for _, t in labelled]
        # A DTensor's local shard lives in storage that FSDP2 owns: copy it in and out (FlatStorage.synced).
        sharded = any(isinstance(t, DTensor) for t in values)
        tensors = [local_part(t) for t in values] if sharded else values
        storage = self._storage
        if storage is not None and list(map(torch.Tensor.data_ptr, tensors)) == storage.addresses:
            return self._layout
        self._storage = FlatStorage(tensors, rehome=not sharded) if tensors else None
        if self._storage is not None:
            self._storage.release()
        description = repr([(i, key, tuple(t.shape), str(t.dtype)) for ((i, key), _), t in zip(labelled, tensors)])
        self._layout = (fingerprint(description) & 0xFFFF, description) if tensors else (0, "")
        return self._layout

    @property
    def layout(self) -> tuple[int, str]:
        """A 16-bit fingerprint of the state's keys, shapes and dtypes (0: no state), and their description, as
        of the last :meth:`refresh`: ranks whose optimizers differ (amsgrad on one) differ here."""
        return self._layout

    def all_reduce_mean_(
        self, group: ProcessGroup = None, *, scale: float = 1.0, abandon: Callable[[], bool] | None = None
    ) -> Traffic:
        """Replace the state found by the last :meth:`refresh` by its mean over ``group``, in place; returns what
        it sent. ``scale`` and ``abandon``: see :func:`~fabric_multimodel.comm.collectives.all_reduce_mean_`."""
        if self._storage is None:
            return Traffic()
        with self._storage.synced():
            return all_reduce_mean_(self._storage.data, group, scale=scale, abandon=abandon)
