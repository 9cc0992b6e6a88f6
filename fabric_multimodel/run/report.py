"""What a run reports: the bytes DDP sent (:class:`GradientBytes`), the bytes a rank holds (:func:`state_bytes`),
and the one-line summary it ends with (:func:`final_line`), which benchmarks and tests read back
(:func:`parse_final_line`).

Example::

    grads = GradientBytes([gen, disc])  # after setup_models: counts what their DDPs allreduce
    ...                                 # train
    fabric.print(final_line(steps, f"loss={loss:.4f}", wall_s=wall, iter_seconds=times,
                            comm_bytes=grads.bytes + averager.traffic.bytes, averager=averager))
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from fabric_multimodel.comm.flat import local_part
from fabric_multimodel.ddp.models import ddp_of
from fabric_multimodel.run.progress import process_started

if TYPE_CHECKING:
    from fabric_multimodel.averaging.averager import Averager


class GradientBytes:
    """The gradient bytes this rank's DDPs allreduced: a counting comm hook on each model's DDP (models without one,
    in a single process or sharded, send nothing here).

    Example::

        grads = GradientBytes([gen, disc])
        ...
        print(grads.bytes)
    """

    def __init__(self, models: Iterable[Any]) -> None:
        self.bytes = 0
        for model in models:
            ddp = ddp_of(model)
            if ddp is not None:
                ddp.register_comm_hook(SimpleNamespace(counter=self, group=ddp.process_group), _count_and_allreduce)


def _count_and_allreduce(state, bucket):  # unannotated: DDP checks annotations, and ours would be strings
    """A DDP comm hook: add the bytes this rank sends to the counter, then allreduce as DDP does, over its group."""
    state.counter.bytes += bucket.buffer().numel() * bucket.buffer().element_size()
    return allreduce_hook(state.group, bucket)


def state_bytes(models: Sequence[nn.Module], optimizers: Sequence[Any], averager: Averager | None = None) -> int:
    """This rank's bytes of parameters, gradients, optimizer state and the Averager's own tensors (anchors, outer
    optimizer state, snapshots, send buffers): of an FSDP2 model, its shards. Each storage counts once; what DDP
    and FSDP2 allocate for their collectives (gradient buckets, gathered parameters) is not counted.

    Example::

        print(state_bytes([model], [optimizer], averager) / 2**20, "MiB")
    """
    parameters = [p for model in models for p in model.parameters()]
    tensors = [*parameters, *(p.grad for p in parameters if p.grad is not None)]
    for optimizer in optimizers:
        tensors += [v for entry in optimizer.state.values() for v in entry.values() if isinstance(v, torch.Tensor)]
    storages: dict[int, int] = {}
    for t in tensors:
        storage = local_part(t).untyped_storage()
        storages.setdefault(storage.data_ptr(), storage.nbytes())
    return sum(storages.values()) + (averager.state_bytes if averager is not None else 0)


def final_line(
    steps: int,
    quality: str,
    *,
    wall_s: float,
    iter_seconds: Sequence[float],
    comm_bytes: int,
    rounds: int = 0,
    state_bytes: int | None = None,
    membership_wait_s: float | None = None,
    averager: Averager | None = None,
) -> str:
    """``final: steps=... <quality> wall_s=... iter_ms_median=... iter_ms_mean=... comm_bytes=...
    comm_bytes_per_iter=... rounds=...``, then ``state_bytes=`` when given and, under a membership,
    ``membership_wait_s=`` and ``process_start=`` (this process's start, unix time). ``averager`` supplies the
    rounds and the membership's wait.

    Example::

        line = final_line(400, "val_loss=0.7319", wall_s=12.5, iter_seconds=[0.02, 0.03], comm_bytes=20744)
        print(line)  # final: steps=400 val_loss=0.7319 wall_s=12.5 iter_ms_median=25.00 ...
    """
    if averager is not None:
        rounds = averager.rounds
        membership_wait_s = averager.membership_wait_s if averager.membership is not None else None
    # The median is a typical local step; the mean also carries the averaging rounds' share.
    iter_ms = statistics.median(iter_seconds) * 1000 if iter_seconds else math.nan
    iter_ms_mean = statistics.fmean(iter_seconds) * 1000 if iter_seconds else math.nan
    return (
        f"final: steps={steps} {quality} wall_s={wall_s:.1f}"
        f" iter_ms_median={iter_ms:.2f} iter_ms_mean={iter_ms_mean:.2f}"
        f" comm_bytes={comm_bytes} comm_bytes_per_iter={comm_bytes / steps:.1f} rounds={rounds}"
        + (f" state_bytes={state_bytes}" if state_bytes is not None else "")
        + (
            f" membership_wait_s={membership_wait_s:.2f} process_start={process_started() or math.nan:.1f}"
            if membership_wait_s is not None
            else ""
        )
    )


def parse_final_line(stdout: str, keys: Sequence[str]) -> dict[str, str]:
    """The values of the last ``final: key=value ...`` line in ``stdout``, which must hold exactly ``keys``, in order.

    The examples end with such a line (rank 0 only) so that benchmarks and tests can read their
    results. Raises ``ValueError`` (quoting the end of the output) when there is none or it differs.

    Example::

        final = parse_final_line(proc.stdout, ["steps", "val_loss"])
        print(float(final["val_loss"]))
    """
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    finals = [line for line in lines if line.startswith("final:")]
    if not finals:
        tail = "\n".join(lines[-5:])
        raise ValueError(f"no 'final:' line in the output; it ended with:\n{tail}")
    tokens = finals[-1].removeprefix("final:").split()
    pairs = [token.split("=", 1) for token in tokens]
    found = [pair[0] for pair in pairs]
    if any(len(pair) != 2 or not pair[1] for pair in pairs) or found != list(keys):
        raise ValueError(f"the final line does not hold exactly {list(keys)}: {finals[-1]!r}")
    return dict(pairs)
