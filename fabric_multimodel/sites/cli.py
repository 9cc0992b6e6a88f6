"""The sites tool's command line: ``python -m fabric_multimodel.sites --sites S --devices D --bandwidth RATE
[options] -- SCRIPT [ARGS ...]``; its exit code is the worst site's (2: a bad setting, 124: timed out, 130:
Ctrl-C, 143: SIGTERM)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from fabric_multimodel.plan.rates import RATE_FORMS, parse_rate
from fabric_multimodel.sites.network import SitesError
from fabric_multimodel.sites.run import Churn, Drop, Join, SitesResult, Terminated, run_sites


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"sites: error: {message}\n")  # one line, as the tool's other errors: no usage block


def _rate_argument(text: str) -> int | None:
    try:
        return parse_rate(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parse_arguments(argv: Sequence[str]) -> argparse.Namespace:
    """The tool's options (before ``--``), and ``script`` and ``args`` (after it)."""
    p = _parser()
    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:split])
    if not argv[split + 1 :]:
        p.error("give the script after --, as in: --sites 2 --devices 1 --bandwidth 10mbit -- train.py ARGS")
    args.script, args.args = argv[split + 1], argv[split + 2 :]
    if (args.at is not None or args.back is not None or args.seen is not None) and args.drop_site is None:
        p.error("--at, --back and --seen need --drop-site")
    if args.drop_site is not None and args.at is None:
        p.error("--drop-site needs --at SECONDS")
    if (args.join_site is None) != (args.join_at is None):
        p.error("--join-site and --join-at go together: --join-site SITE --join-at SECONDS")
    return args


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="python -m fabric_multimodel.sites",
        usage="%(prog)s --sites S --devices D --bandwidth RATE [options] -- SCRIPT [ARGS ...]",
        description="Run a Fabric script as S simulated sites (network namespaces) joined by links of a given rate."
        " {site} in ARGS becomes each site's index (--out runs/x/site{site}: a folder per site).",
    )
    p.add_argument("--sites", type=int, required=True, help="sites (nodes), each in its own network namespace")
    p.add_argument("--devices", type=int, required=True, help="processes per site")
    p.add_argument("--bandwidth", type=_rate_argument, required=True, help=f"each link, each way: {RATE_FORMS}")
    p.add_argument("--out", type=Path, help="a new folder for the sites' logs (default: runs/sites/<run id>)")
    p.add_argument(
        "--launcher",
        choices=["fabric", "torchrun", "live"],
        default="fabric",
        help="`fabric run` (default) or torchrun, the sites one world; live: every site a `fabric run` world of its"
        " own, joined through a coordinator in a namespace of its own (the script gets --coordinator and --site)",
    )
    p.add_argument("--max-restarts", type=int, default=3, help="torchrun's worker group restarts (default 3)")
    p.add_argument(
        "--drop-site", type=int, help="kill this site (1..S-1; live: any) --at seconds after the scripts started"
    )
    p.add_argument("--at", type=float, help="when to drop the site, in seconds")
    p.add_argument("--back", type=float, help="when to start the dropped site again, in seconds")
    p.add_argument(
        "--seen",
        metavar="TEXT",
        help="with --drop-site: drop it only once its output holds TEXT too (then --back counts from the drop)",
    )
    p.add_argument("--join-site", type=int, help="start this site (1..S-1) --join-at seconds after the others")
    p.add_argument("--join-at", type=float, help="when the late site starts, in seconds (torchrun)")
    p.add_argument(
        "--cpu",
        type=_cpu_share,
        action="append",
        default=[],
        metavar="SITE:SHARE",
        help="run SITE's processes with SHARE (0.01..1) of one core each, a slower site (repeatable)",
    )
    p.add_argument(
        "--churn",
        type=_churn,
        metavar="EVERY:DOWN",
        help="every EVERY seconds kill the next site (round robin: live from site 0, torchrun from site 1), back"
        " DOWN seconds later",
    )
    p.add_argument("--port", type=int, default=29500, help="site 0's main or rendezvous port (default 29500)")
    p.add_argument("--timeout", type=float, help="stop everything after this many seconds (exit code 124)")
    return p


def _churn(text: str) -> Churn:
    every, colon, down = text.partition(":")
    try:
        if not colon:
            raise ValueError
        return Churn(float(every), float(down))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not EVERY:DOWN in seconds, as in 60:20") from None


def _cpu_share(text: str) -> tuple[int, float]:
    site, colon, share = text.partition(":")
    try:
        if not colon:
            raise ValueError
        return int(site), float(share)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not SITE:SHARE, as in 1:0.5") from None


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: run the sites, return the worst site's exit code (2: a bad setting, 124: timed out,
    130: Ctrl-C, 143: SIGTERM)."""
    args = parse_arguments(sys.argv[1:] if argv is None else argv)
    drop = Drop(args.drop_site, args.at, args.back, args.seen) if args.drop_site is not None else None
    join = Join(args.join_site, args.join_at) if args.join_site is not None else None
    try:
        result = run_sites(
            args.script,
            args.args,
            sites=args.sites,
            devices=args.devices,
            bandwidth=args.bandwidth,
            out=args.out,
            launcher=args.launcher,
            drop=drop,
            join=join,
            churn=args.churn,
            cpu=dict(args.cpu),
            timeout=args.timeout,
            port=args.port,
            max_restarts=args.max_restarts,
        )
    except SitesError as error:
        print(f"sites: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("sites: interrupted; every site stopped and the network removed", file=sys.stderr)
        return 130
    except Terminated:
        print("sites: terminated; every site stopped and the network removed", file=sys.stderr)
        return 143
    codes = ", ".join(f"{r}: {_describe(code, r, result)}" for r, code in enumerate(result.codes))
    print(f"sites: exit {result.code} after {result.wall_s:.1f} s (sites {codes}); logs in {result.out}", flush=True)
    return result.code


def _describe(code: int, site: int, result: SitesResult) -> str:
    if site in result.stopped:
        return f"{code} (stopped)"
    if result.drop is not None and site == result.drop.site and result.back_at is None:
        return f"{code} (dropped)"
    return str(code)
