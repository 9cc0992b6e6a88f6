"""Per-model DDP and explicit model averaging (post-local SGD) for Lightning Fabric loops.

Example::

    from fabric_multimodel import Averager, frozen, setup_models

    gen, disc = setup_models(fabric, gen=G, disc=D)
    with Averager(fabric, [gen, disc], period=8, warmup_steps=200) as averager:
        for real in loader:
            ...
            averager.step()
"""

from fabric_multimodel.averaging import Averager, Replica, SyncReport, average_models, replicas_in_sync
from fabric_multimodel.collectives import Traffic
from fabric_multimodel.config import AveragerConfig
from fabric_multimodel.frozen import frozen
from fabric_multimodel.groups import NodeGroups, node_groups
from fabric_multimodel.models import Models, ddp_of, setup_models
from fabric_multimodel.rounds import AveragingError, NonFiniteError

__all__ = [
    "Averager",
    "AveragerConfig",
    "AveragingError",
    "Models",
    "NodeGroups",
    "NonFiniteError",
    "Replica",
    "SyncReport",
    "Traffic",
    "average_models",
    "ddp_of",
    "frozen",
    "node_groups",
    "replicas_in_sync",
    "setup_models",
]
__version__ = "0.1.0"
