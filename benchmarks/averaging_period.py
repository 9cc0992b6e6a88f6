"""Averaging period sweep on the ring GAN: time per iteration, bytes per iteration and GAN quality.

Runs the example ``examples/gan_fabric.py`` under ``fabric run`` once per setting and seed, and
parses its last line (``final: steps=... modes_captured=K/8 high_quality=F wall_s=T
iter_ms_median=MS iter_ms_mean=MS comm_bytes=B comm_bytes_per_iter=BPI rounds=R``). Settings:
synchronous DDP (``--period 0``), averaging periods 1, 2, 4, 8, 16, 32 after ``--warmup-steps``
synchronous steps, the floor for local training ("local": the same warm-up, then no communication
until one round at the very end) and no communication at all (``--period <steps> --warmup-steps 0``).
Seeds are the outer loop, settings the inner one, so machine noise hits every setting.
Usage::

    python benchmarks/averaging_period.py [--quick] [--out DIR] [--steps 3000] [--seeds 3] [--reuse]
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from fabric_multimodel.launch import free_port, parse_final_line, stop_process_tree  # noqa: E402

NAME = "averaging_period"
EXAMPLE = common.REPO / "examples" / "gan_fabric.py"
DEFAULT_PERIODS = (1, 2, 4, 8, 16, 32)

FINAL_KEYS = (
    "steps", "modes_captured", "high_quality", "wall_s", "iter_ms_median", "iter_ms_mean",
    "comm_bytes", "comm_bytes_per_iter", "rounds",
)  # fmt: skip


class Final(NamedTuple):
    """The example's machine-readable last line."""

    steps: int
    modes_captured: int
    modes: int
    high_quality: float
    wall_s: float
    iter_ms_median: float
    iter_ms_mean: float
    comm_bytes: int
    comm_bytes_per_iter: float
    rounds: int


def parse_final(stdout: str) -> Final:
    """Parse the example's ``final: ...`` line (the last line of ``stdout`` that starts with ``final:``).

    Raises ValueError (quoting the end of the output) when there is none or it does not match the
    contract exactly.
    """
    g = parse_final_line(stdout, FINAL_KEYS)
    captured, _, modes = g["modes_captured"].partition("/")
    try:
        return Final(
            steps=int(g["steps"]),
            modes_captured=int(captured),
            modes=int(modes),
            high_quality=float(g["high_quality"]),
            wall_s=float(g["wall_s"]),
            iter_ms_median=float(g["iter_ms_median"]),
            iter_ms_mean=float(g["iter_ms_mean"]),
            comm_bytes=int(g["comm_bytes"]),
            comm_bytes_per_iter=float(g["comm_bytes_per_iter"]),
            rounds=int(g["rounds"]),
        )
    except ValueError as error:
        raise ValueError(f"the example's final line has a malformed value ({error}): {g}") from None


class Setting(NamedTuple):
    key: str  # "sync", "period=8", "local", "no-comm"
    label: str
    period: int  # the example's --period
    warmup_steps: int  # the example's --warmup-steps
    x: str  # the label on the plot's axis


def settings(periods: list[int], steps: int, warmup: int) -> list[Setting]:
    # --period 0 runs no Averager, so it has no warm-up phase: every iteration is synchronous.
    out = [Setting("sync", "synchronous DDP (--period 0)", 0, 0, "sync")]
    out += [Setting(f"period={p}", f"period {p}", p, warmup, str(p)) for p in periods]
    # The floor for local training: the same warm-up, then no communication until one round at the end.
    out.append(Setting("local", "no communication after warm-up (1 round, at the end)", steps, warmup, "local"))
    out.append(Setting("no-comm", "no communication at all (1 round, at the end)", steps, 0, "none"))
    return out


def fabric_executable() -> list[str]:
    """The ``fabric`` CLI of this Python environment."""
    beside = Path(sys.executable).with_name("fabric")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("fabric")
    if found:
        return [found]
    raise SystemExit(
        "averaging_period: the `fabric` command (from lightning-fabric) was not found next to Python or on PATH"
    )


def command(setting: Setting, args: Any, seed: int, run_dir: Path) -> list[str]:
    cmd = [
        *fabric_executable(),
        "run",
        "--accelerator", "cpu",
        "--devices", str(args.devices),
        "--main-address", "127.0.0.1",
        "--main-port", "{port}",  # replaced per run by a free port; kept symbolic for --reuse
        str(EXAMPLE),
        "--steps", str(args.steps),
        "--period", str(setting.period),
        "--warmup-steps", str(setting.warmup_steps),
        "--seed", str(seed),
        "--out", str(run_dir),
    ]  # fmt: skip
    if args.batch_size is not None:
        cmd += ["--batch-size", str(args.batch_size)]
    if args.lr is not None:
        cmd += ["--lr", str(args.lr)]
    return cmd


def run_once(setting: Setting, args: Any, seed: int, runs_dir: Path) -> dict[str, Any]:
    """Run the example for one setting and seed (or reuse a finished identical run); return its row."""
    run_dir = runs_dir / f"{setting.key.replace('=', '')}_seed{seed}"
    cmd = command(setting, args, seed, run_dir)
    result_path = run_dir / "result.json"
    if args.reuse and result_path.exists():
        saved = json.loads(result_path.read_text())
        if saved.get("command") == cmd and saved.get("final"):
            return _row(setting, seed, Final(**saved["final"]), saved["elapsed_s"], reused=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    actual = [part.replace("{port}", str(free_port())) for part in cmd]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    start = time.monotonic()
    # Output goes to files, not pipes: a rank process that outlived its launcher would otherwise
    # keep a pipe open and block the read forever.
    stdout_path, stderr_path = run_dir / "stdout.txt", run_dir / "stderr.txt"
    with stdout_path.open("w") as out, stderr_path.open("w") as err:
        proc = subprocess.Popen(actual, cwd=common.REPO, env=env, stdout=out, stderr=err, text=True)
        try:
            proc.wait(timeout=args.run_timeout)
        except subprocess.TimeoutExpired:
            stop_process_tree(proc)
            raise RuntimeError(
                f"{setting.key} seed {seed}: timed out after {args.run_timeout} s (logs in {run_dir})"
            ) from None
        except BaseException:  # Ctrl-C: do not leave the ranks running
            stop_process_tree(proc, grace_s=5)
            raise
    stdout, stderr = stdout_path.read_text(), stderr_path.read_text()
    elapsed = time.monotonic() - start
    if proc.returncode != 0:
        tail = "\n".join(stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"{setting.key} seed {seed}: exit code {proc.returncode} (logs in {run_dir}):\n{tail}")
    final = parse_final(stdout)
    common.write_json(result_path, {"command": cmd, "final": final._asdict(), "elapsed_s": elapsed})
    return _row(setting, seed, final, elapsed, reused=False)


def _row(setting: Setting, seed: int, final: Final, elapsed: float, reused: bool) -> dict[str, Any]:
    return {
        "setting": setting.key,
        "period": setting.period,
        "warmup_steps": setting.warmup_steps,
        "seed": seed,
        **final._asdict(),
        "run_s": round(elapsed, 1),
        "reused": reused,
    }


def summarise(all_settings: list[Setting], runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per setting: medians and spreads over seeds."""
    by_key = {s.key: [r for r in runs if r["setting"] == s.key] for s in all_settings}
    floor = by_key.get("local") or []
    base_median = statistics.median(r["iter_ms_median"] for r in floor) if floor else math.nan
    base_mean = statistics.median(r["iter_ms_mean"] for r in floor) if floor else math.nan
    rows = []
    for s in all_settings:
        mine = by_key[s.key]
        if not mine:
            continue
        hq = [r["high_quality"] for r in mine]
        modes = [r["modes_captured"] for r in mine]
        iter_ms = statistics.median(r["iter_ms_median"] for r in mine)
        iter_ms_mean = statistics.median(r["iter_ms_mean"] for r in mine)
        rows.append(
            {
                "setting": s.key,
                "description": s.label,
                "period": s.period,
                "warmup_steps": s.warmup_steps,
                "steps": mine[0]["steps"],
                "seeds": len(mine),
                "iter_ms_median": iter_ms,
                "median_ratio_to_local": iter_ms / base_median if base_median else math.nan,
                "iter_ms_mean": iter_ms_mean,
                "mean_ratio_to_local": iter_ms_mean / base_mean if base_mean else math.nan,
                "comm_bytes_per_iter": statistics.median(r["comm_bytes_per_iter"] for r in mine),
                "rounds": statistics.median(r["rounds"] for r in mine),
                "modes_captured_mean": statistics.mean(modes),
                "modes_captured_min": min(modes),
                "modes": mine[0]["modes"],
                "high_quality_mean": statistics.mean(hq),
                "high_quality_std": statistics.pstdev(hq) if len(hq) > 1 else 0.0,
                "high_quality_min": min(hq),
                "high_quality_max": max(hq),
                "wall_s_median": statistics.median(r["wall_s"] for r in mine),
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    headers = [
        "setting",
        "warm-up",
        "seeds",
        "ms/iter median",
        "median / local",
        "ms/iter mean",
        "mean / local",
        "bytes/iter",
        "rounds",
        "modes captured mean (min)",
        "high quality mean ± std [min-max]",
    ]
    body = []
    for r in rows:
        body.append(
            [
                r["description"],
                r["warmup_steps"] if r["period"] else "-",
                r["seeds"],
                f"{r['iter_ms_median']:.2f}",
                common.ratio(r["median_ratio_to_local"]),
                f"{r['iter_ms_mean']:.2f}",
                common.ratio(r["mean_ratio_to_local"]),
                f"{r['comm_bytes_per_iter']:,.1f}",
                f"{r['rounds']:g}",
                f"{r['modes_captured_mean']:.2f}/{r['modes']} ({r['modes_captured_min']})",
                f"{r['high_quality_mean']:.3f} ± {r['high_quality_std']:.3f}"
                f" [{r['high_quality_min']:.3f}-{r['high_quality_max']:.3f}]",
            ]
        )
    return common.markdown_table(headers, body)


def plot(path: Path, all_settings: list[Setting], rows: list[dict[str, Any]], title: str) -> Path | None:
    plt = common.pyplot()
    if plt is None:
        return None
    xs = {s.key: s.x for s in all_settings}
    labels = [xs[r["setting"]] for r in rows]
    positions = list(range(len(rows)))
    fig, (ax_ms, ax_bytes, ax_quality) = plt.subplots(1, 3, figsize=(15, 4.2))
    ax_ms.plot(positions, [r["iter_ms_median"] for r in rows], "o-", label="median iteration")
    ax_ms.plot(positions, [r["iter_ms_mean"] for r in rows], "s--", label="mean iteration (rounds included)")
    ax_ms.set_ylabel("ms / iteration after warm-up (median over seeds)")
    ax_ms.legend(fontsize=8)
    ax_bytes.plot(positions, [max(r["comm_bytes_per_iter"], 1.0) for r in rows], "o-", color="tab:orange")
    ax_bytes.set_yscale("log")
    ax_bytes.set_ylabel("bytes communicated / iteration (per rank)")
    hq_mean = [r["high_quality_mean"] for r in rows]
    low = [r["high_quality_mean"] - r["high_quality_min"] for r in rows]
    high = [r["high_quality_max"] - r["high_quality_mean"] for r in rows]
    ax_quality.errorbar(
        positions, hq_mean, yerr=[low, high], fmt="o-", capsize=3, label="high-quality fraction (min-max)"
    )
    ax_quality.set_ylim(0, 1.05)
    ax_quality.set_ylabel("high-quality fraction")
    ax_modes = ax_quality.twinx()
    ax_modes.plot(
        positions, [r["modes_captured_mean"] for r in rows], "s--", color="tab:green", label="modes captured (mean)"
    )
    ax_modes.set_ylim(0, rows[0]["modes"] + 0.5)
    ax_modes.set_ylabel("modes captured (of 8)")
    handles = ax_quality.get_legend_handles_labels()[0] + ax_modes.get_legend_handles_labels()[0]
    ax_quality.legend(handles, [h.get_label() for h in handles], loc="lower left", fontsize=8)
    for ax in (ax_ms, ax_bytes, ax_quality):
        ax.set_xticks(positions, labels)
        ax.set_xlabel("averaging period")
        ax.grid(alpha=0.3)
    fig.suptitle(title + " (sync: DDP every step; none: no communication)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    common.start_clock()
    p = common.parser(NAME, __doc__.splitlines()[0])
    p.add_argument(
        "--steps", type=int, default=None, help="iterations per run (default: 3000, the example's default; quick: 60)"
    )
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=None,
        help="synchronous steps before local SGD (default: steps/6; quick: 10)",
    )
    p.add_argument(
        "--periods", type=int, nargs="+", default=None, help="averaging periods (default: 1 2 4 8 16 32; quick: 8)"
    )
    p.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 per setting (default: 3; quick: 1)")
    p.add_argument("--devices", type=int, default=4, help="processes per run (default: 4)")
    p.add_argument("--batch-size", type=int, default=None, help="per process; passed to the example when given")
    p.add_argument("--lr", type=float, default=None, help="passed to the example when given")
    p.add_argument(
        "--run-timeout", type=float, default=1800.0, help="seconds before one run is abandoned (default: 1800)"
    )
    p.add_argument(
        "--reuse", action="store_true", help="reuse finished runs with identical commands in --out (resume a sweep)"
    )
    args = p.parse_args(argv)
    args.steps = args.steps or (60 if args.quick else 3000)
    if args.warmup_steps is None:
        args.warmup_steps = 10 if args.quick else args.steps // 6
    periods = args.periods or ([8] if args.quick else list(DEFAULT_PERIODS))
    seeds = list(range(args.seeds or (1 if args.quick else 3)))
    if not EXAMPLE.exists():
        raise SystemExit(f"averaging_period: {EXAMPLE} is missing; this benchmark runs it")
    info = common.machine_info()
    all_settings = settings(periods, args.steps, args.warmup_steps)
    runs_dir = args.out / f"{NAME}_runs"

    runs: list[dict[str, Any]] = []
    failures: list[str] = []
    bar = common.Progress("runs", len(seeds) * len(all_settings), every_s=0)
    for seed in seeds:
        for setting in all_settings:
            try:
                row = run_once(setting, args, seed, runs_dir)
            except (RuntimeError, ValueError) as error:
                failures.append(str(error))
                common.progress(f"FAILED {error}")
                bar.advance(note=f"{setting.key} seed {seed} failed")
                continue
            runs.append(row)
            how = "reused" if row["reused"] else f"{row['run_s']:.0f}s"
            bar.advance(
                note=f"{setting.key} seed {seed}: {row['iter_ms_median']:.2f} ms/iter,"
                f" {row['comm_bytes_per_iter']:,.0f} B/iter,"
                f" {row['modes_captured']}/{row['modes']} modes, hq {row['high_quality']:.3f}"
                f" ({how})"
            )
    elapsed = common.elapsed()
    rows = summarise(all_settings, runs)

    print(f"# Averaging period sweep{' (QUICK mode: indicative only)' if args.quick else ''}\n")
    print(
        common.machine_line(
            info, world_size=args.devices, steps=args.steps, warmup_steps=args.warmup_steps, seeds=len(seeds)
        )
    )
    print()
    print(
        "Ring GAN, examples/gan_fabric.py under `fabric run`. ms/iter median / mean: median over seeds of"
        " each run's median / mean iteration time on rank 0 after warm-up (sync DDP and no-comm: all"
        " iterations); the mean includes the averaging rounds, the median leaves them out. Ratios are to"
        " 'local' (same warm-up, then no communication), the floor for local training. bytes/iter: gradient"
        " allreduce bytes (warm-up included) plus averaging rounds (parameters and Adam moments), divided"
        " by all steps, per rank. Quality of the final (averaged) generator, 2500 samples.\n"
    )
    if rows:
        print(table(rows))
    if failures:
        print(f"\n{len(failures)} run(s) FAILED:")
        for failure in failures:
            print(f"- {failure.splitlines()[0]}")
    if rows:
        csv_path = common.write_csv(args.out / f"{NAME}.csv", rows)
        common.write_csv(args.out / f"{NAME}_runs.csv", runs)
        png = plot(
            args.out / f"{NAME}.png",
            all_settings,
            rows,
            f"Ring GAN, {args.devices} processes, {args.steps} steps, warm-up {args.warmup_steps},"
            f" {len(seeds)} seed(s)",
        )
        common.write_json(
            args.out / f"{NAME}.json",
            {"machine": info, "args": vars(args), "elapsed_s": elapsed, "rows": rows, "runs": runs},
        )
        common.progress(f"done in {elapsed:.0f}s; wrote {csv_path}" + (f" and {png}" if png else ""))
    if failures:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
