"""Rounds as one-off functions: :func:`average_models` (one plain round now) and :func:`replicas_in_sync` (do
the replicas agree, bitwise?). The schedule of rounds is the :class:`~fabric_multimodel.Averager`'s."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch
from torch import nn
from torch.optim import Optimizer

from fabric_multimodel.averaging.arguments import as_module_list, check_optimizers
from fabric_multimodel.averaging.builder import averaged_tensors
from fabric_multimodel.comm.collectives import (
    ProcessGroup,
    Traffic,
    all_reduce_mean_,
    check_member,
    extremes,
    group_size,
    tensors_fingerprint,
)
from fabric_multimodel.comm.flat import local_part
from fabric_multimodel.rounds.errors import NonFiniteError, listed
from fabric_multimodel.rounds.optimizer_state import optimizer_state

if TYPE_CHECKING:
    from lightning_fabric import Fabric

Modules = nn.Module | Iterable[nn.Module]


@dataclass(frozen=True)
class Replica:
    """Which replica this rank holds, of how many, and whether it writes that replica's checkpoint.

    Between rounds every averaging rank holds a replica of its own, except in the islands layout,
    where DDP keeps the processes of a node identical: one replica per node, written by the node's
    first process. See :attr:`Averager.replica`.

    Example::

        replica = averager.replica
        print(f"replica {replica.index} of {replica.count}", "(writes it)" if replica.writer else "")
    """

    index: int
    count: int
    writer: bool


class HasDevice(Protocol):
    """What the functions here read from ``fabric``: the device for their small collectives.

    A launched ``Fabric`` has it; so does a ``LightningModule`` (the Trainer adapter passes one).
    """

    @property
    def device(self) -> torch.device: ...


def average_models(
    fabric: Fabric | HasDevice,
    modules: Modules,
    *,
    average_buffers: bool = True,
    optimizers: Sequence[Optimizer] = (),
    process_group: ProcessGroup = None,
    check_finite: bool = True,
) -> Traffic:
    """Replace parameters (and floating-point buffers, and the optimizers' floating-point state) by
    their mean across ranks: one averaging round. Call it on every rank.

    Parameters are averaged whether or not they require grad or have a ``.grad``: the set is fixed
    by the modules, never by what the last step touched. With ``check_finite``, a mean that holds
    NaN or Inf (one rank's NaN reaches every rank) raises :class:`NonFiniteError` on every rank.
    Returns the :class:`Traffic` sent. There is no ``comm_dtype`` here: without an anchor common to
    all ranks, a half-precision payload would round the parameters themselves (the
    :class:`~fabric_multimodel.Averager` has one).

    Example::

        average_models(fabric, [gen, disc], optimizers=[opt_g, opt_d])
        fabric.save("ckpt.pt", {"gen": gen, "disc": disc})  # rank 0's copy is now everyone's
    """
    module_list = as_module_list(modules, "average_models")
    optimizer_list = check_optimizers(optimizers, "average_models")
    check_member(process_group, "average_models")
    tensors, names, _ = averaged_tensors(module_list, average_buffers)
    tensors = [local_part(t) for t in tensors]
    traffic = all_reduce_mean_(tensors, process_group)
    if check_finite and group_size(process_group) > 1:
        sums = torch.stack([t.detach().sum(dtype=torch.float64) for t in tensors])
        if not bool(torch.isfinite(sums).all()):
            bad = [name for name, total in zip(names, sums.tolist()) if total != total or abs(total) == float("inf")]
            raise NonFiniteError(
                f"average_models: NaN or Inf in {listed(bad)} (on at least one rank); every replica now holds"
                " them: restore a checkpoint.",
                bad,
            )
    return traffic + all_reduce_mean_(optimizer_state(optimizer_list), process_group)


class SyncReport(NamedTuple):
    """What :func:`replicas_in_sync` found; true when everything it checked is equal and finite.

    Example::

        report = replicas_in_sync(fabric, [gen, disc])
        if not report:
            print(report.explain())
    """

    parameters_equal: bool
    buffers_equal: bool
    finite: bool
    buffers_checked: bool = True

    def __bool__(self) -> bool:
        return self.parameters_equal and self.finite and (self.buffers_equal or not self.buffers_checked)

    def explain(self) -> str:
        """One sentence on what differs (or that nothing does)."""
        problems = []
        if not self.finite:
            problems.append("some replica holds NaN or Inf")
        if not self.parameters_equal:
            problems.append("parameters differ across ranks")
        if not self.buffers_equal:
            problems.append(
                "buffers differ across ranks"
                + ("" if self.buffers_checked else " (not counted: buffers=False)")
                + " (BatchNorm running statistics stay rank-local under synchronous DDP until they are averaged)"
            )
        return "; ".join(problems) or "replicas are identical and finite"


def replicas_in_sync(
    fabric: Fabric | HasDevice, modules: Modules, *, process_group: ProcessGroup = None, buffers: bool = True
) -> SyncReport:
    """Whether every parameter (and buffer) is bitwise equal on all ranks and finite. One small allreduce.

    Returns a :class:`SyncReport`, true when all is equal and finite, that tells parameters and
    buffers apart: synchronous DDP keeps parameters identical but leaves BatchNorm running
    statistics rank-local, so ``buffers=False`` leaves them out of the verdict (they are still
    reported). NaN or Inf anywhere makes it false even where every rank holds the same NaN. Hashes
    the tensors locally (GPU tensors are copied to host), so it is a check for tests and before
    checkpoints, not for every step.

    Example::

        averager.sync()
        assert replicas_in_sync(fabric, [gen, disc])
        assert replicas_in_sync(fabric, [gen], buffers=False)  # under synchronous DDP with BatchNorm
    """
    module_list = as_module_list(modules, "replicas_in_sync")
    check_member(process_group, "replicas_in_sync")
    params = _unique(p for m in module_list for p in m.parameters())
    buffer_list = _unique(b for m in module_list for b in m.buffers())
    finite = all(bool(torch.isfinite(t).all()) for t in [*params, *buffer_list] if t.is_floating_point())
    local = [tensors_fingerprint(params), tensors_fingerprint(buffer_list), int(not finite)]
    if group_size(process_group) == 1:
        return SyncReport(True, True, finite, buffers)
    top, bottom = extremes(local, fabric.device, process_group)
    return SyncReport(top[0] == bottom[0], top[1] == bottom[1], top[2] == 0, buffers)


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor once; an FSDP2 parameter as this rank's shard."""
    return [local_part(t) for t in {id(t): t for t in tensors}.values()]
