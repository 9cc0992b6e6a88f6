"""Per-model DDP and explicit model averaging (post-local SGD) for Lightning Fabric loops.

Example::

    from fabric_multimodel import Averager, frozen, setup_models

    gen, disc = setup_models(fabric, gen=G, disc=D)
    with Averager(fabric, [gen, disc], period=8, warmup_steps=200) as averager:
        for real in loader:
            ...
            averager.step()
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fabric_multimodel.averaging.averager import Averager
    from fabric_multimodel.averaging.config import AveragerConfig
    from fabric_multimodel.averaging.replicas import Replica, SyncReport, average_models, replicas_in_sync
    from fabric_multimodel.checkpoints.checkpointer import Checkpointer
    from fabric_multimodel.comm.collectives import Traffic
    from fabric_multimodel.comm.node_groups import NodeGroups, node_groups
    from fabric_multimodel.ddp.frozen import frozen
    from fabric_multimodel.ddp.models import Models, ddp_of, setup_models
    from fabric_multimodel.membership.epoch import Epoch, RunEnded
    from fabric_multimodel.membership.link import CoordinatorLost
    from fabric_multimodel.membership.membership import Membership
    from fabric_multimodel.membership.signed import WrongSecret
    from fabric_multimodel.rounds.errors import AveragingError, NonFiniteError, PeerError
    from fabric_multimodel.run.loop import Loop
    from fabric_multimodel.run.preemption import PreemptionStop

# Each public name and its module, imported on first use: the sites tool (`python -m fabric_multimodel.sites`)
# needs only the standard library, and must not wait seconds for torch.
_HOMES = {
    "Averager": "averaging.averager",
    "Replica": "averaging.replicas",
    "Checkpointer": "checkpoints.checkpointer",
    "Traffic": "comm.collectives",
    "AveragerConfig": "averaging.config",
    "frozen": "ddp.frozen",
    "NodeGroups": "comm.node_groups",
    "node_groups": "comm.node_groups",
    "Loop": "run.loop",
    "Epoch": "membership.epoch",
    "Membership": "membership.membership",
    "RunEnded": "membership.epoch",
    "CoordinatorLost": "membership.link",
    "WrongSecret": "membership.signed",
    "Models": "ddp.models",
    "ddp_of": "ddp.models",
    "setup_models": "ddp.models",
    "PreemptionStop": "run.preemption",
    "SyncReport": "averaging.replicas",
    "average_models": "averaging.replicas",
    "replicas_in_sync": "averaging.replicas",
    "AveragingError": "rounds.errors",
    "NonFiniteError": "rounds.errors",
    "PeerError": "rounds.errors",
}
__all__ = [
    "Averager",
    "AveragerConfig",
    "AveragingError",
    "Checkpointer",
    "CoordinatorLost",
    "Epoch",
    "Loop",
    "Membership",
    "Models",
    "NodeGroups",
    "NonFiniteError",
    "PeerError",
    "PreemptionStop",
    "Replica",
    "RunEnded",
    "SyncReport",
    "Traffic",
    "WrongSecret",
    "average_models",
    "ddp_of",
    "frozen",
    "node_groups",
    "replicas_in_sync",
    "setup_models",
]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'fabric_multimodel' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"fabric_multimodel.{_HOMES[name]}"), name)
    globals()[name] = value  # once
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
