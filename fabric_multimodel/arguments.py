"""The `Averager`'s and `ModelAveraging`'s arguments, checked before anything is built.

Every rank runs these checks on its own arguments before any collective, so a mistake is one clear error on every
rank instead of a hang. Each error names the argument and the fix.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from fabric_multimodel.collectives import ProcessGroup, group_ranks
from fabric_multimodel.families import is_instance
from fabric_multimodel.quantized import CODE_DTYPES


def check_options(
    period: Any,
    warmup_steps: Any,
    overlap_steps: Any,
    average_buffers: Any,
    check_finite: Any,
    comm_dtype: Any,
    outer_optimizer: Any,
    mixing: Any = None,
    error_feedback: Any = False,
    caller: str = "Averager",
) -> None:
    """The schedule's and the round's options, checked before anything is built (the Trainer callback too)."""
    check_int("period", period, minimum=1, caller=caller)
    check_int("warmup_steps", warmup_steps, minimum=0, caller=caller)
    check_int("overlap_steps", overlap_steps, minimum=0, caller=caller)
    for name, flag in [
        ("average_buffers", average_buffers),
        ("check_finite", check_finite),
        ("error_feedback", error_feedback),
    ]:
        if not isinstance(flag, bool):
            raise TypeError(f"{caller}: `{name}` must be True or False, got {flag!r}.")
    if overlap_steps >= period:
        raise ValueError(
            f"{caller}: `overlap_steps` ({overlap_steps}) must be smaller than `period` ({period}), so that a"
            " round is merged before the next one starts."
        )
    if comm_dtype is not None and not (isinstance(comm_dtype, torch.dtype) and comm_dtype.is_floating_point):
        raise TypeError(
            f"{caller}: `comm_dtype` must be a floating torch.dtype such as torch.bfloat16 (or, for block-quantized"
            " rounds, torch.float8_e4m3fn, torch.float8_e5m2 or torch.float4_e2m1fn_x2), or None; got"
            f" {comm_dtype!r}."
        )
    if error_feedback and comm_dtype not in CODE_DTYPES:
        raise ValueError(
            f"{caller}: `error_feedback` keeps what block quantization drops; it needs a low-bit `comm_dtype`"
            f" (torch.float8_e4m3fn, torch.float8_e5m2 or torch.float4_e2m1fn_x2), got {comm_dtype!r}."
        )
    if isinstance(outer_optimizer, Optimizer):
        raise TypeError(
            f"{caller}: `outer_optimizer` must be a factory that builds the optimizer from the parameters it is"
            " given, not an optimizer: e.g."
            " functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)."
        )
    if mixing is not None:
        if isinstance(mixing, bool) or not isinstance(mixing, (int, float)) or not 0 <= mixing <= 1:
            raise ValueError(f"{caller}: `mixing` must be a number in [0, 1] or None, got {mixing!r}.")
        if not overlap_steps:
            raise ValueError(
                f"{caller}: `mixing` sets how overlapped rounds merge; set `overlap_steps` too, or drop `mixing`."
            )


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


def check_two_levels(
    period: int,
    node_period: Any,
    node_group: ProcessGroup,
    outer_optimizer: Any,
    comm_dtype: Any,
    overlap_steps: int,
    fragments: Any,
) -> None:
    if node_period is None:
        if node_group is not None:
            raise ValueError("Averager: `node_group` is only used with `node_period`; pass both or neither.")
        return
    check_int("node_period", node_period, minimum=1)
    if node_group is None:
        raise ValueError(
            "Averager: `node_period` needs `node_group`, the group of this rank's node (node_groups(fabric).node)."
        )
    if period % node_period or node_period == period:
        raise ValueError(
            f"Averager: `period` ({period}) must be a multiple of `node_period` ({node_period}), and larger: a round"
            " across the world every `period` steps, inside the node every `node_period` steps in between."
        )
    if outer_optimizer is not None or comm_dtype is not None or overlap_steps or fragments != 1:
        raise ValueError(
            "Averager: two-level averaging (`node_period`) is plain, blocking averaging; drop outer_optimizer,"
            " comm_dtype, overlap_steps and fragments, or use the islands layout (DDP inside the node) for those."
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


def check_replicated(module: nn.Module) -> None:
    """Averaging needs a whole replica per rank: refuse sharded models (FSDP, DeepSpeed, tensor parallel)."""
    from torch.distributed.tensor import DTensor

    forward = module._forward_module if is_instance(module, "wrappers._FabricModule") else module
    forward = getattr(forward, "_orig_mod", forward)
    wrapped = isinstance(forward, DistributedDataParallel) or forward is plain_module(module)
    if not wrapped or any(isinstance(p, DTensor) for p in module.parameters()):
        raise TypeError(
            f"Averager: {type(forward).__name__} holds a shard of the model on each rank, not a replica; averaging"
            " needs DDP (or single-device) models: set them up with setup_models under a DDP strategy."
        )


def check_int(name: str, value: Any, minimum: int, caller: str = "Averager") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{caller}: `{name}` must be an int >= {minimum}, got {value!r} ({type(value).__name__}).")
    if value < minimum:
        raise ValueError(f"{caller}: `{name}` must be >= {minimum}, got {value}.")


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
