"""The cost model against the simulated sites: predicted and measured steady-state utilisation of the LM example.

Each setting runs ``examples/lm_fabric.py`` as 2 sites of ``D`` processes (``fabric_multimodel.sites``, root)
behind a link of the setting's rate, for ten periods; its floor is the same example with no round until the end
and an unlimited link, at the same ``D``, run before the settings and after them (the mean of the two; the table
gives their spread). Both time the steady state only (the example's ``iter_ms_*`` skip the
warm-up; here there is none).

- **measured**: the floor's mean step over this run's (``iter_ms_mean``: the rounds' waits are in the run's). Both
  means carry the same costs that are no round's (validation, logging): the floor's median against the run's
  mean counted those against the rounds (the floor's mean was 2.5% and 4.8% above its median).
- **predicted**: ``fabric_multimodel.plan.cost_model.utilisation`` for the LM's parameters, the floor's mean step and
  the setting, at the rate the sites tool measured for the link (what TCP carries of it).

The settings cover 1 and 2 processes per site, 100 / 10 / 1 Mbit/s, fp32 / fp8 / fp4 payloads, 1 and 4
fragments, overlap 0 and 16.

Usage::

    python benchmarks/plan_check.py [--quick] [--out DIR] [--settings KEY ...]
"""

from __future__ import annotations

import shutil
import statistics
import sys
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common, site_sweep  # noqa: E402
from fabric_multimodel.plan.cost_model import Setting, utilisation  # noqa: E402
from fabric_multimodel.run.report import parse_final_line  # noqa: E402
from fabric_multimodel.sites import run_sites  # noqa: E402

NAME = "plan_check"
DTYPES = {"fp32": "float32", "fp8": "float8_e4m3fn", "fp4": "float4_e2m1fn_x2"}


class Case(NamedTuple):
    key: str
    devices: int
    bandwidth: str
    payload: str
    fragments: int
    overlap_steps: int
    period: int


CASES = (
    Case("1x100mbit-fp32", 1, "100mbit", "fp32", 1, 0, 16),
    Case("1x10mbit-fp32", 1, "10mbit", "fp32", 1, 0, 64),
    Case("1x10mbit-fp8-F4-o16", 1, "10mbit", "fp8", 4, 16, 128),
    Case("1x1mbit-fp4", 1, "1mbit", "fp4", 1, 0, 128),
    Case("1x1mbit-fp8-F4-o16", 1, "1mbit", "fp8", 4, 16, 128),
    Case("2x10mbit-fp32", 2, "10mbit", "fp32", 1, 0, 64),
    Case("2x10mbit-fp4-F4-o16", 2, "10mbit", "fp4", 4, 16, 128),
    Case("2x1mbit-fp8-F4-o16", 2, "1mbit", "fp8", 4, 16, 128),
)
QUICK = ("1x10mbit-fp8-F4-o16",)


def run(args: Any, label: str, devices: int, bandwidth: str, steps: int, flags: list[str]) -> dict[str, Any]:
    """One run of the LM example as 2 sites; its final line as numbers, and the link rate the tool measured."""
    folder = args.out / f"{NAME}_runs" / label
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    script = ["--steps", str(steps), "--warmup-steps", "0", "--layout", "islands", "--checkpoint-every", "0"]
    script += ["--outer", "nesterov", "--out", str(folder / "run"), *flags]
    result = run_sites(
        common.REPO / "examples" / "lm_fabric.py",
        script,
        sites=2,
        devices=devices,
        bandwidth=bandwidth,
        out=folder / "sites",
        stream=False,
        timeout=args.run_timeout,
    )
    if result.code != 0:
        raise SystemExit(f"{NAME}: {label} exited with {result.code}; logs in {folder}")
    final = parse_final_line(result.logs[0][0].read_text(), common.LM_KEYS)
    return {key: float(value) for key, value in final.items()} | {"mbit_s": result.measured_mbit_s}


def main(argv: list[str] | None = None) -> None:
    common.start_clock()
    p = common.parser(NAME, __doc__.splitlines()[0])
    p.add_argument("--settings", nargs="+", default=None, help=f"keys of {[c.key for c in CASES]}")
    p.add_argument("--periods", type=int, default=10, help="rounds of each setting (steps = periods x period)")
    p.add_argument("--run-timeout", type=float, default=900.0, help="seconds before a run is abandoned")
    args = p.parse_args(argv)
    keys = args.settings or (QUICK if args.quick else [c.key for c in CASES])
    cases = [c for c in CASES if c.key in keys]
    if unknown := sorted(set(keys) - {c.key for c in cases}):
        p.error(f"--settings: unknown {unknown}")
    periods = 4 if args.quick else args.periods
    info = common.machine_info()
    params = site_sweep.LM_PARAMETER_BYTES / 4
    devices = sorted({c.devices for c in cases})
    floors: dict[int, list[float]] = {d: [] for d in devices}  # mean step ms, before the settings and after
    bar = common.Progress("runs", len(cases) + 2 * len(devices), every_s=0)

    def floor(count: int, when: str) -> None:
        longest = periods * max(c.period for c in cases if c.devices == count)
        no_rounds = ["--period", str(longest)]  # one round, at the last step
        found = run(args, f"floor-{count}-{when}", count, "none", longest, no_rounds)
        floors[count].append(found["iter_ms_mean"])
        bar.advance(note=f"floor {when}, {count} per site: {found['iter_ms_mean']:.2f} ms")

    measured_runs = []
    for case in cases:
        if not floors[case.devices]:
            floor(case.devices, "before")
        flags = ["--period", str(case.period), "--fragments", str(case.fragments)]
        flags += ["--overlap-steps", str(case.overlap_steps), "--comm-dtype", DTYPES[case.payload]]
        measured_runs.append((case, run(args, case.key, case.devices, case.bandwidth, periods * case.period, flags)))
        bar.advance(note=case.key)
    # Again after the settings: one floor on 2 shared cores moved by 18% between two runs of this script.
    for count in devices:
        floor(count, "after")
    rows = []
    for case, found in measured_runs:
        floor_ms = statistics.fmean(floors[case.devices])
        shape = (case.period, 2, case.devices, case.fragments, case.overlap_steps, DTYPES[case.payload])
        setting = Setting(params, floor_ms / 1000, *shape)
        predicted = utilisation(setting, found["mbit_s"] * 1e6 * site_sweep.TCP_PAYLOAD)
        measured = floor_ms / found["iter_ms_mean"]
        rows.append(
            {
                **case._asdict(),
                "steps": periods * case.period,
                "floor_iter_ms": floor_ms,
                "floor_spread": max(floors[case.devices]) / min(floors[case.devices]) - 1,
                "iter_ms_mean": found["iter_ms_mean"],
                "mbit_s": found["mbit_s"],
                "predicted": round(predicted, 4),
                "measured": round(measured, 4),
                "points": round(100 * (measured - predicted), 1),
            }
        )
    common.write_results(args.out, NAME, info, args, common.elapsed(), rows)
    print(common.machine_line(info, sites=2, periods=periods) + "\n")
    headers = ["setting", "per site", "link", "payload", "F", "overlap", "period", "floor ms (spread)"]
    headers += ["predicted", "measured", "measured - predicted"]
    table = [
        [r["key"], r["devices"], r["bandwidth"], r["payload"], r["fragments"], r["overlap_steps"], r["period"]]
        + [f"{r['floor_iter_ms']:.2f} ({r['floor_spread']:.0%})", f"{r['predicted']:.1%}", f"{r['measured']:.1%}"]
        + [f"{r['points']:+.1f}"]
        for r in rows
    ]
    print(common.markdown_table(headers, table))


if __name__ == "__main__":
    main()
