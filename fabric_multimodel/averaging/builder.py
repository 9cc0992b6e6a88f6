"""How an :class:`~fabric_multimodel.Averager` is put together: the tensors it averages, laid out in flat
storage fragment by fragment, and the round of the kind its :class:`~fabric_multimodel.AveragerConfig` asks
for. The Averager (the driver) only carries out the schedule's events with what is built here.

The kind of round follows from the options alone: ``outer_optimizer`` makes a DiLoCo
:class:`~fabric_multimodel.rounds.outer.OuterRound`, a ``comm_dtype`` an anchored
:class:`~fabric_multimodel.rounds.delta.DeltaRound`, neither a plain :class:`~fabric_multimodel.rounds.round.MeanRound`.
A new kind of storage (a shard's) or of round is one more case here, not in the driver.

Example::

    config = AveragerConfig(period=8)
    built = build_rounds(config, [model], check_placement([model], [], None, None, config))
    built.round.launch(stamp, label="round 1", blocking=True)
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from fabric_multimodel.averaging.arguments import Placement, check_fragments, plain_module
from fabric_multimodel.averaging.auto_period import shortest_period
from fabric_multimodel.averaging.config import AveragerConfig
from fabric_multimodel.comm.codec import CODE_DTYPES
from fabric_multimodel.comm.collectives import ProcessGroup, group_size
from fabric_multimodel.comm.flat import FlatStorage, Part, local_part
from fabric_multimodel.comm.quantized import QuantizedMean
from fabric_multimodel.comm.robust_mean import RobustMean
from fabric_multimodel.comm.sparse_mean import SparseMean
from fabric_multimodel.ddp.models import ddp_ignored
from fabric_multimodel.rounds.delta import DeltaRound
from fabric_multimodel.rounds.fragments import fragment_indices
from fabric_multimodel.rounds.header import Header
from fabric_multimodel.rounds.outer import OuterRound
from fabric_multimodel.rounds.round import MeanRound, Round
from fabric_multimodel.rounds.transports import Encoding


@dataclass(frozen=True)
class Built:
    """What an Averager works with: its round (and two-level averaging's round inside the node), over one
    flat storage of the averaged tensors."""

    round: Round
    #: Two-level averaging (``node_period``): the plain round inside the node.
    node_round: MeanRound | None
    #: The number of fragments; a round covers one.
    fragments: int
    #: The period: the config's, or with ``period="auto"`` the smallest the fragments and overlap allow.
    period: int
    #: Whether floating-point buffers are averaged too (they ride with the last fragment).
    has_buffers: bool
    #: The tensors (names, shapes, dtypes) and settings every rank of the averaging group must share.
    agreement: str


def build_rounds(
    config: AveragerConfig,
    modules: Sequence[nn.Module],
    placement: Placement,
    optimizers: Sequence[Optimizer] = (),
    process_group: ProcessGroup = None,
    node_group: ProcessGroup = None,
    model_names: Sequence[str] | None = None,
    live_sites: int | None = None,
) -> Built:
    """The storage and the rounds for ``modules`` under ``config``; a clear error for fragments that do not fit.
    ``live_sites``: with a membership, the most sites an epoch may have: the rounds keep room for their headers,
    and never send from the parameters' own storage (a round that fails half-way then leaves them as they were).
    """
    tensors, names, n_params = averaged_tensors(modules, config.average_buffers, model_names)
    groups = fragment_indices(tensors[:n_params], names[:n_params], config.fragments)
    # period="auto" is chosen at the end of warm-up; until then the smallest one the fragments and overlap allow.
    period = config.period if isinstance(config.period, int) else shortest_period(len(groups), config.first_overlap)
    check_fragments(len(groups), period, config.first_overlap, optimizers)
    # Each fragment's parameters next to each other in the flat storage (buffers last, with the last fragment),
    # so that a fragment is one range of each flat buffer. Fragments are cut by the whole parameters, so that
    # every rank of a site cuts the same; a round averages what this rank holds of each.
    placed = [i for group in groups for i in group]
    whole = [tensors[i] for i in placed] + tensors[n_params:]
    tensors = [local_part(t) for t in whole]
    names = [names[i] for i in placed] + names[n_params:]
    largest = max(group_size(process_group), group_size(node_group) if config.node_period else 1, live_sites or 1)
    # FSDP2 owns its shards' storage (its all-gathers read it): rounds work on a copy that exists only while they run.
    # The shards' parameters come along, so that the rounds' state (anchors) can be saved placed like them.
    shards = whole if placement.sharded else None
    storage = FlatStorage(tensors, names, spare=Header.SLOTS * largest, rehome=not placement.sharded, shards=shards)
    ends = list(itertools.accumulate(len(group) for group in groups))
    ends[-1] = len(tensors)
    parts = [storage.part(range(start, end)) for start, end in zip([0, *ends], ends)] if len(groups) > 1 else None
    order = sorted(range(n_params), key=placed.__getitem__)  # storage positions, in the modules' order
    node = _node_of(placement.ddps) if placement.islands and placement.ddps else None
    node_round = None
    if config.node_period:
        node_round = MeanRound(storage, node_group, overlap=False, check_finite=config.check_finite)
    averaging_round = _round(config, storage, n_params, process_group, parts, order, node, live_sites is not None)
    storage.release()  # a copy of FSDP2's shards is needed only while rounds run
    layout = [(name, tuple(t.shape), str(t.dtype)) for name, t in zip(names, tensors)]
    settings = (config.agreement(), len(optimizers), placement.islands, ends)
    return Built(
        averaging_round,
        node_round,
        len(groups),
        period,
        len(tensors) > n_params,
        repr((layout, settings)),
    )


def _round(
    config: AveragerConfig,
    storage: FlatStorage,
    n_params: int,
    group: ProcessGroup,
    parts: list[Part] | None,
    order: list[int],
    node: ProcessGroup,
    own_buffers: bool,
) -> Round:
    """The kind of round the options ask for."""
    overlap, check_finite, mixing = config.overlap_steps != 0, config.check_finite, config.mixing
    if config.outer_optimizer is None and config.comm_dtype is None and config.density == 1 and not config.robust:
        return MeanRound(
            storage,
            group,
            parts=parts,
            overlap=overlap,
            check_finite=check_finite,
            mixing=mixing,
            node_group=node,
            own_buffers=own_buffers,
        )
    anchored: dict[str, Any] = {"parts": parts, "comm_dtype": config.comm_dtype, "mixing": mixing, "node_group": node}
    anchored["own_buffers"] = own_buffers
    anchored["encoding"] = encoding(config)
    anchored["error_feedback"] = config.error_feedback or config.density != 1
    if config.outer_optimizer is None:
        return DeltaRound(storage, n_params, group, overlap=overlap, check_finite=check_finite, **anchored)
    return OuterRound(
        storage,
        n_params,
        group,
        outer_optimizer=config.outer_optimizer,
        order=order,
        overlap=overlap,
        check_finite=check_finite,
        **anchored,
    )


def encoding(config: AveragerConfig) -> Encoding | None:
    """What encodes an anchored round's payload: a ``robust`` rule's mean, a ``density`` below 1's sparse mean, a
    low-bit ``comm_dtype``'s quantized mean, or nothing (the payload is summed as it is)."""
    if config.robust is not None:
        return functools.partial(_robust, rule=config.robust, trim=config.trim, code_dtype=config.comm_dtype)
    if config.density != 1:
        return functools.partial(_sparse, density=config.density, decay=config.error_decay)
    if config.comm_dtype in CODE_DTYPES:
        return functools.partial(_quantized, code_dtype=config.comm_dtype, error_feedback=config.error_feedback)
    return None


def _sparse(
    numel: int, device: torch.device, group: ProcessGroup, exact_numel: int, *, density: float, decay: float
) -> SparseMean:
    return SparseMean(numel, density, device, group=group, exact_numel=exact_numel, decay=decay)


def _robust(
    numel: int, device: torch.device, group: ProcessGroup, exact_numel: int, *, rule: str, trim: float,
    code_dtype: torch.dtype | None
) -> RobustMean:  # fmt: skip
    return RobustMean(numel, device, rule=rule, trim=trim, group=group, exact_numel=exact_numel, code_dtype=code_dtype)


def _quantized(
    numel: int, device: torch.device, group: ProcessGroup, exact_numel: int, *, code_dtype: torch.dtype,
    error_feedback: bool
) -> QuantizedMean:  # fmt: skip
    return QuantizedMean(numel, code_dtype, device, group=group, exact_numel=exact_numel, error_feedback=error_feedback)


def averaged_tensors(
    modules: Sequence[nn.Module], average_buffers: bool, model_names: Sequence[str] | None = None
) -> tuple[list[torch.Tensor], list[str], int]:
    """The tensors a round averages (FSDP2 parameters whole, as DTensors), their names (``model.layer.weight``),
    and how many are parameters (first). What a module asks DDP to leave alone (``_ddp_params_and_buffers_to_ignore``:
    each rank keeps its own) no round averages either."""
    prefixes = model_names or ([""] if len(modules) == 1 else [f"modules[{i}]" for i in range(len(modules))])
    seen: dict[int, tuple[torch.Tensor, str]] = {}
    n_params = 0
    for kind in ("parameters", "buffers"):
        for module, prefix in zip(modules, prefixes):
            plain = plain_module(module)
            ignored = set(ddp_ignored(plain, "Averager"))
            for name, t in getattr(plain, f"named_{kind}")():
                if name in ignored or (kind == "buffers" and not (average_buffers and t.is_floating_point())):
                    continue
                seen.setdefault(id(t), (t, f"{prefix}.{name}" if prefix else name))
        if kind == "parameters":
            n_params = len(seen)
    tensors, names = zip(*seen.values()) if seen else ((), ())
    return list(tensors), list(names), n_params


def _node_of(ddps: Sequence[torch.nn.parallel.DistributedDataParallel]) -> ProcessGroup:
    """The group over which the islands' DDPs synchronise (the node), when they all share one; else None."""
    groups = {tuple(dist.get_process_group_ranks(ddp.process_group)): ddp.process_group for ddp in ddps}
    return next(iter(groups.values())) if len(groups) == 1 else None
