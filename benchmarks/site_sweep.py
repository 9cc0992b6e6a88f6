"""The averaging sweep across simulated sites: each run under ``fabric_multimodel.sites`` behind a link of a
given rate, and what it costs and buys there: compute utilisation, wall-clock to a target loss, a cost model.

``benchmarks/averaging_period.py --sites S --bandwidth none 100mbit 10mbit`` uses this module: every setting
runs at every bandwidth as S sites of ``--devices`` processes each, one network namespace per site (root).

- **Compute utilisation**: the no-communication run's wall-clock for the same steps (its mean iteration
  time times the steps) over this run's wall-clock, warm-up and rounds included.
- **Wall-clock to target**: the first logged validation loss at or below the target (the synchronous run's
  loss at half its steps, unlimited link), read from the run's ``metrics.csv``; ``not reached`` is an answer.
- **Cost model**: ``fabric_multimodel.plan.cost_model.run_seconds``, the library's one model (the planner's and
  ``period="auto"``'s): the compute at the no-communication iteration time, a flat warm-up's gradients across
  the link, each round's wait beyond its overlap, and the blocking end round, at the measured link rate.
- **Runs-too-long guard**: a run the model predicts to exceed ``--run-budget`` seconds runs for fewer steps,
  and its row says so.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any, NamedTuple

from fabric_multimodel.plan.cost_model import Setting, run_seconds

LM_PARAMETER_BYTES = 218_496 * 4  # examples/lm_fabric.py at its defaults, fp32
RING_PARAMETER_BYTES = 34_179 * 4  # examples/gan_fabric.py's ring GAN, generator and discriminator
TCP_PAYLOAD = 0.957  # of a tbf rate, what TCP carries (measured by the sites tool at 10 mbit-1 gbit)


class SiteSetting(NamedTuple):
    key: str
    label: str
    flags: tuple[str, ...]
    hidden: int = 0  # steps a round overlaps with
    islands: bool = False
    comm_dtype: str = "float32"  # what a round sends
    fragments: int = 1
    density: float = 1.0  # below 1: sparse rounds
    links: tuple[str, ...] = ()  # the bandwidths it runs at (empty: all)


def lm_site_settings(steps: int, warmup: int, quick: bool) -> list[SiteSetting]:
    """The LM example's settings of the sweep (``--quick``: three, for CI)."""
    diloco = ("--outer", "nesterov", "--outer-lr", "0.7", "--outer-momentum", "0.9")

    def run(period: int | str, *extra: str) -> tuple[str, ...]:
        return ("--period", str(period), "--warmup-steps", str(warmup), *diloco, *extra)

    islands, flat = ("--layout", "islands"), ("--layout", "flat")
    streaming = ("--fragments", "4", "--overlap-steps", "16")
    if quick:
        return [
            SiteSetting("sync", "synchronous DDP", ("--period", "0")),
            SiteSetting(
                "streaming=4-fp8",
                "islands, streaming DiLoCo 4 (F=2, overlap 1), fp8",
                run(4, *islands, "--fragments", "2", "--overlap-steps", "1", "--comm-dtype", "float8_e4m3fn"),
                hidden=1,
                islands=True,
                comm_dtype="float8_e4m3fn",
                fragments=2,
            ),
        ]
    return [
        SiteSetting("sync", "synchronous DDP", ("--period", "0")),
        SiteSetting("diloco=128", "DiLoCo 128", run(128, *flat)),
        SiteSetting(
            "diloco=128-overlap=8", "DiLoCo 128, overlapped 8", run(128, *flat, "--overlap-steps", "8"), hidden=8
        ),
        SiteSetting("islands-diloco=128", "islands, DiLoCo 128", run(128, *islands), islands=True),
        SiteSetting(
            "streaming=128",
            "islands, streaming DiLoCo 128 (F=4, overlap 16)",
            run(128, *islands, *streaming),
            hidden=16,
            islands=True,
            fragments=4,
        ),
        # FSDP2 inside each site (memory per rank falls with the processes per site), beside the DDP islands rows.
        SiteSetting(
            "sharded-diloco=128",
            "sharded islands (FSDP2), DiLoCo 128",
            run(128, *islands, "--shard", "node"),
            islands=True,
            links=("none", "10mbit"),
        ),
        SiteSetting(
            "sharded-streaming=128",
            "sharded islands (FSDP2), streaming DiLoCo 128 (F=4, overlap 16)",
            run(128, *islands, *streaming, "--shard", "node"),
            hidden=16,
            islands=True,
            fragments=4,
            links=("none", "10mbit"),
        ),
        # The examples' defaults for a run across sites: no --layout (islands, since the world spans the sites).
        SiteSetting(
            "default=128",
            "streaming DiLoCo 128 (F=4, overlap 16), default layout",
            run(128, *streaming),
            hidden=16,
            islands=True,
            fragments=4,
            links=("none", "100mbit", "10mbit"),
        ),
        # The period chosen from the measured step and link (--period auto), beside the fixed 128 above.
        SiteSetting(
            "default=auto",
            "streaming DiLoCo, period auto (F=4, overlap 16), default layout",
            run("auto", *streaming),
            hidden=16,
            islands=True,
            fragments=4,
            links=("none", "100mbit", "10mbit", "1mbit"),
        ),
        # The overlap chosen too (--overlap-steps auto): the steps a round needs, then the shortest period.
        SiteSetting(
            "default=auto-overlap",
            "streaming DiLoCo, period and overlap auto (F=4), default layout",
            run("auto", "--fragments", "4", "--overlap-steps", "auto"),
            hidden=1,  # until the run says what it chose
            islands=True,
            fragments=4,
            links=("none", "100mbit", "10mbit", "1mbit"),
        ),
        SiteSetting(
            "default=128-fp4",
            "streaming DiLoCo 128, fp4, default layout",
            run(128, *streaming, "--comm-dtype", "float4_e2m1fn_x2"),
            hidden=16,
            islands=True,
            comm_dtype="float4_e2m1fn_x2",
            fragments=4,
            links=("none", "10mbit", "1mbit"),
        ),
        SiteSetting(
            "streaming=128-bf16",
            "islands, streaming DiLoCo 128, bf16",
            run(128, *islands, *streaming, "--comm-dtype", "bfloat16"),
            hidden=16,
            islands=True,
            comm_dtype="bfloat16",
            fragments=4,
            links=("10mbit",),  # beside the low-bit rows, where the link is what limits
        ),
        SiteSetting(
            "streaming=128-fp8",
            "islands, streaming DiLoCo 128, fp8",
            run(128, *islands, *streaming, "--comm-dtype", "float8_e4m3fn"),
            hidden=16,
            islands=True,
            comm_dtype="float8_e4m3fn",
            fragments=4,
        ),
        SiteSetting(
            "streaming=128-fp4",
            "islands, streaming DiLoCo 128, fp4",
            run(128, *islands, *streaming, "--comm-dtype", "float4_e2m1fn_x2"),
            hidden=16,
            islands=True,
            comm_dtype="float4_e2m1fn_x2",
            fragments=4,
        ),
        # Sparse rounds (SparseLoCo): each fragment's top 1/64 per chunk; what a site has not sent stands in for the
        # outer momentum, so no outer optimizer.
        SiteSetting(
            "streaming=128-sparse64",
            "islands, streaming 128, density 1/64",
            ("--period", "128", "--warmup-steps", str(warmup), *islands, *streaming, "--density", "1/64"),
            hidden=16,
            islands=True,
            fragments=4,
            density=1 / 64,
            links=("none", "1mbit", "100kbit"),
        ),
    ]


def ring_site_settings(warmup: int) -> list[SiteSetting]:
    """The ring GAN's settings of the sweep: synchronous DDP and local SGD at periods 8 and 32."""
    return [
        SiteSetting("sync", "synchronous DDP", ("--period", "0")),
        *(
            SiteSetting(
                f"period={p}", f"period {p}", ("--period", str(p), "--warmup-steps", str(warmup), "--layout", "flat")
            )
            for p in (8, 32)
        ),
    ]


def floor_setting(steps: int) -> SiteSetting:
    """No communication at all: one round at the very end (the compute the others are measured against)."""
    return SiteSetting(
        "no-comm",
        "no communication (1 round, at the end)",
        ("--period", str(steps), "--warmup-steps", "0", "--layout", "flat"),
    )


def predict_wall_s(
    setting: SiteSetting,
    *,
    steps: int,
    warmup: int,
    period: int,
    iter_s: float,
    rate_bits: float | None,
    sites: int,
    devices: int,
    parameter_bytes: int = LM_PARAMETER_BYTES,
) -> float:
    """The cost model's wall-clock for a run of ``steps`` (``rate_bits`` None: an unlimited link)."""
    planned = Setting(
        parameter_bytes / 4,
        iter_s,
        period or None,
        sites,
        devices,
        setting.fragments,
        setting.hidden,
        setting.comm_dtype,
        setting.density,
    )
    crosses = bool(period) and not setting.islands
    return run_seconds(planned, steps, rate_bits, warmup_steps=warmup, warmup_crosses=crosses)


def time_to_target(metrics_csv: Path, target: float) -> float | None:
    """Seconds (the run's ``elapsed_s``) of the first logged validation loss at or below ``target``."""
    for row in read_curve(metrics_csv):
        if row[1] <= target:
            return row[0]
    return None


def read_curve(metrics_csv: Path) -> list[tuple[float, float, int]]:
    """(elapsed seconds, validation loss, step) for each logged validation of an LM run."""
    if not metrics_csv.is_file():
        return []
    out = []
    with metrics_csv.open() as f:
        for row in csv.DictReader(f):
            if row.get("val_loss") and row.get("elapsed_s"):
                out.append((float(row["elapsed_s"]), float(row["val_loss"]), int(float(row["step"]))))
    return sorted(out)


def loss_by(curve: list[tuple[float, float, int]], seconds: float) -> float | None:
    """The latest validation loss of ``curve`` (from :func:`read_curve`) logged at or before ``seconds``."""
    by = [loss for elapsed, loss, _ in curve if elapsed <= seconds]
    return by[-1] if by else None


def loss_interpolated(curve: list[tuple[float, float, int]], seconds: float) -> float | None:
    """The validation loss of ``curve`` at ``seconds``, linear between the validations logged either side (the
    last one's at or after it; None before the first). Finer than :func:`loss_by`, which can be a whole
    validation interval old: on the LM at 2000 steps that is 100 steps, more than a period's gain."""
    before = [(elapsed, loss) for elapsed, loss, _ in curve if elapsed <= seconds]
    after = [(elapsed, loss) for elapsed, loss, _ in curve if elapsed > seconds]
    if not before:
        return None
    if not after:
        return before[-1][1]
    (t0, l0), (t1, l1) = before[-1], after[0]
    return l0 + (l1 - l0) * (seconds - t0) / (t1 - t0)


def equal_wall_clock(curves: list[list[tuple[float, float, int]]]) -> float | None:
    """When the first of these runs logged its last validation: the time at which all of them can be compared."""
    ends = [curve[-1][0] for curve in curves if curve]
    return min(ends) if ends else None


def loss_at(metrics_csv: Path, step: int) -> float | None:
    """The validation loss logged at ``step`` (None when that step was not logged)."""
    return next((loss for _, loss, s in read_curve(metrics_csv) if s == step), None)


def plot_curves(plt: Any, path: Path, curves: dict[str, dict[str, list]], target: float | None) -> Path:
    """Validation loss against wall-clock seconds, one panel per bandwidth."""
    bandwidths = list(curves)
    fig, axes = plt.subplots(1, len(bandwidths), figsize=(5 * len(bandwidths), 4.2), sharey=True, squeeze=False)
    for ax, bandwidth in zip(axes[0], bandwidths):
        for label, points in curves[bandwidth].items():
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker=".", label=label)
        if target is not None:
            ax.axhline(target, color="grey", linestyle=":", linewidth=1, label="target")
        ax.set_title(f"link {bandwidth}")
        ax.set_xlabel("wall-clock seconds (rank 0)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("validation loss (nats per byte)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def utilisation(floor_iter_s: float, steps: int, wall_s: float) -> float:
    return floor_iter_s * steps / wall_s if wall_s > 0 else math.nan
