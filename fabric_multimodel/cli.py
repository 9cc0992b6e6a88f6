"""The Averager's options as command-line flags, in the spellings the examples, the sites tool and the planner share:
:func:`add_averager_arguments` adds them to a parser, :func:`check_averager_arguments` checks their combinations
with the flags' names (on every rank, before any collective), :func:`averager_options` turns them into the
Averager's keywords.

Example::

    parser = argparse.ArgumentParser()
    add_averager_arguments(parser, warmup_steps=100)
    args = parser.parse_args()
    check_averager_arguments(parser, args)
    options = averager_options(args, [optimizer])  # {} with --period 0: synchronous DDP
    averager = Averager(fabric, model, **options) if options else None
"""

from __future__ import annotations

import argparse
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

#: The payloads ``--comm-dtype`` takes (torch's names); the float8 and float4 ones are block-quantized.
COMM_DTYPES = ("float32", "bfloat16", "float8_e4m3fn", "float8_e5m2", "float4_e2m1fn_x2")
LOW_BIT = COMM_DTYPES[2:]


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
    ``--error-feedback``, ``--fragments``, ``--mixing``, ``--pace``; returns the group, for flags of your own.

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


def check_averager_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``parser.error`` (exit 2, one line naming the flags) on a value or a combination the Averager cannot take;
    sets ``--mixing`` to its default where it depends on the others (0.5 for overlapped streaming rounds)."""
    auto = args.period == "auto"
    for flag, minimum in (("period", 0), ("warmup_steps", 0), ("overlap_steps", 0), ("fragments", 1)):
        value = getattr(args, flag)
        if value != "auto" and value < minimum:
            parser.error(f"--{flag.replace('_', '-')} must be >= {minimum}, got {value}")
    if auto and args.warmup_steps < 2:
        parser.error("--period auto times the warm-up's steps: it needs --warmup-steps 2 or more")
    if args.overlap_steps == "auto" and not auto:
        parser.error(
            "--overlap-steps auto is chosen with the period: it needs --period auto (or give a number of steps)"
        )
    if not (math.isfinite(args.outer_lr) and args.outer_lr > 0):
        parser.error(f"--outer-lr must be a positive number, got {args.outer_lr}")
    if not 0 <= args.outer_momentum < 1:
        parser.error(f"--outer-momentum must be in [0, 1), got {args.outer_momentum}")
    if args.period == 0 and (
        args.overlap_steps or args.outer != "none" or args.comm_dtype != "float32" or args.fragments > 1
    ):
        parser.error("--overlap-steps, --outer, --comm-dtype and --fragments need --period N (averaging rounds)")
    paced_round = args.fragments == 1 and not args.overlap_steps and args.comm_dtype in ("float32", "bfloat16")
    if args.pace == "speed" and (not args.period or auto or args.warmup_steps < 2 or not paced_round):
        parser.error(
            "--pace speed needs --period N (a number), --warmup-steps 2 or more, and no --fragments, --overlap-steps"
            " or low-bit --comm-dtype yet"
        )
    if not auto and args.overlap_steps and args.overlap_steps >= args.period:
        parser.error(f"--overlap-steps must be smaller than --period, got {args.overlap_steps} >= {args.period}")
    if (
        not auto
        and args.fragments > 1
        and (args.period % args.fragments or args.overlap_steps >= args.period // args.fragments)
    ):
        parser.error("--fragments F needs a --period that F divides and --overlap-steps smaller than --period / F")
    if args.error_feedback and args.comm_dtype not in LOW_BIT:
        parser.error("--error-feedback needs a float8 or float4 --comm-dtype")
    if args.mixing is not None and not (args.overlap_steps and (args.mixing == "progress" or 0 <= args.mixing <= 1)):
        parser.error(f"--mixing must be in [0, 1] or 'progress' and needs --overlap-steps, got {args.mixing}")
    if args.mixing is None and args.fragments > 1 and args.overlap_steps:
        # Streaming rounds merge best by mixing half the local replica back in: 2.2-2.3% lower validation loss
        # than global + local progress on the LM, on both of two seeds (benchmarks/README.md).
        args.mixing = 0.5


def averager_options(args: argparse.Namespace, optimizers: Sequence[Any] = ()) -> dict[str, Any]:
    """The Averager's keyword arguments for the flags (empty with ``--period 0``: synchronous DDP).

    Plain blocking averaging also averages the ``optimizers``' state (Adam's moments), so a checkpoint written
    by rank 0 loses nothing; DiLoCo keeps it local, as DiLoCo does (its rounds send the parameters only), and
    overlapped and streaming rounds cannot carry it.

    Example::

        averager = Averager(fabric, model, **averager_options(args, [optimizer]))
    """
    import torch

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
    if args.fragments > 1:
        options["fragments"] = args.fragments
    if args.pace != "steps":
        options["pace"] = args.pace
    if args.mixing not in (None, "progress"):
        options["mixing"] = args.mixing
    if args.outer == "none" and not args.overlap_steps and args.fragments == 1:
        options["optimizers"] = list(optimizers)
    return options
