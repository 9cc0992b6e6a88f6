"""Checkpoints of FSDP2 models inside each site: ``torch.distributed.checkpoint`` over the site's own group.

A model sharded inside a site (``setup_models(..., shard=site)``) has no rank that holds it whole, so
:func:`~fabric_multimodel.checkpoints.files.save_checkpoint` refuses it. Here every process of a site writes
its shards of the models, the optimizers and the Averager's state (anchors and outer optimizer, placed
like the parameters) into one folder per site, the site's replica (``replica_path``). Every collective
runs over the site's group, the group the models are sharded over: a checkpoint sends nothing across
sites, and one site can save while the others train.

Loading reshards: a folder written by ``D`` processes per site loads into ``D'``, and a site that has
no folder of its own (a new one, or one of more sites) loads another's and starts from the anchors,
the global model (``Averager.load_state_dict`` does that when the replica index differs).

:func:`resume_latest_sharded` is ``--resume auto`` for such runs: every site loads the newest folder, its own
when that is the newest; a site that can read none receives what it needs over the link.

The error-feedback residuals of low-bit rounds (``error_feedback=True``) are each process's own, laid
out by its quantization of its shards: each goes under a key of its own rank in the site, and a folder
written by another number of processes per site has none for it, so error feedback starts again from
zero there (as it does when a site starts from another's anchors).

Example::

    site = node_groups(fabric).node
    (model,) = setup_models(fabric, model=Model(), shard=site)
    averager = Averager(fabric, model, period=128, outer_optimizer=diloco, process_group=node_groups(fabric).peers)
    folder = replica_path("checkpoint", averager.replica.index)     # checkpoint, checkpoint.replica1, ...
    save_sharded(folder, {"model": model, "opt": opt, "averager": averager, "step": step})
    ...
    values = load_sharded(folder, {"model": model, "opt": opt, "averager": averager, "step": 0})
    step = values["step"]
"""

from __future__ import annotations

import io
import os
import shutil
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from fabric_multimodel.averaging.arguments import plain_module
from fabric_multimodel.checkpoints.files import TEMPORARY_INFIX, CheckpointError, replica_path, validated
from fabric_multimodel.comm.flat import local_part, placed_like
from fabric_multimodel.comm.relay import relay_bytes

#: The file torch.distributed.checkpoint writes last: a folder without it is not a complete checkpoint.
METADATA = ".metadata"


def save_sharded(path: str | os.PathLike, state: Mapping[str, Any]) -> Path:
    """Write ``state`` into the folder ``path`` with ``torch.distributed.checkpoint``, on every process of the site.

    ``state`` maps names to FSDP2 modules (what ``setup_models(..., shard=...)`` returned), their optimizers,
    an :class:`~fabric_multimodel.Averager`, other objects with ``state_dict()``, and plain values. The
    site is the group the modules are sharded over; every collective runs over it. The folder is written
    beside ``path`` under a temporary name and then takes its place, so an interrupted save leaves the
    previous checkpoint whole.

    Example::

        save_sharded(replica_path(out / "checkpoint", averager.replica.index), {"model": model, "step": step})
    """

    path = Path(path)
    group, rank = _site(path, state)
    _write(path, _stateful(path, state, rank), group, rank)
    return path


def _write(path: Path, saved: dict[str, Any], group: Any, rank: int) -> None:
    """``dcp.save`` of ``saved`` over the site's ``group`` into a temporary folder, which then takes the place of
    ``path``; ``rank`` is this process's in the group."""
    import torch.distributed.checkpoint as dcp

    # One name for every process of the site (a site may span hosts that share the folder).
    temporary, previous = _beside(path, "save"), _beside(path, "previous")
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        if previous.exists() and not path.exists():  # a save killed between its two renames below
            previous.rename(path)
        for stale in (temporary, previous):  # an interrupted save's; nobody writes before the plan below
            shutil.rmtree(stale, ignore_errors=True)
    dcp.save(saved, checkpoint_id=temporary, process_group=group)
    if rank == 0:
        _replace(temporary, path)
    dist.barrier(group=group)  # the folder is in place on every process's return


def load_sharded(path: str | os.PathLike, state: Mapping[str, Any]) -> dict[str, Any]:
    """Load the folder ``path`` (written by :func:`save_sharded`, by any number of processes per site) into
    the objects of ``state``, on every process of the site; returns the plain values by name.

    ``state`` names what to load, as it was saved: modules, optimizers and an Averager are loaded in
    place, and a plain value's entry gives its type (its value is not used). A missing or incomplete
    folder, or one that lacks a name, is a :class:`~fabric_multimodel.checkpoints.files.CheckpointError`
    naming it, raised before anything is changed.

    Example::

        step = load_sharded(folder, {"model": model, "opt": opt, "averager": averager, "step": 0})["step"]
    """

    path = Path(path)
    group, _ = _site(path, state)
    return _load(path, state, group)


def _load(path: Path, state: Mapping[str, Any], group: Any) -> dict[str, Any]:
    """``dcp.load`` of the folder ``path`` over the site's ``group`` into the objects of ``state``; the plain values."""
    import torch.distributed.checkpoint as dcp

    if not (path / METADATA).is_file():
        raise CheckpointError(f"{path}: not a complete sharded checkpoint (no {METADATA}; was its save interrupted?).")
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for name in state:
        if not any(key == name or key.startswith(f"{name}.") for key in saved):
            raise CheckpointError(f"{path}: holds no `{name}`; it holds {sorted({k.split('.')[0] for k in saved})}.")
    template = _stateful(path, state, dist.get_rank(group))
    restarted = {}  # error-feedback residuals the folder does not hold for this rank: they start at zero
    for name, value in state.items():
        if _is_averager(value):
            _add_outer_state(template[name], saved, name)
            restarted[name] = _own_residuals(template[name], saved, name)
    dcp.load(template, checkpoint_id=path, process_group=group)
    for name, residuals in restarted.items():
        if residuals:
            template[name]["error_feedback"] = residuals
    return _apply(path, state, template)


def saved_step(path: str | os.PathLike, step_key: str = "step") -> int:
    """The value ``step_key`` of the complete sharded checkpoint ``path``, read by this process alone (no
    collective); -1 when there is none there, or none that can be read.

    Example::

        if saved_step("runs/lm/checkpoint") >= 0:
            values = load_sharded("runs/lm/checkpoint", state)
    """
    import torch.distributed.checkpoint as dcp

    path = Path(path)
    if not (path / METADATA).is_file():
        return -1
    values: dict[str, Any] = {step_key: -1}
    try:
        if step_key not in dcp.FileSystemReader(path).read_metadata().state_dict_metadata:
            return -1
        with warnings.catch_warnings():  # that it reads in one process: what it is asked to do
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(values, checkpoint_id=path, no_dist=True)
    # DCP raises its failures as CheckpointException, a BaseException; a folder that cannot be read is no
    # checkpoint to resume from.
    except (Exception, dcp.api.CheckpointException):  # noqa: BLE001
        return -1
    step = values[step_key]
    return step if isinstance(step, int) and not isinstance(step, bool) else -1


class ResumedSharded(NamedTuple):
    """What :func:`resume_latest_sharded` loaded, on this process.

    ``step``: the newest folder's; ``folder``: the one this site loaded (a site that received its state:
    the source site's, by the name this process would give it); ``values``: its plain values, by name;
    ``source``: the site whose folder that is (this site's own index when it held the newest);
    ``bytes``: what this process sent or received over the link (0: nothing); ``seconds``: how long that
    took.
    """

    step: int
    folder: Path
    values: dict[str, Any]
    source: int
    bytes: int
    seconds: float

    def describe(self, site: int) -> str:
        """Where site ``site``'s resume came from: its own folder, another site's, or another site's state received
        over the link.

        Example::

            found = resume_latest_sharded(fabric, folder / "checkpoint", state)
            if found is not None:
                print(f"step {found.step} from {found.describe(site)}")
        """
        if self.source == site:
            sent = f"; sent {self.bytes / 1e6:.2f} MB to sites without one" if self.bytes else ""
            return f"{self.folder} (its own{sent})"
        if self.bytes:
            received = f"{self.bytes / 1e6:.2f} MB in {self.seconds:.1f} s"
            return f"site {self.source} over the link ({received}: it starts from the anchors)"
        return f"{self.folder} (another site's: it starts from the anchors)"


def resume_latest_sharded(
    fabric: Any,
    path: str | os.PathLike,
    state: Mapping[str, Any],
    *,
    validate: Callable[[dict[str, Any]], None] | None = None,
    step_key: str = "step",
    progress: Callable[[int, int, float], None] | None = None,
) -> ResumedSharded | None:
    """Load the newest sharded checkpoint into ``state`` on every process: each site its own folder
    (``replica_path(path, averager.replica.index)``) when that is the newest, else the newest folder all
    its processes can read (another site's, in a folder the sites share), from whose anchors the Averager
    starts it; a site that can read none receives one over the link.

    Every process reads the steps of the sites' folders it sees (:func:`saved_step`); one all-gather
    over the world agrees on the newest and on where each site loads it from, and each site that can
    loads its folder (:func:`load_sharded`'s collectives, inside the site). A site that can read no
    folder at that step receives what it needs from the first site that loaded one, once, from that
    site's first process to its own (point to point: :func:`~fabric_multimodel.comm.relay.relay_bytes`,
    with ``progress`` as there), into a hidden folder beside its own that its processes load and then
    remove (they share its disk): with an anchored Averager past warm-up, its state and the plain values
    only (the site's modules start from the anchors, its inner optimizers keep their state, as
    :func:`~fabric_multimodel.checkpoints.resume.resume_latest` does), else the whole folder. ``validate`` checks
    the plain values. Returns None, changing nothing, when no site has a checkpoint: a fresh start.
    Call it on every process, before the first collective of training.

    Example::

        resumed = resume_latest_sharded(fabric, out / "checkpoint", state)
        start = resumed.step if resumed else 0
    """
    averager = next((value for value in state.values() if _is_averager(value)), None)
    if averager is None:
        raise CheckpointError(f"{path}: resume_latest_sharded needs the Averager in `state` (it names the site).")
    replica = averager.replica
    folders = [replica_path(path, index) for index in range(replica.count)]
    visible = [saved_step(folder, step_key) for folder in folders]  # this process's view, by site
    device = getattr(fabric, "device", None)
    mine = torch.tensor([replica.index, *visible], dtype=torch.int64, device=device)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, mine)
    ranks: dict[int, list[int]] = {}  # by site, its processes' global ranks
    seen: dict[int, list[list[int]]] = {}
    for rank, row in enumerate(rows):
        ranks.setdefault(int(row[0]), []).append(rank)
        seen.setdefault(int(row[0]), []).append(row[1:].tolist())
    # By site, the step of each folder that all its processes read (they load it together).
    views = {site: [min(steps) for steps in zip(*site_views)] for site, site_views in seen.items()}
    newest = max(max(view) for view in views.values())
    if newest < 0:
        return None
    sources = {site: _source(view, site, newest) for site, view in views.items()}
    # A site that can read no folder at the newest step receives what it needs (see _relay_state) from the first
    # site that loads a folder, from that site's first process.
    holder = min(site for site, source in sources.items() if source is not None)
    held = sources[holder]
    assert held is not None
    plan = [(ranks[holder][0], ranks[site][0]) for site, source in sorted(sources.items()) if source is None]
    source = sources[replica.index]
    group, site_rank = _site(Path(path), state)
    values = _load(folders[source], state, group) if source is not None else {}
    sent, seconds = 0, 0.0
    if plan:
        start = time.perf_counter()
        received = _beside(folders[replica.index], "receive")
        site = (group, site_rank)
        # The holding site sends its state as loaded: its objects, and the plain values it read.
        loaded = {**state, **values}
        part = _relay_state(plan, loaded, folders[held], received, site, holder == replica.index, device, progress)
        sent = part.bytes
        if source is None:
            values = _load(received, part.state, group)
            dist.barrier(group=group)  # every process of the site has read the folder
            if site_rank == 0:
                shutil.rmtree(received)
        seconds = time.perf_counter() - start
    origin = held if source is None else source
    validated(folders[origin], values, validate)
    return ResumedSharded(newest, folders[origin], values, origin, sent, seconds)


class _Relayed(NamedTuple):
    state: dict[str, Any]  # what a receiving site loads
    bytes: int  # what this process sent or received


def _relay_state(
    plan: list[tuple[int, int]],
    state: Mapping[str, Any],
    folder: Path,
    received: Path,
    site: tuple[Any, int],
    holding: bool,
    device: Any,
    progress: Callable[[int, int, float], None] | None,
) -> _Relayed:
    """Send the first process of each receiving site (the receivers of ``plan``) what it needs from the holding
    site's loaded state, written into ``received``; every process of the world calls it.

    With an anchored Averager whose anchors are the global model (:func:`~fabric_multimodel.checkpoints.resume.
    holds_global_model`), that is the Averager's state and the plain values: the holding site writes them
    into a folder of their own (``dcp.save`` inside the site), and a receiving site starts its modules from
    the anchors and keeps its inner optimizers' state. Otherwise the holding site's whole ``folder``
    travels. One broadcast over the world tells every process which (the holder knows it, having loaded
    the state), then the transfer point to point, then a barrier: the folders are written."""
    from fabric_multimodel.checkpoints.resume import holds_global_model

    sender = plan[0][0]
    flag = torch.zeros(1, dtype=torch.int64, device=device)
    if dist.get_rank() == sender:
        averagers = [value for value in state.values() if _is_averager(value)]
        flag[0] = all(value.anchored and holds_global_model(value, value.state_dict()) for value in averagers)
    dist.broadcast(flag, src=sender)
    needed = dict(state)
    if bool(flag):  # the modules and inner optimizers stay as they are
        needed = {k: v for k, v in state.items() if not isinstance(v, nn.Module) and not _is_optimizer(v)}
    payload = None
    if holding:  # the sender is the holding site's first process
        group, rank = site
        if bool(flag):
            outbox = _beside(folder, "send")
            saved = _stateful(folder, needed, rank)
            for name, value in needed.items():  # a site that starts from another's anchors clears its residuals
                if _is_averager(value):
                    saved[name].pop("error_feedback", None)
            _write(outbox, saved, group, rank)
            if rank == 0:
                payload = _pack(outbox)
                shutil.rmtree(outbox)
        elif rank == 0:
            payload = _pack(folder)
    data, size = relay_bytes(plan, payload, device or torch.device("cpu"), progress)
    if any(dist.get_rank() == receiver for _, receiver in plan) and data is not None:
        _unpack(data, received)
    dist.barrier()
    return _Relayed(needed, size)


def _source(view: list[int], own: int, newest: int) -> int | None:
    """The site whose folder a process with ``view`` (steps by site) loads: its own when at ``newest``."""
    if view[own] == newest:
        return own
    return next((site for site, step in enumerate(view) if step == newest), None)


def _pack(folder: Path) -> bytes:
    """The files of a checkpoint folder, as one ``torch.save`` of their bytes by name."""
    files = {f.name: torch.frombuffer(bytearray(f.read_bytes()), dtype=torch.uint8) for f in sorted(folder.iterdir())}
    buffer = io.BytesIO()
    torch.save(files, buffer)
    return buffer.getvalue()


def _unpack(data: bytes, path: Path) -> None:
    """Write the files :func:`_pack` packed into the new folder ``path`` (what a killed receive left there goes)."""
    files = torch.load(io.BytesIO(data), weights_only=True)
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    for name, content in files.items():
        (path / name).write_bytes(content.numpy().tobytes())


def _replace(temporary: Path, path: Path) -> None:
    """Put the complete folder ``temporary`` in the place of ``path``: a kill at any point leaves one of the two
    whole, ``path`` itself or the previous folder under a name the next save puts back."""
    previous = _beside(path, "previous")
    if path.exists():
        path.rename(previous)
    temporary.rename(path)
    shutil.rmtree(previous, ignore_errors=True)


def _beside(path: Path, what: str) -> Path:
    """The hidden name beside ``path`` of its folder while ``what`` (save, receive) writes it, or of the previous."""
    return path.parent / f".{path.name}{TEMPORARY_INFIX}{what}"


def _site(path: Path, state: Mapping[str, Any]) -> tuple[Any, int]:
    """The group the state's FSDP2 modules are sharded over (one for all of them), and this rank's place in it."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    groups = {}
    for name, value in state.items():
        if isinstance(value, nn.Module):
            for module in plain_module(value).modules():
                if isinstance(module, FSDPModule):
                    module.reshard()  # a forward without backward (evaluation) leaves the parameters gathered
            for parameter in value.parameters():
                if isinstance(parameter, DTensor):
                    group = parameter.device_mesh.get_group()
                    groups[tuple(dist.get_process_group_ranks(group))] = (name, group)
    if len(groups) != 1:
        found = "none" if not groups else ", ".join(f"`{name}` over ranks {list(r)}" for r, (name, _) in groups.items())
        raise CheckpointError(
            f"{path}: a sharded checkpoint needs FSDP2 modules all sharded over one group (the site), found {found};"
            " for models that are not sharded use save_checkpoint."
        )
    ((_, group),) = groups.values()
    return group, dist.get_rank(group)


def _stateful(path: Path, state: Mapping[str, Any], rank: int) -> dict[str, Any]:
    """``state`` in the form torch.distributed.checkpoint saves and loads: each object's state dict, by name. An
    Averager's error-feedback residuals are this process's own (laid out by its quantization of its shards):
    they go under a key of its own, ``error_feedback.rank<rank in the site>``."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    out: dict[str, Any] = {}
    for name, value in state.items():
        if isinstance(value, nn.Module):
            out[name] = get_model_state_dict(plain_module(value))
        elif _is_optimizer(value):
            out[name] = get_optimizer_state_dict(_owner(path, name, value, state), _optimizer(value))
        elif hasattr(value, "state_dict"):
            out[name] = value.state_dict()
            if _is_averager(value) and "error_feedback" in out[name]:
                out[name]["error_feedback"] = {f"rank{rank}": out[name]["error_feedback"]}
        else:
            out[name] = value
    return out


def _apply(path: Path, state: Mapping[str, Any], loaded: dict[str, Any]) -> dict[str, Any]:
    """Load ``loaded`` (filled by torch.distributed.checkpoint) into the objects of ``state``; the plain values."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    values = {}
    for name, value in state.items():
        if isinstance(value, nn.Module):
            set_model_state_dict(plain_module(value), loaded[name])
        elif _is_optimizer(value):
            set_optimizer_state_dict(_owner(path, name, value, state), _optimizer(value), loaded[name])
        elif hasattr(value, "load_state_dict"):
            if _is_averager(value) and "error_feedback" in loaded[name]:
                (loaded[name]["error_feedback"],) = loaded[name]["error_feedback"].values()  # this rank's own
            value.load_state_dict(loaded[name])
        else:
            values[name] = loaded[name]
    return values


def _own_residuals(template: dict[str, Any], saved: Mapping[str, Any], name: str) -> dict[str, Any]:
    """This rank's error-feedback residuals when the folder holds none of their sizes for it (written by another
    number of processes per site): taken out of ``template`` and returned as zeros, what error feedback starts
    from. Empty when the folder holds them, or the Averager keeps none."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    own = template.get("error_feedback")
    if own is None:
        return {}
    ((key, residuals),) = own.items()
    stored = [saved.get(f"{name}.error_feedback.{key}.{i}") for i in range(len(residuals))]
    if all(isinstance(m, TensorStorageMetadata) and tuple(m.size) == tuple(r.shape) for m, r in zip(stored, residuals)):
        return {}
    del template["error_feedback"]
    return {key: [torch.zeros_like(r) for r in residuals]}


def _add_outer_state(template: dict[str, Any], saved: Mapping[str, Any], name: str) -> None:
    """An outer optimizer fills its state in its first step; entries the checkpoint has and the template lacks
    (this Averager has not stepped yet) get a place to load into, shaped like the saved entry."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    outer = template.get("outer_optimizer")
    if outer is None:
        return
    prefix = f"{name}.outer_optimizer.state."
    shards = template["anchor"]  # by tensor name, placed like the parameter
    for key, meta in saved.items():
        if not key.startswith(prefix) or not isinstance(meta, TensorStorageMetadata):
            continue
        tensor, field = key[len(prefix) :].rsplit(".", 1)
        entry = outer["state"].setdefault(tensor, {})
        if field in entry:
            continue
        like = shards.get(tensor)
        if like is not None and tuple(meta.size) == tuple(like.shape):
            entry[field] = placed_like(like, torch.zeros_like(local_part(like), dtype=meta.properties.dtype))
        else:
            entry[field] = torch.zeros(tuple(meta.size), dtype=meta.properties.dtype)


def _is_optimizer(value: Any) -> bool:
    return isinstance(_optimizer(value), Optimizer)


def _optimizer(value: Any) -> Any:
    """The torch optimizer under Fabric's wrapper."""
    return getattr(value, "optimizer", value) if not isinstance(value, Optimizer) else value


def _is_averager(value: Any) -> bool:
    from fabric_multimodel.averaging.averager import Averager

    return isinstance(value, Averager)


def _owner(path: Path, name: str, optimizer: Any, state: Mapping[str, Any]) -> nn.Module:
    """The module of ``state`` whose parameters ``optimizer`` steps."""
    params = {id(p) for group in _optimizer(optimizer).param_groups for p in group["params"]}
    for value in state.values():
        if isinstance(value, nn.Module) and params <= {id(p) for p in value.parameters()}:
            return plain_module(value)
    raise CheckpointError(
        f"{path}: `{name}` steps parameters of no single module of the checkpoint; save it with its model."
    )
