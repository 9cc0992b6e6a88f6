"""Which writer saves a run's checkpoint, to which file, and when: :class:`Checkpointer`.

The right writer depends on the run: replicas that are equal after every round need one copy (rank 0's);
anchored rounds (DiLoCo) leave every replica its own local progress, which each saves itself in the
background without a round; FSDP2 sites save shards, each site its own folder.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from fabric_multimodel.checkpoints.files import (
    CheckpointError,
    CheckpointWriter,
    load_checkpoint,
    read_checkpoint,
    remove_stale_temporaries,
    replica_path,
    save_checkpoint,
    site_path,
    validated,
)
from fabric_multimodel.checkpoints.resume import Resumed, resume_latest
from fabric_multimodel.checkpoints.sharded import (
    METADATA,
    ResumedSharded,
    load_sharded,
    resume_latest_sharded,
    save_sharded,
)
from fabric_multimodel.comm.collectives import extremes

_log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from lightning_fabric import Fabric

    from fabric_multimodel.averaging.averager import Averager


class Checkpointer:
    """A run's checkpoints in ``folder``: :meth:`save` when the loop wants one, :meth:`after_round` after an
    averaging round, each by the right writer for the run (stale temporaries of killed saves are removed first).

    - Anchored rounds (DiLoCo, a low-bit ``comm_dtype``): a checkpoint sends nothing. Each replica's writer
      saves its own file (``checkpoint.pt``, ``checkpoint.replica1.pt``, ...) in the background: no round, no
      barrier, and a replica that restarts finds its own local progress.
    - FSDP2 inside each site (``averager.sharded``): each site writes its own folder (``checkpoint``,
      ``checkpoint.replica1``, ...), every process its shards; nothing crosses sites.
    - Otherwise (replicas equal after each round): rank 0 writes ``checkpoint.pt`` (every rank waits); with
      ``rounds=True`` the round checkpoints are written in the background by one process per node, so that a
      restarted node finds its own.

    Example::

        checkpointer = Checkpointer(fabric, Path("runs/x"), rounds=True, averager=averager)
        with averager:
            for step in range(steps):
                ...
                averager.step()
                if averager.finished_at == averager.steps and not averager.pending:  # a round ended here
                    checkpointer.after_round({"gen": gen, "averager": averager, "step": step + 1})
        checkpointer.save({"gen": gen, "averager": averager, "step": steps})
        print(checkpointer.close())
    """

    def __init__(
        self, fabric: Fabric, folder: str | os.PathLike, rounds: bool = False, averager: Averager | None = None
    ) -> None:
        self.folder = folder = Path(folder)
        self.fabric, self.path = fabric, folder / "checkpoint.pt"
        #: True when each replica writes its own checkpoint and no checkpoint needs a round.
        self.local = averager is not None and averager.anchored
        #: FSDP2 models: each site writes its replica's folder, every process its shards (no round, inside the site).
        self.sharded = averager is not None and averager.sharded
        #: The replica (with FSDP2: the site) whose copies this process writes and resumes from.
        self.replica = averager.replica.index if averager is not None else 0
        membership = averager.membership if averager is not None else None
        #: A live site's name (its files carry it); None without a membership.
        self.site = membership.site if membership is not None else None
        if self.sharded:
            assert averager is not None
            self.path = replica_path(folder / "checkpoint", averager.replica.index)
        if membership is not None:  # a live site's rank changes with its epochs; its name does not
            self.replica = 0
            self.path = site_path(folder / ("checkpoint" if self.sharded else "checkpoint.pt"), membership.site)
        if self.local:
            assert averager is not None
            replica = averager.replica
            self.writer = CheckpointWriter(replica_path(self.path, self.replica), enabled=replica.writer)
        else:  # a sharded run writes its round checkpoints in the training thread (DCP's collectives are the site's)
            self.writer = CheckpointWriter(self.path, enabled=rounds and fabric.local_rank == 0 and not self.sharded)
        #: Seconds each sharded round checkpoint held the training thread.
        self.sharded_seconds: list[float] = []
        if fabric.local_rank == 0:
            for stale in remove_stale_temporaries(folder):
                _log.warning("removed %s, left by a save that was interrupted", stale)

    def resume(
        self,
        state: dict[str, Any],
        *,
        validate: Callable[[dict[str, Any]], None] | None = None,
        progress: Callable[[int, int, float], None] | None = None,
    ) -> Resumed | ResumedSharded | None:
        """Load this run's newest checkpoint in ``folder`` into ``state`` on every rank (before the first
        collective of training), or None and nothing changed when there is none: a fresh start. Each replica
        (anchored) or site (FSDP2) resumes from its own copy when that is the newest, else receives what it lacks
        from one that has it (:func:`~fabric_multimodel.checkpoints.resume.resume_latest`,
        :func:`~fabric_multimodel.checkpoints.sharded.resume_latest_sharded`; ``validate`` and ``progress`` as
        there).

        Example::

            resumed = checkpointer.resume(state)
            step = state["step"] if resumed else 0
        """
        resumed: Resumed | ResumedSharded | None
        if self.sharded and self.site is not None:
            if self.path.exists():  # not resumed yet: the site receives the run's state when it joins
                _log.warning("%s: a live FSDP2 site's own folder is not resumed yet; this site starts fresh", self.path)
            return None
        if self.sharded:
            folder = self.folder / "checkpoint"
            resumed = resume_latest_sharded(self.fabric, folder, state, validate=validate, progress=progress)
        else:
            resumed = resume_latest(self.fabric, self.own_path, state, validate=validate, progress=progress)
        if resumed is None:
            _log.info("no checkpoint in %s: a fresh start", self.folder)
        else:
            _log.info("resumed step %d from %s", resumed.step, self.folder)
        return resumed

    @property
    def own_path(self) -> Path:
        """The file this process writes and resumes from: with anchored rounds, its replica's own."""
        return self.writer.path if self.local else self.path

    def load(
        self,
        path: str | os.PathLike,
        state: dict[str, Any],
        *,
        validate: Callable[[dict[str, Any]], None] | None = None,
        step_key: str = "step",
    ) -> dict[str, Any]:
        """Load the checkpoint the user names at ``path`` (``--resume PATH``: not necessarily the newest) into
        ``state`` on every rank; returns what it held beyond ``state``. Each replica loads its own copy beside it
        where that is the same checkpoint: anchored rounds, its file when whole and at ``path``'s step (else
        ``path``, and the Averager starts this replica from the anchors); FSDP2, its site's folder when
        complete, and then every site must be at one step (one small allreduce). Problems are one-line
        :class:`~fabric_multimodel.checkpoints.files.CheckpointError` s naming the file (``validate`` as in
        :func:`~fabric_multimodel.checkpoints.files.load_checkpoint`).

        Example::

            extra = checkpointer.load("runs/x/checkpoint.pt", state, validate=same_settings(config))
        """
        path = Path(path)
        if not self.sharded:
            return load_checkpoint(self.fabric, self._own_copy(path, step_key), state, validate=validate)
        own = replica_path(path, self.replica)
        path = own if (own / METADATA).is_file() else path
        values = load_sharded(path, state)
        validated(path, values, validate)
        state.update(values)
        top, bottom = extremes([state[step_key]], self.fabric.device)
        if top != bottom:
            other = bottom[0] if top[0] == state[step_key] else top[0]
            raise CheckpointError(
                f"{path} is at step {state[step_key]}, another site's folder at step {other}; resume every site"
                " from one step (give a folder that every site saved at that step)"
            )
        return {}

    def _own_copy(self, path: Path, step_key: str) -> Path:
        """Anchored rounds: this replica's file beside ``path`` when whole and at the same step, else ``path``."""
        own = replica_path(path, self.replica)
        if not self.local or own == path:
            return path
        try:
            return own if read_checkpoint(own)[step_key] == read_checkpoint(path)[step_key] else path
        except (CheckpointError, KeyError):
            return path

    def save(self, state: Mapping[str, Any]) -> Path:
        """A checkpoint now (call it on every rank); the path it went to. ``state`` holds ``"step"``: what
        :meth:`resume` agrees the newest copy by (a ``ValueError`` before anything is written, else)."""
        _check_step(state)
        if self.sharded:
            return save_sharded(self.path, state)
        if self.local:
            self.writer.save(state)
            return self.writer.path
        self.writer.wait()  # the rename of a background write must not land after this one
        path = save_checkpoint(self.fabric, self.path, state)
        _log.debug("saved %s", path)
        return path

    def after_round(self, state: Mapping[str, Any]) -> None:
        """After a round (where the replicas are the same, or anchored): a checkpoint written in the background,
        or, sharded, each site's folder written by its processes (nothing crosses sites)."""
        _check_step(state)
        if self.sharded:
            start = time.perf_counter()
            save_sharded(self.path, state)
            self.sharded_seconds.append(time.perf_counter() - start)
            return
        self.writer.save(state)

    def close(self) -> str:
        """Finish the background write; a line with what the round checkpoints cost, when there were any."""
        self.writer.close()
        if self.sharded_seconds:
            median_ms = 1000 * statistics.median(self.sharded_seconds)
            return (
                f"checkpoints after rounds: {len(self.sharded_seconds)} sharded saves, training thread"
                f" {median_ms:.1f} ms each (median)"
            )
        if not self.writer.seconds:
            return ""
        copies, writes = zip(*self.writer.seconds)
        copy_ms, write_ms = 1000 * statistics.median(copies), 1000 * statistics.median(writes)
        return (
            f"checkpoints in the background: {len(copies)}, training thread {copy_ms:.2f} ms each (median),"
            f" background write {write_ms:.1f} ms"
        )


def _check_step(state: Mapping[str, Any]) -> None:
    """A state to save holds its step as a whole number: a resume finds the newest copy by it."""
    step = state.get("step")
    if isinstance(step, torch.Tensor) and step.numel() == 1 and not step.is_floating_point():
        step = step.item()
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(
            f"Checkpointer: the state to save needs 'step', a whole number >= 0 (the loop's step: a resume finds the"
            f" newest copy by it), got {step!r}; add it: checkpointer.save({{**state, 'step': step}})"
        )
