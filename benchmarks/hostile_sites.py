"""One hostile site among four (issue 70): what it does to the honest sites' model with the plain mean, and with
robust rounds (``--robust clip`` / ``trimmed_mean``), on examples/minimal_loop.py's regression as live sites.

Each run starts a coordinator and live sites of the minimal loop on this machine (each site its own data): three
honest sites alone, then the same three beside a fourth whose every local step is turned by an attack before its
Averager sees it: ``noise`` (Gaussian noise of ``--sigma`` added to its parameters each step), ``scale`` (its step,
so its pseudo-gradient, times 100) or ``flip`` (its step's sign flipped). The attack is this script's, applied in the
hostile site's process around its optimizer's step: the library is not told. Reported: the honest sites' final
validation loss (the same on every site: the rounds leave the replicas identical) and its change against three
honest sites alone with the same rule. The plain mean's column is the example's default round (fp8 codes and
DiLoCo's Nesterov step); the robust ones send fp32 pseudo-gradients to the same outer step.

Usage::

    python benchmarks/hostile_sites.py [--steps 1000] [--attacks noise scale flip] [--rules none clip trimmed_mean]
"""

from __future__ import annotations

import argparse
import os
import runpy
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import common  # noqa: E402
from fabric_multimodel.run.launch import free_port, stop_process_tree  # noqa: E402
from fabric_multimodel.run.report import parse_final_line  # noqa: E402

NAME = "hostile_sites"
EXAMPLE = common.REPO / "examples" / "minimal_loop.py"
KEYS = ("steps", "val_loss", "wall_s", "comm_bytes", "rounds")
ATTACKS = ("noise", "scale", "flip")
RULES = ("none", "clip", "trimmed_mean")


def run_hostile(attack: str, sigma: float, argv: list[str]) -> None:
    """This process as the hostile site: the example, its optimizer's every step turned by ``attack``."""
    import torch

    step = torch.optim.AdamW.step

    def turned(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        params = [p for group in self.param_groups for p in group["params"]]
        before = [p.detach().clone() for p in params]
        result = step(self, *args, **kwargs)
        with torch.no_grad():
            for p, b in zip(params, before):
                if attack == "noise":
                    p.add_(sigma * torch.randn_like(p))
                elif attack == "scale":
                    p.copy_(b + 100 * (p - b))
                else:
                    p.copy_(b - (p - b))
        return result

    torch.optim.AdamW.step = turned  # type: ignore[method-assign]
    sys.argv = [str(EXAMPLE), *argv]
    runpy.run_path(str(EXAMPLE), run_name="__main__")


def one_run(args: argparse.Namespace, rule: str, attack: str | None, folder: Path) -> dict[str, Any]:
    """Three honest sites (and a hostile fourth with ``attack``) of the minimal loop; the honest sites' results."""
    port = free_port()
    coordinator = subprocess.Popen([sys.executable, "-m", "fabric_multimodel.coordinator", "--port", str(port)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    sites = ["a", "b", "c"] + (["x"] if attack else [])
    procs = []
    start = time.perf_counter()
    try:
        for site in sites:
            flags = ["--steps", str(args.steps), "--out", str(folder / site), "--coordinator", f"127.0.0.1:{port}",
                     "--min-sites", str(len(sites)), "--robust", rule]  # fmt: skip
            hostile = [sys.executable, __file__, "--as-hostile", attack or "", "--sigma", str(args.sigma), "--"]
            command = [*hostile, *flags] if site == "x" else [sys.executable, str(EXAMPLE), *flags]
            log = (folder / f"{site}.log").open("w")
            procs.append(subprocess.Popen(command, env={**os.environ, "SITE": site}, stdout=log,
                                          stderr=subprocess.STDOUT, cwd=common.REPO))  # fmt: skip
        codes = [proc.wait(timeout=args.run_timeout) for proc in procs]
    finally:
        for proc in [*procs, coordinator]:
            stop_process_tree(proc)
    texts = [(folder / f"{site}.log").read_text() for site in sites]
    row: dict[str, Any] = {
        "rule": rule,
        "attack": attack or "none",
        "codes": codes,
        "wall_s": time.perf_counter() - start,
    }
    finals = [parse_final_line(text, KEYS) for text, code in zip(texts[:3], codes) if code == 0]
    if len(finals) == 3:
        losses = {float(final["val_loss"]) for final in finals}
        row["val_loss"] = max(losses)
        row["agree"] = len(losses) == 1
    return row


def main() -> None:
    common.start_clock()
    p = common.parser(NAME, __doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1000, help="each site's steps")
    p.add_argument("--attacks", nargs="+", choices=ATTACKS, default=list(ATTACKS))
    p.add_argument("--rules", nargs="+", choices=RULES, default=list(RULES))
    p.add_argument("--sigma", type=float, default=0.05, help="the noise attack's standard deviation per step")
    p.add_argument("--run-timeout", type=float, default=900.0)
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="hostile-") as scratch:
        for rule in args.rules:
            for attack in [None, *args.attacks]:
                folder = Path(scratch) / f"{rule}-{attack or 'honest'}"
                folder.mkdir()
                rows.append(one_run(args, rule, attack, folder))
                common.progress(f"{rule}, {attack or 'three honest sites alone'}: {rows[-1]}")
    print(f"# One hostile site among four{' (QUICK)' if args.quick else ''}\n")
    print(common.machine_line(common.machine_info(), steps=args.steps))
    print(f"\nexamples/minimal_loop.py as live sites on this machine; noise sigma {args.sigma:g}.\n")
    header = ["attack", *(f"{'plain mean' if rule == 'none' else rule} (vs alone)" for rule in args.rules)]
    table = []
    for attack in ["none", *args.attacks]:
        cells = [attack if attack != "none" else "none: three honest sites alone"]
        for rule in args.rules:
            row = next(r for r in rows if r["rule"] == rule and r["attack"] == attack)
            alone = next(r for r in rows if r["rule"] == rule and r["attack"] == "none").get("val_loss")
            loss = row.get("val_loss")
            if loss is None:
                cells.append(f"failed {row['codes']}")
            elif attack == "none" or alone is None:
                cells.append(f"{loss:.4f}")
            else:
                cells.append(f"{loss:.4f} ({100 * (loss / alone - 1):+.1f}%)")
        table.append(cells)
    print(common.markdown_table(header, table))
    common.write_json(args.out / f"{NAME}.json", {"args": vars(args), "rows": rows, "at": time.time()})


if __name__ == "__main__":
    if "--as-hostile" in sys.argv:
        split = sys.argv.index("--")
        own = argparse.ArgumentParser()
        own.add_argument("--as-hostile", choices=ATTACKS)
        own.add_argument("--sigma", type=float)
        mine = own.parse_args(sys.argv[1:split])
        run_hostile(mine.as_hostile, mine.sigma, sys.argv[split + 1 :])
    else:
        main()
