"""Averaging-period sweep: time, bytes and model quality per averaging setting, on the ring GAN or a language model.

Runs an example under ``fabric run`` once per setting and seed and parses its last line (``final:
key=value ...``) and its ``comm:`` line (bytes per kind of collective). Seeds are the outer loop,
settings the inner one, so machine noise hits every setting. Every run keeps its logs in
``<out>/averaging_period_runs/<name>/<setting>_seed<S>/`` (``<name>``: the results' file name); a
failed run's folder is renamed ``...-failed-<time>`` (never overwritten) and the sweep says where it is.

Tasks:

- ``--task ring`` (default): ``examples/gan_fabric.py``. Synchronous DDP, periods 1-32 after a
  synchronous warm-up, overlapped rounds (``--overlap``), the no-communication floors. Quality: modes
  captured and high-quality fraction of the final generator.
- ``--task lm``: ``examples/lm_fabric.py``. Synchronous DDP; plain averaging at periods 8, 32, 128;
  DiLoCo (outer Nesterov 0.7/0.9) at 32, 128, 512; DiLoCo 128 with a bf16 payload and overlapped;
  no communication after warm-up. Quality: validation loss of the final, averaged model.
  ``--layouts`` runs instead the multi-node layouts, 2 nodes x 2 processes, each node its own
  ``fabric run``: synchronous DDP over the world, flat DiLoCo 128, islands DiLoCo 128, two-level 4/32,
  with the bytes per iteration that cross nodes and that stay inside them.

``--sites S --bandwidth RATE...`` runs every setting instead as S simulated sites (network namespaces
behind tbf-limited links, `fabric_multimodel.sites`, root) at each rate, and reports compute utilisation,
bytes crossing sites, wall-clock to a target loss and a cost model beside each row (benchmarks/site_sweep.py).

Usage::

    python benchmarks/averaging_period.py [--task ring|lm] [--quick] [--out DIR] [--seeds N] [--reuse]
    python benchmarks/averaging_period.py --task lm --sites 2 --devices 2 --bandwidth none 1gbit 100mbit 10mbit
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import (
    common,  # noqa: E402
    site_sweep,  # noqa: E402
)
from fabric_multimodel.run.launch import free_port, stop_process_tree  # noqa: E402
from fabric_multimodel.run.report import parse_final_line  # noqa: E402
from fabric_multimodel.sites import parse_rate, run_sites  # noqa: E402

NAME = "averaging_period"


class Task(NamedTuple):
    """An example the sweep runs, what its final line holds, and which of it is model quality."""

    name: str
    example: Path
    keys: tuple[str, ...]  # the final line, in order
    quality: tuple[str, ...]  # the final-line values summarised as mean ± std over seeds
    steps: int  # full-mode iterations per run
    quick_steps: int
    warmup_steps: int  # full-mode synchronous steps before averaging


RING = Task(
    "ring",
    common.REPO / "examples" / "gan_fabric.py",
    keys=(
        "steps", "modes_captured", "high_quality", "wall_s", "iter_ms_median", "iter_ms_mean",
        "comm_bytes", "comm_bytes_per_iter", "rounds", "state_bytes",
    ),
    quality=("modes_captured", "high_quality"),
    steps=3000,
    quick_steps=40,
    warmup_steps=500,
)  # fmt: skip
LM = Task(
    "lm",
    common.REPO / "examples" / "lm_fabric.py",
    keys=common.LM_KEYS,
    quality=("val_loss", "val_bpb"),
    steps=2000,
    quick_steps=40,
    warmup_steps=20,
)  # fmt: skip
TASKS = {task.name: task for task in (RING, LM)}


class Setting(NamedTuple):
    key: str  # a short id, used in file names and the CSV: "sync", "period=8", "diloco=128-bf16"...
    label: str  # for the table
    flags: tuple[str, ...]  # the example's flags for this setting
    x: str  # the label on a plot's axis
    nodes: int = 1  # 2: two `fabric run` launchers of --devices/2 processes each (simulated nodes)


def averaging(period: int, warmup: int, *extra: str) -> tuple[str, ...]:
    return ("--period", str(period), "--warmup-steps", str(warmup), *extra)


DILOCO = ("--outer", "nesterov", "--outer-lr", "0.7", "--outer-momentum", "0.9")


def ring_settings(args: Any) -> list[Setting]:
    w, steps = args.warmup_steps, args.steps
    periods = args.periods or ([8] if args.quick else [1, 2, 4, 8, 16, 32])
    out = [Setting("sync", "synchronous DDP (--period 0)", ("--period", "0"), "sync")]
    out += [Setting(f"period={p}", f"period {p}", averaging(p, w), str(p)) for p in periods]
    if args.overlap:
        for p, k in [(p, k) for p in (8, 32) for k in args.overlap_steps if k < p]:
            out.append(
                Setting(
                    f"period={p}-overlap={k}",
                    f"period {p}, overlapped {k}",
                    averaging(p, w, "--overlap-steps", str(k)),
                    f"{p}/o{k}",
                )
            )
    # The floor for local training: the same warm-up, then no communication until one round at the end.
    out.append(Setting("local", "no communication after warm-up (1 round, at the end)", averaging(steps, w), "local"))
    out.append(Setting("no-comm", "no communication at all (1 round, at the end)", averaging(steps, 0), "none"))
    return out


def lm_compare_settings(args: Any) -> list[Setting]:
    """``--compare lowbit``: DiLoCo 128's payload in fp32, fp8 and fp4, with and without error feedback;
    ``--compare sparse``: DiLoCo 128 in fp32 and fp4 beside sparse rounds (SparseLoCo: each chunk's top 1/16, 1/64,
    1/256 with error feedback in place of the outer momentum) every 128 steps, and 1/64 and 1/256 every 16;
    ``--compare streaming``: blocking DiLoCo 128 beside streaming (4 fragments, overlap 16), with each merge rule."""
    w = args.warmup_steps
    base = averaging(128, w, *DILOCO)
    if args.compare == "sparse":
        out = [
            Setting("diloco=128", "DiLoCo 128, fp32", base, "fp32"),
            Setting("diloco=128-fp4", "DiLoCo 128, fp4", (*base, "--comm-dtype", "float4_e2m1fn_x2"), "fp4"),
        ]
        for period, density in ((128, "1/16"), (128, "1/64"), (128, "1/256"), (16, "1/64"), (16, "1/256")):
            key = f"sparse={period}-{density.replace('/', 'in')}"
            flags = averaging(period, w, "--density", density)
            out.append(Setting(key, f"sparse {period}, density {density}", flags, f"{period} {density}"))
        return out
    if args.compare == "lowbit":
        out = [Setting("diloco=128", "DiLoCo 128, fp32", base, "fp32")]
        for code, short in (("float8_e4m3fn", "fp8"), ("float4_e2m1fn_x2", "fp4")):
            out.append(Setting(f"diloco=128-{short}", f"DiLoCo 128, {short}", (*base, "--comm-dtype", code), short))
            out.append(
                Setting(
                    f"diloco=128-{short}-ef",
                    f"DiLoCo 128, {short}, error feedback",
                    (*base, "--comm-dtype", code, "--error-feedback"),
                    f"{short}+ef",
                )
            )
        return out
    streaming = (*base, "--fragments", "4", "--overlap-steps", "16")
    return [
        Setting("diloco=128", "DiLoCo 128, blocking", base, "D128"),
        Setting("diloco=128-overlap=8", "DiLoCo 128, overlapped 8", (*base, "--overlap-steps", "8"), "o8"),
        Setting(
            "streaming=128",
            "streaming DiLoCo 128 (F=4, overlap 16), global + local progress",
            (*streaming, "--mixing", "progress"),
            "F4",
        ),
        Setting(
            "streaming=128-mixing=0.5",
            "streaming DiLoCo 128 (F=4, overlap 16), mixing 0.5",
            (*streaming, "--mixing", "0.5"),
            "F4 a.5",
        ),
        Setting(
            "streaming=128-mixing=0",
            "streaming DiLoCo 128 (F=4, overlap 16), mixing 0 (global only)",
            (*streaming, "--mixing", "0"),
            "F4 a0",
        ),
    ]


def lm_settings(args: Any) -> list[Setting]:
    w, steps = args.warmup_steps, args.steps
    if args.compare:
        return lm_compare_settings(args)
    if args.layouts:
        return [
            Setting("nodes-sync", "synchronous DDP over the world", ("--period", "0"), "sync", nodes=2),
            Setting(
                "nodes-diloco=128",
                "flat DiLoCo 128 (DDP over the world in warm-up)",
                averaging(128, w, *DILOCO, "--layout", "flat"),
                "flat",
                2,
            ),
            Setting(
                "nodes-islands-diloco=128",
                "islands: DDP inside the node, DiLoCo 128 across",
                averaging(128, w, *DILOCO, "--layout", "islands"),
                "islands",
                nodes=2,
            ),
            Setting(
                "nodes-two-level=4/32",
                "two-level: node every 4, world every 32",
                averaging(32, w, "--node-period", "4"),
                "4/32",
                2,
            ),
        ]
    if args.quick:
        return [
            Setting("sync", "synchronous DDP", ("--period", "0"), "sync"),
            Setting("diloco=8", "DiLoCo 8", averaging(8, w, *DILOCO), "D8"),
            Setting("local", "no communication after warm-up", averaging(steps, w), "local"),
        ]
    out = [Setting("sync", "synchronous DDP", ("--period", "0"), "sync")]
    out += [Setting(f"period={p}", f"plain averaging, period {p}", averaging(p, w), f"P{p}") for p in (8, 32, 128)]
    out += [
        Setting(f"diloco={p}", f"DiLoCo (Nesterov 0.7/0.9), period {p}", averaging(p, w, *DILOCO), f"D{p}")
        for p in (32, 128, 512)
    ]
    out.append(
        Setting(
            "diloco=128-bf16",
            "DiLoCo 128, bf16 payload",
            averaging(128, w, *DILOCO, "--comm-dtype", "bfloat16"),
            "D128bf16",
        )
    )
    out.append(
        Setting(
            "diloco=128-overlap=8",
            "DiLoCo 128, overlapped 8 steps",
            averaging(128, w, *DILOCO, "--overlap-steps", "8"),
            "D128o8",
        )
    )
    out.append(Setting("local", "no communication after warm-up (1 round, at the end)", averaging(steps, w), "local"))
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
        "averaging_period: the `fabric` command (from lightning-fabric) was not found beside Python or on PATH"
    )


def commands(task: Task, setting: Setting, args: Any, seed: int, run_dir: Path) -> list[list[str]]:
    """One command per (simulated) node; ``{port}`` is replaced by a free port when run."""
    script = [str(task.example), "--steps", str(args.steps), "--seed", str(seed), "--out", str(run_dir)]
    script += ["--checkpoint-every", "0", *setting.flags, *args.example_args]
    per_node = args.devices // setting.nodes
    return [
        [
            *fabric_executable(), "run", "--accelerator", "cpu", "--devices", str(per_node),
            *(("--num-nodes", str(setting.nodes), "--node-rank", str(node)) if setting.nodes > 1 else ()),
            "--main-address", "127.0.0.1", "--main-port", "{port}",
            *script,
        ]
        for node in range(setting.nodes)
    ]  # fmt: skip


def run_once(task: Task, setting: Setting, args: Any, seed: int, runs_dir: Path) -> dict[str, Any]:
    """Run the example for one setting and seed (or reuse a finished identical run); return its row."""
    run_dir = runs_dir / f"{setting.key.replace('=', '').replace('/', '-')}_seed{seed}"
    cmds = commands(task, setting, args, seed, run_dir)
    result_path = run_dir / "result.json"
    if args.reuse and result_path.exists():
        saved = json.loads(result_path.read_text())
        if saved.get("commands") == cmds and saved.get("final"):
            return _row(task, setting, seed, saved["final"], saved.get("comm", {}), saved["elapsed_s"], reused=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    port = str(free_port())
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    start = time.monotonic()
    launchers, logs = [], []
    try:
        # Output goes to files, not pipes: a rank that outlived its launcher would otherwise keep a
        # pipe open and block the read forever.
        for node, cmd in enumerate(cmds):
            out = (run_dir / f"stdout{node or ''}.txt").open("w")
            err = (run_dir / f"stderr{node or ''}.txt").open("w")
            logs += [out, err]
            actual = [part.replace("{port}", port) for part in cmd]
            launchers.append(subprocess.Popen(actual, cwd=common.REPO, env=env, stdout=out, stderr=err, text=True))
        deadline = time.monotonic() + args.run_timeout
        for launcher in launchers:
            launcher.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        failure = f"timed out after {args.run_timeout:.0f} s"
    except BaseException:  # Ctrl-C: do not leave the ranks running
        for launcher in launchers:
            stop_process_tree(launcher, grace_s=5)
        raise
    else:
        codes = [launcher.returncode for launcher in launchers]
        failure = None if all(code == 0 for code in codes) else f"exit codes {codes}"
    finally:
        for launcher in launchers:
            stop_process_tree(launcher, grace_s=5)
        for log in logs:
            log.close()
    elapsed = time.monotonic() - start
    stdout = (run_dir / "stdout.txt").read_text()
    try:
        if failure is not None:
            raise RuntimeError(failure)
        final = _numbers(parse_final_line(stdout, task.keys))
        comm = _comm_line(stdout)
    except (RuntimeError, ValueError) as error:
        kept = run_dir.with_name(f"{run_dir.name}-failed-{time.strftime('%Y%m%d-%H%M%S')}")
        run_dir.rename(kept)
        tail = "\n".join((kept / "stderr.txt").read_text().strip().splitlines()[-15:])
        raise RuntimeError(f"{setting.key} seed {seed}: {error}; logs kept in {kept}\n{tail}") from None
    common.write_json(result_path, {"commands": cmds, "final": final, "comm": comm, "elapsed_s": elapsed})
    return _row(task, setting, seed, final, comm, elapsed, reused=False)


def _numbers(values: dict[str, str]) -> dict[str, float]:
    """Final-line values as numbers; ``K/N`` (modes captured of N) gives ``key`` and ``key_of``."""
    out: dict[str, float] = {}
    for key, value in values.items():
        if "/" in value:
            part, _, whole = value.partition("/")
            out[key], out[f"{key}_of"] = float(int(part)), float(int(whole))
        else:
            out[key] = float(value)
    return out


def _comm_line(stdout: str) -> dict[str, float]:
    """The example's ``comm: ddp_bytes=... round_bytes=... node_round_bytes=...`` line (empty if absent)."""
    lines = [line.strip() for line in stdout.splitlines() if line.startswith("comm:")]
    if not lines:
        return {}
    return {k: float(v) for k, v in (token.split("=", 1) for token in lines[-1].removeprefix("comm:").split())}


def _row(
    task: Task,
    setting: Setting,
    seed: int,
    final: dict[str, float],
    comm: dict[str, float],
    elapsed: float,
    reused: bool,
) -> dict[str, Any]:
    steps = final["steps"]
    ddp, rounds, node_rounds = (comm.get(k, math.nan) for k in ("ddp_bytes", "round_bytes", "node_round_bytes"))
    islands = "--layout" in setting.flags and "islands" in setting.flags
    # Bytes that cross nodes: collectives over groups that span nodes. In the islands layout DDP
    # stays inside the node and only rounds cross; in two-level averaging the node rounds stay inside.
    inside = (ddp if islands else 0.0) + (node_rounds if node_rounds == node_rounds else 0.0)
    return {
        "task": task.name,
        "setting": setting.key,
        "seed": seed,
        "nodes": setting.nodes,
        **final,
        "crossing_bytes_per_iter": (final["comm_bytes"] - inside) / steps,
        "inside_bytes_per_iter": inside / steps,
        "ddp_bytes": ddp,
        "round_bytes": rounds,
        "run_s": round(elapsed, 1),
        "reused": reused,
    }


def summarise(task: Task, settings: list[Setting], runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per setting: medians of time and bytes over seeds, mean and spread of the quality values."""
    by_key = {s.key: [r for r in runs if r["setting"] == s.key] for s in settings}
    floor = by_key.get("local") or []
    base_median = statistics.median(r["iter_ms_median"] for r in floor) if floor else math.nan
    base_mean = statistics.median(r["iter_ms_mean"] for r in floor) if floor else math.nan
    sync = by_key.get("sync") or by_key.get("nodes-sync") or []
    sync_bytes = statistics.median(r["comm_bytes_per_iter"] for r in sync) if sync else math.nan
    rows = []
    for s in settings:
        mine = by_key[s.key]
        if not mine:
            continue
        row: dict[str, Any] = {
            "setting": s.key,
            "description": s.label,
            "x": s.x,
            "seeds": len(mine),
            "steps": mine[0]["steps"],
            "iter_ms_median": statistics.median(r["iter_ms_median"] for r in mine),
            "iter_ms_mean": statistics.median(r["iter_ms_mean"] for r in mine),
            "comm_bytes_per_iter": statistics.median(r["comm_bytes_per_iter"] for r in mine),
            "crossing_bytes_per_iter": statistics.median(r["crossing_bytes_per_iter"] for r in mine),
            "inside_bytes_per_iter": statistics.median(r["inside_bytes_per_iter"] for r in mine),
            "rounds": statistics.median(r["rounds"] for r in mine),
            "wall_s_median": statistics.median(r["wall_s"] for r in mine),
        }
        row["median_ratio_to_local"] = row["iter_ms_median"] / base_median if base_median else math.nan
        row["mean_ratio_to_local"] = row["iter_ms_mean"] / base_mean if base_mean else math.nan
        row["bytes_ratio_to_sync"] = sync_bytes / row["comm_bytes_per_iter"] if row["comm_bytes_per_iter"] else math.inf
        for metric in task.quality:
            values = [r[metric] for r in mine]
            row[f"{metric}_mean"] = statistics.mean(values)
            row[f"{metric}_std"] = statistics.pstdev(values) if len(values) > 1 else 0.0
            row[f"{metric}_min"], row[f"{metric}_max"] = min(values), max(values)
        if task is RING:
            row["modes"] = mine[0]["modes_captured_of"]
        rows.append(row)
    return rows


def table(task: Task, rows: list[dict[str, Any]], layouts: bool) -> str:
    headers = ["setting", "seeds", "ms/iter median", "median / local", "ms/iter mean", "mean / local", "bytes/iter"]
    headers += ["sync bytes / bytes", "rounds"]
    if layouts:
        headers += ["bytes/iter crossing nodes", "bytes/iter inside nodes"]
    headers += (
        ["modes captured mean (min)", "high quality mean ± std [min-max]"]
        if task is RING
        else ["val loss mean ± std [min-max]", "val bpb mean"]
    )
    body = []
    for r in rows:
        line = [
            r["description"],
            r["seeds"],
            f"{r['iter_ms_median']:.2f}",
            common.ratio(r["median_ratio_to_local"]),
            f"{r['iter_ms_mean']:.2f}",
            common.ratio(r["mean_ratio_to_local"]),
            f"{r['comm_bytes_per_iter']:,.1f}",
            f"1/{r['bytes_ratio_to_sync']:.1f}"
            if r["bytes_ratio_to_sync"] > 1.0001
            else common.ratio(1 / r["bytes_ratio_to_sync"]),
            f"{r['rounds']:g}",
        ]
        if layouts:
            line += [f"{r['crossing_bytes_per_iter']:,.1f}", f"{r['inside_bytes_per_iter']:,.1f}"]
        if task is RING:
            line += [
                f"{r['modes_captured_mean']:.2f}/{r['modes']:g} ({r['modes_captured_min']:g})",
                f"{r['high_quality_mean']:.3f} ± {r['high_quality_std']:.3f}"
                f" [{r['high_quality_min']:.3f}-{r['high_quality_max']:.3f}]",
            ]
        else:
            line += [
                f"{r['val_loss_mean']:.4f} ± {r['val_loss_std']:.4f} [{r['val_loss_min']:.4f}-{r['val_loss_max']:.4f}]",
                f"{r['val_bpb_mean']:.3f}",
            ]
        body.append(line)
    return common.markdown_table(headers, body)


def plot(task: Task, path: Path, rows: list[dict[str, Any]], title: str) -> Path | None:
    plt = common.pyplot()
    if plt is None:
        return None
    if task is RING:
        fig = _plot_ring(plt, rows)
    else:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in rows:
            x = max(r["comm_bytes_per_iter"], 1.0)
            spread = [[r["val_loss_mean"] - r["val_loss_min"]], [r["val_loss_max"] - r["val_loss_mean"]]]
            ax.errorbar([x], [r["val_loss_mean"]], yerr=spread, fmt="o", capsize=3)
            ax.annotate(r["x"], (x, r["val_loss_mean"]), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xscale("log")
        ax.set_xlabel("bytes communicated per iteration per rank (log)")
        ax.set_ylabel("validation loss (nats/byte), mean and min-max over seeds")
        ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _plot_ring(plt: Any, rows: list[dict[str, Any]]) -> Any:
    positions = list(range(len(rows)))
    fig, (ax_ms, ax_bytes, ax_quality) = plt.subplots(1, 3, figsize=(15, 4.2))
    ax_ms.plot(positions, [r["iter_ms_median"] for r in rows], "o-", label="median iteration")
    ax_ms.plot(positions, [r["iter_ms_mean"] for r in rows], "s--", label="mean iteration (rounds included)")
    ax_ms.set_ylabel("ms / iteration after warm-up (median over seeds)")
    ax_ms.legend(fontsize=8)
    ax_bytes.plot(positions, [max(r["comm_bytes_per_iter"], 1.0) for r in rows], "o-", color="tab:orange")
    ax_bytes.set_yscale("log")
    ax_bytes.set_ylabel("bytes communicated / iteration (per rank)")
    hq = [r["high_quality_mean"] for r in rows]
    low = [r["high_quality_mean"] - r["high_quality_min"] for r in rows]
    high = [r["high_quality_max"] - r["high_quality_mean"] for r in rows]
    ax_quality.errorbar(positions, hq, yerr=[low, high], fmt="o-", capsize=3, label="high-quality fraction (min-max)")
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
        ax.set_xticks(positions, [r["x"] for r in rows])
        ax.set_xlabel("setting (sync: DDP every step; none: no communication)")
        ax.grid(alpha=0.3)
    return fig


def sweep_sites(task: Task, args: Any, p: argparse.ArgumentParser) -> None:
    """Every setting at every bandwidth across ``--sites`` simulated sites (see benchmarks/site_sweep.py)."""
    if args.sites < 2 or args.layouts:
        p.error("--sites needs at least 2 sites, and no --layouts (the islands rows are in the sweep)")
    args.steps = args.steps or (10 if args.quick else task.steps)
    warmup = args.warmup_steps if args.warmup_steps is not None else (2 if args.quick else task.warmup_steps)
    args.devices = args.devices or (1 if args.quick else 2)  # per site
    bandwidths = args.bandwidth or (["10mbit"] if args.quick else ["none", "100mbit", "10mbit", "1mbit"])
    for bandwidth in bandwidths:
        try:
            parse_rate(bandwidth)
        except ValueError as error:
            p.error(f"--bandwidth {error}")
    budget = args.run_budget or (120.0 if args.quick else 240.0)
    seed = 0
    name = f"{NAME}_{task.name}_sites"
    runs_dir = args.out / f"{NAME}_runs" / name
    settings = (
        site_sweep.lm_site_settings(args.steps, warmup, args.quick)
        if task is LM
        else site_sweep.ring_site_settings(warmup)
    )
    if args.settings:
        unknown = sorted(set(args.settings) - {s.key for s in settings})
        if unknown:
            p.error(f"--settings: unknown {unknown}; choose from {[s.key for s in settings]}")
        by_key = {s.key: s for s in settings}
        settings = [by_key[key] for key in dict.fromkeys(args.settings)]  # in the order given: swap it to check drift
    info = common.machine_info()
    floor = run_on_sites(task, site_sweep.floor_setting(args.steps), args, "none", seed, runs_dir, args.steps)
    iter_s = floor["wall_s"] / args.steps  # the compute every other run is measured against (until the second)
    rows = [floor]
    modelled = []  # per row: its cost model, waiting for the compute time
    cases = interleave(bandwidths, settings, args.repeats)
    bar = common.Progress("runs", len(cases), every_s=0)
    for bandwidth, repeat, setting in cases:
        nominal = parse_rate(bandwidth)
        rate = nominal * site_sweep.TCP_PAYLOAD if nominal else None
        period = _flag_value(setting.flags, "--period")
        if period is None:  # --period auto: the smallest it may choose, until the run says what it chose
            period = setting.fragments * (setting.hidden + 1)
        model = functools.partial(
            site_sweep.predict_wall_s,
            setting,
            warmup=warmup,
            period=period,
            iter_s=iter_s,
            sites=args.sites,
            devices=args.devices,
            parameter_bytes=task_parameter_bytes(task),
        )
        steps = args.steps
        overlap_auto = _flag_value(setting.flags, "--overlap-steps") is None
        predicted = model(steps=steps, rate_bits=rate)
        # The guard: fewer steps, said in the row; not where the overlap is chosen to hide the rounds, which the
        # model cannot know before the run says what it chose.
        if predicted > budget and not overlap_auto:
            steps = max(10, int(args.steps * budget / predicted) // 10 * 10)
        try:
            row = run_on_sites(task, setting, args, bandwidth, seed, runs_dir, steps, repeat)
        except RuntimeError as error:
            common.progress(f"FAILED {error}")
            bar.advance(note=f"{bandwidth} {setting.key} failed")
            continue
        measured = row["measured_mbit_s"] * 1e6 if row["measured_mbit_s"] else None
        overlap_chosen = overlap_auto and row.get("chosen_overlap")
        if overlap_chosen:
            model = functools.partial(model.func, setting._replace(hidden=row["chosen_overlap"]), **model.keywords)
        if row.get("chosen_period"):
            model = functools.partial(model, period=row["chosen_period"])
            chose = f"{row['chosen_period']}" + (f", overlap {row['chosen_overlap']}" if overlap_chosen else "")
            row["description"] += f": chose {chose}"
        modelled.append(functools.partial(model, steps=steps, rate_bits=measured if nominal else None))
        row["model_wall_s"] = modelled[-1]()
        row["utilisation"] = site_sweep.utilisation(iter_s, steps, row["wall_s"])
        row["shortened"] = steps < args.steps
        rows.append(row)
        bar.advance(note=f"{bandwidth} {setting.key}: {row['wall_s']:.1f} s, utilisation {row['utilisation']:.0%}")
    # The machine is shared: the floor runs again at the end, and the faster of the two is the compute every row
    # is measured against (the lower, more conservative utilisation). A quick sweep checks the script, not the
    # machine: one floor.
    if not args.quick:
        again = site_sweep.floor_setting(args.steps)._replace(key="no-comm-end")
        second = run_on_sites(task, again, args, "none", seed, runs_dir, args.steps)
        common.progress(f"floor: {floor['wall_s']:.1f} s at the start, {second['wall_s']:.1f} s at the end")
        if second["wall_s"] < floor["wall_s"]:
            rows[0] = second
    iter_s = rows[0]["wall_s"] / args.steps
    for row, model in zip(rows[1:], modelled):
        row["utilisation"] = site_sweep.utilisation(iter_s, int(row["steps"]), row["wall_s"])
        row["model_wall_s"] = model(iter_s=iter_s)
    report_sites(task, args, info, rows, bandwidths, warmup, name)


def interleave(bandwidths: Sequence[str], settings: Sequence[Any], repeats: int) -> list[tuple[str, int, Any]]:
    """(link, repeat, setting) in the order they run: per link, the repeats one after another, each with the
    settings in an order rotated by one, so that the machine's drift and a run's place in the order fall on
    every setting alike. A setting limited to some links (``links``) runs only there."""
    return [
        (bandwidth, repeat, setting)
        for bandwidth in bandwidths
        for repeat in range(repeats)
        for setting in [*settings[repeat % len(settings) :], *settings[: repeat % len(settings)]]
        if not setting.links or bandwidth in setting.links
    ]


def task_parameter_bytes(task: Task) -> int:
    return site_sweep.LM_PARAMETER_BYTES if task is LM else site_sweep.RING_PARAMETER_BYTES


def _flag_value(flags: Sequence[str], flag: str) -> int | None:
    """A flag's whole-number value (0 when absent), None for ``auto``."""
    if flag not in flags:
        return 0
    value = flags[flags.index(flag) + 1]
    return None if value == "auto" else int(value)


def run_on_sites(
    task: Task, setting: Any, args: Any, bandwidth: str, seed: int, runs_dir: Path, steps: int, repeat: int = 0
) -> dict[str, Any]:
    """One run of the example as ``--sites`` sites behind ``bandwidth`` (or reuse an identical finished one)."""
    run_dir = runs_dir / f"{bandwidth}-{setting.key.replace('=', '').replace('/', '-')}_seed{seed}"
    if repeat:
        run_dir = run_dir.with_name(f"{run_dir.name}_repeat{repeat}")
    script_args = ["--steps", str(steps), "--seed", str(seed), "--out", str(run_dir / "run")]
    if args.checkpoints == "off" or setting.key.startswith("no-comm"):  # the floor is compute alone
        script_args += ["--checkpoint-every", "0"]
    script_args += ["--log-every", str(max(1, steps // 20)), *setting.flags, *args.example_args]
    key = {"args": script_args, "sites": args.sites, "devices": args.devices, "bandwidth": bandwidth}
    result_path = run_dir / "result.json"
    if args.reuse and result_path.exists():
        saved = json.loads(result_path.read_text())
        if saved.get("key") == key:
            return saved["row"]
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    result = run_sites(
        task.example,
        script_args,
        sites=args.sites,
        devices=args.devices,
        bandwidth=bandwidth,
        out=run_dir / "sites",
        stream=False,
        timeout=args.run_timeout,
    )
    stdout = result.logs[0][0].read_text()
    try:
        if result.code != 0:
            raise RuntimeError(f"exit code {result.code}")
        final = _numbers(parse_final_line(stdout, task.keys))
    except (RuntimeError, ValueError) as error:
        tail = "\n".join(result.logs[0][1].read_text().strip().splitlines()[-10:])
        raise RuntimeError(f"{bandwidth} {setting.key}: {error}; logs in {run_dir}\n{tail}") from None
    comm = _comm_line(stdout)
    chosen = re.search(r"^period auto: (\d+) \((?:overlap (\d+);)?", stdout, re.MULTILINE)
    crossing = comm.get("round_bytes", 0.0) + (0.0 if setting.islands else comm.get("ddp_bytes", 0.0))
    metrics = next((run_dir / "run").glob("logs/version_*/metrics.csv"), run_dir / "missing.csv")
    row = {
        "task": task.name,
        "bandwidth": bandwidth,
        "setting": setting.key,
        "description": setting.label,
        **final,
        "crossing_bytes_per_iter": crossing / final["steps"],
        # DDP's gradient allreduce inside each site (islands): on these shared cores it competes with compute,
        # which on accelerators it would not; the same setting's unlimited-link row shows what it costs in time.
        "inside_bytes_per_iter": (comm.get("ddp_bytes", 0.0) if setting.islands else 0.0) / final["steps"],
        "measured_mbit_s": result.measured_mbit_s,
        "metrics": str(metrics),
        "run_s": round(result.wall_s, 1),
        "chosen_period": int(chosen[1]) if chosen else None,
        "chosen_overlap": int(chosen[2]) if chosen and chosen[2] else None,
        "repeat": repeat,
    }
    common.write_json(result_path, {"key": key, "row": row})
    return row


def print_repeats_summary(runs: list[dict[str, Any]], repeats: int, lm: bool) -> None:
    """Per link and setting, the median of its repeats (and their range); on the LM, how often its loss at
    equal wall-clock (the latest logged, and interpolated) was the lowest on its link."""
    print(
        f"\nOver {repeats} interleaved repeats: the median (min-max) per link and setting. Lowest: in how many"
        " repeats this setting's loss at equal wall-clock was the lowest on its link (ties count for each).\n"
    )
    headers = ["link", "setting", "runs", "wall s", "utilisation"]
    if lm:
        headers += ["val loss", "at equal wall-clock", "lowest", "interpolated", "lowest (interpolated)"]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["bandwidth"], r["setting"]), []).append(r)

    def spread(values: list[float], scale: float = 1.0, digits: int = 1, unit: str = "") -> str:
        values = [v for v in values if v == v]
        if not values:
            return "-"
        low, mid, high = (scale * v for v in (min(values), statistics.median(values), max(values)))
        return f"{mid:.{digits}f}{unit} ({low:.{digits}f}-{high:.{digits}f})"

    def lowest(mine: list[dict[str, Any]], key: str) -> str:
        count = 0
        for r in mine:
            rivals = [o[key] for o in runs if (o["bandwidth"], o["repeat"]) == (r["bandwidth"], r["repeat"])]
            rivals = [v for v in rivals if v == v]
            count += bool(rivals) and r[key] == min(rivals)
        return f"{count}/{len(mine)}"

    table = []
    for mine in groups.values():
        line = [mine[0]["bandwidth"], mine[0]["description"], len(mine)]
        line += [spread([r["wall_s"] for r in mine]), spread([r["utilisation"] for r in mine], 100, 0, "%")]
        if lm:
            line += [spread([r["val_loss"] for r in mine], digits=4)]
            for key in ("val_loss_at_equal_wall", "val_loss_at_equal_wall_interpolated"):
                line += [spread([r[key] for r in mine], digits=4), lowest(mine, key)]
        table.append(line)
    print(common.markdown_table(headers, table))


def report_sites(
    task: Task,
    args: Any,
    info: dict[str, Any],
    rows: list[dict[str, Any]],
    bandwidths: list[str],
    warmup: int,
    name: str,
) -> None:
    floor, runs = rows[0], rows[1:]
    target = None
    if task is LM:
        sync = [r for r in runs if r["setting"] == "sync" and not r["shortened"]]
        target = site_sweep.loss_at(Path(sync[0]["metrics"]), args.steps // 2) if sync else None
    for row in runs:
        reached = site_sweep.time_to_target(Path(row["metrics"]), target) if target is not None else None
        row["time_to_target_s"] = reached if reached is not None else math.nan
        row["model_error"] = row["model_wall_s"] / row["wall_s"] - 1 if row["wall_s"] else math.nan
    # Equal wall-clock: on each link, every run's latest validation by the time the first run (of its repeat)
    # logged its last.
    for bandwidth, repeat in itertools.product(bandwidths, range(args.repeats)):
        on_link = [r for r in runs if r["bandwidth"] == bandwidth and r["repeat"] == repeat]
        curves = [site_sweep.read_curve(Path(r["metrics"])) for r in on_link]
        seconds = site_sweep.equal_wall_clock(curves)
        for row, curve in zip(on_link, curves):
            logged = site_sweep.loss_by(curve, seconds) if seconds is not None else None
            between = site_sweep.loss_interpolated(curve, seconds) if seconds is not None else None
            row["equal_wall_s"] = seconds if seconds is not None else math.nan
            row["val_loss_at_equal_wall"] = logged if logged is not None else math.nan
            row["val_loss_at_equal_wall_interpolated"] = between if between is not None else math.nan
    print(f"# Averaging across {args.sites} simulated sites, task {task.name}{' (QUICK)' if args.quick else ''}\n")
    print(common.machine_line(info, sites=args.sites, processes_per_site=args.devices, steps=args.steps))
    policy = "every 10% of the steps (the examples' default)" if args.checkpoints == "default" else "off"
    floors = "one no-communication run (quick)" if args.quick else "the faster of two no-communication runs"
    print(
        f"\n{task.example.relative_to(common.REPO)} as {args.sites} sites of {args.devices} processes (network"
        " namespaces joined by tbf-limited links, `fabric_multimodel.sites`); warm-up"
        f" {warmup}; checkpoints {policy}. Utilisation: {floors} (at the start{'' if args.quick else ' and the end'}"
        f" of the sweep), {floor['wall_s'] / args.steps * 1e3:.1f} ms per iteration, times the steps, over"
        " the run's wall-clock; vs unlimited link: the same setting's time per iteration with no limit, over this"
        " one's (what the link costs alone); the utilisation on an unlimited link is what the simulation costs"
        " (DDP inside a site and the rounds' own work on the shared cores). Crossing bytes: per rank and iteration,"
        " the collectives over groups that span sites; in-site DDP bytes: DDP's allreduce inside each site (FSDP2's"
        " traffic inside a site is not counted). State: the final line's state_bytes, rank 0's parameters,"
        " gradients, optimizer states and the Averager's own tensors."
        + (f" Target: validation loss {target:.4f} (synchronous DDP at step {args.steps // 2})." if target else "")
        + (
            " At equal wall-clock: each run's latest validation loss by the time the first run on its link logged"
            " its last; interpolated: linear between the validations either side of that moment (the latest can be"
            " a whole validation interval old)."
            if task is LM
            else ""
        )
        + " Model: the cost model's wall-clock (benchmarks/site_sweep.py) from the measured link rate.\n"
    )
    # The same setting on an unlimited link: what it costs besides the link (DDP inside a site, the rounds' own work).
    unlimited = {r["setting"]: r["wall_s"] / r["steps"] for r in runs if r["bandwidth"] == "none"}
    headers = ["link", "setting", *(["repeat"] if args.repeats > 1 else []), "steps", "wall s", "ms/iter mean"]
    headers += ["utilisation", "vs unlimited link"]
    headers += ["crossing B/iter", "in-site DDP B/iter"]
    headers += (
        ["val loss", "at equal wall-clock", "interpolated", "to target s", "state B/rank"]
        if task is LM
        else ["modes", "high quality"]
    )
    headers += ["model wall s (error)"]
    table = []
    for r in runs:
        line = [
            f"{r['bandwidth']} ({r['measured_mbit_s']:.0f} Mbit/s)" if r["measured_mbit_s"] else r["bandwidth"],
            r["description"],
            *([r["repeat"]] if args.repeats > 1 else []),
            f"{r['steps']:g}" + (" (shortened)" if r["shortened"] else ""),
            f"{r['wall_s']:.1f}",
            f"{r['iter_ms_mean']:.1f}",
            f"{100 * r['utilisation']:.0f}%",
            f"{100 * unlimited[r['setting']] * r['steps'] / r['wall_s']:.0f}%" if r["setting"] in unlimited else "-",
            f"{r['crossing_bytes_per_iter']:,.0f}",
            f"{r.get('inside_bytes_per_iter', 0.0):,.0f}",
        ]
        if task is LM:
            reached = r["time_to_target_s"]
            at_equal, between = r["val_loss_at_equal_wall"], r["val_loss_at_equal_wall_interpolated"]
            line += [f"{r['val_loss']:.4f}"]
            line += [f"{at_equal:.4f} ({r['equal_wall_s']:.0f} s)" if at_equal == at_equal else "-"]
            line += [f"{between:.4f}" if between == between else "-"]
            line += [f"{reached:.1f}" if reached == reached else "not reached"]
            line += [f"{r['state_bytes']:,.0f}"]
        else:
            line += [f"{r['modes_captured']:g}/{r['modes_captured_of']:g}", f"{r['high_quality']:.3f}"]
        line.append(f"{r['model_wall_s']:.1f} ({100 * r['model_error']:+.0f}%)")
        table.append(line)
    print(common.markdown_table(headers, table))
    if args.repeats > 1:
        print_repeats_summary(runs, args.repeats, task is LM)
    csv_path = common.write_csv(args.out / f"{name}.csv", runs)
    common.write_json(args.out / f"{name}.json", {"machine": info, "args": vars(args), "rows": rows, "target": target})
    plt = common.pyplot() if task is LM else None
    if plt is not None:
        curves = {
            bandwidth: {
                r["description"]: site_sweep.read_curve(Path(r["metrics"]))
                for r in runs
                if r["bandwidth"] == bandwidth and r["repeat"] == 0  # with --repeats, the first of each
            }
            for bandwidth in bandwidths
        }
        png = site_sweep.plot_curves(plt, args.out / f"{name}.png", curves, target)
        common.progress(f"wrote {csv_path} and {png}")


def main(argv: Sequence[str] | None = None) -> None:
    common.start_clock()
    p = common.parser(NAME, __doc__.splitlines()[0])
    p.add_argument(
        "--task", choices=sorted(TASKS), default="ring", help="ring: the GAN example; lm: the language model"
    )
    p.add_argument("--steps", type=int, default=None, help="iterations per run (default: the task's; quick: fewer)")
    p.add_argument(
        "--warmup-steps", type=int, default=None, help="synchronous steps before averaging (default: the task's)"
    )
    p.add_argument(
        "--periods", type=int, nargs="+", default=None, help="ring: averaging periods (default: 1 2 4 8 16 32)"
    )
    p.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="ring: overlapped rows (default: yes; quick: no)",
    )
    p.add_argument("--overlap-steps", type=int, nargs="+", default=[1, 4], help="ring: overlap_steps of those rows")
    p.add_argument("--layouts", action="store_true", help="lm: the multi-node layouts (2 nodes x 2 processes)")
    p.add_argument(
        "--compare",
        choices=["lowbit", "sparse", "streaming"],
        help="lm: compare payload formats, sparse rounds, or streaming merges, at DiLoCo 128",
    )
    p.add_argument("--seeds", type=int, default=None, help="seeds 0..N-1 per setting (default: ring 3, lm 2; quick: 1)")
    p.add_argument("--devices", type=int, default=None, help="processes per run (default: 4; quick: 2)")
    p.add_argument("--run-timeout", type=float, default=1800.0, help="seconds before one run is abandoned")
    p.add_argument("--reuse", action="store_true", help="reuse finished runs with identical commands (resume a sweep)")
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="runs at a time (default: 1, so that runs do not slow each other; quick: 2)",
    )
    p.add_argument(
        "--sites",
        type=int,
        default=0,
        help="run every setting across this many simulated sites (root; see --bandwidth)",
    )
    p.add_argument(
        "--bandwidth",
        nargs="+",
        default=None,
        help="with --sites: the link rates to sweep (default: none 100mbit 10mbit 1mbit; quick: 10mbit)",
    )
    p.add_argument(
        "--settings", nargs="+", default=None, help="with --sites: only these settings, in this order, and the floor"
    )
    p.add_argument(
        "--checkpoints",
        choices=["default", "off"],
        default="default",
        help="with --sites: the examples' default checkpoint policy (every 10%% of the steps), or none",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="with --sites: runs of each setting on each link, interleaved; the report adds their medians",
    )
    p.add_argument(
        "--run-budget", type=float, default=None, help="with --sites: seconds a run may take before it is shortened"
    )
    p.add_argument("example_args", nargs="*", help="more flags for the example, after `--` (e.g. -- --batch-size 32)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.jobs is not None and args.jobs < 1:
        p.error(f"--jobs must be at least 1, got {args.jobs}")
    task = TASKS[args.task]
    if args.sites:
        sweep_sites(task, args, p)
        return
    args.steps = args.steps or (task.quick_steps if args.quick else task.steps)
    if args.warmup_steps is None:
        args.warmup_steps = 10 if args.quick and task is RING else task.warmup_steps
    args.overlap = args.overlap if args.overlap is not None else not args.quick
    args.devices = args.devices or (2 if args.quick else 4)
    if args.layouts and (task is not LM or args.devices % 2):
        p.error("--layouts needs --task lm and an even --devices (2 nodes)")
    seeds = list(range(args.seeds or (1 if args.quick else 3 if task is RING else 2)))
    if not task.example.exists():
        raise SystemExit(f"averaging_period: {task.example} is missing; this benchmark runs it")
    info = common.machine_info()
    settings = ring_settings(args) if task is RING else lm_settings(args)
    name = NAME if task is RING else f"{NAME}_{task.name}{'_layouts' if args.layouts else ''}"
    name += f"_{args.compare}" if args.compare else ""
    runs_dir = args.out / f"{NAME}_runs" / name

    runs: list[dict[str, Any]] = []
    failures: list[str] = []
    bar = common.Progress("runs", len(seeds) * len(settings), every_s=0)
    cases = [(seed, setting) for seed in seeds for setting in settings]
    # Runs at a time: one for timings; a quick sweep checks the script, and two runs fill the core that one run's
    # launcher leaves idle while it imports.
    with ThreadPoolExecutor(args.jobs or (2 if args.quick else 1)) as pool:
        futures = {
            pool.submit(run_once, task, setting, args, seed, runs_dir): (seed, setting) for seed, setting in cases
        }
        done: dict[tuple[int, str], dict[str, Any]] = {}
        for future in as_completed(futures):
            seed, setting = futures[future]
            try:
                row = future.result()
            except RuntimeError as error:
                failures.append(str(error))
                common.progress(f"FAILED {error}")
                bar.advance(note=f"{setting.key} seed {seed} failed")
                continue
            done[seed, setting.key] = row
            quality = ", ".join(f"{m} {row[m]:.3f}" for m in task.quality)
            how = "reused" if row["reused"] else f"{row['run_s']:.0f}s"
            bar.advance(
                note=f"{setting.key} seed {seed}: {row['iter_ms_median']:.2f} ms/iter,"
                f" {row['comm_bytes_per_iter']:,.0f} B/iter, {quality} ({how})"
            )
    runs.extend(done[seed, setting.key] for seed, setting in cases if (seed, setting.key) in done)
    elapsed = common.elapsed()
    rows = summarise(task, settings, runs)

    print(f"# Averaging period sweep, task {task.name}{' (QUICK mode: indicative only)' if args.quick else ''}\n")
    print(
        common.machine_line(
            info, world_size=args.devices, steps=args.steps, warmup_steps=args.warmup_steps, seeds=len(seeds)
        )
    )
    print()
    print(
        f"{task.example.relative_to(common.REPO)} under `fabric run`. ms/iter median / mean: median over seeds of each"
        " run's median / mean iteration time on rank 0 after warm-up (synchronous DDP: all iterations); the mean"
        " includes the averaging rounds. Ratios are to 'local' (same warm-up, then no communication). bytes/iter:"
        " per rank, warm-up included, divided by all steps; 'sync bytes / bytes': how many times fewer than"
        " synchronous DDP."
        + (" Crossing nodes: collectives over groups that span both nodes." if args.layouts else "")
        + "\n"
    )
    if rows:
        print(table(task, rows, args.layouts))
    if failures:
        print(f"\n{len(failures)} run(s) FAILED:")
        for failure in failures:
            print(f"- {failure.splitlines()[0]}")
    if rows:
        csv_path = common.write_csv(args.out / f"{name}.csv", rows)
        common.write_csv(args.out / f"{name}_runs.csv", runs)
        png = plot(
            task,
            args.out / f"{name}.png",
            rows,
            f"{task.name}: {args.devices} processes, {args.steps} steps, {len(seeds)} seed(s)",
        )
        common.write_json(
            args.out / f"{name}.json",
            {"machine": info, "args": vars(args), "elapsed_s": elapsed, "rows": rows, "runs": runs},
        )
        common.progress(f"done in {elapsed:.0f}s; wrote {csv_path}" + (f" and {png}" if png else ""))
    if failures:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
