"""The errors a round raises on every rank, and how a message lists tensor names."""

from __future__ import annotations

from collections.abc import Sequence


class AveragingError(RuntimeError):
    """An averaging round failed on every rank: a peer is gone, or the ranks disagree on the schedule.

    Example::

        try:
            averager.step()
        except AveragingError as error:
            fabric.print(f"stopping: {error}")
            raise
    """


class PeerError(AveragingError):
    """A round failed because a peer exited, or did not answer within the group's timeout.

    Example::

        try:
            averager.step()
        except PeerError:
            ...  # without a Membership, the run cannot go on with this group
    """


class NonFiniteError(AveragingError):
    """A round found NaN or Inf in what the replicas sent; raised on every rank.

    ``names`` lists every tensor (``model.layer.weight``) that held them; the message, the first eight.
    Anchored rounds (DiLoCo, ``comm_dtype``) have put the parameters back to the anchor, identical and
    finite on every rank; plain averaging has already spread the values to every replica.

    Example::

        except NonFiniteError as error:
            print(error.names)
    """

    def __init__(self, message: str, names: Sequence[str]) -> None:
        super().__init__(message)
        self.names = list(names)


def listed(names: Sequence[str], limit: int = 8) -> str:
    """``names`` for an error message: the first ``limit``, then how many more (a 400-tensor model lists 400).

    Example::

        listed(["a", "b", "c"], limit=2)  # "a, b and 1 more"
    """
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
