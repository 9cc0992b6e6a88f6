"""Plan a run before it starts: ``python -m fabric_multimodel.plan``, from the cost model
(:mod:`fabric_multimodel.plan.cost_model`); no torch import, so it answers at once on any machine.

Two questions, and a third:

- ``--bandwidth RATE``: what share of the time does this setting compute at that link?
- ``--target 0.95``: what link does it need for that share?
- ``--recommend`` (with both): which period, payload and overlap reach the target at that link (the smallest
  period, then the most exact payload, then the shortest overlap; sparse rounds' densities when no dense payload
  does within ``--max-period``), with their figures.

Usage::

    python -m fabric_multimodel.plan --params 1e9 --step-s 0.1 --period 100 --fragments 8 --overlap-steps 1 \\
        --comm-dtype bf16 --bandwidth 10gbit --target 0.95
    python -m fabric_multimodel.plan --params 10B --step-s 0.8 --sync --target 0.95      # synchronous DDP
    python -m fabric_multimodel.plan --params 100B --step-s 4.9 --fragments 36 --bandwidth 1gbit --target 0.95 \\
        --recommend
    python -m fabric_multimodel.plan --params 218496 --step-s 0.015 --sites 4 --period 128 --density 1/64 \\
        --bandwidth 100kbit --target 0.9

The last line is for machines: ``plan: utilisation=... bandwidth_bits=... round_bytes=... round_s=...`` (the
setting's, or the recommended one's).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Sequence

from fabric_multimodel.plan.cost_model import (
    LIBRARY,
    Assumptions,
    Setting,
    bandwidth_for,
    paper,
    recommend,
    round_seconds,
    round_wait,
    utilisation,
    wire_bytes,
)
from fabric_multimodel.plan.payloads import PAYLOADS, fraction
from fabric_multimodel.plan.rates import RATE_FORMS, parse_rate

_SUFFIXES = {"k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


def parse_count(text: str) -> float:
    """``218496``, ``1e9``, ``1.5M``, ``10B``: a count of parameters.

    Example::

        assert parse_count("10B") == 1e10
    """
    value = text.strip().lower()
    scale = _SUFFIXES.get(value[-1:], 1.0)
    number = float(value[:-1] if value[-1:] in _SUFFIXES else value)
    if not number > 0 or math.isinf(number):
        raise ValueError(text)
    return number * scale


def format_bits(rate: float) -> str:
    """Bits per second for people: ``9.62 Gbit/s``, ``750 kbit/s``.

    Example::

        assert format_bits(1.25e9) == "1.25 Gbit/s"
    """
    if math.isinf(rate):
        return "never"
    for unit, scale in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if rate >= scale:
            return f"{rate / scale:.3g} {unit}"
    return f"{rate:.3g} bit/s"


def _density(text: str) -> float:
    try:
        return fraction(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _rate(text: str) -> float:
    rate = parse_rate(text)
    if rate is None:
        raise argparse.ArgumentTypeError(f"a link of some rate: {RATE_FORMS} (not none)")
    return float(rate)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m fabric_multimodel.plan",
        description="What a run's rounds cost at a link, before it starts (the cost model, no measurement).",
    )
    p.add_argument("--params", type=parse_count, required=True, help="parameters averaged: 218496, 1e9, 1.5M, 10B")
    p.add_argument("--step-s", type=float, required=True, help="seconds of one training step's compute")
    p.add_argument("--sites", type=int, default=2, help="sites averaging together (default 2)")
    p.add_argument("--devices", type=int, default=1, help="processes per site (islands: each sends 1/devices)")
    how = p.add_mutually_exclusive_group()
    how.add_argument("--period", type=int, help="steps between a fragment's rounds (default 100)")
    how.add_argument("--sync", action="store_true", help="synchronous DDP across the sites instead")
    p.add_argument("--fragments", type=int, default=1, help="streaming: fragments, one round each per period")
    p.add_argument("--overlap-steps", type=int, default=0, help="steps a round overlaps before it is merged")
    p.add_argument(
        "--comm-dtype",
        default="float32",
        choices=[*PAYLOADS, *(p.short for p in PAYLOADS.values())],
        help="what a round sends (the examples' names, or their short ones: fp32, bf16, fp8, fp4, ...)",
    )
    p.add_argument(
        "--density",
        type=_density,
        default=1.0,
        help="below 1: sparse rounds sending this share of the entries (1/64, 0.0156)",
    )
    p.add_argument("--bandwidth", type=_rate, help=f"the link of each site, each way: {RATE_FORMS}")
    p.add_argument("--target", type=float, help="the share of the time computing to reach, e.g. 0.95")
    p.add_argument("--recommend", action="store_true", help="the settings that reach --target at --bandwidth")
    p.add_argument("--max-period", type=int, default=100_000, help="with --recommend: the longest period to consider")
    p.add_argument("--latency-ms", type=float, default=0.0, help="milliseconds per phase of a round's collective")
    p.add_argument(
        "--assumptions",
        choices=["library", "paper"],
        default="library",
        help="library: this library's rounds (default); paper: the Streaming DiLoCo simulation's (arXiv 2501.18512)",
    )
    p.add_argument("--layers", type=int, default=24, help="with --assumptions paper: the model's layers (buckets)")
    return p


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[Setting, Assumptions]:
    if args.bandwidth is None and args.target is None:
        p.error("give --bandwidth RATE (the utilisation at it), --target SHARE (the link it needs), or both")
    if args.target is not None and not 0 < args.target < 1:
        p.error(f"--target must be a share in (0, 1), e.g. 0.95; got {args.target}")
    if args.recommend and (args.sync or args.bandwidth is None or args.target is None):
        p.error("--recommend needs --bandwidth and --target, and averages (no --sync)")
    if args.step_s <= 0 or args.latency_ms < 0 or args.layers < 1 or args.max_period < 1:
        p.error("--step-s must be positive, --latency-ms at least 0, --layers and --max-period at least 1")
    period = None if args.sync else (args.period or 100)
    try:
        setting = Setting(
            args.params, args.step_s, period, args.sites, args.devices, args.fragments, args.overlap_steps,
            args.comm_dtype, args.density,
        )  # fmt: skip
    except ValueError as error:
        p.error(str(error).replace("Setting: ", "").replace("`", "--").replace("_", "-"))
    base = paper(args.layers) if args.assumptions == "paper" else LIBRARY
    return setting, dataclasses.replace(base, latency_s=args.latency_ms / 1e3)


def describe(setting: Setting) -> str:
    """A setting in the examples' words."""
    if setting.period is None:
        return f"synchronous DDP, {setting.sites} sites x {setting.devices}"
    text = f"period {setting.period}"
    if setting.fragments > 1:
        text += f", {setting.fragments} fragments"
    if setting.overlap_steps:
        text += f", overlap {setting.overlap_steps}"
    payload = f"density {setting.density:.3g}" if setting.density < 1 else PAYLOADS[setting.comm_dtype].short
    return f"{text}, {payload}, {setting.sites} sites x {setting.devices}"


def _row(setting: Setting, rate: float | None, target: float | None, assumptions: Assumptions) -> list[str]:
    cells = [describe(setting), f"{wire_bytes(setting, assumptions):,.0f}"]
    if rate is not None:
        cells += [
            f"{round_seconds(setting, rate, assumptions):.4g}",
            f"{round_wait(setting, rate, assumptions):.4g}",
            f"{utilisation(setting, rate, assumptions):.2%}",
        ]
    if target is not None:
        cells.append(format_bits(bandwidth_for(setting, target, assumptions)))
    return cells


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    setting, assumptions = _check(p, args)
    rate, target = args.bandwidth, args.target
    rows = [_row(setting, rate, target, assumptions)]
    chosen = setting
    if args.recommend:
        found = recommend(setting, rate, target, assumptions, args.max_period)
        if found is None:
            print(f"plan: no period up to {args.max_period:,} steps reaches {target:.0%} at {format_bits(rate)}")
        else:
            chosen = found
            rows.append(_row(found, rate, target, assumptions))
    header = ["", "setting", "bytes a round puts on each link"]
    if rate is not None:
        header += [f"round s at {format_bits(rate)}", "wait s per round", "utilisation"]
    if target is not None:
        header.append(f"link for {target:.0%}")
    table = [header, ["---"] * len(header)] + [[label, *row] for label, row in zip(["given", "recommended"], rows)]
    print(f"# plan ({args.assumptions} assumptions; {setting.params:,.0f} parameters, a step of {setting.step_s} s)")
    for line in table:
        print("| " + " | ".join(line) + " |")
    fields = {"round_bytes": f"{wire_bytes(chosen, assumptions):.0f}"}
    if rate is not None:
        fields["utilisation"] = f"{utilisation(chosen, rate, assumptions):.4f}"
        fields["round_s"] = f"{round_seconds(chosen, rate, assumptions):.6g}"
    if target is not None:
        fields["bandwidth_bits"] = f"{bandwidth_for(chosen, target, assumptions):.6g}"
    if args.recommend:
        fields["period"] = str(chosen.period)
        fields["overlap_steps"] = str(chosen.overlap_steps)
        fields["comm_dtype"] = chosen.comm_dtype
        fields["density"] = f"{chosen.density:.6g}"
    order = ["utilisation", "bandwidth_bits", "round_bytes", "round_s", "period", "overlap_steps", "comm_dtype"]
    order.append("density")
    print("plan: " + " ".join(f"{key}={fields[key]}" for key in order if key in fields))
    return 0


if __name__ == "__main__":
    sys.exit(main())
