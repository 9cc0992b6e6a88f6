"""The library on a GPU in one command: what every CPU/gloo figure so far leaves unchecked.

Each step runs in its own subprocess with its own timeout (a hanging step is killed, reported, and
the next one starts), all of them within ``--budget-s``:

1. ``tests``: the tests that take the ``device`` fixture (``tests/test_quantized.py``'s codes and
   one-process rounds, ``tests/test_flat.py``) with CUDA tensors: ``pytest -m device --device cuda``.
2. ``gloo``: worlds of 2 and 4 processes sharing the one GPU over gloo (``run_world(...,
   accelerator="cuda")``): each collective the library uses, on CUDA tensors, then an
   ``average_models`` round and Averager runs (plain, bf16, DiLoCo, overlapped DiLoCo, fp8, fp4,
   fragments; and FSDP2 inside sites of two ranks with DiLoCo over the shards), each checked for bitwise
   identical replicas and for ``averager.traffic.bytes`` equal
   to the bytes of the collectives it issued (``all_reduce`` and ``all_to_all_messages`` inputs; the
   all-gather (``all_gather_messages``) returns a 1/W share of the latter, also checked).
3. ``nccl``: the same over NCCL, one process per GPU (2 with two GPUs; with one GPU a world of one,
   where the collectives still run, ``ReduceOp.AVG`` included, and the rounds take their code paths).
4. ``gan`` and ``lm``: ``examples/gan_fabric.py`` and ``examples/lm_fabric.py`` for 300 steps on cuda,
   one process each; their ``final:`` lines (the ring GAN's modes captured and high-quality fraction).
5. ``averaging-cost``: ``benchmarks/averaging_cost.py --quick --accelerator cuda`` at 2 ranks; its
   summary table.
6. ``trainer``: the Trainer adapter (``MultiModelDDPStrategy``) on the GPU: a fit in ``16-mixed``, the memory
   CUDA still holds after its teardown, and with 4 GPUs or more a fit on device ids ``[1, 3]`` (not
   consecutive: its barriers must name the right devices).

On the lent GPU machine (the device tool's ``run``, ``timeout_s`` 420; about 4 minutes)::

    python benchmarks/gpu_check.py --out $OUT

Then read ``$OUT/gpu_check.md``: first a table of every step (status, seconds, the figures), then a
section per step with its tables and, for a step that failed, the end of its output. ``gpu_check.json``
beside it holds the raw results. A status is ``ok``, ``failed``, ``timeout``, ``missing`` (a package or
the GPU is not there: nothing is installed) or ``skipped`` (the budget was spent). The exit code is 0
when every step is ``ok``, 1 otherwise.

Without a GPU (what CI runs, so that this script cannot rot; about a minute on 2 cores)::

    python benchmarks/gpu_check.py --dry-run --out /tmp/gpu_check

runs every step on CPU with tiny sizes and few steps: gloo in place of NCCL, one world of 2 that
shares its device the way the GPU worlds do, three steps at a time.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

NAME = "gpu_check"
DEFAULT_OUT = REPO / "benchmarks" / "results"
TEST_FILES = ("tests/test_quantized.py", "tests/test_flat.py")
GAN_KEYS = [
    "steps", "modes_captured", "high_quality", "wall_s", "iter_ms_median", "iter_ms_mean",
    "comm_bytes", "comm_bytes_per_iter", "rounds", "state_bytes",
]  # fmt: skip
LM_KEYS = [
    "steps", "val_loss", "val_bpb", "wall_s", "iter_ms_median", "iter_ms_mean", "comm_bytes", "comm_bytes_per_iter",
    "rounds", "state_bytes",
]  # fmt: skip
GAN_HEADLINE = ["modes_captured", "high_quality", "iter_ms_median", "wall_s"]
LM_HEADLINE = ["val_loss", "val_bpb", "iter_ms_median", "wall_s"]
#: The Averager runs of the world steps: name -> options (``outer``: DiLoCo's Nesterov step; dtypes by name).
MODES: dict[str, dict[str, Any]] = {
    "mean": {},
    "bf16": {"comm_dtype": "bfloat16"},
    "diloco": {"outer": True},
    "diloco-overlap2": {"outer": True, "overlap_steps": 2},
    "fp8": {"comm_dtype": "float8_e4m3fn"},
    "fp4-diloco": {"outer": True, "comm_dtype": "float4_e2m1fn_x2"},
    "fp8-diloco-fragments2": {"outer": True, "comm_dtype": "float8_e4m3fn", "fragments": 2, "overlap_steps": 1},
    "fp4-diloco-fragments2-ef": {
        "outer": True,
        "comm_dtype": "float4_e2m1fn_x2",
        "fragments": 2,
        "overlap_steps": 2,
        "error_feedback": True,
    },
    # FSDP2 inside sites of two ranks (of one in a world of 2 or less), rounds of the shards across sites
    "fsdp2-diloco-fp8-fragments2": {
        "shard": True,
        "outer": True,
        "comm_dtype": "float8_e4m3fn",
        "fragments": 2,
        "overlap_steps": 1,
    },
}
PERIOD, WARMUP_STEPS = 8, 2  # after warm-up, a round every 8 local steps (with 2 fragments, one every 4)
FABRIC = "lightning_fabric|lightning"  # either Lightning family (what a step needs, for find_spec)
THIS = str(Path(__file__).resolve())
#: Seconds a step must have left to be started at all.
MIN_STEP_S = 20.0


# --- the plan --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One subprocess: its command, its limit, what it needs, and how its output becomes figures."""

    name: str
    title: str
    argv: list[str]
    timeout_s: float
    needs: tuple[str, ...]  # importable modules; "a|b" means either
    gpu: bool  # needs a visible GPU (except in a dry run)
    read: Callable[[Path, str], Reading]  # (its result file, its stdout) -> what it found
    result: Path | None = None


@dataclass
class Reading:
    """What a step found: the verdict, a few headline figures, markdown tables, notes, and everything (JSON)."""

    ok: bool
    figures: dict[str, str] = field(default_factory=dict)
    tables: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    raw: Any = None


def python(*args: str) -> list[str]:
    return [sys.executable, *args]


def plan(args: argparse.Namespace, environment: dict[str, Any], scratch: Path) -> list[Step]:
    """The steps after the environment's, sized for the GPU or (``--dry-run``) for a CPU."""
    dry = args.dry_run
    accelerator = "cpu" if dry else "cuda"
    # Training steps: one period of local steps in a dry run, two on the GPU.
    sizes = {"widths": [8, 33, 17, 4], "batch": 8, "probe": 1000, "steps": WARMUP_STEPS + PERIOD} if dry else {}
    sizes = sizes or {"widths": [512, 2048, 2048, 1000, 64], "batch": 64, "probe": 1 << 20, "steps": 18}
    # The dry run's world shares its device as the GPU's gloo worlds do (Fabric's rank arithmetic is the same).
    gloo = {"sizes": [2] if dry else [2, 4], "backend": "gloo", "accelerator": accelerator, "share_device": True}
    nccl_ranks = 1 if dry or environment.get("cuda_devices", 0) < 2 else 2
    nccl = {"sizes": [nccl_ranks], "backend": "gloo" if dry else "nccl", "accelerator": accelerator}
    nccl_title = "dry run: gloo on CPU" if dry else f"NCCL, {'one GPU per rank' if nccl_ranks > 1 else 'one GPU'}"
    example_steps = args.example_steps or (12 if dry else 300)
    example = ["--accelerator", accelerator, "--steps", str(example_steps), "--checkpoint-every", "0"]
    lm_size = ["--batch-size", "4", "--eval-batches", "2"] if dry else []
    # The dry run times the small model only: the script is what it checks (tests/test_benchmarks.py times both).
    repeats = ["--repeats", "1", "--warmup", "0", "--models", "mlp400"] if dry else ["--repeats", "10", "--warmup", "2"]
    # The dry run checks the step, not the tests (the suite runs them on the CPU): one file.
    files = TEST_FILES[-1:] if dry else TEST_FILES
    pytest = ["-m", "pytest", *files, "-q", "-m", "device", "--device", accelerator, "-p", "no:cacheprovider"]
    ranks = " and ".join(map(str, gloo["sizes"]))
    trainer_spec = {"accelerator": accelerator, "gpus": 0 if dry else environment.get("cuda_devices", 0)}
    trainer_result = scratch / "trainer.json"
    return [
        Step(
            name="tests",
            title=f"the device tests on {accelerator}",
            argv=python(*pytest),
            timeout_s=90,
            needs=("torch", "pytest", "hypothesis"),
            gpu=True,
            read=read_pytest,
        ),
        world_step(
            "gloo", f"gloo worlds of {ranks} ranks sharing one {accelerator} device", {**gloo, **sizes}, 150, scratch
        ),
        world_step("nccl", f"a world of {nccl_ranks} ({nccl_title})", {**nccl, **sizes}, 90 if dry else 75, scratch),
        Step(
            name="gan",
            title=f"examples/gan_fabric.py, {example_steps} steps on {accelerator}",
            argv=python("examples/gan_fabric.py", *example, "--out", str(scratch / "gan")),
            timeout_s=120 if dry else 90,
            needs=("torch", "lightning"),
            gpu=True,
            read=lambda _, out: read_final(out, GAN_KEYS, GAN_HEADLINE),
        ),
        Step(
            name="lm",
            title=f"examples/lm_fabric.py, {example_steps} steps on {accelerator}",
            argv=python("examples/lm_fabric.py", *example, *lm_size, "--out", str(scratch / "lm")),
            timeout_s=120 if dry else 100,
            needs=("torch", "lightning"),
            gpu=True,
            read=lambda _, out: read_final(out, LM_KEYS, LM_HEADLINE),
        ),
        Step(
            name="averaging-cost",
            title=f"benchmarks/averaging_cost.py --quick at 2 ranks on {accelerator}",
            argv=python("benchmarks/averaging_cost.py", "--quick", "--accelerator", accelerator, "--world-sizes", "2")
            + [*repeats, "--out", str(scratch / "averaging_cost")],
            timeout_s=180 if dry else 150,
            needs=("torch", FABRIC),
            gpu=True,
            read=read_cost,
        ),
        Step(
            name="trainer",
            title=f"the Trainer adapter on {accelerator} ({'bf16' if dry else '16'}-mixed)",
            argv=python(THIS, "--step", "trainer", "--spec", json.dumps(trainer_spec), "--result", str(trainer_result)),
            timeout_s=120,
            needs=("torch", "lightning|pytorch_lightning"),
            gpu=True,
            read=read_trainer,
            result=trainer_result,
        ),
    ]


def world_step(name: str, title: str, spec: dict[str, Any], timeout_s: float, scratch: Path) -> Step:
    """A step that runs :func:`worlds_step` in a subprocess; each world gets its share of the step's time."""
    spec = {**spec, "world_timeout_s": timeout_s / len(spec["sizes"]) - 5}
    result = scratch / f"{name}.json"
    argv = python(THIS, "--step", "worlds", "--spec", json.dumps(spec), "--result", str(result))
    return Step(name, title, argv, timeout_s, ("torch", FABRIC), True, read_worlds, result)


# --- running the steps ------------------------------------------------------------------------------


@dataclass
class Outcome:
    name: str
    title: str
    status: str  # ok, failed, timeout, missing, skipped
    seconds: float
    command: str
    reading: Reading
    stdout: str = ""
    stderr: str = ""


class Clock:
    def __init__(self) -> None:
        self.start = time.monotonic()

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def say(self, message: str) -> None:
        print(f"[{self.elapsed:7.1f}s] {message}", flush=True)


def missing_needs(step: Step, environment: dict[str, Any], dry_run: bool) -> list[str]:
    """What the step needs that this machine lacks: modules (not imported here: find_spec only) or the GPU."""
    lacking = [need for need in step.needs if not any(importlib.util.find_spec(m) for m in need.split("|"))]
    if step.gpu and not dry_run and not environment.get("cuda_devices"):
        lacking.append("a visible CUDA GPU (torch.cuda.is_available() is False)")
    return lacking


def child_env() -> dict[str, str]:
    """This copy of the repository first on the path (installed or not), output unbuffered, no inherited clocks."""
    env = {k: v for k, v in os.environ.items() if k != "BENCHMARKS_T0" and not k.startswith("LT_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    return env


class Running:
    """A step's process, in its own process group so that a timeout ends it and every rank it spawned."""

    def __init__(self, step: Step, timeout_s: float, logs: Path) -> None:
        self.step, self.timeout_s = step, timeout_s
        self.out, self.err = logs / f"{step.name}.out", logs / f"{step.name}.err"
        self.started = time.monotonic()
        self.timed_out = False
        with self.out.open("w") as out, self.err.open("w") as err:
            self.proc = subprocess.Popen(
                step.argv, cwd=REPO, env=child_env(), stdout=out, stderr=err, start_new_session=True
            )

    def done(self) -> bool:
        if self.proc.poll() is not None:
            return True
        if time.monotonic() - self.started > self.timeout_s:
            self.timed_out = True
            self._kill_group()
            self.proc.wait()
            return True
        return False

    def _kill_group(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def outcome(self) -> Outcome:
        seconds = time.monotonic() - self.started
        self._kill_group()  # whatever a finished step left running (a rank that did not exit)
        stdout, stderr = self.out.read_text(errors="replace"), self.err.read_text(errors="replace")
        reading = self._read(stdout)
        if self.timed_out:
            status = "timeout"
            reading.notes.insert(0, f"killed after {self.timeout_s:.0f} s (its timeout)")
        elif self.proc.returncode != 0:
            status = "failed"
            reading.notes.insert(0, f"exit code {self.proc.returncode}")
        else:
            status = "ok" if reading.ok else "failed"
        command = command_line(self.step.argv)
        return Outcome(self.step.name, self.step.title, status, seconds, command, reading, stdout, stderr)

    def _read(self, stdout: str) -> Reading:
        result = self.step.result
        if result is not None and not result.is_file():
            return Reading(False, notes=["it wrote no result file"])
        try:
            return self.step.read(result, stdout)
        except (ValueError, KeyError, OSError, StopIteration) as error:  # a run that ended early printed less
            return Reading(False, notes=[f"its output holds no result: {type(error).__name__}: {error}"])


def command_line(argv: list[str]) -> str:
    shown = ["python" if a == sys.executable else a.replace(str(REPO) + os.sep, "") for a in argv]
    return shlex.join(shown)


def run_steps(
    steps: list[Step], args: argparse.Namespace, environment: dict[str, Any], clock: Clock, logs: Path
) -> list[Outcome]:
    """Start the steps, ``args.jobs`` at a time, each limited by its timeout and what is left of the budget.

    One at a time they start in order; several at a time, the longest (by timeout) first, which packs better.
    """
    pending = list(steps) if args.jobs == 1 else sorted(steps, key=lambda s: -s.timeout_s)
    running: list[Running] = []
    outcomes: dict[str, Outcome] = {}
    while pending or running:
        while pending and len(running) < args.jobs:
            step = pending.pop(0)
            lacking = missing_needs(step, environment, args.dry_run)
            left = args.budget_s - clock.elapsed
            if lacking or left < MIN_STEP_S:
                status = "missing" if lacking else "skipped"
                note = f"missing: {', '.join(lacking)}" if lacking else f"skipped: {left:.0f} s of the budget left"
                outcomes[step.name] = Outcome(
                    step.name, step.title, status, 0.0, command_line(step.argv), Reading(False, notes=[note])
                )
                clock.say(f"{step.name}: {note}")
                continue
            timeout = min(step.timeout_s, left)
            clock.say(f"{step.name}: started ({step.title}; timeout {timeout:.0f} s)")
            running.append(Running(step, timeout, logs))
        for run in [r for r in running if r.done()]:
            running.remove(run)
            outcome = run.outcome()
            outcomes[run.step.name] = outcome
            clock.say(f"{run.step.name}: {outcome.status} in {outcome.seconds:.1f} s {summary_of(outcome)}")
        time.sleep(0.2)
    return [outcomes[s.name] for s in steps]


def summary_of(outcome: Outcome) -> str:
    figures = outcome.reading.figures
    return ("(" + "; ".join(f"{k}: {v}" for k, v in figures.items()) + ")") if figures else ""


# --- reading what the steps printed ------------------------------------------------------------------


def read_pytest(_: Path | None, stdout: str) -> Reading:
    """pytest -q's last line (``21 passed, 29 deselected in 4.8s``) and its FAILED lines."""
    lines = [line.strip() for line in stdout.splitlines() if line.strip()]
    summary = next((line for line in reversed(lines) if " in " in line and ("passed" in line or "failed" in line)), "")
    counts = {}
    for part in summary.strip("= ").split(" in ")[0].split(","):
        number, _, what = part.strip().partition(" ")
        if number.isdigit():
            counts[what] = number
    failed = [line.removeprefix("FAILED ") for line in lines if line.startswith(("FAILED ", "ERROR "))]
    ok = int(counts.get("passed", 0)) > 0 and not failed and "failed" not in counts and "error" not in counts
    return Reading(ok, counts, notes=failed)


def read_final(stdout: str, keys: list[str], headline: list[str]) -> Reading:
    """An example's ``final:`` line: every value (raw), the ``headline`` ones as figures."""
    from fabric_multimodel.run.report import parse_final_line

    final = parse_final_line(stdout, keys)
    line = next(line for line in reversed(stdout.splitlines()) if line.startswith("final:"))
    return Reading(True, {k: final[k] for k in headline}, tables=[f"```\n{line}\n```"], raw=final)


def read_cost(_: Path | None, stdout: str) -> Reading:
    """averaging_cost's machine line and its first table (the summary)."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    machine = next((line for line in lines if line.startswith("Machine:")), "")
    rows = lines[start + 2 : end]
    figures = {row.split("|")[1].strip(): f"floor {row.split('|')[3].strip()} ms" for row in rows}
    return Reading(True, figures, tables=["\n".join(lines[start:end])], notes=[machine] if machine else [])


def read_worlds(result: Path, _: str) -> Reading:
    data = json.loads(result.read_text())
    figures, tables, notes = {}, [], []
    for world in data["worlds"]:
        size = world["size"]
        probes, modes = world["probes"], world["modes"]
        collectives = f"{sum(p['ok'] for p in probes)}/{len(probes)} collectives"
        figures[f"{size}-rank world"] = f"{collectives}, {sum(m['ok'] for m in modes)}/{len(modes)} rounds ok"
        notes.append(f"{size}-rank world: {world['placement_text']}")
        if world["error"]:
            notes.append(f"{size}-rank world: ended with an error:\n```\n{world['error']}\n```")
    tables.append(probe_table(data["worlds"]))
    tables.append(mode_table(data["worlds"]))
    return Reading(data["ok"], figures, tables, notes, raw=data)


def probe_table(worlds: list[dict[str, Any]]) -> str:
    names = list(dict.fromkeys(p["name"] for w in worlds for p in w["probes"]))
    rows = []
    for name in names:
        cells = []
        for world in worlds:
            probe = next((p for p in world["probes"] if p["name"] == name), None)
            cells.append("-" if probe is None else "ok" if probe["ok"] else f"**{probe['error']}**")
        rows.append([name, *cells])
    return markdown_table(["collective", *(f"{w['size']}-rank world" for w in worlds)], rows)


def mode_table(worlds: list[dict[str, Any]]) -> str:
    headers = ["round", "ranks", "status", "rounds", "traffic B", "all_reduce B", "all_to_all B", "all_gather B"]
    headers += ["in sync", "s"]
    rows = []
    for world in worlds:
        for m in world["modes"]:
            ops = m.get("ops", {})
            status = "ok" if m["ok"] else f"**{m.get('error') or m.get('problem') or 'failed'}**"
            rows.append(
                [m["name"], world["size"], status, m.get("rounds", "-"), m.get("traffic_bytes", "-")]
                + [ops.get(op, [0, 0])[1] for op in ("all_reduce", "all_to_all_messages", "all_gather_messages")]
                + [m.get("in_sync", "-"), f"{m.get('seconds', 0):.2f}"]
            )
    return markdown_table(headers, rows)


def markdown_table(headers: list[str], rows: list[list[Any]]) -> str:
    def line(cells: list[Any]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in cells) + " |"

    return "\n".join([line(headers), "|" + "|".join("---" for _ in headers) + "|", *map(line, rows)])


# --- the report --------------------------------------------------------------------------------------


def write_report(
    out: Path, args: argparse.Namespace, environment: Outcome, outcomes: list[Outcome], seconds: float
) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    everything = [environment, *outcomes]
    passed = sum(o.status == "ok" for o in everything)
    raw = {
        "dry_run": args.dry_run,
        "seconds": seconds,
        "budget_s": args.budget_s,
        "passed": passed,
        "steps": [
            {
                "name": o.name,
                "title": o.title,
                "status": o.status,
                "seconds": round(o.seconds, 2),
                "command": o.command,
                "figures": o.reading.figures,
                "notes": o.reading.notes,
                "tables": o.reading.tables,
                "raw": o.reading.raw,
                "stdout_tail": o.stdout[-4000:],
                "stderr_tail": o.stderr[-4000:],
            }
            for o in everything
        ],
    }
    (out / f"{NAME}.json").write_text(json.dumps(raw, indent=2) + "\n")
    path = out / f"{NAME}.md"
    path.write_text(report_markdown(args, everything, passed, seconds))
    return path


def report_markdown(args: argparse.Namespace, everything: list[Outcome], passed: int, seconds: float) -> str:
    title = (
        "# GPU check: DRY RUN on CPU (tiny sizes; it checks the script, not a GPU)" if args.dry_run else "# GPU check"
    )
    lines = [title, ""]
    lines.append(f"{passed} of {len(everything)} steps ok in {seconds:.0f} s (budget {args.budget_s:.0f} s).")
    lines += ["", markdown_table(["step", "status", "seconds", "figures"], [
        [o.name, o.status, f"{o.seconds:.1f}", "; ".join(f"{k}: {v}" for k, v in o.reading.figures.items())]
        for o in everything
    ]), ""]  # fmt: skip
    for o in everything:
        lines += [f"## {o.name}: {o.title}", "", f"**{o.status}** in {o.seconds:.1f} s: `{o.command}`", ""]
        lines += [*(f"- {note}" for note in o.reading.notes), ""] if o.reading.notes else []
        for table in o.reading.tables:
            lines += [table, ""]
        if o.status in ("failed", "timeout"):
            for label, text in (("stdout", o.stdout), ("stderr", o.stderr)):
                tail = "\n".join(text.strip().splitlines()[-40:])
                lines += [f"End of its {label}:", "", "```", tail, "```", ""] if tail else []
    return "\n".join(lines)


# --- step: the environment ----------------------------------------------------------------------------


def environment_step() -> dict[str, Any]:
    """Versions and devices, as the other steps will see them (imports torch; initialises CUDA if there)."""
    import torch
    import torch.distributed as dist

    found: dict[str, Any] = {"python": sys.version.split()[0], "torch": torch.__version__}
    found["torch_cuda"] = torch.version.cuda
    found["cuda_devices"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
    found["devices"] = [
        f"{torch.cuda.get_device_name(i)} ({torch.cuda.get_device_properties(i).total_memory / 2**30:.0f} GiB)"
        for i in range(found["cuda_devices"])
    ]
    nccl = torch.cuda.nccl.version() if found["cuda_devices"] and dist.is_nccl_available() else None
    found["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl
    found["gloo"], found["nccl_available"] = dist.is_gloo_available(), dist.is_nccl_available()
    found["float4_e2m1fn_x2"] = hasattr(torch, "float4_e2m1fn_x2")
    for package in ("lightning", "lightning-fabric", "pytorch-lightning", "pytest", "hypothesis", "matplotlib"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = None
    return found


def read_environment(found: dict[str, Any]) -> Reading:
    gpus = ", ".join(found["devices"]) or "no CUDA GPU visible"
    figures = {"torch": f"{found['torch']} (CUDA {found['torch_cuda']})", "GPUs": gpus}
    figures["NCCL"] = str(found["nccl"])
    notes = [f"{k}: {v}" for k, v in found.items() if k not in ("devices",)]
    return Reading(True, figures, notes=notes, raw=found)


# --- step: worlds (gloo sharing the device, or NCCL) ----------------------------------------------------


def worlds_step(spec: dict[str, Any]) -> dict[str, Any]:
    """Run :func:`world_checks` in a fresh world of each size; each rank logs as it goes, so a world that hangs
    or dies still tells what it got through."""
    from fabric_multimodel.run.launch import run_world

    placement = {k: spec[k] for k in ("accelerator", "backend", "share_device") if k in spec}
    worlds = []
    for size in spec["sizes"]:
        log = Path(tempfile.mkdtemp(prefix=f"{NAME}-world{size}-"))
        error = None
        try:
            run_world(size, world_checks, spec, str(log), timeout=spec["world_timeout_s"], **placement)
        except RuntimeError as raised:
            error = str(raised)[-3000:]
        worlds.append(summarize_world(size, spec, log, error))
        shutil.rmtree(log, ignore_errors=True)
    ok = all(w["ok"] for w in worlds)
    return {"ok": ok, "spec": spec, "worlds": worlds}


def summarize_world(size: int, spec: dict[str, Any], log: Path, error: str | None) -> dict[str, Any]:
    """Every rank's log merged: a check is ok when every rank got through it and found it ok."""
    entries: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for rank in range(size):
        path = log / f"rank{rank}.jsonl"
        for line in path.read_text().splitlines() if path.is_file() else []:
            entry = json.loads(line)
            entries.setdefault((entry["kind"], entry["name"]), []).append(entry)

    def merged(kind: str) -> list[dict[str, Any]]:
        found = []
        for (k, _), ranks in entries.items():
            if k != kind:
                continue
            bad = next((e for e in ranks if not e["ok"]), None)
            first = {**ranks[0], **(bad or {})}
            missing = size - len(ranks)
            first["ok"] = bad is None and not missing
            if missing:
                first["error"] = first.get("error") or f"no result from {missing} rank(s)"
            found.append(first)
        return found

    placement = sorted(
        (e for (k, _), ranks in entries.items() if k == "placement" for e in ranks), key=lambda e: e["rank"]
    )
    placement_ok = len(placement) == size and [p["global_rank"] for p in placement] == list(range(size))
    placement_ok = placement_ok and all(p["world_size"] == size for p in placement)
    devices = [p["device"] for p in placement]
    if spec.get("share_device"):
        placement_ok = placement_ok and len(set(devices)) == 1
    elif spec.get("accelerator") != "cpu":
        placement_ok = placement_ok and len(set(devices)) == size
    text = ", ".join(
        f"rank {p['global_rank']} on {p['device']} ({p['backend']}; Fabric's local_rank {p['local_rank']},"
        f" node_rank {p['node_rank']})"
        for p in placement
    )
    probes, modes = merged("probe"), merged("mode")
    ok = error is None and placement_ok and bool(probes) and bool(modes) and all(x["ok"] for x in probes + modes)
    return {
        "size": size,
        "ok": ok,
        "error": error,
        "placement_ok": placement_ok,
        "placement_text": text or "no rank reported",
        "probes": probes,
        "modes": modes,
    }


def world_checks(fabric: Any, spec: dict[str, Any], log: str) -> None:
    """On every rank: where it is, each collective on the world's device, then the rounds; a JSON line per check."""
    import torch.distributed as dist

    with (Path(log) / f"rank{fabric.global_rank}.jsonl").open("a") as out:

        def record(kind: str, name: str, entry: dict[str, Any]) -> None:
            out.write(json.dumps({"kind": kind, "name": name, **entry}) + "\n")
            out.flush()

        where = {"rank": fabric.global_rank, "global_rank": dist.get_rank(), "world_size": dist.get_world_size()}
        where.update(local_rank=fabric.local_rank, node_rank=fabric.node_rank, device=str(fabric.device))
        record("placement", str(fabric.global_rank), {**where, "ok": True, "backend": dist.get_backend()})
        for name, probe in probes(dist.get_backend()).items():
            record("probe", name, checked(probe, fabric.device, spec["probe"]))
        record("mode", "average_models", round_checked(fabric, None, spec))
        for name, options in MODES.items():
            record("mode", name, round_checked(fabric, options, spec))


def checked(probe: Callable[..., Any], *args: Any) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        probe(*args)
        return {"ok": True, "seconds": time.perf_counter() - start}
    except Exception as error:  # a wrong result (AssertionError) or the backend refusing the call
        return {"ok": False, "error": describe(error), "seconds": time.perf_counter() - start}


def describe(error: BaseException) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    text = " / ".join(lines[:3])
    return f"{type(error).__name__}: {text[:400]}"


# The collectives, each on the world's device with values that show where every element came from.


def probes(backend: str) -> dict[str, Callable[[Any, int], None]]:
    import torch

    table = {
        "all_reduce SUM float32": lambda d, n: _all_reduce(d, n, torch.float32, "SUM"),
        "all_reduce SUM bfloat16": lambda d, n: _all_reduce(d, n, torch.bfloat16, "SUM"),
        "all_reduce MAX int64": lambda d, n: _all_reduce(d, n, torch.int64, "MAX"),
        "all_reduce SUM float32, async wait": lambda d, n: _all_reduce(d, n, torch.float32, "SUM", async_op=True),
        "broadcast float32": _broadcast,
        "all_to_all_single uint8": _all_to_all,
        "all_to_all_single uint8, async wait": lambda d, n: _all_to_all(d, n, async_op=True),
        "all_gather_single uint8": _all_gather,
        "all_gather_single uint8, async wait": lambda d, n: _all_gather(d, n, async_op=True),
        "barrier": lambda d, n: _barrier(),
    }
    if backend == "nccl":  # gloo has no AVG ("Cannot use ReduceOp.AVG with Gloo"): the library sums and divides
        table["all_reduce AVG float32"] = lambda d, n: _all_reduce(d, n, torch.float32, "AVG")
    return table


def _expect(got: Any, expected: Any, what: str) -> None:
    import torch

    if not torch.equal(got.cpu(), expected.cpu()):
        wrong = (got.cpu() != expected.cpu()).nonzero()[:3].flatten().tolist()
        raise AssertionError(f"{what}: wrong values (first at {wrong}): got {got.flatten()[:4].tolist()}")


def _all_reduce(device: Any, n: int, dtype: Any, op: str, async_op: bool = False) -> None:
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    t = torch.full((n,), rank + 1, dtype=dtype, device=device)
    work = dist.all_reduce(t, op=getattr(dist.ReduceOp, op), async_op=async_op)
    if async_op:
        work.wait()
        if not work.is_completed():
            raise AssertionError("the work handle is not completed after wait()")
    expected = {"SUM": world * (world + 1) / 2, "MAX": world, "AVG": (world + 1) / 2}[op]
    _expect(t, torch.full((n,), expected, dtype=dtype, device=device), f"all_reduce {op}")


def _broadcast(device: Any, n: int) -> None:
    import torch
    import torch.distributed as dist

    t = torch.full((n,), float(dist.get_rank() + 7), device=device)
    dist.broadcast(t, src=0)
    _expect(t, torch.full((n,), 7.0, device=device), "broadcast")


def _all_to_all(device: Any, n: int, async_op: bool = False) -> None:
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    # Chunk j of rank r holds (r * world + j) % 251: chunk j of the output comes from rank j.
    source = torch.arange(world, device=device).repeat_interleave(n) + rank * world
    received = torch.empty(world * n, dtype=torch.uint8, device=device)
    work = dist.all_to_all_single(received, (source % 251).to(torch.uint8), async_op=async_op)
    if async_op:
        work.wait()
    expected = (torch.arange(world, device=device) * world + rank).repeat_interleave(n) % 251
    _expect(received, expected.to(torch.uint8), "all_to_all_single")


def _all_gather(device: Any, n: int, async_op: bool = False) -> None:
    import torch
    import torch.distributed as dist

    from fabric_multimodel.comm.collectives import all_gather_single

    rank, world = dist.get_rank(), dist.get_world_size()
    gathered = torch.empty(world * n, dtype=torch.uint8, device=device)
    work = all_gather_single(gathered, torch.full((n,), rank + 3, dtype=torch.uint8, device=device), async_op=async_op)
    if async_op:
        work.wait()
    expected = (torch.arange(world, device=device) + 3).repeat_interleave(n).to(torch.uint8)
    _expect(gathered, expected, "all_gather_single")


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


# Rounds: average_models once, then an Averager training run per mode, with the collectives counted.


class Collectives:
    """Wraps the collectives (torch's all-reduce and broadcast, the library's all-to-all and all-gather): counts
    calls and input bytes while ``counting``, and names the call that raised (at launch or at its handle's
    ``wait()``)."""

    NAMES = ("all_reduce", "all_to_all_messages", "all_gather_messages", "broadcast")

    def __init__(self) -> None:
        self.counting = False
        self.ops: dict[str, list[int]] = {name: [0, 0] for name in self.NAMES}
        self.failure: str | None = None

    @contextmanager
    def installed(self) -> Iterator[Collectives]:
        import torch.distributed as dist

        from fabric_multimodel.comm import collectives

        # A payload's all-to-all and all-gather are the library's (point-to-point messages on gloo), the rest torch's.
        ours = ("all_to_all_messages", "all_gather_messages")
        modules = {name: collectives if name in ours else dist for name in self.NAMES}
        saved = {name: getattr(modules[name], name) for name in self.NAMES}
        for name, original in saved.items():
            setattr(modules[name], name, self._wrap(name, original))
        try:
            yield self
        finally:
            for name, original in saved.items():
                setattr(modules[name], name, original)

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            sent = args[1] if name in ("all_to_all_messages", "all_gather_messages") else args[0]
            if self.counting:
                self.ops[name][0] += 1
                self.ops[name][1] += sent.numel() * sent.element_size()
            where = f"{name}({str(sent.dtype).removeprefix('torch.')} on {sent.device})"
            try:
                work = original(*args, **kwargs)
            except Exception as error:
                self.failure = self.failure or f"{where}: {describe(error)}"
                raise
            return _Watched(work, where, self) if work is not None else None

        return call


class _Watched:
    """A work handle whose ``wait()`` failure is recorded as the failing collective's."""

    def __init__(self, work: Any, where: str, collectives: Collectives) -> None:
        self._work, self._where, self._collectives = work, where, collectives

    def wait(self, *args: Any) -> Any:
        try:
            return self._work.wait(*args)
        except Exception as error:
            self._collectives.failure = self._collectives.failure or f"{self._where} at wait(): {describe(error)}"
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def round_checked(fabric: Any, options: dict[str, Any] | None, spec: dict[str, Any]) -> dict[str, Any]:
    """One mode: replicas bitwise identical after it, and the traffic it reports equal to what it sent."""
    start = time.perf_counter()
    collectives = Collectives()
    try:
        with collectives.installed():
            found = (
                averaged_run(fabric, options, spec, collectives)
                if options is not None
                else averaged_once(fabric, spec, collectives)
            )
    except Exception as error:
        entry = {"ok": False, "error": collectives.failure or describe(error), "seconds": time.perf_counter() - start}
        return {**entry, "ops": collectives.ops, "traceback": traceback.format_exc()[-2000:]}
    ops = collectives.ops
    sent = ops["all_reduce"][1] + ops["all_to_all_messages"][1]
    found["traffic_matches"] = found["traffic_bytes"] == sent
    found["gather_matches"] = ops["all_gather_messages"][1] * found["ranks"] == ops["all_to_all_messages"][1]
    problems = [
        text
        for failed, text in (
            (not found["in_sync"], f"replicas differ: {found['explain']}"),
            (not found["traffic_matches"], f"traffic.bytes {found['traffic_bytes']} != {sent} sent"),
            (not found["gather_matches"], "the all-gather did not return 1/W of the all-to-all"),
            (not found["rounds"], "no round"),
            (ops["broadcast"][0] > 0, "a broadcast inside the rounds"),
        )
        if failed
    ]
    return {
        **found,
        "ok": not problems,
        "problem": "; ".join(problems),
        "ops": ops,
        "seconds": time.perf_counter() - start,
    }


def mlp(widths: list[int]) -> Any:
    from torch import nn

    layers: list[Any] = []
    for i, (n_in, n_out) in enumerate(zip(widths, widths[1:])):
        layers += [nn.Linear(n_in, n_out)] + ([nn.LeakyReLU(0.2)] if i < len(widths) - 2 else [])
    return nn.Sequential(*layers)


def batch(fabric: Any, step: int, widths: list[int], size: int) -> tuple[Any, Any]:
    """This rank's batch for ``step`` (different on every rank, so that local steps drift apart)."""
    import torch

    g = torch.Generator().manual_seed(1000 * step + fabric.global_rank)
    x, y = torch.randn(size, widths[0], generator=g), torch.randn(size, widths[-1], generator=g)
    return x.to(fabric.device), y.to(fabric.device)


def averaged_run(
    fabric: Any, options: dict[str, Any], spec: dict[str, Any], collectives: Collectives
) -> dict[str, Any]:
    import functools

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from fabric_multimodel import Averager, replicas_in_sync, setup_models

    torch.manual_seed(0)
    site, peers = sites(fabric) if options.get("shard") else (None, None)
    placement = {"shard": site} if site is not None else {}
    (model,) = setup_models(fabric, m=mlp(spec["widths"]), **placement)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    kwargs = {k: v for k, v in options.items() if k not in ("outer", "comm_dtype", "shard")}
    kwargs |= {"process_group": peers} if peers is not None else {}
    if options.get("outer"):
        kwargs["outer_optimizer"] = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
    if "comm_dtype" in options:
        kwargs["comm_dtype"] = getattr(torch, options["comm_dtype"])
    averager = Averager(fabric, model, period=PERIOD, warmup_steps=WARMUP_STEPS, **kwargs)
    try:
        with averager:
            for step in range(1, spec["steps"] + 1):
                x, y = batch(fabric, step, spec["widths"], spec["batch"])
                fabric.backward(F.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
                collectives.counting = True
                averager.step()
                collectives.counting = False
            collectives.counting = True  # leaving the block is a round too
    finally:
        collectives.counting = False
    report = replicas_in_sync(fabric, model, process_group=peers)
    devices = sorted({str(p.device) for p in model.parameters()})
    ranks = fabric.world_size if peers is None else dist.get_world_size(peers)  # of the averaging group
    found = {"rounds": averager.rounds, "traffic_bytes": averager.traffic.bytes, "in_sync": bool(report)}
    found |= {"ranks": ranks}
    return {**found, "explain": report.explain(), "parameters_on": devices}


def sites(fabric: Any) -> tuple[Any, Any]:
    """This rank's site (consecutive ranks, two per site in a world of 4 or more, else one) and its peers across
    sites; every rank makes every group, in one order."""
    import torch.distributed as dist

    world, rank = fabric.world_size, fabric.global_rank
    per = 2 if world >= 4 and world % 2 == 0 else 1
    site_groups = [dist.new_group(list(range(first, first + per))) for first in range(0, world, per)]
    peer_groups = [dist.new_group(list(range(local, world, per))) for local in range(per)]
    return site_groups[rank // per], peer_groups[rank % per]


def averaged_once(fabric: Any, spec: dict[str, Any], collectives: Collectives) -> dict[str, Any]:
    """``average_models`` of replicas that differ (the NCCL path averages inside the collective: AVG)."""
    import torch

    from fabric_multimodel import average_models, replicas_in_sync, setup_models

    torch.manual_seed(0)
    (model,) = setup_models(fabric, m=mlp(spec["widths"]))
    g = torch.Generator().manual_seed(fabric.global_rank)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.device))
    collectives.counting = True
    try:
        traffic = average_models(fabric, model)
    finally:
        collectives.counting = False
    report = replicas_in_sync(fabric, model)
    found = {"rounds": 1, "traffic_bytes": traffic.bytes, "in_sync": bool(report), "explain": report.explain()}
    return {**found, "ranks": fabric.world_size}


# --- the Trainer adapter ---------------------------------------------------------------------------------


def trainer_step(spec: dict[str, Any]) -> dict[str, Any]:
    """A fit of two models through ``MultiModelDDPStrategy`` in mixed precision, the memory the device still holds
    after the Trainer's teardown, and with 4 GPUs a fit on device ids ``[1, 3]``."""
    import torch

    try:
        import lightning.pytorch as pl

        from fabric_multimodel.lightning import MultiModelDDPStrategy
    except ImportError:
        import pytorch_lightning as pl  # type: ignore[no-redef]

        from fabric_multimodel.pytorch_lightning import MultiModelDDPStrategy  # type: ignore[assignment]
    cuda = spec["accelerator"] == "cuda"
    found: dict[str, Any] = {"fits": [], "ok": True}
    layouts = [("16-mixed" if cuda else "bf16-mixed", 1)] + ([("16-mixed", [1, 3])] if spec["gpus"] >= 4 else [])
    for precision, devices in layouts:
        before = torch.cuda.memory_allocated() if cuda else 0
        start = time.perf_counter()
        try:
            module = _two_models(pl)()
            data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 16)), batch_size=8)
            trainer = pl.Trainer(
                accelerator=spec["accelerator"], devices=devices, strategy=MultiModelDDPStrategy(),
                precision=precision, max_epochs=1, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False,
            )  # fmt: skip
            trainer.fit(module, data)
            loss = float(trainer.callback_metrics.get("loss", torch.tensor(float("nan"))))
            del trainer
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            held = (torch.cuda.memory_allocated() - before) if cuda else 0
            model_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
            fit = {"precision": precision, "devices": str(devices), "ok": True, "loss": loss, "held_bytes": held}
            fit["model_bytes"] = model_bytes
            fit["ok"] = math.isfinite(loss) and held <= model_bytes  # at most the model, if it stayed on the device
        except Exception as error:  # reported in the step's table, the next layout still runs
            fit = {"precision": precision, "devices": str(devices), "ok": False, "error": describe(error)}
        fit["seconds"] = time.perf_counter() - start
        found["fits"].append(fit)
        found["ok"] = found["ok"] and fit["ok"]
    if spec["gpus"] and spec["gpus"] < 4:
        found["notes"] = [f"device ids [1, 3] need 4 GPUs; this machine has {spec['gpus']}"]
    return found


def _two_models(pl: Any) -> Any:
    import torch
    from torch import nn

    class TwoModels(pl.LightningModule):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            super().__init__()
            self.generator = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16))
            self.critic = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = self.critic(self.generator(batch[0])).pow(2).mean()
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return TwoModels


def read_trainer(result: Path, _: str) -> Reading:
    data = json.loads(result.read_text())
    rows = [
        [f["precision"], f["devices"], "ok" if f["ok"] else f"**{f.get('error', 'failed')}**", f.get("loss", "-"),
         f.get("held_bytes", "-"), f"{f['seconds']:.1f}"]
        for f in data["fits"]
    ]  # fmt: skip
    figures = {f"fit {f['precision']} on {f['devices']}": "ok" if f["ok"] else "failed" for f in data["fits"]}
    table = markdown_table(["precision", "devices", "status", "loss", "bytes held after teardown", "s"], rows)
    return Reading(data["ok"], figures, [table], data.get("notes", []), raw=data)


# --- the command line ----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=f"benchmarks/{NAME}.py", description=__doc__.splitlines()[0])
    p.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"folder for {NAME}.md and .json (default: {DEFAULT_OUT})"
    )
    p.add_argument("--dry-run", action="store_true", help="every step on CPU with tiny sizes (CI; no GPU needed)")
    p.add_argument("--budget-s", type=float, default=None, help="seconds for all steps (default: 330; dry run: 600)")
    p.add_argument(
        "--jobs", type=int, default=None, help="steps at a time (default: 1, the GPU's steps alone; dry run: 3)"
    )
    p.add_argument("--example-steps", type=int, default=None, help="steps of each example (default: 300; dry run: 12)")
    # One step's body, run by the script itself in a subprocess.
    p.add_argument("--step", choices=["environment", "worlds", "trainer"], help=argparse.SUPPRESS)
    p.add_argument("--spec", type=json.loads, default={}, help=argparse.SUPPRESS)
    p.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.budget_s = args.budget_s or (600.0 if args.dry_run else 330.0)
    args.jobs = args.jobs or (3 if args.dry_run else 1)
    return args


def run_environment(
    args: argparse.Namespace, clock: Clock, logs: Path, scratch: Path
) -> tuple[Outcome, dict[str, Any]]:
    """The first step, alone: what the others will find (their plan depends on it); ``{}`` when it failed."""
    result = scratch / "environment.json"
    step = Step(
        name="environment",
        title="versions and devices",
        argv=python(THIS, "--step", "environment", "--result", str(result)),
        timeout_s=90,
        needs=("torch",),
        gpu=False,
        read=lambda path, _: read_environment(json.loads(path.read_text())),
        result=result,
    )
    (outcome,) = run_steps([step], args, {}, clock, logs)
    return outcome, json.loads(result.read_text()) if outcome.status == "ok" else {}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.step == "environment":
        args.result.write_text(json.dumps(environment_step()))
        return 0
    if args.step == "worlds":
        found = worlds_step(args.spec)
        args.result.write_text(json.dumps(found))
        return 0 if found["ok"] else 1
    if args.step == "trainer":
        found = trainer_step(args.spec)
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:  # Lightning ran this script again on each other device
            args.result.write_text(json.dumps(found))
        return 0 if found["ok"] else 1
    clock = Clock()
    scratch = Path(tempfile.mkdtemp(prefix=f"{NAME}-"))
    logs = scratch / "logs"
    logs.mkdir()
    try:
        environment, found = run_environment(args, clock, logs, scratch)
        outcomes = run_steps(plan(args, found, scratch), args, found, clock, logs)
        path = write_report(args.out, args, environment, outcomes, clock.elapsed)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    failed = [o.name for o in [environment, *outcomes] if o.status != "ok"]
    clock.say(f"{'all steps ok' if not failed else 'not ok: ' + ', '.join(failed)}; report: {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
