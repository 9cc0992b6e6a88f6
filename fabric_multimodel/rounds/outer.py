"""DiLoCo's outer step: the anchor moves by an optimizer step on the mean pseudo-gradient.

``OuterRound`` is a :class:`~fabric_multimodel.rounds.delta.DeltaRound` whose anchor is not simply
moved by the mean pseudo-gradient but stepped by an *outer optimizer* (DiLoCo: SGD with lr 0.7,
momentum 0.9, Nesterov), for which that mean is the gradient. The optimizer is built once by the
user's factory over the anchor's copies of the parameters, so the model's own ``param.grad`` is
never touched. SGD with lr 1 and no momentum is plain averaging.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.optim import Optimizer

from fabric_multimodel.comm.collectives import ProcessGroup
from fabric_multimodel.comm.flat import FlatStorage, Part, local_part
from fabric_multimodel.rounds.delta import DeltaRound
from fabric_multimodel.rounds.transports import Encoding

OuterOptimizerFactory = Callable[[list[torch.Tensor]], Optimizer]


class OuterRound(DeltaRound):
    """A DiLoCo round: ``anchor.grad = mean(anchor - param)``, one outer-optimizer step, ``param <- anchor``.

    Floating-point buffers are averaged (their anchor moves by their mean), never stepped. The
    outer optimizer's state (momentum) is the only memory added to a :class:`DeltaRound`'s. With
    fragments, one outer optimizer holds every parameter and a round steps only its fragment's
    (the others get no gradient, so PyTorch's optimizers leave them and their state alone).
    """

    def __init__(
        self,
        storage: FlatStorage,
        n_params: int,
        group: ProcessGroup,
        *,
        outer_optimizer: OuterOptimizerFactory,
        comm_dtype: torch.dtype | None,
        overlap: bool,
        check_finite: bool,
        parts: Sequence[Part] | None = None,
        order: Sequence[int] | None = None,
        mixing: float | None = None,
        encoding: Encoding | None = None,
        error_feedback: bool = False,
        node_group: ProcessGroup = None,
        own_buffers: bool = False,
    ) -> None:
        super().__init__(
            storage,
            n_params,
            group,
            parts=parts,
            comm_dtype=comm_dtype,
            overlap=overlap,
            check_finite=check_finite,
            mixing=mixing,
            encoding=encoding,
            error_feedback=error_feedback,
            node_group=node_group,
            own_buffers=own_buffers,
        )
        #: The parameters' positions in the storage, in the modules' order (the order the factory sees).
        self.order = list(order) if order is not None else list(range(n_params))
        self.params = self.storage.views(self.anchor, self.order)
        # The mean pseudo-gradient is computed in the parameters' own memory (scratch during a round).
        self._grads = self.storage.views(self.storage.data, self.order)
        self.optimizer = make_outer_optimizer(outer_optimizer, self.params)

    def _move_anchor(self, summed: list[torch.Tensor]) -> None:
        if not self._outer:
            super()._move_anchor(summed)
            return
        if self._carrier.sums:  # an encoded transport delivers the mean itself
            for total in summed:
                total.div_(self.world)
        stepped = set(self.part.indices)
        for index, param, grad in zip(self.order, self.params, self._grads):
            param.grad = grad if index in stepped else None
        try:
            self.optimizer.step()
        finally:
            for param in self.params:
                param.grad = None
        for anchor, mean in zip(self._buffers_part(self.part.of(self.anchor)), self._buffers_part(summed)):
            anchor.sub_(mean)

    state_keys = ("anchor", "outer_optimizer")

    def state_dict(self) -> dict[str, Any]:
        outer = self.optimizer.state_dict()
        if self.storage.shards is not None:  # FSDP2 shards: the state by parameter name, placed like the parameter
            outer["state"] = {
                self.storage.names[self.order[k]]: {
                    key: self.storage.shard(self.order[k], value) if self._per_element(k, value) else value
                    for key, value in entry.items()
                }
                for k, entry in outer["state"].items()
            }
        return {**super().state_dict(), "outer_optimizer": outer}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        outer = state["outer_optimizer"]
        if self.storage.shards is not None:
            position = {self.storage.names[index]: k for k, index in enumerate(self.order)}
            unknown = sorted(set(outer["state"]) - set(position))
            if unknown:
                raise ValueError(f"the checkpoint's outer optimizer holds state of unknown tensors {unknown}.")
            outer = {
                **outer,
                "state": {
                    position[name]: {
                        key: local_part(value) if isinstance(value, torch.Tensor) else value
                        for key, value in entry.items()
                    }
                    for name, entry in outer["state"].items()
                },
            }
        super().load_state_dict(state)
        self.optimizer.load_state_dict(outer)

    def _per_element(self, k: int, value: Any) -> bool:
        """Whether ``value`` is optimizer state with one element per element of parameter ``k`` (momentum), not a
        scalar (a step count)."""
        return isinstance(value, torch.Tensor) and value.shape == self.params[k].shape


def make_outer_optimizer(factory: Any, params: list[torch.Tensor]) -> Optimizer:
    """Call the user's ``outer_optimizer`` factory and check that it optimizes exactly ``params``."""
    if not callable(factory):
        raise TypeError(
            "Averager: `outer_optimizer` must be a factory params -> Optimizer, e.g."
            f" functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True); got {type(factory).__name__}."
        )
    optimizer = factory(params)
    if not isinstance(optimizer, Optimizer):
        raise TypeError(
            f"Averager: `outer_optimizer(params)` must return a torch.optim.Optimizer, got {type(optimizer).__name__}."
        )
    given = {id(p) for p in params}
    optimized = [p for group in optimizer.param_groups for p in group["params"]]
    if {id(p) for p in optimized} != given or len(optimized) != len(params):
        raise ValueError(
            "Averager: the optimizer built by `outer_optimizer(params)` must optimize exactly the tensors it was"
            " given (the anchor copies of the averaged parameters), each once."
        )
    return optimizer
