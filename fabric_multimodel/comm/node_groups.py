"""Process groups for multi-node layouts: the processes of this rank's node, and its peers across nodes.

Clusters are islands: fast links inside a node, slow ones between nodes. Two layouts use these groups:

- *islands*: every model's DDP synchronises inside the node each step
  (``setup_models(..., process_group=groups.node)``) and an :class:`~fabric_multimodel.Averager` averages across nodes
  (``Averager(..., process_group=groups.across)``);
- *two-level averaging*: DDP over the world during warm-up, then local steps, a round inside the
  node every ``node_period`` steps and across the world every ``period`` steps
  (``Averager(..., period=32, node_period=4, node_group=groups.node)``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from fabric_multimodel.comm.collectives import ProcessGroup, new_group


class NodeGroups(NamedTuple):
    """This rank's groups in a world of ``nodes`` nodes of ``per_node`` processes each."""

    node: ProcessGroup  # the processes of this rank's node
    across: ProcessGroup  # one process per node: those with this rank's local rank
    node_rank: int
    local_rank: int
    nodes: int
    per_node: int


def node_groups(fabric: Any, num_nodes: int | None = None) -> NodeGroups:
    """Build the node and cross-node groups on every rank, in the same order (call it on every rank).

    The layout is read from every rank (one small all-gather of its node rank and local rank), so
    it holds however the launcher numbered the ranks; ``num_nodes`` defaults to Fabric's. A world
    that is not a whole number of equal nodes is a ``ValueError`` on every rank, before any group
    is made. Creates ``nodes + per_node`` groups (``torch.distributed.new_group`` on every rank).

    Example::

        groups = node_groups(fabric)  # under `fabric run --num-nodes 2 --devices 4 ...`
        gen, disc = setup_models(fabric, gen=G, disc=D, process_group=groups.node)
        with Averager(fabric, [gen, disc], period=128, process_group=groups.across, outer_optimizer=diloco) as averager:
            ...
    """
    nodes = num_nodes if num_nodes is not None else int(getattr(fabric.strategy, "num_nodes", 1))
    world = dist.get_world_size()
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"node_groups: `num_nodes` must be a positive int, got {nodes!r}.")
    if world % nodes:
        raise ValueError(
            f"node_groups: {world} processes do not make {nodes} nodes of equal size; start the same number of"
            " processes on every node (fabric run --num-nodes N --devices G)."
        )
    per_node = world // nodes
    mine = torch.tensor([fabric.node_rank, fabric.local_rank], dtype=torch.int64, device=fabric.device)
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine)
    layout = [tuple(int(v) for v in t.tolist()) for t in everyone]  # (node rank, local rank) per global rank
    by_node: dict[int, list[int]] = {}
    by_local: dict[int, list[int]] = {}
    for rank, (node, local) in enumerate(layout):
        by_node.setdefault(node, []).append(rank)
        by_local.setdefault(local, []).append(rank)
    if len(by_node) != nodes or any(len(ranks) != per_node for ranks in by_node.values()):
        sizes = {node: len(ranks) for node, ranks in sorted(by_node.items())}
        raise ValueError(
            f"node_groups: expected {nodes} nodes of {per_node} processes, but the ranks report nodes {sizes}"
            " (node rank: processes); start the same number of processes on every node."
        )
    node_rank, local_rank = layout[dist.get_rank()]
    node_group = across_group = None
    # Every rank must create every group, in the same order, even the groups it is not in.
    for node in sorted(by_node):
        group = new_group(by_node[node])
        if node == node_rank:
            node_group = group
    for local in sorted(by_local):
        group = new_group(by_local[local])
        if local == local_rank:
            across_group = group
    return NodeGroups(node_group, across_group, node_rank, local_rank, nodes, per_node)
