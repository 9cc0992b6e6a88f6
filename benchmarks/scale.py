"""What a run needs at 1B, 10B and 100B parameters: the cost model beside the published Streaming DiLoCo simulation.

Two tables, from ``fabric_multimodel.plan.cost_model`` alone (no measurement, no torch work: a second):

1. Table 4 of the Streaming DiLoCo paper (Douillard et al. 2025, arXiv 2501.18512), the bandwidth each method
   needs for 50 / 80 / 90 / 95 / 99% compute utilisation, beside what the model gives under the paper's
   assumptions (``--assumptions paper``: rounds during the backward, a bucket per layer, a ring of two, no scales).
2. What this library's own rounds need for 90 / 95 / 99% (rounds after the step, overlapped by whole steps,
   fp8 and fp4 with their block scales), beside the paper's rows; what the link of each process must carry
   when a site of 8 processes (islands) gives each its own network card; and the fp8 rounds when one of the two
   sites runs at half speed, each site making the period's steps (``pace="steps"``) or the steps its speed allows
   (``pace="speed"``).

Usage::

    python benchmarks/scale.py [--out DIR]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fabric_multimodel.plan.cost_model import LIBRARY, Assumptions, Setting, bandwidth_for, paced, paper  # noqa: E402

NAME = "scale"
#: Streaming DiLoCo, Table 4: Gbit/s for 50 / 80 / 90 / 95 / 99% compute utilisation; H = 100, fragments of 3
#: layers, an overlap of one step, bf16 payloads (fp4 in the last row); step times from the FLOPs at 60% MFU.
PUBLISHED = {
    (1e9, 24, 0.1): {
        "data-parallel": (86.8, 152.6, 184.2, 222.3, 569.0),
        "DiLoCo": (1.4, 6.2, 13.3, 23.3, 86.8),
        "streaming": (1.4, 5.2, 9.1, 16.0, 28.1),
        "+ overlap": (1.4, 4.3, 6.2, 9.1, 11.0),
        "+ overlap, fp4": (0.4, 0.9, 1.7, 2.0, 3.0),
    },
    (10e9, 48, 0.8): {
        "data-parallel": (104.8, 222.3, 222.3, 268.3, 471.5),
        "DiLoCo": (1.7, 7.5, 16.0, 33.9, 104.8),
        "streaming": (1.7, 5.2, 9.1, 13.3, 19.3),
        "+ overlap": (1.7, 3.6, 5.2, 6.2, 7.5),
        "+ overlap, fp4": (0.4, 0.9, 1.4, 1.4, 1.7),
    },
    (100e9, 108, 4.9): {
        "data-parallel": (184.2, 323.8, 390.7, 390.7, 471.5),
        "DiLoCo": (3.0, 11.0, 23.3, 49.4, 184.2),
        "streaming": (2.4, 6.2, 9.1, 11.0, 19.3),
        "+ overlap": (1.7, 3.6, 4.3, 5.2, 5.2),
        "+ overlap, fp4": (0.5, 0.9, 1.1, 1.1, 1.4),
    },
}
TARGETS = (0.5, 0.8, 0.9, 0.95, 0.99)
#: Two sites, the second at half the first's speed (steps per second).
HALF_SPEED = (1.0, 0.5)


def paper_settings(params: float, layers: int, step_s: float) -> dict[str, Setting]:
    """The paper's methods as settings: H = 100 (at least two steps per fragment), a fragment per 3 layers."""
    fragments = layers // 3
    streaming = Setting(params, step_s, 100, fragments=fragments, comm_dtype="bf16")
    overlapped = streaming.replace(period=max(100, 2 * fragments), overlap_steps=1)
    return {
        "data-parallel": Setting(params, step_s, None),
        "DiLoCo": Setting(params, step_s, 100, comm_dtype="bf16"),
        "streaming": streaming,
        "+ overlap": overlapped,
        "+ overlap, fp4": overlapped.replace(comm_dtype="fp4"),
    }


def library_settings(params: float, layers: int, step_s: float) -> dict[str, Setting]:
    """This library's rounds for the same models: H = 100, or the least the fragments and overlap allow."""
    fragments = layers // 3
    streaming = Setting(
        params, step_s, max(100, 2 * fragments), fragments=fragments, overlap_steps=1, comm_dtype="bf16"
    )
    return {
        "synchronous DDP (fp32 gradients, 25 MiB buckets)": Setting(params, step_s, None),
        "DiLoCo 100, bf16": Setting(params, step_s, 100, comm_dtype="bf16"),
        "streaming, overlap 1, bf16": streaming,
        "streaming, overlap 1, fp8": streaming.replace(comm_dtype="fp8"),
        "streaming, overlap 1, fp4": streaming.replace(comm_dtype="fp4"),
        "streaming, overlap 5, fp4": streaming.replace(
            period=max(100, 6 * fragments), overlap_steps=5, comm_dtype="fp4"
        ),
    }


def gbits(setting: Setting, target: float, assumptions: Assumptions = LIBRARY) -> float:
    return bandwidth_for(setting, target, assumptions) / 1e9


def paper_table() -> tuple[list[list[str]], float]:
    """Rows of (model, method, published / modelled per target), and the worst relative difference."""
    rows, worst = [], 0.0
    for (params, layers, step_s), methods in PUBLISHED.items():
        settings = paper_settings(params, layers, step_s)
        for method, published in methods.items():
            cells = []
            for target, value in zip(TARGETS, published):
                got = gbits(settings[method], target, paper(layers))
                worst = max(worst, abs(got / value - 1))
                cells.append(f"{value:g} / {got:.3g}")
            rows.append([f"{params / 1e9:g}B ({layers}, {step_s} s)", method, *cells])
    return rows, worst


def library_table() -> list[list[str]]:
    rows = []
    for params, layers, step_s in PUBLISHED:
        for method, setting in library_settings(params, layers, step_s).items():
            cells = [f"{gbits(setting, target):.3g}" for target in TARGETS[2:]]
            per_card = gbits(setting, 0.95) / 8
            rows.append([f"{params / 1e9:g}B", method, *cells, f"{per_card:.3g}"])
            if method.endswith("overlap 1, fp8"):
                rows += [[f"{params / 1e9:g}B", *paced_cells(setting, pace)] for pace in ("steps", "speed")]
    return rows


def paced_cells(setting: Setting, pace: str) -> list[str]:
    """The fp8 row with the second of its two sites at half speed: a target the pace cannot reach is ``never``."""
    waited, share = paced(setting, HALF_SPEED, pace)

    def need(target: float, per: int = 1, never: str = f"never (at most {share:.0%})") -> str:
        return f"{gbits(waited, target / share) / per:.3g}" if target < share else never

    cells = [need(target) for target in TARGETS[2:]]
    return [f'the fp8 row, one site at half speed, pace="{pace}"', *cells, need(0.95, per=8, never="never")]


def markdown(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="also write the tables to DIR/scale.md")
    p.add_argument("--quick", action="store_true", help="the same (it takes a second)")
    args = p.parse_args()
    rows, worst = paper_table()
    text = [
        "# What a run needs at 1B-100B parameters: the cost model beside the Streaming DiLoCo simulation\n",
        "## Table 4 (Gbit/s, published / modelled with `--assumptions paper`)\n",
        markdown(["model (layers, step)", "method", *(f"{t:.0%}" for t in TARGETS)], rows),
        f"\nworst difference: {worst:.0%} of the published value\n",
        "## This library's rounds (Gbit/s per site, 2 sites; `--assumptions library`)\n",
        markdown(
            ["model", "setting", *(f"{t:.0%}" for t in TARGETS[2:]), "95%, per card of a site of 8 (islands)"],
            library_table(),
        ),
    ]
    output = "\n".join(text)
    print(output)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"{NAME}.md").write_text(output + "\n")


if __name__ == "__main__":
    main()
