"""What the example scripts share beyond the library's parts: their flags and checks, run folders, the resume's
flags, the lines they print, and a clean exit. Each example stays a plain Fabric training loop."""

from __future__ import annotations

import argparse
import math
import sys
import time
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, NoReturn

from lightning.fabric import Fabric

from fabric_multimodel import Averager, Checkpointer, Loop, NodeGroups, node_groups
from fabric_multimodel.checkpoints.files import CheckpointError, same_settings
from fabric_multimodel.checkpoints.resume import restart_count
from fabric_multimodel.checkpoints.sharded import ResumedSharded
from fabric_multimodel.membership.epoch import RunEnded
from fabric_multimodel.membership.link import CoordinatorLost
from fabric_multimodel.membership.names import site_of
from fabric_multimodel.plan.payloads import PAYLOADS
from fabric_multimodel.run import cli
from fabric_multimodel.run.cli import (
    add_averager_arguments,
    add_launch_arguments,
    add_log_arguments,
    add_membership_arguments,
    check_averager_arguments,
    check_launch_arguments,
    check_membership_arguments,
    configure_logging,
    record_error,
)
from fabric_multimodel.run.launch import shutdown, world_shape
from fabric_multimodel.run.progress import Progress, StartPhases, transfer_printer
from fabric_multimodel.run.report import GradientBytes

AUTO = Path("auto")  # --resume auto


def add_averaging_arguments(p: argparse.ArgumentParser, *, warmup_steps: int) -> None:
    """The library's averaging flags (``fabric_multimodel.run.cli``), and the examples' layouts and membership."""
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
    add_membership_arguments(p)


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
    add_log_arguments(p)
    add_launch_arguments(p)


def check_arguments(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The checks every example makes; every rank runs them before any collective, so a bad flag stops all."""
    configure_logging(args.log_level)
    if args.layout == "auto":
        # Warm-up never crosses sites by default: synchronous DDP over a slow link cost more than the rest of a
        # run (20 warm-up steps: about 20 s at 10 Mbit/s, minutes at 1 Mbit/s).
        across_nodes = args.period and not args.node_period and world_shape(args.devices, args.num_nodes)[1] > 1
        args.layout = "islands" if across_nodes else "flat"
        args.layout_chosen = True
    if args.shard == "node":
        check_sharding(p, args)
    check_averager_arguments(p, args)
    check_launch_arguments(p, args)
    check_membership_arguments(p, args)
    minimums = {"steps": 1, "batch_size": 1, "checkpoint_every": 0, "log_every": 1, "node_period": 0}
    if args.period == "auto" and args.node_period:
        p.error("--period auto chooses the period across the world: it takes no --node-period")
    for flag, minimum in minimums.items():
        value = getattr(args, flag, None)
        if value is not None and value < minimum:
            p.error(f"--{flag.replace('_', '-')} must be >= {minimum}, got {value}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        p.error(f"--lr must be a positive number, got {args.lr}")
    if args.node_period and args.fragments > 1:
        p.error("--node-period (two-level averaging) cannot be combined with --fragments")
    if args.period == 0 and (args.layout != "flat" or args.node_period):
        p.error("--layout islands and --node-period need --period N (rounds across nodes)")
    if (args.layout != "flat" or args.node_period) and math.prod(world_shape(args.devices, args.num_nodes)) == 1:
        p.error("--layout islands and --node-period need several processes (--devices N), and this run has one")
    if args.node_period and (
        args.layout != "flat" or args.period % args.node_period or args.node_period == args.period
    ):
        p.error("--node-period needs --layout flat and a --period that is a larger multiple of it")
    if args.coordinator and (args.node_period or (args.layout != "flat" and args.shard != "node")):
        p.error(
            "--coordinator: each site's processes are a world of their own, with DDP (or --shard node: FSDP2) inside"
            " it and rounds across the sites; drop --layout and --node-period"
        )
    if args.resume is None and restart_count():
        args.resume = AUTO  # torchrun's agent restarted this node's workers: go on from the run folder
    sharded = args.shard == "node"  # its checkpoints are folders, one per site
    kind = "folder" if sharded else "file"
    if args.resume not in (None, AUTO) and not (args.resume.is_dir() if sharded else args.resume.is_file()):
        p.error(f"--resume {args.resume}: no such {kind}")
    anchored = args.outer != "none" or args.comm_dtype != "float32" or args.density != 1
    if args.checkpoint_rounds and (not args.period or args.node_period or (args.overlap_steps and not anchored)):
        p.error(
            "--checkpoint-rounds needs --period N, no --node-period, and with --overlap-steps anchored rounds"
            " (--outer nesterov, a --comm-dtype or a --density)"
        )
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
    if math.prod(world_shape(args.devices, args.num_nodes)) == 1:
        p.error("--shard node shards over a node's processes: start several (--devices N), this run has one")


def mode_name(args: argparse.Namespace) -> str:
    """A short name for the averaging settings, for run folders: ``sync``, ``period8-warmup500-nesterov``..."""
    if not args.period:
        return "sync"
    parts = [f"period{args.period}", f"warmup{args.warmup_steps}"]
    parts += [f"overlap{args.overlap_steps}"] if args.overlap_steps else []
    parts += [f"nesterov{args.outer_lr:g}-{args.outer_momentum:g}"] if args.outer != "none" else []
    parts += [PAYLOADS[args.comm_dtype].short] if args.comm_dtype != "float32" else []
    parts += ["ef"] if args.error_feedback else []
    parts += [f"density{args.density:.3g}"] if args.density != 1 else []
    parts += ["islands"] if args.layout == "islands" else []
    parts += ["sharded"] if args.shard == "node" else []
    parts += [f"node{args.node_period}"] if args.node_period else []
    parts += [f"fragments{args.fragments}"] if args.fragments > 1 else []
    parts += [f"mixing{args.mixing:g}" if args.mixing != "progress" else "progress"] if args.mixing is not None else []
    return "-".join(parts)


def run_folder(
    p: argparse.ArgumentParser, args: argparse.Namespace, example: str, *settings: str, checkpoint: str | None = None
) -> Path:
    """``--out``, else the folder of ``--resume``, else ``runs/<example>/<settings>-seed<seed>``. A folder that holds
    an earlier run's ``checkpoint`` (default: :func:`checkpoint_name`) is never written over: an error naming
    ``--resume`` (every rank reaches it before any collective)."""
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


def start_averager(
    fabric: Fabric, args: argparse.Namespace, modules: Any, placement: Layout, optimizers: Sequence[Any]
) -> Averager | None:
    """The run's Averager (None for synchronous DDP), its line printed; with ``--coordinator``, this site joins the
    run, and a site started after the run's last round ends here (exit 0: nothing to join)."""
    options = cli.averager_options(args, optimizers)
    if not options:
        return None
    transfer = transfer_printer("the run's state", fabric.local_rank == 0)
    membership = cli.membership(args, fabric.device, on_transfer=transfer)
    averager = Averager(fabric, modules, **options, **placement.averager, membership=membership)
    fabric.print(averaging_line(args, averager))
    return averager


def join_run(fabric: Fabric, averager: Averager | None, state: dict[str, Any]) -> None:
    """With ``--coordinator``, once this site resumed its own checkpoint: join the run (the sites agree on the newest
    state any of them holds; ``state["step"]`` becomes the run's); a site started after the run's last round ends
    here (exit 0: nothing to join)."""
    if averager is None or averager.membership is None:
        return
    try:
        averager.join()
    except RunEnded as error:
        fabric.print(f"run ended: {error}")
        raise SystemExit(0) from None
    state["step"] = max(state["step"], averager.steps)


class CoordinatorGuard:
    """The block a live site trains in: a :class:`CoordinatorLost` raised in it (a site was lost while the coordinator
    was away past its grace) ends the block, kept in ``error``, so that the site saves its checkpoint and says so."""

    def __init__(self) -> None:
        self.error: CoordinatorLost | None = None

    def __enter__(self) -> CoordinatorGuard:
        return self

    def __exit__(self, kind: Any, error: BaseException | None, traceback: Any) -> bool:
        if isinstance(error, CoordinatorLost):
            self.error = error
            return True
        return False


def data_rank(fabric: Fabric, args: argparse.Namespace) -> int:
    """What orders this process's training data: its global rank, or with ``--coordinator`` (every site a world
    of its own) its site's name and its rank in the site."""
    return zlib.crc32(args.site.encode()) + fabric.global_rank if args.coordinator else fabric.global_rank


def report_membership(fabric: Fabric, averager: Averager | None, seen: tuple[int, Any]) -> tuple[int, Any]:
    """Print ``membership: epoch=E sites=... left=... joined=... waited_s=... state_bytes=... time=...`` when this site
    entered an epoch after ``seen``'s, and the pace when agreed again; returns (epoch, pace) (``(0, None)`` first)."""
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
    """An averaging run's first line: what the Averager does and in which layout (and why, when not given)."""
    line = f"averaging: {averager.config} layout={'islands' if averager.islands else args.layout}"
    if averager.membership is not None and averager.islands:
        inside = "FSDP2" if averager.sharded else "DDP"
        line += f" (each site a world of its own: {inside} inside it, rounds across the sites that joined)"
    elif averager.sharded:
        line += " (FSDP2 inside each node, rounds of its shards across nodes)"
    elif getattr(args, "layout_chosen", False) and args.layout == "islands":
        nodes = world_shape(args.devices, args.num_nodes)[1]
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


def summary(
    args: argparse.Namespace, gradients: GradientBytes, averager: Averager | None, made: str, saves: str, *more: str
) -> str:
    """The last lines before ``final:``: the run folder and what it holds (``made``: the example's files), ``comm:
    ddp_bytes=... round_bytes=... node_round_bytes=...`` (this rank's, by kind: the benchmarks tell what crosses
    nodes), ``more`` (those not empty), and with ``--checkpoint-rounds`` their cost (``saves``: ``Loop.close``'s)."""
    checkpoint = "checkpoint/ (a folder per site)" if args.shard == "node" else "checkpoint.pt"
    rounds, node_rounds = (averager.traffic.bytes, averager.node_traffic.bytes) if averager is not None else (0, 0)
    comm = f"comm: ddp_bytes={gradients.bytes} round_bytes={rounds} node_round_bytes={node_rounds}"
    saves = saves if args.checkpoint_rounds else ""
    lines = [f"run folder: {args.out} ({checkpoint}, logs/, {made})", comm, *more, saves]
    return "\n".join(line for line in lines if line)


def stopped(fabric: Fabric, loop: Loop, guard: CoordinatorGuard | None = None) -> int:
    """After a stop (every rank at one step, its checkpoint written: SIGTERM, or a live site's coordinator out of
    reach past its grace; or, in ``guard``, a round failed meanwhile, whose checkpoint is written here): close the
    loop and say how to go on; the exit code (143, as a process ended by SIGTERM)."""
    if guard is not None and guard.error is not None:
        loop.save(reason=f"a lost coordinator ({guard.error})")
    loop.close()
    live = loop.averager is not None and loop.averager.membership is not None
    how = "the same command resumes it" if live else f"resume with --resume {loop.saved}"
    fabric.print(f"stopped by {loop.stop_reason} at step {loop.step}; {how}")
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


def run_config(args: argparse.Namespace, *settings: str, **more: Any) -> dict[str, Any]:
    """What a resumed run must share with the checkpoint's run: the common flags, the example's ``settings`` (flag
    names) and ``more`` values (not the number of processes: a checkpoint holds one replica, averaged)."""
    flags = "batch_size lr seed period warmup_steps overlap_steps outer outer_lr outer_momentum comm_dtype fragments"
    flags += " mixing error_feedback density error_decay pace"
    return {**{flag: getattr(args, flag) for flag in (*flags.split(), *settings)}, **more}


def checkpoints(
    fabric: Fabric, args: argparse.Namespace, state: dict[str, Any], averager: Averager | None, phases: StartPhases
) -> Checkpointer:
    """The run's :class:`Checkpointer` in ``--out``, and ``--resume`` loaded into ``state`` (every rank reads it;
    plain values come back there); any problem is one line and exit code 2. ``--resume auto``: the newest
    checkpoint any rank finds in the run folder, or a fresh start. ``state["config"]`` (:func:`run_config`'s) must
    match the checkpoint's, which must not be beyond ``--steps``; the ``--resume auto`` line ends with ``phases``.
    With ``--coordinator`` and no ``--resume``, a live site resumes its own newest checkpoint, as ``--resume auto``.
    """
    checkpointer = Checkpointer(fabric, args.out, rounds=args.checkpoint_rounds, averager=averager)
    resume = args.resume
    if resume is None and getattr(args, "coordinator", None):  # a live site's own file: the same command resumes it
        resume = AUTO
    if resume is None:
        return checkpointer
    validate = same_settings(state["config"], spell=_flag)  # the load replaces state["config"] with the checkpoint's
    if resume != AUTO:
        path = resume
    else:  # a live site's own file, else the run folder's
        path = checkpointer.own_path if args.resume is None else args.out / checkpoint_name(args)
    try:
        if resume != AUTO:
            extra = checkpointer.load(path, state, validate=validate)
        else:
            progress = transfer_printer("--resume auto", fabric.local_rank == 0)
            resumed = checkpointer.resume(state, validate=validate, progress=progress)
            if resumed is None:
                fabric.print(f"--resume auto: no checkpoint in {args.out} yet; starting at step 0")
                return checkpointer
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
    return checkpointer


def resumed_line(fabric: Fabric, checkpointer: Checkpointer, resumed: Any, phases: StartPhases | None) -> str:
    """The ``--resume auto`` line: the step and where it came from; a node the unix time (a benchmark tells from it
    how long a lost node kept the others from training), torchrun's restart, where its start went and what
    travelled."""
    if isinstance(resumed, ResumedSharded):
        return f"--resume auto: step {resumed.step} from {resumed.describe(checkpointer.replica)}"
    restart = f", torchrun restart {restart_count()}" if restart_count() else ""
    return (
        f"--resume auto: step {resumed.step} from {checkpointer.own_path} into {fabric.world_size} processes"
        f" (unix time {time.time():.1f}{restart}); {resumed.describe(phases.seconds if phases else None)}"
    )


def fail(fabric: Fabric, message: str) -> NoReturn:
    """Exit with code 2 and one line on rank 0 (every rank reached the same verdict on its own)."""
    line = f"{Path(sys.argv[0]).name}: error: {message}"
    record_error(line)
    if fabric.is_global_zero:
        print(line, file=sys.stderr, flush=True)
    raise SystemExit(2)


def main(run: Callable[[], int | None]) -> None:
    """Run an example's ``run()`` and end the process cleanly: ``run`` returns, its models and the process
    group go away, and only then does the interpreter exit (see :func:`fabric_multimodel.run.launch.shutdown`)."""
    try:
        code = run()
    finally:
        shutdown()
    sys.stdout.flush()
    raise SystemExit(code or 0)


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-") if not key.startswith("model") else key
