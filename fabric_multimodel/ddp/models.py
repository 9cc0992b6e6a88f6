"""Where models get wrapped: each model in its own ``DistributedDataParallel``, with its own options."""

from __future__ import annotations

import inspect
from collections import namedtuple
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fabric_multimodel.comm.collectives import describe_disagreement, fingerprint
from fabric_multimodel.ddp.families import family_class, is_instance

if TYPE_CHECKING:
    from lightning_fabric import Fabric

# Fabric passes these itself; a user value would clash with (or silently undo) Fabric's choice.
_RESERVED_DDP_KWARGS = ("module", "device_ids")
_DDP_KWARGS = set(inspect.signature(DistributedDataParallel.__init__).parameters) - {"self"}


class Models(tuple):
    """The models returned by :func:`setup_models`: a named tuple, in the order they were passed.

    Example::

        models = setup_models(fabric, gen=G, disc=D)
        gen, disc = models                  # unpack
        models.gen                          # by name
        models._asdict()                    # {"gen": ..., "disc": ...}
    """

    __slots__ = ()

    if TYPE_CHECKING:  # what the namedtuple that each instance's class also derives from (_models_type) provides
        _fields: tuple[str, ...]

        def _asdict(self) -> dict[str, Any]: ...

        def __getattr__(self, name: str) -> Any: ...


def setup_models(
    fabric: Fabric,
    /,
    *,
    ddp_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
    process_group: Any = None,
    shard: Any = None,
    **models: nn.Module,
) -> Models:
    """Set up each model with Fabric, each in its **own** ``DistributedDataParallel``.

    Under a DDP strategy every model gets the strategy's DDP options overridden by
    ``ddp_kwargs[name]``, so a GAN's discriminator can skip buffer broadcasts while the generator
    keeps them, and no model needs ``find_unused_parameters=True`` (use :func:`frozen` for the
    model that is only used, not trained, in a step). A model with no trainable parameter (a
    frozen teacher) is set up without DDP: DDP has nothing to synchronise and refuses such a model;
    it is still converted, moved and wrapped by Fabric. Make its parameters trainable before this
    call if you mean to train it. Single-process strategies ignore ``ddp_kwargs``; FSDP, DeepSpeed
    and any strategy that builds its own wrapper set each model up as Fabric does and reject
    ``ddp_kwargs``.

    With several processes, one small allreduce first checks that every rank passed the same model
    names, in the same order, with the same parameter and buffer shapes and dtypes, and the same
    ``ddp_kwargs`` names and options; a mismatch is a ``ValueError`` on every rank that says what
    differs, instead of a hang inside DDP.

    ``process_group`` is the group every model's DDP synchronises over (the default group when
    None); ``ddp_kwargs[name]["process_group"]`` overrides it for one model. The islands layout of
    a multi-node run passes the node's group (see :func:`node_groups`). A DDP whose group holds one
    process (the islands layout with one device per node) prepares no gradient reduction and
    broadcasts no buffers: it costs nothing per step.

    ``shard`` (a process group, e.g. ``node_groups(fabric).node``, or a 1-D ``DeviceMesh``) shards each
    model over that group with FSDP2 (``fully_shard``) instead of wrapping it in DDP: each rank holds
    1/S of the parameters, gradients are reduce-scattered inside the group every step, and an
    :class:`~fabric_multimodel.Averager` over the sites (``process_group=groups.across``) averages
    each shard with the same shard of the other sites. Models with submodules to shard one by one
    (transformer blocks, for lower peak memory): apply ``fully_shard(block, mesh=...)`` to them
    first; this call shards the root. ``frozen`` keeps its promise: a frozen model's forward
    all-gathers its parameters but its backward reduce-scatters nothing.

    Args:
        fabric: a launched Fabric (``lightning.fabric.Fabric`` or ``lightning_fabric.Fabric``).
        ddp_kwargs: per-model ``DistributedDataParallel`` options, keyed by model name.
        process_group: the group of every model's DDP (DDP strategies only).
        shard: the group (or 1-D device mesh) to shard every model over with FSDP2, instead of DDP.
        **models: the models to set up, by name; the order is kept.

    Returns:
        A :class:`Models` named tuple of the set-up models (what ``fabric.setup_module`` returns).

    Example::

        gen, disc = setup_models(fabric, gen=G, disc=D, ddp_kwargs={"disc": {"forward_sync_buffers": False}})
        gen, disc = setup_models(fabric, gen=G, disc=D, process_group=node_groups(fabric).node)  # islands
        gen, disc = setup_models(fabric, gen=G, disc=D, shard=node_groups(fabric).node)  # FSDP2 inside each node
    """
    _validate(fabric, ddp_kwargs, models)
    if shard is not None:
        return _setup_sharded(fabric, shard, ddp_kwargs, process_group, models)
    if process_group is not None:
        if not builds_plain_ddp(fabric.strategy):
            raise ValueError(
                f"setup_models: `process_group` only applies to DDP strategies, but this Fabric uses"
                f" {type(fabric.strategy).__name__}."
            )
        ddp_kwargs = {name: {"process_group": process_group, **(ddp_kwargs or {}).get(name, {})} for name in models}
    ddp_kwargs = ddp_kwargs or {}
    for module in models.values():
        ddp_ignored(module, "setup_models")  # before the first collective
    _check_agreement(fabric, ddp_kwargs, models)
    strategy = fabric.strategy
    set_up = {}
    for name, module in models.items():
        if not builds_plain_ddp(strategy):
            set_up[name] = fabric.setup_module(module)
        elif not any(p.requires_grad for p in module.parameters()):
            with _wrapped_by(strategy, lambda module: module):  # DDP has nothing to synchronise
                set_up[name] = fabric.setup_module(module)
        else:
            with _ddp_options(strategy, ddp_kwargs.get(name, {})):
                set_up[name] = fabric.setup_module(module)
            _quiet_if_alone(ddp_of(set_up[name]))
    return _models_type(tuple(set_up))(**set_up)


def _quiet_if_alone(ddp: DistributedDataParallel | None) -> None:
    """A DDP over a group of one process has nothing to synchronise: it then prepares no gradient reduction
    (no bucket copies, no allreduce) and broadcasts no buffers, as under ``no_sync()`` for good. The islands
    layout with one device per site paid both on every step (48.4 ms against 45.6 ms per LM step)."""
    if ddp is not None and dist.get_world_size(ddp.process_group) == 1:
        ddp.require_backward_grad_sync = False
        ddp.broadcast_buffers = False


def _setup_sharded(
    fabric: Fabric, shard: Any, ddp_kwargs: Any, process_group: Any, models: Mapping[str, nn.Module]
) -> Models:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    if not builds_plain_ddp(fabric.strategy):
        raise ValueError(
            f"setup_models: `shard` builds FSDP2 models under Fabric's DDP strategy (which starts the processes),"
            f" but this Fabric uses {type(fabric.strategy).__name__}; use strategy='ddp', or drop `shard`."
        )
    if ddp_kwargs or process_group is not None:
        raise ValueError(
            "setup_models: `shard` wraps the models in FSDP2, not DDP; drop `ddp_kwargs` and `process_group`."
        )
    if isinstance(shard, DeviceMesh):
        if shard.ndim != 1:
            raise ValueError(f"setup_models: `shard` must be a 1-D DeviceMesh (the site), got {shard.ndim} dims.")
        mesh = shard
    elif isinstance(shard, dist.ProcessGroup):
        mesh = DeviceMesh.from_group(shard, fabric.device.type)
    else:
        raise TypeError(
            "setup_models: `shard` must be a process group (e.g. node_groups(fabric).node) or a 1-D DeviceMesh,"
            f" got {type(shard).__name__}."
        )
    _check_agreement(fabric, {}, models)
    strategy = fabric.strategy
    set_up = {}
    for name, module in models.items():
        with _wrapped_by(strategy, lambda module: fully_shard(module, mesh=mesh)):
            set_up[name] = fabric.setup_module(module)
    return _models_type(tuple(set_up))(**set_up)


#: What PyTorch's DDP reads from the module it wraps: the names (relative to that module) of the parameters and
#: buffers it leaves alone, neither broadcast nor reduced (each rank keeps its own).
DDP_IGNORE = "_ddp_params_and_buffers_to_ignore"


def ddp_ignored(module: nn.Module, caller: str) -> list[str]:
    """The names ``module._ddp_params_and_buffers_to_ignore`` lists (PyTorch's attribute, names relative to
    ``module``), each checked to name a parameter or buffer of ``module``: ``ValueError`` naming the first that names
    nothing. No collective, so every rank raises alike before any.

    Example::

        discriminator._ddp_params_and_buffers_to_ignore = ["mine"]  # a buffer each rank keeps for itself
        ddp_ignored(discriminator, "setup_models")  # ['mine']
    """
    names = [str(name) for name in getattr(module, DDP_IGNORE, None) or ()]
    known = {name for name, _ in module.named_parameters()} | {name for name, _ in module.named_buffers()}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(
            f"{caller}: {type(module).__name__}.{DDP_IGNORE} names {unknown[0]!r}, which is no parameter or buffer of"
            f" it; list names relative to the module, as named_parameters() and named_buffers() give them"
            f" (e.g. {sorted(known)[:3]})."
        )
    return names


def ddp_of(module: nn.Module) -> DistributedDataParallel | None:
    """The ``DistributedDataParallel`` that runs ``module``'s forward, or None when there is none.

    Accepts what :func:`setup_models` or ``fabric.setup_module`` returned, a DDP module, or a
    plain module (None).

    Example::

        ddp = ddp_of(models.gen)
        if ddp is not None:
            print(ddp.broadcast_buffers)
    """
    if is_instance(module, "wrappers._FabricModule"):
        module = cast(nn.Module, module._forward_module)  # nn.Module.__getattr__ is typed Tensor | Module
    module = getattr(module, "_orig_mod", module)  # torch.compile wraps DDP in an OptimizedModule
    return module if isinstance(module, DistributedDataParallel) else None


def _validate(fabric: Fabric, ddp_kwargs: Any, models: Mapping[str, Any]) -> None:
    if not is_instance(fabric, "Fabric"):
        raise TypeError(
            "setup_models: `fabric` must be a Fabric (lightning.fabric.Fabric or lightning_fabric.Fabric), got"
            f" {type(fabric).__module__}.{type(fabric).__name__}."
        )
    if not models:
        raise ValueError("setup_models: pass at least one model by name, e.g. setup_models(fabric, gen=G, disc=D).")
    seen: dict[int, str] = {}
    for name, module in models.items():
        if name.startswith("_"):
            raise ValueError(f"setup_models: model name {name!r} must not start with '_'; rename the keyword.")
        if is_instance(module, "wrappers._FabricModule") or ddp_of(module) is not None:
            raise ValueError(
                f"setup_models: model {name!r} is already set up; pass the original nn.Module, not what"
                " fabric.setup_module or setup_models returned."
            )
        if not isinstance(module, nn.Module):
            raise TypeError(f"setup_models: model {name!r} must be a torch.nn.Module, got {type(module).__name__}.")
        if id(module) in seen:
            raise ValueError(f"setup_models: models {seen[id(module)]!r} and {name!r} are the same module object.")
        seen[id(module)] = name
    if ddp_kwargs is None:
        return
    if not isinstance(ddp_kwargs, Mapping):
        raise TypeError(
            "setup_models: `ddp_kwargs` must map model names to DDP options, e.g."
            f" {{'disc': {{'broadcast_buffers': False}}}}; got {type(ddp_kwargs).__name__}."
        )
    unknown = set(ddp_kwargs) - set(models)
    if unknown:
        raise ValueError(
            f"setup_models: `ddp_kwargs` names {sorted(unknown)}, which are not models passed here"
            f" ({list(models)}); use the model keyword names."
        )
    for name, options in ddp_kwargs.items():
        if not isinstance(options, Mapping):
            raise TypeError(
                f"setup_models: `ddp_kwargs[{name!r}]` must be a mapping of DDP options, got {type(options).__name__}."
            )
        problem = ddp_options_problem(options)
        if problem:
            raise ValueError(f"setup_models: `ddp_kwargs[{name!r}]` {problem}")
    strategy = fabric.strategy
    if ddp_kwargs and is_instance(strategy, "strategies.ParallelStrategy") and not builds_plain_ddp(strategy):
        raise ValueError(
            f"setup_models: `ddp_kwargs` only applies to DDP strategies, but this Fabric uses"
            f" {type(strategy).__name__}; configure that strategy instead and drop `ddp_kwargs`."
        )


def ddp_options_problem(options: Mapping[str, Any]) -> str | None:
    """What is wrong with keyword arguments meant for ``DistributedDataParallel`` (None: nothing).

    Example::

        problem = ddp_options_problem({"broadcast_buffer": False})  # "has ['broadcast_buffer'], which ..."
    """
    reserved = sorted(set(options) & set(_RESERVED_DDP_KWARGS))
    if reserved:
        return f"sets {reserved}, which the strategy chooses; remove them."
    unknown = sorted(set(options) - _DDP_KWARGS)
    if unknown:
        return (
            f"has {unknown}, which DistributedDataParallel does not accept; check the spelling against"
            " torch.nn.parallel.DistributedDataParallel."
        )
    return None


def builds_plain_ddp(strategy: Any) -> bool:
    """True for Fabric's DDP strategy and subclasses that keep its module wrapping (not DeepSpeed's)."""
    ddp = family_class(strategy, "strategies.DDPStrategy")
    return ddp is not None and type(strategy).setup_module is ddp.setup_module


def _check_agreement(
    fabric: Fabric, ddp_kwargs: Mapping[str, Mapping[str, Any]], models: Mapping[str, nn.Module]
) -> None:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return

    def describe(module: nn.Module) -> str:
        params, buffers = list(module.parameters()), list(module.buffers())
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in [*params, *buffers]})
        shapes = fingerprint(repr([(tuple(t.shape), t.dtype) for t in [*params, *buffers]])) % 10**6
        trainable = sum(p.requires_grad for p in params)
        return (
            f"{len(params)} parameters ({trainable} trainable, {sum(p.numel() for p in params):,} elements),"
            f" {len(buffers)} buffers,"
            f" {'/'.join(dtypes) or 'no dtype'}, shapes #{shapes:06d}"
        )

    models_text = ", ".join(f"{name} [{describe(module)}]" for name, module in models.items())
    options = {name: sorted(options) for name, options in sorted(ddp_kwargs.items())}
    problem = describe_disagreement(f"models {models_text}; ddp_kwargs {options}", fabric.device)
    if problem:
        raise ValueError(
            "setup_models: the models (names, order, parameter and buffer shapes and dtypes) or the ddp_kwargs"
            f" differ across ranks; pass the same models on every rank. {problem}"
        )


@contextmanager
def _ddp_options(strategy: Any, overrides: Mapping[str, Any]) -> Iterator[None]:
    # Fabric's DDPStrategy builds every DDP from one `_ddp_kwargs` dict; swapping it per model keeps
    # all of Fabric's own setup (precision, device placement, compile, the _FabricModule wrapper).
    saved = strategy._ddp_kwargs
    strategy._ddp_kwargs = {**saved, **overrides}
    try:
        yield
    finally:
        strategy._ddp_kwargs = saved


@contextmanager
def _wrapped_by(strategy: Any, wrap: Callable[[nn.Module], Any]) -> Iterator[None]:
    # Fabric's setup_module still converts precision, moves the model and wraps it; only the
    # strategy's own wrapping is replaced (an instance attribute shadows the method for this call).
    strategy.setup_module = wrap
    try:
        yield
    finally:
        del strategy.setup_module


def _models_type(names: tuple[str, ...]) -> type[Models]:
    fields = namedtuple("Models", names)  # type: ignore[misc]
    return type("Models", (fields, Models), {"__slots__": ()})
