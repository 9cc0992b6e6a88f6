"""Command-line flags for a training script, in the spellings the examples, the sites tool and the planner share.

- The Averager's options: :func:`add_averager_arguments` adds them, :func:`check_averager_arguments` checks their
  combinations with the flags' names, :func:`averager_options` turns them into the Averager's keywords.
- Where the processes come from: :func:`add_launch_arguments` (``--devices``, ``--num-nodes``, ``--accelerator``,
  ``--timeout``), :func:`check_launch_arguments` (which refuses the flags a launcher such as ``fabric run`` owns),
  :func:`start_fabric`.
- Live membership: :func:`add_membership_arguments` (``--coordinator``, ``--site``, ``--min-sites``),
  :func:`check_membership_arguments`, :func:`membership`.
- What the library's loggers show: :func:`add_log_arguments` (``--log-level``) and :func:`configure_logging`, the
  script's own choice (the library configures no handler by itself).
- :class:`Parser`: argparse whose errors are one line, also in torch elastic's failure report.

Every check runs on every rank before any collective, so a bad flag stops every process with one line.

Example::

    parser = Parser("train.py", "my training script")
    add_averager_arguments(parser, warmup_steps=100)
    add_launch_arguments(parser)
    args = parser.parse_args()
    check_averager_arguments(parser, args)
    check_launch_arguments(parser, args)
    fabric = start_fabric(Fabric, args)
    options = averager_options(args, [optimizer])  # {} with --period 0: synchronous DDP
    averager = Averager(fabric, model, **options) if options else None
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import os
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from fabric_multimodel.membership.names import check_site_name
from fabric_multimodel.plan.payloads import PAYLOADS, fraction
from fabric_multimodel.run import launch

if TYPE_CHECKING:
    from lightning.fabric import Fabric

    from fabric_multimodel.membership.membership import Membership

#: The payloads ``--comm-dtype`` takes (torch's names); the float8 and float4 ones are block-quantized.
COMM_DTYPES = tuple(PAYLOADS)


def _word_or(word: str, number: Callable[[str], Any], what: str) -> Callable[[str], Any]:
    """An argparse type: ``word`` itself, or a number read by ``number``; else one line naming both."""

    def parse(text: str) -> Any:
        if text == word:
            return text
        try:
            return number(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} or {word!r}, got {text!r}") from None

    return parse


def add_averager_arguments(parser: argparse.ArgumentParser, *, warmup_steps: int = 0) -> argparse._ArgumentGroup:
    """Add the group ``averaging (local SGD and DiLoCo)``: ``--period`` (0, the default: synchronous DDP),
    ``--warmup-steps``, ``--overlap-steps``, ``--outer``, ``--outer-lr``, ``--outer-momentum``, ``--comm-dtype``,
    ``--error-feedback``, ``--density``, ``--error-decay``, ``--robust``, ``--trim``, ``--fragments``, ``--mixing``,
    ``--pace``; returns the group, for flags of your own.

    Example::

        group = add_averager_arguments(parser, warmup_steps=500)
        group.add_argument("--layout", choices=["flat", "islands"], default="flat")
    """
    g = parser.add_argument_group("averaging (local SGD and DiLoCo)")
    steps_or_auto = _word_or("auto", int, "a whole number of steps")
    g.add_argument(
        "--period",
        type=steps_or_auto,
        default=0,
        help="0: synchronous DDP; N: average every N steps after warm-up; auto: the smallest period whose rounds hide"
        " behind compute, chosen at the end of warm-up from the measured step and link",
    )
    g.add_argument("--warmup-steps", type=int, default=warmup_steps, help="synchronous steps before local steps")
    g.add_argument(
        "--overlap-steps",
        type=steps_or_auto,
        default=0,
        help="merge each round this many steps after its launch; auto (with --period auto): the steps a round needs,"
        " measured at the end of warm-up, then the smallest period they allow",
    )
    g.add_argument("--outer", choices=["none", "nesterov"], default="none", help="nesterov: DiLoCo's outer step")
    g.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo outer learning rate")
    g.add_argument("--outer-momentum", type=float, default=0.9, help="DiLoCo outer Nesterov momentum")
    g.add_argument(
        "--comm-dtype", choices=COMM_DTYPES, default="float32", help="what a round sends; the float8/float4 ones"
        " block-quantized"
    )  # fmt: skip
    g.add_argument(
        "--error-feedback", action="store_true", help="low-bit rounds: add back what each rank's quantization dropped"
    )
    g.add_argument(
        "--density",
        type=fraction,
        default=1.0,
        help="below 1: sparse rounds (SparseLoCo): each rank sends this share of each chunk's entries, the largest,"
        " plus what it did not send before (e.g. 1/64)",
    )
    g.add_argument(
        "--error-decay", type=float, default=0.95, help="sparse rounds: the decay of what each rank did not send yet"
    )
    _add_robust_arguments(g)
    g.add_argument(
        "--pace",
        choices=["steps", "speed"],
        default="steps",
        help="speed: the fastest site runs --period local steps per round, a slower one fewer, in proportion to its"
        " speed measured in warm-up; --steps counts the fastest site's steps, and rounds weight sites by theirs",
    )
    g.add_argument(
        "--fragments", type=int, default=1, help="streaming: each round sends one of F fragments, every period/F steps"
    )
    g.add_argument(
        "--mixing",
        type=_word_or("progress", float, "a number in [0, 1]"),
        help="overlapped merges: (1 - a) * global + a * local, or 'progress': global + local progress (default:"
        " 0.5 with --fragments, measured best on two seeds; progress without)",
    )
    return g


def _add_robust_arguments(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--robust",
        choices=["none", "clip", "trimmed_mean"],
        default="none",
        help="rounds no single site steers alone: every site receives every pseudo-gradient and applies the rule"
        " (clip: centered clipping; trimmed_mean: per coordinate, --trim of the values dropped from each side)",
    )
    g.add_argument("--trim", type=float, default=0.25, help="--robust trimmed_mean: the share dropped from each side")


def check_averager_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``parser.error`` (exit 2, one line naming the flags) on a value or a combination the Averager cannot take;
    sets ``--mixing`` to its default where it depends on the others (0.5 for overlapped streaming rounds).

    The flags' own rules are here (the outer optimizer's numbers, round options without ``--period N``); every rule of
    the Averager's options is :class:`~fabric_multimodel.AveragerConfig`'s, asked here and said in the flags' words.
    """
    for flag, minimum in (("period", 0), ("warmup_steps", 0), ("overlap_steps", 0), ("fragments", 1)):
        value = getattr(args, flag)
        if value != "auto" and value < minimum:
            parser.error(f"--{flag.replace('_', '-')} must be >= {minimum}, got {value}")
    if not (math.isfinite(args.outer_lr) and args.outer_lr > 0):
        parser.error(f"--outer-lr must be a positive number, got {args.outer_lr}")
    if not 0 <= args.outer_momentum < 1:
        parser.error(f"--outer-momentum must be in [0, 1), got {args.outer_momentum}")
    if args.period == 0 and args.pace == "speed":
        parser.error("--pace speed needs --period N (a number): it paces averaging rounds")
    if (
        args.period == 0
        and (args.overlap_steps or args.outer != "none" or args.comm_dtype != "float32" or args.fragments > 1)
        or (args.period == 0 and (args.density != 1 or args.robust != "none"))
    ):
        parser.error(
            "--overlap-steps, --outer, --comm-dtype, --density, --robust and --fragments need --period N (averaging"
            " rounds)"
        )
    if args.mixing == "progress" and not args.overlap_steps:
        parser.error("--mixing progress sets how overlapped rounds merge: it needs --overlap-steps")
    if args.mixing is None and args.fragments > 1 and args.overlap_steps:
        # Streaming rounds merge best by mixing half the local replica back in: 2.2-2.3% lower validation loss
        # than global + local progress on the LM, on both of two seeds (benchmarks/README.md).
        args.mixing = 0.5
    if args.period:
        options = averager_options(args)
        options.pop("optimizers", None)  # the Averager's argument, not a config field
        _ask_config(parser, options)


def _ask_config(parser: argparse.ArgumentParser, options: dict[str, Any]) -> None:
    """The Averager's own checks of ``options`` (its config's, and an int ``fragments``' fit with the period),
    their message with each option named as its flag."""
    from fabric_multimodel.averaging.arguments import check_fragments
    from fabric_multimodel.averaging.config import AveragerConfig

    try:
        config = AveragerConfig.build(None, options, "Averager")
        if isinstance(config.period, int) and isinstance(config.fragments, int) and config.fragments > 1:
            check_fragments(config.fragments, config.period, config.first_overlap, ())
    except (TypeError, ValueError) as error:
        parser.error(in_flag_words(str(error).removeprefix("Averager: ")))


def in_flag_words(message: str) -> str:
    """An Averager's message with each option named as the flag that sets it: ```overlap_steps``` becomes
    ``--overlap-steps``, ```pace='speed'``` becomes ``--pace speed``.

    Example::

        in_flag_words("`period='auto'` needs `warmup_steps` >= 2")  # "--period auto needs --warmup-steps >= 2"
    """

    def flag(match: re.Match[str]) -> str:
        name, value = match["name"], match["value"]
        return f"--{name.replace('_', '-')}" + (f" {value.strip(chr(39))}" if value is not None else "")

    return re.sub(r"`(?P<name>[a-z_]+)(?:=(?P<value>[^`]+))?`", flag, message)


def averager_options(args: argparse.Namespace, optimizers: Sequence[Any] = ()) -> dict[str, Any]:
    """The Averager's keyword arguments for the flags (empty with ``--period 0``: synchronous DDP).

    Plain blocking averaging also averages the ``optimizers``' state (Adam's moments), so a checkpoint written
    by rank 0 loses nothing; DiLoCo keeps it local, as DiLoCo does (its rounds send the parameters only), and
    overlapped, streaming and sparse rounds cannot carry it.

    Example::

        averager = Averager(fabric, model, **averager_options(args, [optimizer]))
    """
    import torch

    from fabric_multimodel.averaging.config import AveragerConfig

    if not args.period:
        return {}
    options: dict[str, Any] = {
        "period": args.period,
        "warmup_steps": args.warmup_steps,
        "overlap_steps": args.overlap_steps,
    }
    if args.outer == "nesterov":
        options["outer_optimizer"] = functools.partial(
            torch.optim.SGD, lr=args.outer_lr, momentum=args.outer_momentum, nesterov=True, foreach=True
        )
    if args.comm_dtype != "float32":
        options["comm_dtype"] = getattr(torch, args.comm_dtype)
    if args.error_feedback:
        options["error_feedback"] = True
    if args.density != 1:
        options["density"] = args.density
    if args.error_decay != AveragerConfig.error_decay:
        options["error_decay"] = args.error_decay
    if args.robust != "none":
        options["robust"] = args.robust
    if args.trim != AveragerConfig.trim:
        options["trim"] = args.trim
    if args.fragments > 1:
        options["fragments"] = args.fragments
    if args.pace != "steps":
        options["pace"] = args.pace
    if args.mixing not in (None, "progress"):
        options["mixing"] = args.mixing
    plain = args.density == 1 and args.robust == "none"  # a plain mean: the optimizers' state is averaged too
    if args.outer == "none" and not args.overlap_steps and args.fragments == 1 and plain:
        options["optimizers"] = list(optimizers)
    return options


#: What ``--log-level`` takes.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def add_log_arguments(parser: argparse.ArgumentParser, *, default: str = "INFO") -> None:
    """Add ``--log-level``: what the library's loggers (``fabric_multimodel.*``) show; INFO follows a run (epochs,
    joins and losses, the local phase, resumes, progress lines), DEBUG adds every round (bytes, seconds)."""
    parser.add_argument(
        "--log-level", choices=LOG_LEVELS, default=default, help="what the library's loggers show (DEBUG: each round)"
    )


def configure_logging(level: str) -> None:
    """Show the ``fabric_multimodel`` loggers' records at ``level`` and above as plain lines on stdout, where a
    script's own lines go: a script's choice, made once at its start.

    Example::

        args = parser.parse_args()
        configure_logging(args.log_level)
    """
    logger = logging.getLogger("fabric_multimodel")
    ours = [h for h in logger.handlers if isinstance(h, logging.StreamHandler) and hasattr(h, "fabric_multimodel")]
    if ours:  # one handler however often it is called, writing where stdout is now
        ours[0].setStream(sys.stdout)
    else:
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.fabric_multimodel = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    logger.setLevel(level)


def add_launch_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Add the group ``processes``: ``--devices``, ``--num-nodes`` and ``--accelerator`` (for a script started with
    plain ``python``, which starts its own processes) and ``--timeout`` (seconds a collective may wait for a peer)."""
    g = parser.add_argument_group("processes")
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
    return g


def check_launch_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``parser.error`` on a count below 1, a timeout that is not a positive number, or a flag that the launcher
    which started this process owns (``--devices 2`` under ``fabric run``: give it to ``fabric run``)."""
    for flag in ("devices", "num_nodes"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        parser.error(f"--timeout must be a positive number, got {args.timeout}")
    launcher = launch.launched_by()
    if launcher is not None:
        devices, nodes, accelerator = launch.LAUNCHER_FLAGS[launcher]
        given: list[tuple[str, str | None, bool]] = [
            ("--devices", devices, args.devices is not None),
            ("--num-nodes", nodes, args.num_nodes != 1),
            ("--accelerator", accelerator, accelerator is not None and args.accelerator != "auto"),
        ]
        for flag, theirs, set_here in given:
            if set_here:
                parser.error(f"{flag}: {launcher} started the processes; give {theirs} to {launcher} instead")


def start_fabric(fabric_class: type[Fabric], args: argparse.Namespace, **kwargs: Any) -> Fabric:
    """A launched Fabric in the world this process was started into, or the one ``--devices`` and ``--num-nodes``
    ask for (see ``fabric_multimodel.run.launch.start_fabric``); a collective that waits longer than ``--timeout``
    for a peer fails.

    Example::

        fabric = start_fabric(Fabric, args, precision="bf16-mixed")
    """
    options = dict(devices=args.devices, num_nodes=args.num_nodes, accelerator=args.accelerator)
    return launch.start_fabric(fabric_class, timeout=args.timeout, **options, **kwargs)


def add_membership_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Add the group ``live membership``: ``--coordinator`` (this process's world is a site of its own that joins
    the run there), ``--site`` (its name, default ``$SITE``), ``--min-sites`` (sites the run starts with) and
    ``--grace`` (how long the coordinator may be out of reach)."""
    g = parser.add_argument_group("live membership")
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
    g.add_argument(
        "--grace",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="with --coordinator: how long the coordinator may be out of reach (training goes on meanwhile); past it"
        " every site saves a checkpoint and stops, and the same command resumes it",
    )
    return g


def check_membership_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``parser.error`` on ``--coordinator`` without a ``--period`` (the sites average in rounds) or a ``--site``
    name, or ``--min-sites`` below 1."""
    if args.min_sites < 1:
        parser.error(f"--min-sites must be >= 1, got {args.min_sites}")
    if not args.grace > 0:
        parser.error(f"--grace must be a positive number of seconds, got {args.grace}")
    if args.coordinator and not args.period:
        parser.error("--coordinator needs --period (N or auto): the sites average in rounds")
    if args.coordinator:
        try:
            check_site_name(args.site)
        except ValueError as error:
            parser.error(f"--coordinator needs --site NAME: {error}")


def membership(
    args: argparse.Namespace, device: Any, on_transfer: Callable[[int, int, float], None] | None = None
) -> Membership | None:
    """The Averager's ``membership`` for ``--coordinator`` (None without it): this site's, its collectives failing
    after ``--timeout``; ``on_transfer`` hears a joining site's progress in receiving the run's state. A run's secret
    comes from ``FABRIC_MULTIMODEL_SECRET`` (never a flag: a command line is visible to every user of the host); a
    wrong one ends the process in one line (``SystemExit``).

    Example::

        averager = Averager(fabric, model, **averager_options(args), membership=membership(args, fabric.device))
    """
    if not args.coordinator:
        return None
    from fabric_multimodel.membership.membership import Membership
    from fabric_multimodel.membership.signed import WrongSecret

    timeout = getattr(args, "timeout", 300.0)
    try:
        return Membership(
            args.coordinator,
            args.site,
            device=device,
            min_sites=args.min_sites,
            timeout=timeout,
            on_transfer=on_transfer,
            grace_s=getattr(args, "grace", 300.0),
        )
    except WrongSecret as error:  # one line, before this site wrote anything into the run
        raise SystemExit(f"site {args.site}: {error}") from None


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line (several processes would interleave a usage block), also written where
    torch elastic (``fabric run``, torchrun) reads a worker's failure, so that its report names the cause; and
    --help shows the defaults.

    Example::

        parser = Parser("train.py", "train a model")
    """

    def __init__(self, prog: str, description: str) -> None:
        super().__init__(prog=prog, description=description, formatter_class=_DefaultsHelp)

    def error(self, message: str) -> NoReturn:
        """Exit with code 2 and ``PROG: error: MESSAGE`` on stderr, one line, also recorded for torch elastic."""
        record_error(f"{self.prog}: error: {message}")
        self.exit(2, f"{self.prog}: error: {message}\n")


class _DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or "(default" in (action.help or ""):
            return action.help  # a missing value says nothing; a help text may spell its default out
        return super()._get_help_string(action)


def record_error(message: str) -> None:
    """Tell torch elastic (under ``fabric run`` and torchrun) the one-line reason a worker fails, so that the
    failure report it prints last shows it as the root cause instead of a pointer to its documentation."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        Path(path).write_text(json.dumps({"message": message, "timestamp": str(int(time.time()))}))
