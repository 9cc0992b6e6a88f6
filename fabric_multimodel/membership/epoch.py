"""What a site is part of in a live run: an :class:`Epoch` (its members, this process's rank, their group), and
:class:`RunEnded`, what a site that started after the run's end gets."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from fabric_multimodel.membership.names import site_of


class RunEnded(RuntimeError):
    """The run's members finished (:meth:`Membership.close` with ``finished=True``) before this site was admitted: a
    site that started too late has nothing to join.

    Example::

        averager = Averager(fabric, model, period=128, membership=membership)
        try:
            averager.join()  # or the with block does
        except RunEnded:
            print("the run is over")
    """


@dataclass(frozen=True)
class Epoch:
    """One membership of the run: its number, its members in rank order, this process's rank and their group.

    Example::

        epoch = membership.join()
        print(f"epoch {epoch.number}: sites {epoch.sites}, I am rank {epoch.rank}")
        dist.all_reduce(tensor, group=epoch.group)
    """

    number: int
    #: The members' tokens, ``<site>#<registration>``, in rank order.
    members: tuple[str, ...]
    rank: int
    #: The epoch's process group (None only while it is being made).
    group: dist.ProcessGroup | None = field(repr=False, compare=False)
    #: The members that were not in the previous epoch (all of them in the first).
    joined: tuple[str, ...] = ()
    #: The previous epoch's members that are not in this one.
    left: tuple[str, ...] = ()

    @property
    def sites(self) -> tuple[str, ...]:
        """The members' site names, in rank order."""
        return tuple(site_of(token) for token in self.members)
