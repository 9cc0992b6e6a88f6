"""Checkpoints that survive a kill: atomic, checked writes and loads that say in one line what is wrong.

``fabric.save`` stages a checkpoint in ``$TMPDIR`` and moves it; when the target is on another
filesystem that move rewrites the old checkpoint in place, so a kill in the middle leaves neither
the old nor the new one, and staged files leak. :func:`save_checkpoint` writes a temporary file
next to the target, flushes it to disk and renames it over the target, so the previous checkpoint
stays whole until the new one is complete. :func:`load_checkpoint` verifies the file (zip CRCs,
finite tensors, expected keys) before it changes anything.
"""

from __future__ import annotations

import io
import math
import os
import socket
import threading
import time
import zipfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fabric_multimodel.ddp.families import is_instance
from fabric_multimodel.ddp.models import builds_plain_ddp
from fabric_multimodel.membership.names import check_site_name

if TYPE_CHECKING:
    from lightning_fabric import Fabric

#: Temporary files are named ``.<name>.tmp-<host>-<pid>`` beside their target (see :func:`remove_stale_temporaries`).
TEMPORARY_INFIX = ".tmp-"
#: A temporary file of another machine (a shared folder) is stale once it is this old: a write takes seconds.
FOREIGN_STALE_S = 600.0


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed; the message names the file and the reason, in one line.

    Example::

        try:
            load_checkpoint(fabric, path, state)
        except CheckpointError as error:
            sys.exit(f"train.py: error: {error}")
    """


def same_settings(
    settings: Mapping[str, Any], *, key: str = "config", spell: Callable[[str], str] = str
) -> Callable[[dict[str, Any]], None]:
    """A ``validate`` for :func:`load_checkpoint`, :meth:`~fabric_multimodel.Checkpointer.resume` and
    :meth:`~fabric_multimodel.Checkpointer.load`: the run that wrote the checkpoint saved its settings under
    ``key``, and each setting both runs have must be the same, else a :class:`CheckpointError` naming every
    difference (``spell`` writes a setting's name, as its command-line flag say). Settings one side lacks are
    not compared: a run may add a setting with a default.

    Example::

        config = {"lr": args.lr, "period": args.period}
        state = {"model": model, "optimizer": optimizer, "averager": averager, "step": 0, "config": config}
        checkpointer.resume(state, validate=same_settings(config, spell=lambda k: "--" + k.replace("_", "-")))
    """

    def validate(checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get(key)
        if not isinstance(saved, Mapping):
            raise CheckpointError(f"holds no `{key}`: not written by this script")
        differences = [
            f"{spell(k)} {saved[k]!r} (now {value!r})" for k, value in settings.items() if saved.get(k, value) != value
        ]
        if differences:
            raise CheckpointError(f"written with {', '.join(differences)}; resume with the same settings")

    return validate


def validated(path: Path, checkpoint: dict[str, Any], validate: Callable[[dict[str, Any]], None] | None) -> None:
    """``validate(checkpoint)``, its :class:`CheckpointError` naming ``path``."""
    if validate is None:
        return
    try:
        validate(checkpoint)
    except CheckpointError as error:
        raise CheckpointError(f"{path}: {error}") from None


def save_checkpoint(fabric: Fabric, path: str | os.PathLike, state: Mapping[str, Any]) -> Path:
    """Write ``state`` to ``path`` atomically; call it on every rank (rank 0 writes).

    Modules, optimizers and anything with a ``state_dict()`` (an :class:`~fabric_multimodel.Averager`) are saved
    through it, as ``fabric.save`` does. Rank 0 writes ``.<name>.tmp-<pid>`` in the same folder,
    flushes it to disk and renames it over ``path``: a kill at any moment leaves either the previous
    checkpoint or the new one, whole. Sharded strategies (FSDP, DeepSpeed) save differently; for
    them this calls ``fabric.save``.

    Example::

        averager.sync()
        save_checkpoint(fabric, out / "checkpoint.pt", {"gen": gen, "opt_g": opt_g, "averager": averager, "step": step})
    """
    path = Path(path)
    if not _builds_plain_modules(fabric):
        fabric.save(path, dict(state))
        return path
    _refuse_shards(path, state)  # on every rank, before the barrier
    if fabric.is_global_zero:
        _write_atomically(path, serialize(state))
    fabric.barrier()
    return path


def replica_path(path: str | os.PathLike, index: int) -> Path:
    """Where replica ``index`` keeps its own checkpoint: ``path`` for replica 0, ``<stem>.replica<index><suffix>``
    beside it for the others.

    With anchored rounds (DiLoCo, ``comm_dtype``) a checkpoint needs no round: each replica's writer
    saves the anchors and outer optimizer (the same everywhere) with its own parameters and inner
    optimizer, and nothing crosses the link. Resuming into the same world loads every replica's own
    file, bitwise; a replica with no file of its own at that step loads replica 0's, and the
    :class:`~fabric_multimodel.Averager` then starts it from the anchors.

    Example::

        replica = averager.replica
        CheckpointWriter(replica_path(out / "checkpoint.pt", replica.index), enabled=replica.writer)
        replica_path("runs/lm/checkpoint.pt", 1)  # runs/lm/checkpoint.replica1.pt
    """
    path = Path(path)
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"replica_path: `index` must be a whole number >= 0, got {index!r}.")
    return path if index == 0 else path.with_name(f"{path.stem}.replica{index}{path.suffix}")


def site_path(path: str | os.PathLike, site: str) -> Path:
    """Where a live site (a :class:`~fabric_multimodel.Membership`'s) keeps its own checkpoint: ``<stem>.site-<site>
    <suffix>`` beside ``path``. A site's rank changes with its epochs, its name does not: the same command started
    again finds its own file.

    Example::

        site_path("runs/lm/checkpoint.pt", "berlin")  # runs/lm/checkpoint.site-berlin.pt
    """
    path = Path(path)
    return path.with_name(f"{path.stem}.site-{check_site_name(site)}{path.suffix}")


class CheckpointWriter:
    """Atomic checkpoints written off the training thread, cheap enough for every averaging round.

    :meth:`save` serializes the state (the ``state_dict()`` of modules, optimizers and an
    :class:`~fabric_multimodel.Averager`) into memory and returns; a background thread writes those bytes as
    :func:`save_checkpoint` does (a temporary file beside the target, flushed to disk, renamed over
    it), so a kill at any moment leaves the previous checkpoint or the new one, whole. One write is
    in flight at a time: a ``save`` while one is still being written waits for it first. Make one
    writer per node (``enabled=fabric.local_rank == 0``) so that a restarted node finds its own
    copy; no collective is involved, so other ranks may call ``save`` (disabled: it does nothing)
    or not. ``seconds`` keeps, per save, the time the training thread spent and the write's.
    Serializing on the training thread costs a copy of the state; it leaves the background thread one
    call that waits on the disk (write, flush, rename) and no Python work to contend with training for
    the interpreter lock (measured: pickling in the background slowed two writing processes' steps 5x).

    Example::

        writer = CheckpointWriter(out / "checkpoint.pt", enabled=fabric.local_rank == 0)
        if averager.step():  # right after a round: every replica is the same
            writer.save({"model": model, "averager": averager, "step": step})
        ...
        writer.close()
    """

    def __init__(self, path: str | os.PathLike, *, enabled: bool = True) -> None:
        self.path = Path(path)
        self.enabled = enabled
        #: Per save: (seconds the caller waited for the copy, seconds the background write took).
        self.seconds: list[tuple[float, float]] = []
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, state: Mapping[str, Any]) -> None:
        """Serialize ``state`` now and write it in the background (nothing when disabled)."""
        _refuse_shards(self.path, state)  # on every rank, enabled or not: the same verdict everywhere
        if not self.enabled:
            return
        start = time.perf_counter()
        self.wait()
        snapshot = serialize(state)
        copied = time.perf_counter() - start
        self._thread = threading.Thread(target=self._write, args=(snapshot, copied), daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Wait for the write in flight; raise what it failed with, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise CheckpointError(f"{self.path}: the background write failed ({type(error).__name__}: {error})")

    def close(self) -> None:
        """Finish the write in flight (call it before the process ends)."""
        self.wait()

    def _write(self, snapshot: bytes, copied: float) -> None:
        start = time.perf_counter()
        try:
            _write_atomically(self.path, snapshot)
        except BaseException as error:  # reported on the training thread, at the next save or close
            self._error = error
        self.seconds.append((copied, time.perf_counter() - start))


def _refuse_shards(path: Path, state: Mapping[str, Any]) -> None:
    """A file of one rank's tensors would keep one shard of an FSDP2 model: a :class:`CheckpointError` instead."""
    from torch.distributed.tensor import DTensor

    for key, value in state.items():
        if isinstance(value, nn.Module) and any(isinstance(p, DTensor) for p in value.parameters()):
            raise CheckpointError(
                f"{path}: `{key}` holds FSDP2 shards (DTensor parameters), and this checkpoint is one rank's file:"
                " it would keep one shard of the model. Save sharded models with torch.distributed.checkpoint"
                " (dcp.save({'model': get_model_state_dict(model)}, checkpoint_id=folder)); the Averager's state is"
                " not sharded-aware yet"
            )


def serialize(state: Mapping[str, Any]) -> bytes:
    """``torch.save`` of ``state`` (objects with a ``state_dict()`` saved through it), as bytes."""
    converted = {
        key: value.state_dict() if callable(getattr(value, "state_dict", None)) else value
        for key, value in state.items()
    }
    buffer = io.BytesIO()
    torch.save(converted, buffer)
    return buffer.getvalue()


def _write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}{TEMPORARY_INFIX}{socket.gethostname()}-{os.getpid()}")
    try:
        with temporary.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    _fsync_folder(path.parent)


def remove_stale_temporaries(folder: str | os.PathLike) -> list[Path]:
    """Delete temporary files that a killed :func:`save_checkpoint` left in ``folder``; returns them.

    A temporary is stale when the process that wrote it (its name holds the host and the process
    id) no longer runs; one of another host (a shared folder) when it is older than
    ``FOREIGN_STALE_S``. A write still under way is never touched.

    Example::

        if fabric.is_global_zero:
            remove_stale_temporaries(out)
    """
    folder = Path(folder)
    stale = [p for p in folder.glob(f".*{TEMPORARY_INFIX}*") if p.is_file() and _stale(p)] if folder.is_dir() else []
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def _stale(temporary: Path) -> bool:
    host, _, pid = temporary.name.rpartition(TEMPORARY_INFIX)[2].rpartition("-")
    if host != socket.gethostname() or not pid.isdigit():
        try:
            return time.time() - temporary.stat().st_mtime > FOREIGN_STALE_S
        except OSError:
            return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def read_checkpoint(path: str | os.PathLike, expected: Iterable[str] = ()) -> dict[str, Any]:
    """Read and verify a checkpoint without loading it into anything; raises :class:`CheckpointError`.

    Checks that the file exists and is not empty, that it is a PyTorch zip archive whose every
    member matches its CRC (a flipped byte anywhere is found), that it loads with
    ``weights_only=True``, that it holds the ``expected`` keys, and that every floating-point
    tensor in it is finite.

    Example::

        checkpoint = read_checkpoint("runs/gan/checkpoint.pt", expected=["gen", "disc", "step"])
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    if path.stat().st_size == 0:
        raise CheckpointError(f"{path}: the file is empty (a save that never finished?)")
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as error:
        raise CheckpointError(f"{path}: not a complete PyTorch checkpoint (truncated or foreign: {error})") from None
    if bad is not None:
        raise CheckpointError(f"{path}: corrupted (the CRC of {bad} does not match)")
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"{path}: cannot be loaded ({first})") from None
    if not isinstance(checkpoint, dict):
        raise CheckpointError(f"{path}: holds a {type(checkpoint).__name__}, not a checkpoint dictionary")
    _check_keys(path, checkpoint, expected)
    nonfinite = _nonfinite(checkpoint)
    if nonfinite:
        raise CheckpointError(
            f"{path}: holds NaN or Inf in {', '.join(nonfinite[:5])}{' ...' if len(nonfinite) > 5 else ''}"
        )
    return checkpoint


def load_checkpoint(
    fabric: Fabric,
    path: str | os.PathLike,
    state: dict[str, Any],
    *,
    validate: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Verify ``path`` (see :func:`read_checkpoint`), then load it into ``state`` like ``fabric.load``.

    Objects with ``load_state_dict`` (modules, optimizers, an :class:`~fabric_multimodel.Averager`) are restored in
    place; plain values in ``state`` are replaced. Returns what the checkpoint holds beyond
    ``state``. Every problem, including a model of other shapes, is a :class:`CheckpointError`
    whose one-line message names the file; the file and the models' shapes are checked before
    anything is loaded, and so is ``validate(checkpoint)``, which may raise :class:`CheckpointError` (raised again
    naming the file; :func:`same_settings` makes one)
    (a run's settings that must match, say). Call it on every rank (each reads the file; no collective).

    Example::

        state = {"gen": gen, "opt_g": opt_g, "step": 0}
        load_checkpoint(fabric, "runs/gan/checkpoint.pt", state)
        start = state["step"]
    """
    path = Path(path)
    return load_state(path, read_checkpoint(path), state, validate=validate)


def load_state(
    path: Path,
    checkpoint: dict[str, Any],
    state: dict[str, Any],
    *,
    validate: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Load an already read and verified ``checkpoint`` into ``state`` (see :func:`load_checkpoint`); ``path``
    names it in errors.

    Example::

        load_state(path, read_checkpoint(path), {"model": model, "step": 0})
    """
    validated(path, checkpoint, validate)
    _check_keys(path, checkpoint, state)
    for key, target in state.items():
        if isinstance(target, nn.Module):
            problem = _shape_mismatch(target.state_dict(), checkpoint[key])
            if problem:
                raise CheckpointError(f"{path}: `{key}` does not match this model ({problem})")
    for key, target in state.items():
        if callable(getattr(target, "load_state_dict", None)):
            try:
                target.load_state_dict(checkpoint[key])
            except Exception as error:
                first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                raise CheckpointError(f"{path}: `{key}` does not match ({first})") from None
        else:
            state[key] = checkpoint[key]
    return {key: value for key, value in checkpoint.items() if key not in state}


def _check_keys(path: Path, checkpoint: Mapping[str, Any], expected: Iterable[str]) -> None:
    missing = [key for key in expected if key not in checkpoint]
    if missing:
        raise CheckpointError(f"{path}: not written by this script (it has no {', '.join(missing)})")


def _shape_mismatch(expected: Mapping[str, Any], saved: Any) -> str | None:
    if not isinstance(saved, Mapping):
        return f"a {type(saved).__name__} instead of a state dict"
    missing, unexpected = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
    if missing or unexpected:
        return f"missing {missing[:3]}, unexpected {unexpected[:3]}"
    for name, tensor in expected.items():
        other = saved[name]
        if isinstance(tensor, torch.Tensor) and isinstance(other, torch.Tensor) and tensor.shape != other.shape:
            return f"{name} is {tuple(other.shape)} in the file, {tuple(tensor.shape)} here"
    return None


def _builds_plain_modules(fabric: Fabric) -> bool:
    return is_instance(fabric.strategy, "strategies.SingleDeviceStrategy") or builds_plain_ddp(fabric.strategy)


def _nonfinite(value: Any, prefix: str = "") -> list[str]:
    if isinstance(value, torch.Tensor):
        return [prefix] if value.is_floating_point() and not bool(torch.isfinite(value).all()) else []
    if isinstance(value, float):
        return [prefix] if not math.isfinite(value) else []
    if isinstance(value, Mapping):
        return [
            name for key, item in value.items() for name in _nonfinite(item, f"{prefix}.{key}" if prefix else str(key))
        ]
    if isinstance(value, (list, tuple)):
        return [name for i, item in enumerate(value) for name in _nonfinite(item, f"{prefix}[{i}]")]
    return []


def _fsync_folder(folder: Path) -> None:
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:  # not every platform opens folders
        return
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
