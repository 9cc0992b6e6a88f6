"""Sites of different speeds: the LM example across 2 simulated sites, site 1 at half a core, with and without pacing.

Runs of ``examples/lm_fabric.py`` (DiLoCo, ``--period``, one process per site, the islands layout) as 2 sites
(``fabric_multimodel.sites``, ``--cpu 1:0.5``): both sites at full speed; site 1 at half speed without pacing
(every round waits for it); the same with ``--pace speed`` (site 1 runs fewer local steps per round, in
proportion to its speed, and counts for them); and site 1 at half speed without pacing for as many steps as fit in
the paced run's wall-clock, for the validation loss at equal wall-clock. Reported per run: the example's
wall-clock (its training loop) and its ratio to the full-speed run, each site's steps, the rounds, the fast
site's utilisation (its steps at the full-speed run's median step time, over the wall-clock) and the final
validation loss.

Usage::

    python benchmarks/pacing.py [--quick] [--out DIR] [--steps 2000] [--period 32] [--bandwidth none]
"""

from __future__ import annotations

import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from fabric_multimodel.averaging.pacing import paced_steps  # noqa: E402
from fabric_multimodel.run.report import parse_final_line  # noqa: E402
from fabric_multimodel.sites import run_sites  # noqa: E402

NAME = "pacing"
PACE = re.compile(r"^pace speed: local steps per round by site: (\d+) steps .*?, (\d+) steps ", re.MULTILINE)
SLOW_SHARE = 0.5


def run(args: Any, label: str, steps: int, *, slow: bool, pace: bool) -> dict[str, Any]:
    folder = args.out / f"{NAME}_runs" / label
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    script = [
        "--steps", str(steps), "--period", str(args.period), "--warmup-steps", str(args.warmup_steps),
        "--outer", "nesterov", "--out", str(folder / "run"), *(["--pace", "speed"] if pace else []),
        *args.example_args,
    ]  # fmt: skip
    result = run_sites(
        common.REPO / "examples" / "lm_fabric.py",
        script,
        sites=2,
        devices=1,
        bandwidth=args.bandwidth,
        out=folder / "sites",
        cpu={1: SLOW_SHARE} if slow else None,
        stream=False,
        timeout=args.run_timeout,
    )
    out = result.logs[0][0].read_text()
    row: dict[str, Any] = {"run": label, "code": result.code, "sites_wall_s": result.wall_s}
    if result.code != 0:
        return row
    row.update({k: float(v) for k, v in parse_final_line(out, common.LM_KEYS).items()})
    row["slow_steps"] = row["steps"]
    if pace and (found := PACE.search(out)):
        fast_period, slow_period = int(found.group(1)), int(found.group(2))
        row["slow_steps"] = paced_steps(steps, args.warmup_steps, slow_period, fast_period)
        row["periods"] = (fast_period, slow_period)
    return row


def main(argv: list[str] | None = None) -> None:
    common.start_clock()
    p = common.parser(NAME, __doc__.splitlines()[0])
    p.add_argument("--bandwidth", default="none", help="the link between the sites (default: unlimited)")
    p.add_argument("--steps", type=int, default=None, help="the fast site's LM steps (default 2000; quick 160)")
    p.add_argument("--period", type=int, default=32, help="DiLoCo period (the fast site's local steps per round)")
    p.add_argument("--warmup-steps", type=int, default=None, help="warm-up steps (default 200; quick 40)")
    p.add_argument("--run-timeout", type=float, default=900.0, help="seconds before a run is abandoned")
    p.add_argument("example_args", nargs="*", help="more flags for the example, after `--`")
    args = p.parse_args(argv)
    args.steps = args.steps or (160 if args.quick else 2000)
    args.warmup_steps = args.warmup_steps or (40 if args.quick else 200)
    info = common.machine_info()
    rows = []
    for label, slow, pace in (("full speed", False, False), ("half speed", True, False), ("paced", True, True)):
        rows.append(run(args, label, args.steps, slow=slow, pace=pace))
        common.progress(f"{label}: exit code {rows[-1]['code']}, {rows[-1]['sites_wall_s']:.0f} s")
    full, unpaced, paced = rows
    if all(r["code"] == 0 for r in rows):
        # As many steps as the paced run's wall-clock holds at the unpaced run's pace (warm-up included).
        fit = args.warmup_steps + (args.steps - args.warmup_steps) * paced["wall_s"] / unpaced["wall_s"]
        steps = max(args.warmup_steps + args.period, round(fit))
        rows.append(run(args, "half speed, equal wall-clock", steps, slow=True, pace=False))
        common.progress(f"equal wall-clock ({steps} steps): exit code {rows[-1]['code']}")
    print(f"# Sites of different speeds{' (QUICK)' if args.quick else ''}\n")
    print(common.machine_line(info, bandwidth=args.bandwidth, processes_per_site=1, steps=args.steps))
    print(
        f"\nexamples/lm_fabric.py, DiLoCo period {args.period} (the fast site's), warm-up {args.warmup_steps},"
        f" 2 sites x 1 process; site 1 at {SLOW_SHARE:.0%} of a core where said.\n"
    )
    step_s = full.get("iter_ms_median", float("nan")) / 1000

    def line(row: dict[str, Any]) -> list[Any]:
        if row["code"] != 0:
            return [row["run"], f"exit {row['code']}", "-", "-", "-", "-", "-", "-", "-"]
        pace = "{} / {}".format(*row["periods"]) if "periods" in row else "-"
        return [
            row["run"],
            f"{row['wall_s']:.1f}",
            f"{row['wall_s'] / full['wall_s']:.2f}x" if full["code"] == 0 else "-",
            f"{row['steps']:g}",
            f"{row['slow_steps']:g}",
            pace,
            f"{row['rounds']:g}",
            f"{row['steps'] * step_s / row['wall_s']:.0%}",
            f"{row['val_loss']:.4f}",
        ]

    headers = [
        "run", "wall s", "vs full speed", "fast site steps", "slow site steps", "steps per round", "rounds",
        "fast site utilisation", "val loss",
    ]  # fmt: skip
    print(common.markdown_table(headers, [line(r) for r in rows]))
    common.write_json(args.out / f"{NAME}.json", {"machine": info, "args": vars(args), "rows": rows, "at": time.time()})


if __name__ == "__main__":
    main()
