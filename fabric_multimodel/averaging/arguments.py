"""The `Averager`'s arguments beyond its :class:`~fabric_multimodel.averaging.config.AveragerConfig` (the modules, the
optimizers, the groups), checked before anything is built.

Every rank runs these checks on its own arguments before any collective, so a mistake is one clear error on every
rank instead of a hang. Each error names the argument and the fix.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from fabric_multimodel.averaging.config import AveragerConfig
from fabric_multimodel.comm.collectives import ProcessGroup, check_member, group_ranks, group_size
from fabric_multimodel.ddp.families import is_instance
from fabric_multimodel.ddp.models import ddp_of


def check_fragments(count: int, period: int, overlap_steps: int, optimizers: Sequence[Optimizer]) -> None:
    if period % count:
        raise ValueError(
            f"Averager: `period` ({period}) must be a multiple of the number of fragments ({count}), so that a"
            " fragment's round falls every period / fragments steps."
        )
    if overlap_steps >= period // count:
        raise ValueError(
            f"Averager: `overlap_steps` ({overlap_steps}) must be smaller than period / fragments"
            f" ({period // count}), so that one fragment is in flight at a time."
        )
    if count > 1 and optimizers:
        raise ValueError(
            "Averager: `optimizers` cannot be combined with `fragments`; drop one (the inner optimizers' state"
            " stays local, as in DiLoCo)."
        )


@dataclass(frozen=True)
class Placement:
    """Where an Averager's modules live, as its arguments tell: FSDP2 shards or replicas, and whether each
    node keeps its processes' replicas together (islands: DDP or FSDP2 inside the node, rounds across nodes)."""

    #: The modules are FSDP2 shards: a round averages this rank's shard with the same shard of the other sites.
    sharded: bool
    #: DDP (or FSDP2) synchronises inside each node every step, and rounds average across nodes.
    islands: bool
    #: The modules' DDPs.
    ddps: tuple[DistributedDataParallel, ...]
    #: Islands: the group that keeps this rank's replica together (its DDP's, or its FSDP2 shards'); else None.
    site: ProcessGroup = None


def check_placement(
    modules: Sequence[nn.Module],
    optimizers: Sequence[Optimizer],
    process_group: ProcessGroup,
    node_group: ProcessGroup,
    config: AveragerConfig,
    *,
    across_sites: bool = False,
) -> Placement:
    """The Averager's arguments beyond its config, checked on this rank before any collective; where the
    modules live. ``across_sites``: a membership's, whose sites are worlds of their own (the default group is
    this site's), so a module's DDP inside it makes islands."""
    overlap_steps, node_period = config.overlap_steps, config.node_period
    if overlap_steps and optimizers:
        raise ValueError(
            "Averager: `optimizers` cannot be combined with `overlap_steps`; drop one (inner optimizer state"
            " stays local, as in DiLoCo, when `optimizers` is empty)."
        )
    check_node_group(node_period, node_group)
    check_member(process_group, "Averager")
    check_member(node_group, "Averager")
    shards = [check_replicated(module) for module in modules]
    if group_size(process_group) > 1:
        for module, shard in zip(modules, shards):
            if not (shard or is_instance(module, "wrappers._FabricModule") or ddp_of(module) is not None):
                raise TypeError(
                    f"Averager: module {type(module).__name__} was not set up; pass what setup_models or"
                    " fabric.setup_module returned, so that its gradients are synchronised during warm-up."
                )
    if any(shards):
        if not all(shards) or node_period:
            raise ValueError(
                "Averager: with FSDP2 models, shard every model (setup_models(..., shard=group) shards all) and"
                " average across sites without `node_period` (a round inside a site has nothing to average)."
            )
        # a membership's: each site a world of its own, sharded over it; process i of each site holds shard i
        site = _shard_group(modules[0]) if across_sites else check_sharded_layout(modules, process_group)
        return Placement(True, True, (), site)
    ddps = tuple(ddp for ddp in map(ddp_of, modules) if ddp is not None)
    islands = bool(ddps) if across_sites else islands_layout(ddps, process_group, node_period)
    return Placement(False, islands, ddps, ddps[0].process_group if islands else None)


def check_node_group(node_period: int | None, node_group: ProcessGroup) -> None:
    if node_period is None and node_group is not None:
        raise ValueError("Averager: `node_group` is only used with `node_period`; pass both or neither.")
    if node_period is not None and node_group is None:
        raise ValueError(
            "Averager: `node_period` needs `node_group`, the group of this rank's node (node_groups(fabric).node)."
        )


def check_membership(config: AveragerConfig, process_group: ProcessGroup, node_group: ProcessGroup) -> None:
    """What a :class:`~fabric_multimodel.Membership` does not take, refused before it registers."""
    if process_group is not None:
        raise ValueError(
            "Averager: `membership` does not take a `process_group`: each round runs on the group of the site's"
            " epoch, which the membership makes; leave `process_group` out, or leave out `membership`."
        )
    if node_group is not None or config.node_period is not None:
        raise ValueError(
            "Averager: `membership` does not take `node_group` or `node_period` (two-level averaging) yet: a site of"
            " several processes keeps them in step with DDP or FSDP2 inside it; leave them out, or leave out"
            " `membership`."
        )


def islands_layout(ddps: Sequence[DistributedDataParallel], group: ProcessGroup, node_period: int | None) -> bool:
    """Whether the modules' DDPs synchronise orthogonally to the averaging group (islands) or over it (flat).

    The rule: a DDP over the averaging group itself is switched off after warm-up (local steps);
    a DDP whose group meets the averaging group in this rank alone (its node, when averaging
    across nodes) keeps synchronising every step; anything else is a mistake.
    """
    if not ddps:
        return False
    # A group of one rank is islands too when DDP spans the node: the one node left of an elastic run, whose
    # processes must keep synchronising.
    averaging = set(group_ranks(group))
    kinds = set()
    for ddp in ddps:
        ranks = set(dist.get_process_group_ranks(ddp.process_group))
        if ranks == averaging:
            kinds.add("flat")
        elif ranks & averaging == {dist.get_rank()}:
            kinds.add("islands")
        else:
            raise ValueError(
                f"Averager: a module's DDP synchronises over ranks {sorted(ranks)} and this Averager averages over"
                f" {sorted(averaging)}; use DDP over the averaging group (flat: DDP is switched off after warm-up)"
                " or over this rank's node with the Averager across nodes (islands: DDP keeps synchronising)."
            )
    if len(kinds) > 1:
        raise ValueError(
            "Averager: some modules' DDP synchronises over the averaging group and some inside the node; set up"
            " every module the same way (setup_models(..., process_group=...) applies one group to all)."
        )
    if "islands" in kinds and node_period:
        raise ValueError(
            "Averager: two-level averaging (`node_period`) switches DDP off after warm-up, so set the models up with"
            " DDP over the world (the default), not inside the node."
        )
    return "islands" in kinds


def check_replicated(module: nn.Module) -> bool:
    """Averaging needs a whole replica per rank, or an FSDP2 shard of one (``fully_shard`` over a 1-D mesh, the
    rank's site); True for a shard. Anything else that shards the model (FSDP1, DeepSpeed, tensor or hybrid
    parallel) is a TypeError."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor, Shard

    forward = module._forward_module if is_instance(module, "wrappers._FabricModule") else module
    forward = getattr(forward, "_orig_mod", forward)
    dtensors = [p for p in module.parameters() if isinstance(p, DTensor)]
    if isinstance(forward, FSDPModule):
        if len(dtensors) == len(list(module.parameters())) and all(
            p.device_mesh.ndim == 1 and tuple(p.placements) == (Shard(0),) for p in dtensors
        ):
            return True
        raise TypeError(
            f"Averager: {type(forward).__name__} is sharded over a mesh of more than one dimension (HSDP, or FSDP"
            " with tensor parallel); shard each model over its site only (setup_models(..., shard=group)) and"
            " average across sites with the Averager's process_group."
        )
    wrapped = isinstance(forward, DistributedDataParallel) or forward is plain_module(module)
    if not wrapped or dtensors:
        raise TypeError(
            f"Averager: {type(forward).__name__} holds a shard of the model on each rank, not a replica; averaging"
            " needs DDP, single-device or FSDP2 (fully_shard) models: set them up with setup_models."
        )
    return False


def _shard_group(module: nn.Module) -> ProcessGroup:
    """The group an FSDP2 module's parameters are sharded over (its mesh's)."""
    return next(iter(module.parameters())).device_mesh.get_group()  # type: ignore[attr-defined]


def check_sharded_layout(modules: Sequence[nn.Module], group: ProcessGroup) -> ProcessGroup:
    """FSDP2 models must shard over a group that meets the averaging group in this rank alone (the site, when
    averaging across sites): a round then averages each shard with the same shard of the other sites. Returns
    the group of the first module's shards."""
    from torch.distributed.tensor import DTensor

    site = None
    averaging = set(group_ranks(group))
    for module in modules:
        for p in module.parameters():
            assert isinstance(p, DTensor)
            site = site or p.device_mesh.get_group()
            ranks = set(dist.get_process_group_ranks(p.device_mesh.get_group()))
            if ranks & averaging != {dist.get_rank()}:
                raise ValueError(
                    f"Averager: a sharded module's shards live on ranks {sorted(ranks)} and this Averager averages"
                    f" over {sorted(averaging)}; average across sites, one rank per site holding the same shard:"
                    " process_group=node_groups(fabric).across with setup_models(..., shard=node_groups(fabric).node)."
                )
            break  # one mesh per module (fully_shard's)
    return site


def as_module_list(modules: Any, caller: str) -> list[nn.Module]:
    module_list = (
        [modules] if isinstance(modules, nn.Module) else list(modules) if isinstance(modules, Iterable) else None
    )
    if module_list is None:
        raise TypeError(
            f"{caller}: `modules` must be a module or an iterable of modules, got {type(modules).__name__}."
        )
    if not module_list:
        raise ValueError(f"{caller}: `modules` is empty; pass the models to average.")
    for module in module_list:
        if not isinstance(module, nn.Module):
            raise TypeError(f"{caller}: `modules` must hold torch.nn.Module objects, got {type(module).__name__}.")
    return module_list


def check_optimizers(optimizers: Any, caller: str) -> list[Optimizer]:
    if isinstance(optimizers, Optimizer) or not isinstance(optimizers, Iterable):
        raise TypeError(f"{caller}: `optimizers` must be a list of optimizers, e.g. optimizers=[opt_g, opt_d].")
    optimizers = list(optimizers)
    for opt in optimizers:
        if not isinstance(opt, Optimizer):
            raise TypeError(
                f"{caller}: `optimizers` must hold torch.optim.Optimizer objects, got {type(opt).__name__}."
            )
    return optimizers


def plain_module(module: nn.Module) -> nn.Module:
    """The user's module under Fabric's and DDP's wrappers (for readable tensor names)."""
    if is_instance(module, "wrappers._FabricModule"):
        module = cast(nn.Module, module._original_module)  # nn.Module.__getattr__ is typed Tensor | Module
    return module.module if isinstance(module, DistributedDataParallel) else module
