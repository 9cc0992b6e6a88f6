"""Where averaging happens: one round (`average_models`), a check (`replicas_in_sync`), and the
post-local SGD schedule (`Averager`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from types import TracebackType
from typing import Any

import torch
from lightning_fabric import Fabric
from lightning_fabric.wrappers import _FabricModule
from torch import nn
from torch.optim import Optimizer

from fabric_multimodel.collectives import (
    ProcessGroup,
    Traffic,
    all_ranks_agree,
    all_reduce_mean_,
    fingerprint,
    group_size,
    tensors_fingerprint,
)
from fabric_multimodel.flat import FlatStorage
from fabric_multimodel.models import ddp_of

Modules = nn.Module | Iterable[nn.Module]


def average_models(
    fabric: Fabric,
    modules: Modules,
    *,
    average_buffers: bool = True,
    optimizers: Sequence[Optimizer] = (),
    process_group: ProcessGroup = None,
) -> Traffic:
    """Replace parameters (and floating-point buffers, and the optimizers' floating-point state) by
    their mean across ranks: one averaging round. Call it on every rank.

    Parameters are averaged whether or not they require grad or have a ``.grad``: the set is fixed
    by the modules, never by what the last step touched. Returns the :class:`Traffic` sent.

    Example::

        average_models(fabric, [gen, disc], optimizers=[opt_g, opt_d])
        fabric.save("ckpt.pt", {"gen": gen, "disc": disc})  # rank 0's copy is now everyone's
    """
    module_list = _module_list(modules, "average_models")
    optimizer_list = _check_optimizers(optimizers, "average_models")
    tensors = _averaged_tensors(module_list, average_buffers)
    return all_reduce_mean_(tensors, process_group) + all_reduce_mean_(_optimizer_state(optimizer_list), process_group)


def replicas_in_sync(fabric: Fabric, modules: Modules, *, process_group: ProcessGroup = None) -> bool:
    """True when every parameter and buffer is bitwise equal on all ranks. One small allreduce.

    Hashes the tensors locally (GPU tensors are copied to host for it), so it is a check for tests
    and before checkpoints, not for every step.

    Example::

        averager.sync()
        assert replicas_in_sync(fabric, [gen, disc])
    """
    module_list = _module_list(modules, "replicas_in_sync")
    tensors = [
        *_unique(p for m in module_list for p in m.parameters()),
        *_unique(b for m in module_list for b in m.buffers()),
    ]
    return all_ranks_agree(tensors_fingerprint(tensors), fabric.device, process_group)


class Averager:
    """Post-local SGD for the modules of a Fabric loop, driven by one explicit ``step()`` per iteration.

    - ``step()`` calls 1..``warmup_steps``: ordinary synchronous DDP, gradients allreduced every step.
    - After that, inside the block: local steps with **no** collective in forward or backward (no
      gradient allreduce, no DDP buffer broadcast), and an averaging round of parameters (plus
      floating-point buffers when ``average_buffers``, plus the floating-point state of
      ``optimizers``) when ``(steps - warmup_steps) % period == 0``.
    - Leaving the block averages if any local step happened since the last round, so every replica
      leaves identical. Leaving by exception issues no collective (it must not hang).

    The schedule counts ``step()`` calls, never optimizer steps, so a GAN's two optimizers or a
    GradScaler that skips a step cannot make ranks disagree on when to average. Parameters and
    averaged buffers are moved into flat buffers at construction (they stay the same objects), so
    a round is one in-place allreduce per dtype.

    Args:
        fabric: the launched Fabric.
        modules: a module, an iterable of modules, or the :class:`Models` of :func:`setup_models`.
        period: average every ``period`` steps after warm-up.
        warmup_steps: synchronous steps before local SGD begins.
        average_buffers: also average floating-point buffers (BatchNorm running statistics).
        optimizers: optimizers whose floating-point state (momentum, Adam moments) is averaged too.
        process_group: the group to average over; the default group when None.

    Example::

        with Averager(fabric, [gen, disc], period=8, warmup_steps=200, optimizers=[opt_g, opt_d]) as averager:
            for real in loader:
                ...  # D step, G step, optimizer steps
                averager.step()
    """

    def __init__(
        self,
        fabric: Fabric,
        modules: Modules,
        *,
        period: int,
        warmup_steps: int = 0,
        average_buffers: bool = True,
        optimizers: Sequence[Optimizer] = (),
        process_group: ProcessGroup = None,
    ) -> None:
        _check_int("period", period, minimum=1)
        _check_int("warmup_steps", warmup_steps, minimum=0)
        if not isinstance(average_buffers, bool):
            raise TypeError(f"Averager: `average_buffers` must be True or False, got {average_buffers!r}.")
        module_list = _module_list(modules, "Averager")
        optimizers = _check_optimizers(optimizers, "Averager")
        if group_size(process_group) > 1:
            for module in module_list:
                if not (isinstance(module, _FabricModule) or ddp_of(module) is not None):
                    raise TypeError(
                        f"Averager: module {type(module).__name__} was not set up; pass what setup_models or"
                        " fabric.setup_module returned, so that its gradients are synchronised during warm-up."
                    )
        self.period = period
        self.warmup_steps = warmup_steps
        self.average_buffers = average_buffers
        self.optimizers = list(optimizers)
        self.process_group = process_group
        #: ``step()`` calls so far.
        self.steps = 0
        #: Averaging rounds done (by ``step()``, ``sync()`` or leaving the block).
        self.rounds = 0
        #: Elements and bytes this averager sent in its rounds (per rank).
        self.traffic = Traffic()
        self._synced_at_step = 0
        self._ddp_settings: list[tuple[Any, bool, bool]] | None = None
        self._ddps = [ddp for ddp in map(ddp_of, module_list) if ddp is not None]

        tensors = _averaged_tensors(module_list, average_buffers)
        layout = [(tuple(t.shape), str(t.dtype)) for t in tensors]
        agreed = fingerprint(repr((layout, period, warmup_steps, average_buffers, len(self.optimizers))))
        if not all_ranks_agree(agreed, fabric.device, process_group):
            raise ValueError(
                "Averager: the modules' parameter shapes/dtypes, or the arguments period, warmup_steps,"
                " average_buffers and optimizers, differ across ranks; build the same models and Averager on"
                " every rank."
            )
        self._storage = FlatStorage(tensors)
        self._has_buffers = any(not isinstance(t, nn.Parameter) for t in tensors)

    def __enter__(self) -> Averager:
        if self._ddp_settings is not None:
            raise RuntimeError("Averager: this averager is already in use; enter its `with` block once.")
        self._ddp_settings = [(ddp, ddp.require_backward_grad_sync, ddp.broadcast_buffers) for ddp in self._ddps]
        self._apply_phase()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        try:
            if exc_type is None and self.steps > self._synced_at_step:
                self.sync()
        finally:
            for ddp, grad_sync, broadcast_buffers in self._ddp_settings or ():
                ddp.require_backward_grad_sync = grad_sync
                ddp.broadcast_buffers = broadcast_buffers
            self._ddp_settings = None

    @property
    def local(self) -> bool:
        """True once warm-up is over: forwards and backwards of the modules communicate nothing.

        Example::

            if averager.local:
                print("local SGD phase")
        """
        return self.steps >= self.warmup_steps

    def step(self) -> bool:
        """Count one iteration and average when the schedule says so; True when this call averaged.

        Call it exactly once per iteration, after the optimizer steps, on every rank.

        Example::

            opt.step(); opt.zero_grad()
            if averager.step():
                print("averaged at", averager.steps)
        """
        if self._ddp_settings is None:
            raise RuntimeError("Averager.step: call it inside `with Averager(...) as averager:`.")
        self.steps += 1
        if self.steps <= self.warmup_steps:
            # Synchronous DDP keeps parameters identical, but each rank's forward updates its own
            # buffers after DDP's broadcast, so replicas with buffers are only identical after a round.
            if not self._has_buffers:
                self._synced_at_step = self.steps
            if self.steps == self.warmup_steps:
                self._apply_phase()
            return False
        if (self.steps - self.warmup_steps) % self.period:
            return False
        self.sync()
        return True

    def sync(self) -> None:
        """Average now, on every rank (before evaluation or a checkpoint).

        Example::

            averager.sync()
            fabric.save("ckpt.pt", {"gen": gen, "opt_g": opt_g, "averager": averager})
        """
        if not self._storage.intact():
            raise RuntimeError(
                "Averager: a parameter or buffer was given new storage after the Averager was built (for"
                " example by `.to()` or `param.data = ...`); move models before building the Averager."
            )
        self.traffic += all_reduce_mean_(self._storage.buffers, self.process_group)
        self.traffic += all_reduce_mean_(_optimizer_state(self.optimizers), self.process_group)
        self.rounds += 1
        self._synced_at_step = self.steps

    def state_dict(self) -> dict[str, int]:
        """The schedule's counters, as plain ints, for ``fabric.save``.

        Example::

            fabric.save("ckpt.pt", {"averager": averager, "gen": gen})
        """
        return {
            "steps": self.steps,
            "rounds": self.rounds,
            "synced_at_step": self._synced_at_step,
            "elements_communicated": self.traffic.elements,
            "bytes_communicated": self.traffic.bytes,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Resume the schedule from :meth:`state_dict` (``fabric.load`` calls it).

        Example::

            fabric.load("ckpt.pt", {"averager": averager, "gen": gen})
        """
        missing = {"steps", "rounds", "synced_at_step", "elements_communicated", "bytes_communicated"} - set(state_dict)
        if missing:
            raise KeyError(f"Averager.load_state_dict: the state is missing {sorted(missing)}.")
        self.steps = int(state_dict["steps"])
        self.rounds = int(state_dict["rounds"])
        self._synced_at_step = int(state_dict["synced_at_step"])
        self.traffic = Traffic(int(state_dict["elements_communicated"]), int(state_dict["bytes_communicated"]))
        if self._ddp_settings is not None:
            self._apply_phase()

    def _apply_phase(self) -> None:
        for ddp, grad_sync, broadcast_buffers in self._ddp_settings or ():
            # The local phase turns off both of DDP's collectives: the gradient allreduce (what
            # no_sync() does, but for every forward in the phase) and the per-forward buffer broadcast
            # (`broadcast_buffers`, a property over `forward_sync_buffers` since torch 2.13).
            ddp.require_backward_grad_sync = grad_sync and not self.local
            ddp.broadcast_buffers = broadcast_buffers and not self.local
            if self.local and ddp.reducer._rebuild_buckets():
                # DDP rebuilds its gradient buckets once, with a broadcast, in the first forward after
                # the first synchronous backward. Doing it here, on every rank at the same step, keeps
                # that broadcast out of the local phase.
                ddp._has_rebuilt_buckets = True


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"Averager: `{name}` must be an int >= {minimum}, got {value!r} ({type(value).__name__}).")
    if value < minimum:
        raise ValueError(f"Averager: `{name}` must be >= {minimum}, got {value}.")


def _module_list(modules: Any, caller: str) -> list[nn.Module]:
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


def _check_optimizers(optimizers: Any, caller: str) -> list[Optimizer]:
    if isinstance(optimizers, Optimizer) or not isinstance(optimizers, Iterable):
        raise TypeError(f"{caller}: `optimizers` must be a list of optimizers, e.g. optimizers=[opt_g, opt_d].")
    optimizers = list(optimizers)
    for opt in optimizers:
        if not isinstance(opt, Optimizer):
            raise TypeError(
                f"{caller}: `optimizers` must hold torch.optim.Optimizer objects, got {type(opt).__name__}."
            )
    return optimizers


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return list({id(t): t for t in tensors}.values())


def _averaged_tensors(modules: Sequence[nn.Module], average_buffers: bool) -> list[torch.Tensor]:
    tensors = _unique(p for m in modules for p in m.parameters())
    if average_buffers:
        tensors += _unique(b for m in modules for b in m.buffers() if b.is_floating_point())
    return tensors


def _optimizer_state(optimizers: Sequence[Optimizer]) -> list[torch.Tensor]:
    """Floating-point state tensors in a rank-independent order; the step counter is not a statistic."""
    return [
        value
        for opt in optimizers
        for group in opt.param_groups
        for p in group["params"]
        for key, value in sorted(opt.state.get(p, {}).items())
        if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point()
    ]
