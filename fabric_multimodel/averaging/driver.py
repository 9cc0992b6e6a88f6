"""What the :class:`~fabric_multimodel.Averager` shows the pieces it drives (its epochs, its rounds): :class:`Driver`,
a Protocol of its public state, so that none of them sees the class or its private members."""

from __future__ import annotations

from typing import Any, Protocol

import torch.distributed as dist

from fabric_multimodel.averaging.pacing import Pace
from fabric_multimodel.comm.collectives import Traffic
from fabric_multimodel.membership.membership import Membership
from fabric_multimodel.rounds.schedule import Schedule


class Driver(Protocol):
    """The driver's public state that an epoch change and the rounds read and set: the
    :class:`~fabric_multimodel.Averager`'s counters, its groups and its pace."""

    process_group: dist.ProcessGroup | None
    node_group: dist.ProcessGroup | None
    membership: Membership | None
    steps: int
    rounds: int
    node_rounds: int
    finished_at: int | None
    round_s: float
    pace: Pace | None
    traffic: Traffic
    node_traffic: Traffic
    start_traffic: Traffic
    sharded: bool
    fragments: int
    warmup_steps: int

    @property
    def schedule(self) -> Schedule: ...

    @property
    def local(self) -> bool: ...

    @property
    def anchored(self) -> bool: ...

    def restore_global(self) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
