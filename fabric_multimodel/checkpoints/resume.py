"""Training that goes on when a node is lost: resuming into whatever world torchrun's elastic agent starts.

PyTorch ships the engine: ``torchrun --nnodes 1:S --max-restarts K --rdzv-backend c10d ...``
restarts the workers of the surviving nodes, with a new world, when a node fails, and again with
a larger one when a node comes back. What a run needs from its side is state that survives and a
start that resumes into the world it is given. :func:`resume_latest` is that start: on every rank,
it finds the newest complete checkpoint any rank can read, brings it to every rank (one broadcast
when the ranks' copies differ, as when a node rejoins with an older one) and loads it into the
objects; with :class:`~fabric_multimodel.checkpoints.files.CheckpointWriter` writing a checkpoint after
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

import io
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from fabric_multimodel.averaging.averager import Averager
from fabric_multimodel.checkpoints.files import CheckpointError, load_state, read_checkpoint, serialize
from fabric_multimodel.comm.collectives import group_rank, group_size
from fabric_multimodel.comm.relay import relay_bytes


def restart_count() -> int:
    """How many times torchrun's elastic agent has restarted this node's workers (0: the first start, or no agent).

    Example::

        if restart_count():
            print("a peer was lost or joined; resuming")
    """
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class Resumed(NamedTuple):
    """What :func:`resume_latest` loaded, on this rank.

    ``step``: the checkpoint's; ``source``: the rank whose copy it was; ``broadcast``: whether it travelled
    to ranks whose copies were older or missing; ``extra``: what the checkpoint held beyond ``state``;
    ``seconds``: this rank's time per phase (``read`` its own copy, ``agree`` the all-gather, ``transfer``,
    ``load``); ``bytes``: the size of what travelled of the newest copy (0: nothing did); ``kept``: the keys
    of ``state`` that this rank took from its own older copy, or left as they were with none (``own_step``:
    that copy's step, -1 for none), instead of receiving them.
    """

    step: int
    source: int
    broadcast: bool
    extra: dict[str, Any]
    seconds: dict[str, float]
    bytes: int
    kept: tuple[str, ...]
    own_step: int

    def describe(self, before: Mapping[str, float] | None = None) -> str:
        """Where this rank's resume went and what travelled: ``seconds: read=0.1 agree=0.0 transfer=1.2 load=0.1;
        received 1.83 MB; kept optimizer (its own copy at step 40)``; ``before``: phases of its start to put first.

        Example::

            resumed = resume_latest(fabric, folder / "checkpoint.pt", state)
            if resumed is not None:
                print(f"step {resumed.step}: {resumed.describe()}")
        """
        seconds = {**(before or {}), **self.seconds}
        text = "seconds: " + " ".join(f"{name}={value:.1f}" for name, value in seconds.items())
        if self.own_step == self.step:
            return text + (f"; sent {self.bytes / 1e6:.2f} MB" if self.bytes else "")
        text += f"; received {self.bytes / 1e6:.2f} MB"
        if self.kept:
            where = f"its own copy at step {self.own_step}" if self.own_step >= 0 else "no copy: as built"
            text += f"; kept {', '.join(self.kept)} ({where})"
        return text


def resume_latest(
    fabric: Any,
    path: str | os.PathLike,
    state: dict[str, Any],
    *,
    validate: Callable[[dict[str, Any]], None] | None = None,
    step_key: str = "step",
    progress: Callable[[int, int, float], None] | None = None,
) -> Resumed | None:
    """Load the newest complete checkpoint that any rank can read at ``path`` into ``state``, on every rank.

    Each rank reads and verifies its own copy (see :func:`~fabric_multimodel.checkpoints.files.read_checkpoint`;
    a damaged or half-written file counts as none); ranks may pass different paths (each replica's
    own, :func:`~fabric_multimodel.checkpoints.files.replica_path`). One small all-gather agrees on the newest
    (by ``state[step_key]``) and tells every rank's node. Ranks whose copy is the newest keep theirs. The
    others receive what they lack, once per node across the link: the lowest rank holding the newest
    sends it to one rank of each node that lacks it, which passes it on inside its node (point to point,
    :func:`~fabric_multimodel.comm.relay.relay_bytes`).

    What they lack: with an anchored :class:`~fabric_multimodel.Averager` in ``state`` (DiLoCo,
    ``comm_dtype``), only the Averager's state (the anchors, which are the global model, and the outer
    optimizer) and the plain values. Each inner optimizer keeps its own older copy's state (or its
    state as it is, with no copy), and, past warm-up once every fragment has an anchor, the modules
    start from the anchors. Otherwise the whole checkpoint travels. ``progress(bytes_done, bytes_total,
    seconds)`` is called on sending and receiving ranks every few seconds of a transfer and at its end.
    Then every rank loads into ``state`` as :func:`~fabric_multimodel.checkpoints.files.load_checkpoint` does
    (``validate`` first). Returns None, changing nothing, when no rank has a checkpoint: a fresh start. A file that
    is there but cannot be resumed (damaged, half-written, without ``step_key``) when no rank holds a whole one is a
    :class:`~fabric_multimodel.checkpoints.files.CheckpointError` on every rank naming it: never a silent fresh start
    that would overwrite it. Call it on every rank, before the first collective of training.

    Example::

        resumed = resume_latest(fabric, "runs/lm/checkpoint.pt", state)
        start = state["step"] if resumed else 0
    """
    path = Path(path)
    clock = _Phases()
    broken: CheckpointError | None = None
    try:
        mine: dict[str, Any] | None = read_checkpoint(path, expected=[step_key]) if path.is_file() else None
    except CheckpointError as error:  # another rank's whole copy may replace it; if none has one, a clear stop
        mine, broken = None, error
    own_step = int(mine[step_key]) if mine is not None else (_BROKEN if broken is not None else _NONE)
    clock.mark("read")
    world, rank = group_size(), group_rank()
    steps, nodes = [own_step], [0]
    if world > 1:
        device = getattr(fabric, "device", torch.device("cpu"))
        mine_row = torch.tensor([own_step, int(getattr(fabric, "node_rank", 0))], dtype=torch.int64, device=device)
        rows = [torch.empty_like(mine_row) for _ in range(world)]
        dist.all_gather(rows, mine_row)
        steps, nodes = ([int(row[i]) for row in rows] for i in (0, 1))
    clock.mark("agree")
    newest = max(steps)
    if newest < 0:
        _refuse_broken(path, steps, broken)
        return None
    source = steps.index(newest)
    plan = _plan(steps, nodes, newest)
    kept: tuple[str, ...] = ()
    size = 0
    if plan:
        payload = None
        if own_step == newest and any(sender == rank for sender, _ in plan):
            assert mine is not None
            payload = serialize({k: v for k, v in mine.items() if k not in _kept(state, mine)})
        data, size = relay_bytes(plan, payload, getattr(fabric, "device", torch.device("cpu")), progress)
        clock.mark("transfer")
        if own_step != newest:
            assert data is not None
            received = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            kept = tuple(key for key in state if key not in received)
            own = {k: mine[k] for k in kept if k in mine} if mine is not None else {}
            mine = {**own, **received}
    assert mine is not None
    # A key this rank kept, with no copy of its own, stays as it is; any other key the file lacks is an error.
    loaded = {key: value for key, value in state.items() if key in mine or key not in kept}
    extra = load_state(path, mine, loaded, validate=validate)
    state.update(loaded)  # the plain values
    if any(isinstance(state[key], nn.Module) for key in kept):
        for averager in _anchored_averagers(state):
            averager.restore_global()  # the modules kept their older values: start them from the global model
    clock.mark("load")
    return Resumed(newest, source, bool(plan), extra, clock.seconds, size, kept, own_step)


# What a rank reports in place of a step: no checkpoint file at all, or one that cannot be resumed.
_NONE, _BROKEN = -1, -2


def _refuse_broken(path: Path, steps: list[int], broken: CheckpointError | None) -> None:
    """No rank holds a whole checkpoint: where one holds a file that cannot be resumed, an error on every rank (the
    same steps on each) rather than a fresh start that would overwrite it."""
    if _BROKEN in steps:
        reason = str(broken) if broken is not None else f"{path}: rank {steps.index(_BROKEN)}'s copy cannot be resumed"
        raise CheckpointError(
            f"{reason}; no rank holds a whole checkpoint to resume from, and nothing was overwritten: restore it, or"
            " move it aside to start afresh"
        )


def _kept(state: dict[str, Any], checkpoint: dict[str, Any]) -> set[str]:
    """Keys that a rank lacking the newest copy need not receive (see :func:`resume_latest`)."""
    averagers = {key for key, value in state.items() if isinstance(value, Averager) and value.anchored}
    if not averagers:
        return set()
    kept = {key for key, value in state.items() if hasattr(value, "param_groups")}  # inner optimizers
    if all(holds_global_model(state[key], checkpoint[key]) for key in averagers):
        kept |= {key for key, value in state.items() if isinstance(value, nn.Module)}
    return kept


def _anchored_averagers(state: dict[str, Any]) -> list[Averager]:
    return [value for value in state.values() if isinstance(value, Averager) and value.anchored]


def holds_global_model(averager: Averager, saved: Any) -> bool:
    """Whether an Averager's saved state anchors every fragment (past warm-up, none still to have its first
    round), so that its anchors and outer optimizer are all a replica needs to start from the global model.

    Example::

        if holds_global_model(averager, checkpoint["averager"]):
            print("the anchors are the global model")
    """
    return (
        isinstance(saved, dict) and saved.get("steps", -1) >= averager.warmup_steps and not saved.get("fresh_fragments")
    )


def _plan(steps: list[int], nodes: list[int], newest: int) -> list[tuple[int, int]]:
    """Who sends the newest copy to whom, in order, (sender, receiver): across the link once per node that
    lacks it (from the lowest rank holding it, to the node's lowest rank lacking it, unless a rank of the
    same node holds it), then inside each node."""
    holders = [r for r, s in enumerate(steps) if s == newest]
    across, inside = [], []
    for node in sorted(set(nodes)):
        ranks = [r for r, n in enumerate(nodes) if n == node]
        lacking = [r for r in ranks if steps[r] != newest]
        if not lacking:
            continue
        local = [r for r in ranks if steps[r] == newest]
        entry = local[0] if local else lacking[0]
        if not local:
            across.append((holders[0], entry))
        inside += [(entry, r) for r in lacking if r != entry]
    return across + inside


class _Phases:
    """Seconds between successive marks, by the name of the phase that just ended."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name], self._last = now - self._last, now
