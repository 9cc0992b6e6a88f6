"""What every mean whose round runs in three phases shares (:class:`PhasedMean`): the phase it is in, a whole round
at once, and the checks of a round's arguments; :class:`~fabric_multimodel.comm.quantized.QuantizedMean` and
:class:`~fabric_multimodel.comm.sparse_mean.SparseMean` build on it.

Example::

    mean = SparseMean(delta.numel(), 1 / 64, delta.device, exact_numel=header.numel())
    mean.all_reduce_mean(delta, header)  # start, exchange and finish at once
    assert not mean.pending
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from fabric_multimodel.comm.codec import check_tensor
from fabric_multimodel.comm.collectives import wait_all

IDLE, SENT, GATHERING = "idle", "sent", "gathering"


class PhasedMean(ABC):
    """A mean of a fixed-size fp32 payload (``numel`` elements on ``device``) with an exact channel of
    ``exact_numel`` elements, whose round is :meth:`start`, :meth:`exchange` and :meth:`finish`, each waiting for
    the collective the one before launched (``_handle``) and launching the next.

    Example::

        class MyMean(PhasedMean): ...   # start, exchange and finish of its own, with _waited() between
    """

    numel: int
    exact_numel: int
    device: torch.device

    def __init__(self) -> None:
        self._phase = IDLE
        #: Asked while a wait is unfinished: True ends it with an error (see collectives.wait_all).
        self.abandon: Callable[[], bool] | None = None
        self._handle: Any = None

    @property
    def pending(self) -> bool:
        """True between :meth:`start` and :meth:`finish`."""
        return self._phase != IDLE

    def all_reduce_mean(self, payload: torch.Tensor, exact: torch.Tensor | None = None) -> None:
        """A whole round at once: ``payload`` <- the mean, ``exact`` <- the exact sum.

        Example::

            mean.all_reduce_mean(delta, header)
        """
        self.start(payload, exact)
        self.exchange()
        self.finish()

    @abstractmethod
    def start(self, payload: torch.Tensor, exact: torch.Tensor | None = None, *, carry: bool = True) -> None:
        """Launch a round of ``payload`` (``carry=False``: without what the mean kept from earlier rounds)."""

    @abstractmethod
    def exchange(self) -> None:
        """Wait for :meth:`start`'s collective and launch the second."""

    @abstractmethod
    def finish(self) -> None:
        """Wait for the second collective and write the mean into the payload, the exact sum into ``exact``."""

    def _waited(self, phase: str, method: str) -> None:
        """Wait for the collective ``phase`` launched (a ``RuntimeError`` naming ``method`` when the round is in
        another phase); the object is idle again whether the wait ends well or not."""
        if self._phase != phase:
            what = "no round was started" if phase == SENT else "no round in flight"
            raise RuntimeError(f"{type(self).__name__}.{method}: {what}; call start(payload, exact) first.")
        handle, self._handle, self._phase = self._handle, None, IDLE
        wait_all([handle], self.abandon)

    def _check_round(
        self, payload: torch.Tensor, exact: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``payload`` and ``exact`` flat, once checked against what this mean was built for."""
        name = type(self).__name__
        caller = f"{name}.start"
        if self._phase != IDLE:
            raise RuntimeError(f"{caller}: a round is in flight; finish() it first.")
        check_tensor(payload, caller, "payload", self.numel, self.device, contiguous=True)
        if self.exact_numel == 0:
            if exact is not None and exact.numel():
                raise ValueError(
                    f"{caller}: `exact` has {exact.numel()} elements but this {name} was built with exact_numel=0;"
                    " pass exact=None or build it with exact_numel."
                )
            return payload.view(-1), None
        if exact is None:
            raise ValueError(
                f"{caller}: `exact` is required: this {name} was built with exact_numel={self.exact_numel};"
                " pass a float32 tensor of that many elements."
            )
        check_tensor(exact, caller, "exact", self.exact_numel, self.device, contiguous=True)
        return payload.view(-1), exact.view(-1)

    def _check_between_rounds(self, method: str) -> None:
        if self._phase != IDLE:
            raise RuntimeError(
                f"{type(self).__name__}.{method}: a round is in flight (what it keeps is mid-update); finish() it"
                " first."
            )
