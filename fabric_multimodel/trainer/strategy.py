"""The Trainer adapter, written once for both Lightning package families.

``fabric_multimodel.lightning`` (for ``lightning.pytorch.Trainer``) and
``fabric_multimodel.pytorch_lightning`` (for the standalone ``pytorch_lightning.Trainer``) each
build their ``MultiModelDDPStrategy`` and ``ModelAveraging`` from the two classes here, placed
before that family's ``DDPStrategy`` and ``Callback``: the behaviour is the same line for line, and
the Trainer of each family accepts its own. ``_pl`` (the family's Trainer package) and ``_fabric``
(its Fabric package's name) are what each family sets.

Example::

    from lightning.pytorch import Trainer
    from fabric_multimodel.lightning import ModelAveraging, MultiModelDDPStrategy

    Trainer(devices=4, strategy=MultiModelDDPStrategy(), callbacks=[ModelAveraging(period=8)]).fit(gan)
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Generator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from datetime import timedelta
from types import MappingProxyType, ModuleType
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn
from torch.distributed.constants import default_pg_timeout
from torch.nn.parallel import DistributedDataParallel
from typing_extensions import override

from fabric_multimodel.averaging.averager import Averager
from fabric_multimodel.averaging.config import AveragerConfig
from fabric_multimodel.comm.collectives import Traffic, describe_disagreement
from fabric_multimodel.ddp.models import DDP_IGNORE, ddp_ignored, ddp_options_problem

# The type checker sees the classes each family puts after the two mixins below (checked against the
# standalone family's); at run time they stay plain mixins, so either family's classes can follow.
if TYPE_CHECKING:
    from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment
    from pytorch_lightning import Callback as _CallbackBase
    from pytorch_lightning import LightningModule, Trainer
    from pytorch_lightning.accelerators import Accelerator
    from pytorch_lightning.plugins.precision import Precision
    from pytorch_lightning.strategies import DDPStrategy as _StrategyBase
else:
    _CallbackBase = _StrategyBase = object

#: The adapter module of each family, by the name of the family's Trainer package.
ADAPTERS = {
    "lightning.pytorch": "fabric_multimodel.lightning",
    "pytorch_lightning": "fabric_multimodel.pytorch_lightning",
}


class MultiModelDDP(_StrategyBase):
    """The strategy, for either family (``fabric_multimodel.lightning.MultiModelDDPStrategy`` and
        ``fabric_multimodel.pytorch_lightning.MultiModelDDPStrategy`` put it before their ``DDPStrategy``).

    DDP for a ``LightningModule`` that holds several models: each child model gets its **own**
        ``DistributedDataParallel``, so a GAN trains without ``find_unused_parameters``.

        Lightning's ``DDPStrategy`` wraps the whole ``LightningModule`` in one DDP. A GAN's generator
        step then leaves the discriminator's parameters without gradients (an error without
        ``find_unused_parameters=True``) and, with it, allreduces both models' gradients in both steps.
        Here, while fitting, ``self.generator(z)`` inside ``training_step`` runs through the
        generator's own DDP, and a model whose parameters all have ``requires_grad=False`` at its
        forward (inside :func:`fabric_multimodel.ddp.frozen`, or not in the optimizer that
        ``toggle_optimizer`` selected) prepares no gradient reduction: one step's backward allreduces
        only the model it trains. Calls outside ``training_step`` (validation, callbacks, other hooks)
        and outside ``fit`` run the plain module, so a rank-0-only forward cannot hang.

        The models stay where they are, so checkpoints keep the plain parameter names and load
        without this strategy. Its checks raise on every rank before DDP's first collective: a name in
        ``models`` that is not a child module, a wrapped model with trainable parameters in no
        optimizer, or optimized parameters outside every wrapped model.

        Args:
            models: names of the child modules to wrap; by default every direct child module with a
                trainable parameter. Children without one (a frozen teacher, a metric) get no DDP.
            ddp_kwargs: per-model ``DistributedDataParallel`` options, keyed by model name; they
                override ``**kwargs``.
            accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin,
                process_group_backend, timeout, start_method: as in Lightning's ``DDPStrategy``.
            **kwargs: ``DistributedDataParallel`` options for every model.

        Example::

            strategy = MultiModelDDPStrategy(ddp_kwargs={"discriminator": {"broadcast_buffers": False}})
            trainer = Trainer(accelerator="gpu", devices=4, strategy=strategy)
            trainer.fit(gan)
            strategy.ddp_modules  # {} after fit; {"generator": DDP, "discriminator": DDP} during it
    """

    _pl: ModuleType  # the family's Trainer package: pytorch_lightning or lightning.pytorch
    _fabric: str  # the name of the family's Fabric package

    def __init__(
        self,
        models: Sequence[str] | None = None,
        *,
        ddp_kwargs: Mapping[str, Mapping[str, Any]] | None = None,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
        **kwargs: Any,
    ) -> None:
        _check_strategy_arguments(models, ddp_kwargs, kwargs)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **kwargs,
        )
        self._model_names = None if models is None else list(models)
        self._per_model_kwargs = {name: dict(options) for name, options in (ddp_kwargs or {}).items()}
        self._ddps: dict[str, DistributedDataParallel] = {}

    @property
    def ddp_modules(self) -> Mapping[str, DistributedDataParallel]:
        """Each wrapped model's DDP, by name, while fitting (empty before and after).

        Register communication hooks on them in ``on_fit_start``.

        Example::

            def on_fit_start(self):
                for ddp in self.trainer.strategy.ddp_modules.values():
                    ddp.register_comm_hook(state, hook)
        """
        return MappingProxyType(self._ddps)

    @override
    def setup(self, trainer: Trainer) -> None:
        if trainer.state.fn != self._pl.trainer.states.TrainerFn.FITTING:
            super().setup(trainer)  # no gradients to reduce: no DDP, as in DDPStrategy
            return
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        if self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        # The optimizers come before DDP (which keeps the same parameter objects), so that a model
        # in no optimizer is an error on every rank before DDP's first collective.
        self.setup_optimizers(trainer)
        self._check_optimized(self._models_to_wrap())
        self.configure_ddp()
        self.setup_precision_plugin()
        optimizer_utilities = importlib.import_module(f"{self._fabric}.utilities.optimizer")
        optimizer_utilities._optimizers_to_device(self.optimizers, self.root_device)

    @override
    def configure_ddp(self) -> None:
        models = self._models_to_wrap()
        plan = {
            name: (_describe(model), sorted(self._per_model_kwargs.get(name, {}))) for name, model in models.items()
        }
        problem = describe_disagreement(repr(plan), self.root_device)
        if problem:
            raise ValueError(
                "MultiModelDDPStrategy: the models to wrap (names, parameter shapes) or their ddp_kwargs differ across"
                f" ranks; build the same LightningModule on every rank. {problem}"
            )
        saved = self._ddp_kwargs
        try:
            for name, model in models.items():
                self._ddp_kwargs = {**saved, **self._per_model_kwargs.get(name, {})}
                # DDPStrategy._setup_model builds the DDP (device ids, CUDA side stream) from `_ddp_kwargs`.
                wrapper = _ForwardOf(name, model)
                # DDP reads the list from the module it wraps: the model's own names and the LightningModule's
                # under it (as DDPStrategy's users write them), placed under the wrapper's child.
                setattr(wrapper, DDP_IGNORE, [f"{name}.{n}" for n in self._ignored(name, model)])
                self._ddps[name] = self._setup_model(wrapper)
        finally:
            self._ddp_kwargs = saved

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        # Each model's forward goes through its DDP only for this call, as Lightning's own forward
        # redirection does: hooks, callbacks and copies of the module see the plain forward.
        with ExitStack() as stack:
            for ddp in self._ddps.values():
                stack.enter_context(_forward_through(ddp))
            return super().training_step(*args, **kwargs)

    @override
    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        # Lightning enters this while accumulating gradients (automatic optimization).
        with ExitStack() as stack:
            for ddp in self._ddps.values():
                stack.enter_context(ddp.no_sync())
            yield

    @override
    def on_exception(self, exception: BaseException) -> None:
        # DDPStrategy's hint (find_unused_parameters for the whole module) is the wrong fix here; keep
        # PyTorch's message, which names the parameters, and add ours.
        exception.args = tuple(
            f"{arg}\n{_UNUSED_PARAMETERS_HINT}" if isinstance(arg, str) and _UNFINISHED_REDUCTION in arg else arg
            for arg in exception.args
        )

    @override
    def teardown(self) -> None:
        # Dropping the DDPs lets the process group be destroyed cleanly at exit (see launch.shutdown).
        self._ddps.clear()
        super().teardown()

    # --- internals ---------------------------------------------------------------------------

    def _models_to_wrap(self) -> dict[str, nn.Module]:
        module = self.lightning_module
        assert module is not None
        children = dict(module.named_children())
        if self._model_names is None:
            models = {name: child for name, child in children.items() if _trainable(child)}
        else:
            unknown = [name for name in self._model_names if name not in children]
            if unknown:
                raise ValueError(
                    f"MultiModelDDPStrategy: `models` names {unknown}, which {'is' if len(unknown) == 1 else 'are'} not"
                    f" a child module of {type(module).__name__} (its child modules: {list(children)}); pass the"
                    " attribute names of its models, e.g. models=['generator', 'discriminator']."
                )
            models = {name: children[name] for name in self._model_names if _trainable(children[name])}
        unknown_options = sorted(set(self._per_model_kwargs) - set(children))
        if unknown_options:
            raise ValueError(
                f"MultiModelDDPStrategy: `ddp_kwargs` names {unknown_options}, which are not child modules of"
                f" {type(module).__name__} (its child modules: {list(children)}); key it by the models' names."
            )
        if not models:
            raise ValueError(
                f"MultiModelDDPStrategy: {type(module).__name__} has no child module with a trainable parameter to"
                " wrap; keep the models it trains as attributes (self.generator = ...)."
            )
        owners: dict[int, str] = {}
        for name, model in models.items():
            self._ignored(name, model)  # a name that matches nothing: an error on every rank before DDP's collectives
            for p in _trainable(model):
                if owners.setdefault(id(p), name) != name:
                    raise ValueError(
                        f"MultiModelDDPStrategy: models {owners[id(p)]!r} and {name!r} share trainable parameters, and"
                        " two DDPs cannot both reduce one gradient; hold both in one child module, or name only one of"
                        " them in `models`."
                    )
        return models

    def _ignored(self, name: str, model: nn.Module) -> list[str]:
        """What DDP leaves alone in the model ``name``: its own ``_ddp_params_and_buffers_to_ignore``, and the
        LightningModule's names under ``name.`` (each checked to name something; no collective)."""
        module = self.lightning_module
        assert module is not None
        under = [n[len(name) + 1 :] for n in ddp_ignored(module, "MultiModelDDPStrategy") if n.startswith(f"{name}.")]
        return list(dict.fromkeys([*ddp_ignored(model, "MultiModelDDPStrategy"), *under]))

    def _check_optimized(self, models: Mapping[str, nn.Module]) -> None:
        optimized = {id(p) for opt in self.optimizers for group in opt.param_groups for p in group["params"]}
        for name, model in models.items():
            missing = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in optimized]
            if missing:
                raise ValueError(
                    f"MultiModelDDPStrategy: model {name!r} has trainable parameters in no optimizer ({_few(missing)});"
                    " its DDP would wait for their gradients. Add them to an optimizer in configure_optimizers, or"
                    f" freeze them (requires_grad_(False)) before fit, or leave {name!r} out of `models`."
                )
        wrapped = {id(p) for model in models.values() for p in model.parameters()}
        assert self.lightning_module is not None
        outside = [
            n for n, p in self.lightning_module.named_parameters() if id(p) in optimized and id(p) not in wrapped
        ]
        if outside:
            raise ValueError(
                f"MultiModelDDPStrategy: optimized parameters outside every wrapped model ({_few(outside)}) would never"
                " be synchronised across ranks; add their child module to `models`, or move them into a child module."
            )


class Averaging(_CallbackBase):
    """The callback, for either family (``ModelAveraging`` in ``fabric_multimodel.lightning`` and
        ``fabric_multimodel.pytorch_lightning`` puts it before their ``Callback``).

    Post-local SGD (or DiLoCo) for ``Trainer.fit``: average the replicas every ``period`` batches.

        The first ``warmup_steps`` training batches are ordinary synchronous DDP. After that the
        models' DDPs communicate nothing in forward or backward, and every ``period`` batches their
        parameters (and floating-point buffers with ``average_buffers``) are averaged across ranks.
        The schedule counts **training batches**, once per batch after all of its optimizer steps
        (``on_train_batch_end``), never optimizer steps: a GAN's two optimizers average both models
        on the same batches. Replicas are identical when ``fit`` ends. With ``accumulate_grad_batches``,
        make ``period`` and ``warmup_steps`` multiples of it, so that rounds follow optimizer steps.

        Built on :class:`fabric_multimodel.Averager`, with the same options: an
        :class:`~fabric_multimodel.AveragerConfig`, or its fields as keyword arguments (DiLoCo:
        ``outer_optimizer``; ``comm_dtype``, ``overlap_steps``, ``fragments``, ...; not ``node_period``).
        Needs ``Trainer(strategy=MultiModelDDPStrategy(...))``.

        Checkpoints (its state goes into the Trainer's, and ``fit(ckpt_path=...)`` continues the schedule) and
        forwards no backward reaches: the Trainer guide.

        Args:
            period: average every ``period`` batches after warm-up.
            warmup_steps: synchronous batches before local steps begin.
            config: what the Averager does, instead of (or under) ``period``, ``warmup_steps`` and ``options``.
            average_optimizer_state: also average the optimizers' floating-point state (Adam moments)
                in each round; off, it stays local, as in PyTorch's post-local SGD and in DiLoCo.
            options: fields of :class:`~fabric_multimodel.AveragerConfig`, replacing those of ``config``.

        Example::

            trainer = Trainer(
                devices=4,
                strategy=MultiModelDDPStrategy(),
                callbacks=[ModelAveraging(period=8, warmup_steps=500, average_optimizer_state=True)],
            )
            trainer.fit(gan)
            trainer.callbacks[0].rounds  # averaging rounds so far
    """

    _pl: ModuleType

    def __init__(
        self,
        period: int | None = None,
        warmup_steps: int | None = None,
        *,
        config: AveragerConfig | None = None,
        average_optimizer_state: bool = False,
        **options: Any,
    ) -> None:
        positional = {"period": period, "warmup_steps": warmup_steps}
        given = {name: value for name, value in positional.items() if value is not None}
        #: The Averager's :class:`~fabric_multimodel.AveragerConfig`: ``config`` with the other options replaced.
        self.config = AveragerConfig.build(config, given | options, "ModelAveraging")
        if self.config.node_period is not None:
            raise ValueError(
                "ModelAveraging: two-level averaging (`node_period`) needs node groups the Trainer does not build;"
                " drop `node_period`, or write the loop with Fabric and the Averager."
            )
        if not isinstance(average_optimizer_state, bool):
            raise TypeError(
                f"ModelAveraging: `average_optimizer_state` must be True or False, got {average_optimizer_state!r}."
            )
        if self.config.overlap_steps and average_optimizer_state:
            raise ValueError(
                "ModelAveraging: `average_optimizer_state=True` cannot be combined with `overlap_steps`; drop one."
            )
        self.period = self.config.period
        self.warmup_steps = self.config.warmup_steps
        self.average_optimizer_state = average_optimizer_state
        self._averager: Averager | None = None
        self._entered = False
        # The checkpoint's state arrives before the models are wrapped; it is applied in on_fit_start.
        self._state: dict[str, Any] | None = None

    @property
    def steps(self) -> int:
        """Training batches counted so far (warm-up included), across resumes.

        Example::

            if averaging.steps > averaging.warmup_steps:
                print("local SGD phase")
        """
        return self._averager.steps if self._averager is not None else int((self._state or {}).get("steps", 0))

    @property
    def rounds(self) -> int:
        """Averaging rounds so far, across resumes.

        Example::

            print(f"{trainer.callbacks[0].rounds} rounds")
        """
        return self._averager.rounds if self._averager is not None else int((self._state or {}).get("rounds", 0))

    @property
    def traffic(self) -> Traffic:
        """Elements and bytes this rank sent in averaging rounds, across resumes (not the warm-up's gradients).

        Example::

            print(f"{averaging.traffic.bytes / 2**20:.1f} MiB averaged")
        """
        if self._averager is not None:
            return self._averager.traffic
        state = self._state or {}
        return Traffic(int(state.get("elements_communicated", 0)), int(state.get("bytes_communicated", 0)))

    @property
    def averager(self) -> Averager | None:
        """The :class:`~fabric_multimodel.Averager` driving the rounds, while fitting (its ``traffic``, ``sync()``).

        Example::

            averaging.averager.traffic.bytes  # bytes this rank sent in rounds
        """
        return self._averager

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if not isinstance(trainer, self._pl.Trainer):
            raise TypeError(
                f"ModelAveraging: this callback is {type(self).__module__}'s, for {self._pl.__name__}.Trainer, but the"
                f" Trainer is a {type(trainer).__module__}.Trainer; import it from {_adapter_for(trainer)}."
            )
        if stage == self._pl.trainer.states.TrainerFn.FITTING and not isinstance(trainer.strategy, MultiModelDDP):
            raise ValueError(
                f"ModelAveraging: needs a distributed strategy that gives each model its own DDP, but the Trainer uses"
                f" {type(trainer.strategy).__name__}; pass Trainer(strategy=MultiModelDDPStrategy(), devices=N) (from"
                f" {_adapter_for(trainer)}), or remove the callback."
            )

    @override
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, MultiModelDDP)
        self._averager = Averager(
            pl_module,
            list(strategy.ddp_modules.values()),
            self.config,
            optimizers=trainer.optimizers if self.average_optimizer_state else (),
        )
        if self._state is not None:
            self._averager.load_state_dict(self._state)

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        assert self._averager is not None
        self._averager.__enter__()
        self._entered = True

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        assert self._averager is not None
        self._averager.step()

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        assert self._averager is not None
        self._entered = False
        self._averager.__exit__(None, None, None)  # a last round: every replica leaves fit identical

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self._entered and self._averager is not None:
            self._entered = False
            self._averager.__exit__(type(exception), exception, exception.__traceback__)

    @override
    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if self._averager is not None:
            # Keep the state for a checkpoint saved after fit; drop the Averager, which holds the DDPs.
            self._state = self._averager.state_dict()
            self._averager = None

    @override
    def state_dict(self) -> dict[str, Any]:
        return self._averager.state_dict() if self._averager is not None else dict(self._state or {})

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._state = dict(state_dict)
        if self._averager is not None:
            self._averager.load_state_dict(self._state)


class _ForwardOf(nn.Module):
    """What a model's DDP wraps: the model (for its parameters) and the model's own forward.

    While the model's ``forward`` is redirected to its DDP, DDP calls ``forward_fn`` here, not the
    model, so the model's forward hooks run once, in the outer call.
    """

    def __init__(self, name: str, model: nn.Module) -> None:
        super().__init__()
        self.add_module(name, model)  # under its own name, so DDP's messages name its parameters
        self.model_name = name
        #: What DDP synchronises: the parameters that were trainable when it was built.
        self.trainable = _trainable(model)
        self.forward_fn: Callable[..., Any] = model.forward

    @property
    def model(self) -> nn.Module:
        return self.get_submodule(self.model_name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_fn(*args, **kwargs)


_NO_FORWARD = object()
_UNFINISHED_REDUCTION = "Expected to have finished reduction in the prior iteration"
_UNUSED_PARAMETERS_HINT = (
    "MultiModelDDPStrategy: a wrapped model had trainable parameters that got no gradient in a backward. For a model"
    " that a step only uses (a GAN's discriminator in the generator step), run its forward inside"
    " `fabric_multimodel.ddp.frozen(model)` or after `self.toggle_optimizer(...)`; for parameters a model really leaves"
    " unused, pass ddp_kwargs={name: {'find_unused_parameters': True}} for that model only."
)


@contextmanager
def _forward_through(ddp: DistributedDataParallel) -> Generator[None, None, None]:
    wrapper: _ForwardOf = ddp.module
    model = wrapper.model
    trainable = wrapper.trainable
    own = model.__dict__.get("forward", _NO_FORWARD)  # a forward the user set on the instance
    wrapper.forward_fn = model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() and not any(p.requires_grad for p in trainable):
            # Used, not trained (frozen, or toggled off): no gradient will come. A reduction prepared
            # now would stay armed until the model's next backward, which would then allreduce even
            # under no_sync (gradient accumulation) or in ModelAveraging's local phase.
            with ddp.no_sync():
                return ddp(*args, **kwargs)
        return ddp(*args, **kwargs)

    model.forward = forward
    try:
        yield
    finally:
        if own is _NO_FORWARD:
            del model.forward
        else:
            model.forward = own


def _trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _describe(model: nn.Module) -> str:
    return repr([(tuple(p.shape), str(p.dtype), p.requires_grad) for p in model.parameters()])


def _few(names: Sequence[str], limit: int = 3) -> str:
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def _check_strategy_arguments(models: Any, ddp_kwargs: Any, options: Mapping[str, Any]) -> None:
    if models is not None:
        if isinstance(models, str) or not isinstance(models, Sequence) or not all(isinstance(n, str) for n in models):
            raise TypeError(
                f"MultiModelDDPStrategy: `models` must be a list of child-module names, e.g."
                f" models=['generator', 'discriminator'], or None for all of them; got {models!r}."
            )
        if not models or len(set(models)) != len(models):
            raise ValueError(f"MultiModelDDPStrategy: `models` must name each model once, got {list(models)}.")
    if ddp_kwargs is not None and not (
        isinstance(ddp_kwargs, Mapping) and all(isinstance(v, Mapping) for v in ddp_kwargs.values())
    ):
        raise TypeError(
            "MultiModelDDPStrategy: `ddp_kwargs` must map model names to DDP options, e.g."
            f" {{'discriminator': {{'broadcast_buffers': False}}}}; got {ddp_kwargs!r}."
        )
    if models is not None and ddp_kwargs:
        unknown = sorted(set(ddp_kwargs) - set(models))
        if unknown:
            raise ValueError(
                f"MultiModelDDPStrategy: `ddp_kwargs` names {unknown}, which are not in `models` ({list(models)})."
            )
    for where, given in [("", options), *((f"ddp_kwargs[{n!r}] ", o) for n, o in (ddp_kwargs or {}).items())]:
        problem = ddp_options_problem(given)
        if problem:
            raise ValueError(
                f"MultiModelDDPStrategy: {where or 'the keyword arguments '}{problem} Communication hooks: register"
                " them on strategy.ddp_modules[name] in on_fit_start; model averaging: the ModelAveraging callback."
            )


def _adapter_for(trainer: Any) -> str:
    """The adapter module that serves ``trainer``'s family."""
    package = type(trainer).__module__
    return next(
        (module for family, module in ADAPTERS.items() if package.startswith(family)), ADAPTERS["lightning.pytorch"]
    )
