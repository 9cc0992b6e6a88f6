"""What a live run costs when its coordinator goes, measured with sites of examples/minimal_loop.py on this machine.

Three scenarios, each with three sites (plain `python` processes, as a user starts them) and the one-process
coordinator (`python -m fabric_multimodel.coordinator`):

- outage: the coordinator SIGKILLed once the three sites train, started again on the same port --down seconds later,
  and a fourth site started as soon as it answers: how long the sites trained alone, how many round boundaries
  they kept their epoch at meanwhile, how long the fourth site took to be admitted, and the sites' final lines.
- grace: the coordinator SIGKILLed and never started again (--grace seconds): how each site stopped and when.
- whole: every site and the coordinator SIGKILLed once they trained --kill-at seconds, then the same commands
  again: where each site resumed, and the final loss beside an uninterrupted run's.

    python benchmarks/coordinator_loss.py --steps 3000 --down 10 --grace 8
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from fabric_multimodel.run.launch import free_port
from fabric_multimodel.run.report import parse_final_line

ROOT = Path(__file__).resolve().parents[1]
SITES = ("a", "b", "c")


class Proc:
    """A process whose output lines are kept with the time each arrived."""

    def __init__(self, command: list[str], env: dict[str, str] | None = None) -> None:
        self.lines: list[tuple[float, str]] = []
        self.proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.time(), line.rstrip()))

    def first(self, pattern: str) -> tuple[float, str] | None:
        return next(((t, line) for t, line in self.lines if re.search(pattern, line)), None)

    def wait_for(self, pattern: str, timeout: float = 600.0) -> float:
        deadline = time.monotonic() + timeout
        while (found := self.first(pattern)) is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"no {pattern!r}: " + "\n".join(line for _, line in self.lines[-20:]))
            time.sleep(0.05)
        return found[0]

    def finish(self, timeout: float = 1800.0) -> int:
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return code

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()


def coordinator(port: int) -> Proc:
    proc = Proc([sys.executable, "-m", "fabric_multimodel.coordinator", "--port", str(port)])
    proc.wait_for("serving on port")
    return proc


def site(name: str, port: int, out: Path, args: argparse.Namespace) -> Proc:
    command = [sys.executable, "examples/minimal_loop.py", "--steps", str(args.steps), "--out", str(out / name)]
    command += ["--coordinator", f"127.0.0.1:{port}", "--grace", str(args.grace), "--min-sites", str(args.min_sites)]
    return Proc(command, env={**os.environ, "SITE": name})


def number(proc: Proc, pattern: str) -> float:
    """The number ``pattern``'s group holds in the first line that matches."""
    found = proc.first(pattern)
    assert found is not None, f"no {pattern!r}"
    match = re.search(pattern, found[1])
    assert match is not None
    return float(match.group(1))


def final(proc: Proc) -> dict[str, str]:
    return parse_final_line(
        "\n".join(line for _, line in proc.lines), ("steps", "val_loss", "wall_s", "comm_bytes", "rounds")
    )


def tracebacks(procs: list[Proc]) -> int:
    return sum(1 for p in procs for _, line in p.lines if "Traceback" in line or line.startswith("frame #"))


def training(args: argparse.Namespace, out: Path) -> tuple[int, Proc, list[Proc]]:
    """A coordinator and three sites, returned once the three trained together for ``--kill-at`` seconds."""
    port = free_port()
    first = coordinator(port)
    sites = [site(name, port, out, args) for name in SITES]
    for proc in sites:
        proc.wait_for(r"epoch \d+: 3 sites")
    time.sleep(args.kill_at)
    return port, first, sites


def outage(args: argparse.Namespace, out: Path) -> list[str]:
    port, first, sites = training(args, out)
    first.kill()
    killed = time.time()
    time.sleep(args.down)
    again = coordinator(port)
    back = time.time()
    joiner = site("d", port, out, args)
    codes = [proc.finish() for proc in [*sites, joiner]]
    again.kill()
    alone = [number(proc, r"back after ([\d.]+) s") for proc in sites]
    kept = [int(number(proc, r"through (\d+) round boundaries")) for proc in sites if proc.first("round boundaries")]
    admitted, asked = joiner.first(r"joined the run at step"), joiner.first(r"a fresh start")  # asked: it registers
    finals = [final(proc) for proc in [*sites, joiner]]
    return [
        "| outage | coordinator SIGKILLed, back on its port after "
        f"{back - killed:.1f} s (its start included), a 4th site started then | "
        f"trained without it: {min(alone):.1f}-{max(alone):.1f} s; round boundaries kept meanwhile: "
        f"{', '.join(map(str, kept))}; 4th site admitted {admitted[0] - back:.1f} s after the coordinator answered"
        f" ({admitted[0] - asked[0]:.1f} s after it registered)"
        f" | exit codes {codes}; val_loss {sorted({f['val_loss'] for f in finals})}; tracebacks: {tracebacks(sites)} |"
        if admitted and asked
        else "| outage | the 4th site was not admitted |"
    ]


def grace(args: argparse.Namespace, out: Path) -> list[str]:
    port, first, sites = training(args, out)
    first.kill()
    killed = time.time()
    codes = [proc.finish() for proc in sites]
    stops = [proc.first(r"^stopped by") for proc in sites]
    seconds = [f"{t - killed:.1f}" for t, _ in filter(None, stops)]
    saved = [p.name for p in sorted(out.glob("*/checkpoint.site-*.pt"))]
    return [
        f"| grace {args.grace:.0f} s | coordinator SIGKILLed, never back | stopped {', '.join(seconds)} s after the"
        f" kill; checkpoints {saved} | exit codes {codes}; tracebacks: {tracebacks(sites)};"
        f" {stops[0][1] if stops[0] else 'no stop line'} |"
    ]


def whole(args: argparse.Namespace, out: Path) -> list[str]:
    port, first, sites = training(args, out)
    for proc in [*sites, first]:
        proc.kill()
    again = coordinator(port)
    restarted = [site(name, port, out, args) for name in SITES]
    codes = [proc.finish() for proc in restarted]
    again.kill()
    resumed = [int(number(p, r"resumed at step (\d+)")) if p.first("resumed at step") else 0 for p in restarted]
    finals = [final(proc) for proc in restarted]
    port = free_port()
    base = coordinator(port)
    plain = [site(name, port, out / "uninterrupted", args) for name in SITES]
    for proc in plain:
        proc.finish()
    base.kill()
    expected = float(final(plain[0])["val_loss"])
    got = float(finals[0]["val_loss"])
    return [
        f"| whole run | every site and the coordinator SIGKILLed {args.kill_at:.0f} s after the three trained, the"
        f" same commands again | resumed at steps {resumed} of {args.steps}; ended at {[f['steps'] for f in finals]}"
        f" | exit codes {codes}; val_loss {got:.6f} vs {expected:.6f} uninterrupted"
        f" ({100 * (got / expected - 1):+.2f}%) |"
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--kill-at", type=float, default=5.0, help="seconds of training before the kill")
    p.add_argument("--down", type=float, default=10.0, help="seconds the coordinator stays down (outage)")
    p.add_argument("--grace", type=float, default=8.0, help="the sites' --grace (the grace scenario)")
    p.add_argument("--min-sites", type=int, default=3, help="the sites' --min-sites: 3 starts them together")
    p.add_argument("--out", type=Path, default=Path("runs/coordinator_loss"))
    p.add_argument("--only", choices=("outage", "grace", "whole"), action="append")
    args = p.parse_args()
    rows = ["| scenario | what happened | measured | outcome |", "| --- | --- | --- | --- |"]
    for name, scenario in (("outage", outage), ("grace", grace), ("whole", whole)):
        if args.only and name not in args.only:
            continue
        folder = args.out / name
        subprocess.run(["rm", "-rf", str(folder)], check=True)
        scenario_args = argparse.Namespace(**vars(args))
        if name != "grace":
            scenario_args.grace = 300.0
        rows += scenario(scenario_args, folder)
        print(rows[-1], flush=True)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
