"""What the example scripts share: the command line, starting Fabric, run folders, progress, averaging
options, checkpoints that survive kills, a clean stop on SIGTERM, and a clean exit.

Each example stays a plain Fabric training loop; the plumbing that makes it dependable lives here.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple, NoReturn

import torch
from lightning.fabric import Fabric
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from fabric_multimodel import Averager, Checkpointer, Loop, NodeGroups, cli, ddp_of, launch, node_groups
from fabric_multimodel.checkpoints import CheckpointError, same_settings
from fabric_multimodel.cli import add_averager_arguments, check_averager_arguments
from fabric_multimodel.elastic import Resumed, restart_count
from fabric_multimodel.flat import local_part
from fabric_multimodel.launch import LAUNCHER_FLAGS, launched_by, shutdown
from fabric_multimodel.membership import Membership, RunEnded, site_of
from fabric_multimodel.sharded_checkpoints import ResumedSharded

LAUNCHER = launched_by()
AUTO = Path("auto")  # --resume auto
#: --comm-dtype in run folder names.
LOW_PRECISION = {"bfloat16": "bf16", "float8_e4m3fn": "fp8", "float8_e5m2": "fp8e5m2", "float4_e2m1fn_x2": "fp4"}


def record_error(message: str) -> None:
    """Tell torch elastic (under `fabric run` and torchrun) the one-line reason, so that the failure report it
    prints last shows it as the root cause's ``traceback`` instead of a pointer to its documentation."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        Path(path).write_text(json.dumps({"message": message, "timestamp": str(int(time.time()))}))


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or "(default" in (action.help or ""):
            return action.help  # a missing value says nothing; a help text may spell its default out
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (4 processes would interleave a usage block) and defaults in --help."""

    def __init__(self, prog: str, description: str) -> None:
        super().__init__(prog=prog, description=description, formatter_class=_DefaultsHelp)

    def error(self, message: str) -> NoReturn:
        record_error(f"{self.prog}: error: {message}")
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_averaging_arguments(p: argparse.ArgumentParser, *, warmup_steps: int) -> None:
    """The library's averaging flags (``fabric_multimodel.cli``), and the examples' layouts and membership."""
    g = add_averager_arguments(p, warmup_steps=warmup_steps)
    g.add_argument(
        "--layout",
        choices=["auto", "flat", "islands"],
        default="auto",
        help="islands: DDP inside each node every step, rounds across nodes only; flat: DDP (warm-up) and rounds"
        " over the world; auto: islands when the run averages (--period) across several nodes, else flat",
    )
    g.add_argument("--node-period", type=int, default=0, help="two-level: also average inside the node every N steps")
    g.add_argument(
        "--shard",
        choices=["none", "node"],
        default="none",
        help="node: shard the models over each node's processes with FSDP2 (rounds across nodes: needs --period)",
    )
    g.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="live membership: this process is a site of its own that joins the run through this coordinator"
        " (python -m fabric_multimodel.coordinator; or etcd://HOST:PORT,HOST:PORT,... for an etcd cluster); sites"
        " may leave and join while the others train on (default: none, the processes of this launch are the run)",
    )
    g.add_argument(
        "--site", default=os.environ.get("SITE", ""), help="with --coordinator: this site's name (default: $SITE)"
    )
    g.add_argument("--min-sites", type=int, default=1, help="with --coordinator: sites the run starts with")


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("run")
    g.add_argument("--out", type=Path, help="run folder (default: runs/<example>/<settings>-seed<seed>)")
    g.add_argument(
        "--resume",
        type=Path,
        help="a checkpoint.pt written by this script, with the same settings; auto: the run folder's, when there is"
        " one (what torchrun's restarts use)",
    )
    g.add_argument(
        "--checkpoint-every",
        type=int,
        default=None,
        help="steps between checkpoints (default: 10%% of --steps; 0: only at the end)",
    )
    g.add_argument(
        "--checkpoint-rounds",
        action="store_true",
        help="also write a checkpoint after every averaging round, in the background, one per node (elastic runs)",
    )
    g.add_argument(
        "--log-every", type=int, default=None, help="steps between log lines and stop checks (default: 10%% of --steps)"
    )
    g.add_argument(
        "--timeout", type=float, default=300.0, help="seconds a collective may wait for a peer before failing"
    )
    g.add_argument(
        "--devices", type=int, help="processes to start (default 1); under `fabric run`, give it to `fabric run`"
    )
    g.add_argument(
        "--num-nodes", type=int, default=1, help="nodes, this script started on each; under `fabric run`, give it there"
    )
    g.add_argument(
        "--accelerator",
        choices=["auto", "cpu", "cuda", "gpu", "mps"],
        default="auto",
        help="with --devices, when the script starts its own processes",
    )


def check_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The checks every example makes; every rank runs them before any collective, so a bad flag stops all."""
    if args.layout == "auto":
        # Warm-up never crosses sites by default: synchronous DDP over a slow link cost more than the rest of a
        # run (20 warm-up steps: about 20 s at 10 Mbit/s, minutes at 1 Mbit/s).
        across_nodes = args.period and not args.node_period and world_shape(args)[1] > 1
        args.layout = "islands" if across_nodes else "flat"
        args.layout_chosen = True
    if args.shard == "node":
        check_sharding(p, args)
    check_averager_arguments(p, args)
    minimums = {
        "steps": 1, "batch_size": 1, "checkpoint_every": 0, "log_every": 1, "devices": 1, "num_nodes": 1,
        "node_period": 0,
    }  # fmt: skip
    if args.period == "auto" and args.node_period:
        p.error("--period auto chooses the period across the world: it takes no --node-period")
    for flag, minimum in minimums.items():
        value = getattr(args, flag, None)
        if value is not None and value < minimum:
            p.error(f"--{flag.replace('_', '-')} must be >= {minimum}, got {value}")
    for flag in ("lr", "timeout"):
        value = getattr(args, flag)
        if not (math.isfinite(value) and value > 0):
            p.error(f"--{flag.replace('_', '-')} must be a positive number, got {value}")
    if args.node_period and args.fragments > 1:
        p.error("--node-period (two-level averaging) cannot be combined with --fragments")
    if args.period == 0 and (args.layout != "flat" or args.node_period):
        p.error("--layout islands and --node-period need --period N (rounds across nodes)")
    if (args.layout != "flat" or args.node_period) and math.prod(world_shape(args)) == 1:
        p.error("--layout islands and --node-period need several processes (--devices N), and this run has one")
    if args.node_period and (
        args.layout != "flat" or args.period % args.node_period or args.node_period == args.period
    ):
        p.error("--node-period needs --layout flat and a --period that is a larger multiple of it")
    if args.coordinator and not args.period:
        p.error("--coordinator needs --period (N or auto): the sites average in rounds")
    if args.coordinator and (args.node_period or (args.layout != "flat" and args.shard != "node")):
        p.error(
            "--coordinator: each site's processes are a world of their own, with DDP (or --shard node: FSDP2) inside"
            " it and rounds across the sites; drop --layout and --node-period"
        )
    if args.coordinator and (not args.site or "#" in args.site):
        p.error(f"--coordinator needs --site NAME (no '#'), got {args.site!r}")
    if args.resume is None and restart_count():
        args.resume = AUTO  # torchrun's agent restarted this node's workers: go on from the run folder
    sharded = args.shard == "node"  # its checkpoints are folders, one per site
    kind = "folder" if sharded else "file"
    if args.resume not in (None, AUTO) and not (args.resume.is_dir() if sharded else args.resume.is_file()):
        p.error(f"--resume {args.resume}: no such {kind}")
    anchored = args.outer != "none" or args.comm_dtype != "float32"
    if args.checkpoint_rounds and (not args.period or args.node_period or (args.overlap_steps and not anchored)):
        p.error(
            "--checkpoint-rounds needs --period N, no --node-period, and with --overlap-steps anchored rounds"
            " (--outer nesterov or a --comm-dtype)"
        )
    if LAUNCHER is not None:
        devices, nodes, accelerator = LAUNCHER_FLAGS[LAUNCHER]
        given = [("--devices", devices, args.devices is not None), ("--num-nodes", nodes, args.num_nodes != 1)]
        given.append(("--accelerator", accelerator, accelerator is not None and args.accelerator != "auto"))
        for flag, theirs, set_here in given:
            if set_here:
                p.error(f"{flag}: {LAUNCHER} started the processes; give {theirs} to {LAUNCHER} instead")
    if args.log_every is None:
        args.log_every = max(1, args.steps // 10)
    if args.checkpoint_every is None:
        args.checkpoint_every = max(1, args.steps // 10)


def check_sharding(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--shard node: FSDP2 inside each node, the Averager across nodes; a setting it cannot take is one line."""
    if not args.period:
        p.error("--shard node needs --period N: the models are sharded inside each node and averaged across nodes")
    if args.layout == "flat" and not getattr(args, "layout_chosen", False) or args.node_period:
        p.error("--shard node shards inside each node: drop --layout flat and --node-period")
    args.layout = "islands"
    if math.prod(world_shape(args)) == 1:
        p.error("--shard node shards over a node's processes: start several (--devices N), this run has one")


def mode_name(args: argparse.Namespace) -> str:
    """A short name for the averaging settings, for run folders: ``sync``, ``period8-warmup500-nesterov``..."""
    if not args.period:
        return "sync"
    parts = [f"period{args.period}", f"warmup{args.warmup_steps}"]
    parts += [f"overlap{args.overlap_steps}"] if args.overlap_steps else []
    parts += [f"nesterov{args.outer_lr:g}-{args.outer_momentum:g}"] if args.outer != "none" else []
    parts += [LOW_PRECISION[args.comm_dtype]] if args.comm_dtype != "float32" else []
    parts += ["ef"] if args.error_feedback else []
    parts += ["islands"] if args.layout == "islands" else []
    parts += ["sharded"] if args.shard == "node" else []
    parts += [f"node{args.node_period}"] if args.node_period else []
    parts += [f"fragments{args.fragments}"] if args.fragments > 1 else []
    parts += [f"mixing{args.mixing:g}" if args.mixing != "progress" else "progress"] if args.mixing is not None else []
    return "-".join(parts)


def run_folder(
    p: argparse.ArgumentParser, args: argparse.Namespace, example: str, *settings: str, checkpoint: str | None = None
) -> Path:
    """``--out``, else the folder of ``--resume``, else ``runs/<example>/<settings>-seed<seed>``.

    A folder that holds an earlier run's ``checkpoint`` (default: :func:`checkpoint_name`) is never written
    over by a new run: that is an error naming ``--resume`` (every rank reaches it before any collective)."""
    checkpoint = checkpoint or checkpoint_name(args)
    resuming = getattr(args, "resume", None)
    if args.out is not None:
        folder = args.out
    elif resuming is not None and resuming != AUTO:
        folder = resuming.parent
    else:
        folder = Path("runs") / example / "-".join([*settings, f"seed{args.seed}"])
    earlier = folder / checkpoint
    if resuming is None and earlier.exists():
        how = f"continue it with --resume {earlier} (and a larger --steps), or " if hasattr(args, "resume") else ""
        p.error(f"{folder} holds an earlier run's {checkpoint}; {how}start anew with --out NEW_FOLDER")
    return folder


def checkpoint_name(args: argparse.Namespace) -> str:
    """The run folder's checkpoint: ``checkpoint.pt``, or with ``--shard node`` the folder ``checkpoint`` (one
    beside it per site: ``checkpoint.replica1``, ...)."""
    return "checkpoint" if args.shard == "node" else "checkpoint.pt"


def world_shape(args: argparse.Namespace) -> tuple[int, int]:
    """(processes per node, nodes): the launcher's (torchrun, SLURM), else ``--devices`` and ``--num-nodes``."""
    return launch.world_shape(args.devices, getattr(args, "num_nodes", 1))


def start_fabric(args: argparse.Namespace, **kwargs: Any) -> Fabric:
    """A launched Fabric in the world this process was started into (see ``fabric_multimodel.launch``); a
    collective that waits longer than ``--timeout`` for a peer fails."""
    options = dict(devices=args.devices, num_nodes=args.num_nodes, accelerator=args.accelerator)
    return launch.start_fabric(Fabric, timeout=args.timeout, **options, **kwargs)


def averager_options(args: argparse.Namespace, placement: Layout, optimizers: Sequence[Any]) -> dict[str, Any]:
    """The Averager's keyword arguments for ``--period`` and friends, in the run's layout (empty for synchronous
    DDP)."""
    options = cli.averager_options(args, optimizers)
    return {**options, **placement.averager} if options else {}


def start_averager(
    fabric: Fabric, args: argparse.Namespace, modules: Any, placement: Layout, optimizers: Sequence[Any]
) -> Averager | None:
    """The run's Averager (None for synchronous DDP), its line printed; with ``--coordinator``, this site joins the
    run, and a site started after the run's last round ends here (exit 0: nothing to join)."""
    options = averager_options(args, placement, optimizers)
    if not options:
        return None
    try:
        averager = Averager(fabric, modules, **options, **join_options(fabric, args))
    except RunEnded as error:
        fabric.print(f"run ended: {error}")
        raise SystemExit(0) from None
    fabric.print(averaging_line(args, averager))
    return averager


def join_options(fabric: Fabric, args: argparse.Namespace) -> dict[str, Any]:
    """With ``--coordinator``: the Averager's ``membership``, this site's (its collectives fail after ``--timeout``)."""
    if not args.coordinator:
        return {}
    membership = Membership(
        args.coordinator,
        args.site,
        device=fabric.device,
        min_sites=args.min_sites,
        timeout=args.timeout,
        on_transfer=functools.partial(transfer_progress, fabric, "the run's state"),
    )
    return {"membership": membership}


def data_rank(fabric: Fabric, args: argparse.Namespace) -> int:
    """What orders this process's training data: its global rank, or with ``--coordinator`` (every site a world
    of its own) its site's name and its rank in the site."""
    return zlib.crc32(args.site.encode()) + fabric.global_rank if args.coordinator else fabric.global_rank


def report_membership(fabric: Fabric, averager: Averager | None, seen: tuple[int, Any]) -> tuple[int, Any]:
    """Print ``membership: epoch=E sites=... left=... joined=... waited_s=... state_bytes=... time=...`` (the state
    received or sent on entering, the unix time) when this site entered an epoch after the one in ``seen``, and
    the pace when the members agreed it again; returns what it saw, the epoch and the pace (``(0, None)`` to
    start)."""
    epoch = averager.membership.epoch if averager is not None and averager.membership is not None else None
    if epoch is None:
        return seen
    assert averager is not None
    if epoch.number != seen[0]:
        left, joined = (",".join(map(site_of, tokens)) or "-" for tokens in (epoch.left, epoch.joined))
        fabric.print(
            f"membership: epoch={epoch.number} sites={','.join(epoch.sites)} left={left} joined={joined} waited_s="
            f"{averager.membership_wait_s:.2f} state_bytes={averager.state_traffic.bytes} time={time.time():.2f}"
        )
    if seen[1] is not None and averager.pace != seen[1]:  # the first is printed at the end of warm-up
        fabric.print(averager.pace)
    return epoch.number, averager.pace


def averaging_line(args: argparse.Namespace, averager: Averager) -> str:
    """An averaging run's first line: what the Averager does and in which layout (and why, when --layout was not
    given)."""
    line = f"averaging: {averager.config} layout={'islands' if averager.islands else args.layout}"
    if averager.membership is not None and averager.islands:
        inside = "FSDP2" if averager.sharded else "DDP"
        line += f" (each site a world of its own: {inside} inside it, rounds across the sites that joined)"
    elif averager.sharded:
        line += " (FSDP2 inside each node, rounds of its shards across nodes)"
    elif getattr(args, "layout_chosen", False) and args.layout == "islands":
        nodes = world_shape(args)[1]
        line += f" (the world spans {nodes} nodes: warm-up and DDP stay inside each; --layout flat: DDP across them)"
    return line


class Layout(NamedTuple):
    """Where DDP synchronises and what the Averager averages over, for ``--layout`` and ``--node-period``."""

    setup: dict[str, Any]  # extra keyword arguments of setup_models
    averager: dict[str, Any]  # extra keyword arguments of the Averager
    groups: NodeGroups | None


def layout(fabric: Fabric, args: argparse.Namespace) -> Layout:
    """Flat (DDP and rounds over the world), islands (DDP inside the node, rounds across nodes), or
    two-level (rounds inside the node every ``--node-period`` steps, across the world every ``--period``)."""
    if args.layout == "flat" and not args.node_period:
        return Layout({}, {}, None)
    groups = node_groups(fabric)
    if args.shard == "node":  # FSDP2 over the node's processes instead of DDP; a live site: over its own world
        return Layout({"shard": groups.node}, {} if args.coordinator else {"process_group": groups.across}, groups)
    if args.layout == "islands":
        return Layout({"process_group": groups.node}, {"process_group": groups.across}, groups)
    return Layout({}, {"node_period": args.node_period, "node_group": groups.node}, groups)


class GradientBytes:
    """The gradient bytes this rank's DDPs allreduced: a counting comm hook on each model's DDP.

    Example::

        grads = GradientBytes([gen, disc])
        ...
        print(grads.bytes)
    """

    def __init__(self, models: Iterable[Any]) -> None:
        self.bytes = 0
        for model in models:
            ddp = ddp_of(model)
            if ddp is not None:  # None in a single process: nothing is communicated
                ddp.register_comm_hook(SimpleNamespace(counter=self, group=ddp.process_group), _count_and_allreduce)


def _count_and_allreduce(state, bucket):  # unannotated: DDP checks annotations, and ours would be strings
    """A DDP comm hook: add the bytes this rank sends to the counter, then allreduce as DDP does, over its group."""
    state.counter.bytes += bucket.buffer().numel() * bucket.buffer().element_size()
    return allreduce_hook(state.group, bucket)


def comm_line(gradients: GradientBytes, averager: Any) -> str:
    """``comm: ddp_bytes=... round_bytes=... node_round_bytes=...``: what this rank sent, by kind (the benchmarks
    tell the bytes that cross nodes from those that stay inside with it)."""
    rounds = averager.traffic.bytes if averager is not None else 0
    node_rounds = averager.node_traffic.bytes if averager is not None else 0
    return f"comm: ddp_bytes={gradients.bytes} round_bytes={rounds} node_round_bytes={node_rounds}"


def summary(
    args: argparse.Namespace, gradients: GradientBytes, averager: Averager | None, made: str, *more: str
) -> str:
    """The run's last lines before ``final:``: the run folder and what it holds (``made``: the example's own
    files), the bytes sent by kind, and ``more`` (those that are not empty)."""
    checkpoint = "checkpoint/ (a folder per site)" if args.shard == "node" else "checkpoint.pt"
    lines = [f"run folder: {args.out} ({checkpoint}, logs/, {made})", comm_line(gradients, averager), *more]
    return "\n".join(line for line in lines if line)


def stopped(fabric: Fabric, loop: Loop) -> int:
    """After a stop on SIGTERM (every rank at one step, its checkpoint written): close the loop and say how to go
    on; the exit code (143, as a process ended by SIGTERM)."""
    loop.close()
    fabric.print(f"stopped by SIGTERM at step {loop.step}; resume with --resume {loop.saved}")
    return 143


def link_line(averager: Averager, end_seconds: float, end_bytes: int) -> str:
    """``link: start_bytes=... end_round_bytes=... end_round_s=...``: what the averager's start and its last round
    (leaving the block) cost this rank, beyond the rounds of the schedule."""
    return f"link: start_bytes={averager.start_traffic.bytes} end_round_bytes={end_bytes} end_round_s={end_seconds:.2f}"


def warmup_ended(fabric: Fabric, averager: Averager, loop: Loop, progress: Progress) -> None:
    """Right after the warm-up's last ``step()``: print what ``--period auto`` chose and what ``--pace speed``
    agreed; with pace, this site's loop ends at its own last step (a slower site makes fewer steps)."""
    for agreed in (averager.period_choice, averager.pace):
        if agreed is not None:
            fabric.print(agreed)
    progress.set_total(loop.last)


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
    """``final: steps=... <quality> wall_s=... iter_ms_median=... ...``: the run's last line, in the one format
    the benchmarks and tests parse (``fabric_multimodel.launch.parse_final_line``); ``state_bytes`` (see
    :func:`state_bytes`) ends it when given (the Fabric examples give it; the Trainer example does not)."""
    if averager is not None:  # its rounds, and under a membership what waiting on it cost
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
            f" membership_wait_s={membership_wait_s:.2f} process_start={_process_created() or math.nan:.1f}"
            if membership_wait_s is not None
            else ""
        )
    )


def state_bytes(models: Sequence[nn.Module], optimizers: Sequence[Any], averager: Averager | None) -> int:
    """This rank's bytes of parameters, gradients, optimizer state and the Averager's own tensors (anchors, outer
    optimizer state, snapshots, send buffers): of an FSDP2 model, its shards. Each storage counts once; what DDP
    and FSDP2 allocate for their collectives (gradient buckets, gathered parameters) is not counted."""
    parameters = [p for model in models for p in model.parameters()]
    tensors = [*parameters, *(p.grad for p in parameters if p.grad is not None)]
    for optimizer in optimizers:
        tensors += [v for entry in optimizer.state.values() for v in entry.values() if isinstance(v, torch.Tensor)]
    storages: dict[int, int] = {}
    for t in tensors:
        storage = local_part(t).untyped_storage()
        storages.setdefault(storage.data_ptr(), storage.nbytes())
    return sum(storages.values()) + (averager.state_bytes if averager is not None else 0)


def run_config(args: argparse.Namespace, **more: Any) -> dict[str, Any]:
    """What a resumed run must share with the run that wrote the checkpoint (the number of processes may
    change: the checkpoint holds one replica, averaged before it was written)."""
    flags = (
        "batch_size",
        "lr",
        "seed",
        "period",
        "warmup_steps",
        "overlap_steps",
        "outer",
        "outer_lr",
        "outer_momentum",
        "comm_dtype",
        "fragments",
        "mixing",
        "error_feedback",
        "pace",
    )
    return {**{flag: getattr(args, flag) for flag in flags}, **more}


def checkpoints(
    fabric: Fabric, args: argparse.Namespace, state: dict[str, Any], averager: Averager | None, phases: StartPhases
) -> Checkpointer:
    """The run's :class:`Checkpointer` in ``--out``, and with ``--resume`` ``state`` loaded from it (see
    :func:`resume`)."""
    checkpointer = Checkpointer(fabric, args.out, rounds=args.checkpoint_rounds, averager=averager)
    if args.resume is not None:
        resume(fabric, args, state, checkpointer, phases)  # into the objects in `state`; plain values come back there
    return checkpointer


def resume(
    fabric: Fabric,
    args: argparse.Namespace,
    state: dict[str, Any],
    checkpointer: Checkpointer,
    phases: StartPhases | None = None,
) -> None:
    """Load ``--resume`` into ``state`` (every rank reads it); any problem is one line and exit code 2.

    ``--resume auto`` loads the newest checkpoint any rank finds in the run folder (one small allreduce, and a
    broadcast when the ranks' copies differ: a node that rejoins with an older one), or starts afresh when
    there is none. ``state["config"]`` holds what :func:`run_config` returned for this run; the
    checkpoint's must match it, and the checkpoint must not be beyond ``--steps``. The ``--resume auto`` line
    ends with ``phases``, completed with :func:`resume_latest`'s own.
    """
    validate = same_settings(state["config"], spell=_flag)  # the load replaces state["config"] with the checkpoint's
    path = args.out / checkpoint_name(args) if args.resume == AUTO else args.resume
    try:
        if args.resume != AUTO:
            extra = checkpointer.load(path, state, validate=validate)
        else:
            progress = functools.partial(transfer_progress, fabric, "--resume auto")
            resumed = checkpointer.resume(state, validate=validate, progress=progress)
            if resumed is None:
                fabric.print(f"--resume auto: no checkpoint in {args.out} yet; starting at step 0")
                return
            if isinstance(resumed, ResumedSharded):
                state.update(resumed.values)  # a sharded run's plain values come apart
                extra = {}
            else:
                extra = resumed.extra
            if fabric.local_rank == 0:  # each node (site) says where its start went
                print(resumed_line(fabric, checkpointer, resumed, phases), flush=True)
    except CheckpointError as error:
        fail(fabric, f"--resume {error}")
    if state["step"] > args.steps:
        fail(fabric, f"{path} is at step {state['step']}, beyond --steps {args.steps}")
    if state["step"] == args.steps:
        fabric.print(f"{path} is at step {args.steps} already: nothing to train; pass a larger --steps")
        raise SystemExit(0)
    written_by = extra.get("world_size")
    if written_by is not None and written_by != fabric.world_size:
        fabric.print(
            f"{path} was written by {written_by} processes and resumes into {fabric.world_size}: every"
            " process starts from the checkpoint's replica and optimizer state (rank 0's, averaged before saving)"
        )


def resumed_line(
    fabric: Fabric, checkpointer: Checkpointer, resumed: Resumed | ResumedSharded, phases: StartPhases | None
) -> str:
    """The ``--resume auto`` line: the step and where it came from; a sharded site its own folder or another's, a
    node the unix time (a benchmark tells from it how long a lost node kept the others from training), torchrun's
    restart, where its start went and what it received."""
    if isinstance(resumed, ResumedSharded):
        return f"--resume auto: step {resumed.step} from {resumed_from(resumed, checkpointer.replica)}"
    restart = f", torchrun restart {restart_count()}" if restart_count() else ""
    seconds = {**(phases.seconds if phases else {}), **resumed.seconds}
    return (
        f"--resume auto: step {resumed.step} from {checkpointer.own_path} into {fabric.world_size} processes"
        f" (unix time {time.time():.1f}{restart}); seconds: "
        + " ".join(f"{name}={value:.1f}" for name, value in seconds.items())
        + transfer_summary(resumed)
    )


def resumed_from(found: ResumedSharded, site: int) -> str:
    """Where site ``site``'s sharded resume came from: its own folder, another site's, or another site's state
    received over the link."""
    if found.source == site:
        sent = f"; sent {found.bytes / 1e6:.2f} MB to sites without one" if found.bytes else ""
        return f"{found.folder} (its own{sent})"
    if found.bytes:
        received = f"{found.bytes / 1e6:.2f} MB in {found.seconds:.1f} s"
        return f"site {found.source} over the link ({received}: it starts from the anchors)"
    return f"{found.folder} (another site's: it starts from the anchors)"


def transfer_progress(fabric: Fabric, what: str, done: int, total: int, seconds: float) -> None:
    """A long transfer's progress (``resume_latest``'s, a joining site's state), printed by each node's first
    process: ``<what>: 1.00 of 9.00 MB in 8.1 s``."""
    if fabric.local_rank == 0:
        print(f"{what}: {done / 1e6:.2f} of {total / 1e6:.2f} MB in {seconds:.1f} s", flush=True)


def transfer_summary(resumed: Resumed) -> str:
    """What a rank whose own copy was older received, and what it kept: ``; received 1.83 MB; kept ...``."""
    if resumed.own_step == resumed.step:
        return f"; sent {resumed.bytes / 1e6:.2f} MB" if resumed.bytes else ""
    text = f"; received {resumed.bytes / 1e6:.2f} MB"
    if resumed.kept:
        where = f"its own copy at step {resumed.own_step}" if resumed.own_step >= 0 else "no copy: as built"
        text += f"; kept {', '.join(resumed.kept)} ({where})"
    return text


def fail(fabric: Fabric, message: str) -> NoReturn:
    """Exit with code 2 and one line on rank 0 (every rank reached the same verdict on its own)."""
    line = f"{Path(sys.argv[0]).name}: error: {message}"
    record_error(line)
    if fabric.is_global_zero:
        print(line, file=sys.stderr, flush=True)
    raise SystemExit(2)


class StartPhases:
    """Where this process's start went, in seconds per phase, for the ``--resume auto`` line.

    ``start`` runs from the process's creation (Linux: ``/proc``; elsewhere it is left out) to this
    object: the interpreter, the imports, the arguments. Each :meth:`mark` ends the phase of its name.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.time()
        created = _process_created()
        if created is not None:
            self.seconds["start"] = self._last - created

    def mark(self, name: str) -> None:
        now = time.time()
        self.seconds[name], self._last = now - self._last, now

    def __str__(self) -> str:
        return " ".join(f"{name}={seconds:.1f}" for name, seconds in self.seconds.items())


def _process_created() -> float | None:
    """Unix time this process was created, from ``/proc`` (None where there is none)."""
    try:
        stat = Path("/proc/self/stat").read_text()
        boot = next(line for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime "))
    except (OSError, StopIteration):
        return None
    ticks = int(stat.rpartition(")")[2].split()[19])  # field 22, starttime, counted after the name
    return int(boot.split()[1]) + ticks / os.sysconf("SC_CLK_TCK")


class Progress:
    """Rank 0's progress: a tqdm bar on a terminal, a plain line every ``every`` steps in a log file.

    The bar counts steps; the rate in ``unit``/s (``scale`` units per step) is shown every ``every`` steps.
    """

    def __init__(self, total: int, start: int, every: int, enabled: bool, unit: str = "it") -> None:
        self.total, self.every, self.enabled, self.unit = total, every, enabled, unit
        self.mark = (time.perf_counter(), start)  # rates count from here: right after a resume too
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="it", dynamic_ncols=True, leave=True)

    def __call__(self, step: int, metrics: Callable[[], dict[str, float]], scale: float = 1.0) -> None:
        """Advance to ``step``; ``metrics()`` is only evaluated when something is shown; ``scale`` units per step."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
        if step % self.every and step != self.total:
            return
        now = time.perf_counter()
        rate = (step - self.mark[1]) * scale / max(now - self.mark[0], 1e-9)
        self.mark = (now, step)
        shown = {k: f"{v:.3f}" for k, v in metrics().items()}
        if self.bar is not None:
            # tqdm shows steps per second already; a unit of its own gets its own rate.
            self.bar.set_postfix({**shown, f"{self.unit}/s": f"{rate:,.0f}"} if self.unit != "it" else shown)
            return
        shown_text = " ".join(f"{k}={v}" for k, v in shown.items())
        print(f"step {step}/{self.total} {shown_text} {rate:,.0f} {self.unit}/s", flush=True)

    def set_total(self, total: int) -> None:
        """A new last step (a paced site's, known at the end of warm-up)."""
        self.total = total
        if self.bar is not None:
            self.bar.total = total
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def main(run: Callable[[], int | None]) -> None:
    """Run an example's ``run()`` and end the process cleanly: ``run`` returns, its models and the process
    group go away, and only then does the interpreter exit (see :func:`fabric_multimodel.launch.shutdown`)."""
    try:
        code = run()
    finally:
        shutdown()
    sys.stdout.flush()
    raise SystemExit(code or 0)


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-") if not key.startswith("model") else key
