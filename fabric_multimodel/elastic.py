"""Training that goes on when a node is lost: resuming into whatever world torchrun's elastic agent starts.

PyTorch ships the engine: ``torchrun --nnodes 1:S --max-restarts K --rdzv-backend c10d ...``
restarts the workers of the surviving nodes, with a new world, when a node fails, and again with
a larger one when a node comes back. What a run needs from its side is state that survives and a
start that resumes into the world it is given. :func:`resume_latest` is that start: on every rank,
it finds the newest complete checkpoint any rank can read, brings it to every rank (one broadcast
when the ranks' copies differ, as when a node rejoins with an older one) and loads it into the
objects; with :class:`~fabric_multimodel.checkpoints.CheckpointWriter` writing a checkpoint after
every round, a lost node costs at most one period of steps.

What carries over into a world of another size: everything averaged is identical on every rank
after a round (the parameters, the :class:`~fabric_multimodel.Averager`'s anchor, outer optimizer
and counters) and carries over as is. What is per rank comes from the rank that wrote the
checkpoint (inner optimizer moments) or is derived again from the step (the position in each
rank's own data stream).

Example::

    writer = CheckpointWriter(out / "checkpoint.pt", enabled=fabric.local_rank == 0)
    state = {"model": model, "optimizer": optimizer, "averager": averager, "step": 0}
    resumed = resume_latest(fabric, out / "checkpoint.pt", state)
    for step in range(state["step"] + 1, steps + 1):
        ...
        if averager.step():
            writer.save(state | {"step": step})
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from fabric_multimodel.checkpoints import CheckpointError, load_state, read_checkpoint
from fabric_multimodel.collectives import group_rank, group_size


def restart_count() -> int:
    """How many times torchrun's elastic agent has restarted this node's workers (0: the first start, or no agent).

    Example::

        if restart_count():
            print("a peer was lost or joined; resuming")
    """
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class Resumed(NamedTuple):
    """What :func:`resume_latest` loaded: the checkpoint's step, the rank whose copy it was, whether it
    travelled to the other ranks (their own copies were older or missing), and what the checkpoint held
    beyond ``state``."""

    step: int
    source: int
    broadcast: bool
    extra: dict[str, Any]


def resume_latest(
    fabric: Any,
    path: str | os.PathLike,
    state: dict[str, Any],
    *,
    validate: Callable[[dict[str, Any]], None] | None = None,
    step_key: str = "step",
) -> Resumed | None:
    """Load the newest complete checkpoint that any rank can read at ``path`` into ``state``, on every rank.

    Each rank reads and verifies its own copy (see :func:`~fabric_multimodel.checkpoints.read_checkpoint`;
    a damaged or half-written file counts as none); ranks may pass different paths (each replica's
    own, :func:`~fabric_multimodel.checkpoints.replica_path`). One small allreduce agrees on the newest
    (by ``state[step_key]``); when some ranks' copies are older or missing, the lowest rank holding
    the newest broadcasts its copy to them (one ``broadcast_object_list``), and ranks whose own copy is
    the newest keep theirs. Then every rank loads it into ``state`` as
    :func:`~fabric_multimodel.checkpoints.load_checkpoint` does (``validate`` first). Returns None,
    changing nothing, when no rank has a checkpoint: a fresh start. Call it on every rank, before
    the first collective of training.

    Example::

        resumed = resume_latest(fabric, "runs/lm/checkpoint.pt", state)
        start = state["step"] if resumed else 0
    """
    path = Path(path)
    try:
        mine: dict[str, Any] | None = read_checkpoint(path, expected=[step_key]) if path.is_file() else None
    except CheckpointError:
        mine = None  # a file that is not whole was never a checkpoint to resume from
    step = int(mine[step_key]) if mine is not None else -1
    world, rank = group_size(), group_rank()
    newest, oldest, source = step, step, rank
    if world > 1:
        device = getattr(fabric, "device", torch.device("cpu"))
        # MAX of (step, -step, who): the newest step, the oldest, and the lowest rank holding the newest.
        values = torch.tensor([step, -step, (step + 1) * world + (world - 1 - rank)], dtype=torch.int64, device=device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        newest, oldest, who = int(values[0]), -int(values[1]), int(values[2])
        source = world - 1 - who % world
    if newest < 0:
        return None
    broadcast = oldest != newest
    if broadcast:
        box = [mine if rank == source else None]
        dist.broadcast_object_list(box, src=source)
        if step != newest:  # a rank whose own copy is the newest keeps it (each replica may have its own)
            mine = box[0]
    assert mine is not None
    extra = load_state(path, mine, state, validate=validate)
    return Resumed(newest, source, broadcast, extra)
