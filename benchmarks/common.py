"""What the benchmark scripts share: tables, CSV, plots, the command line, progress, timing and profiling.

Worlds are started with :mod:`fabric_multimodel.run.launch` (shared with the tests).

Every script is run as ``python benchmarks/<name>.py [--quick] [--out DIR]``; it prints markdown to
stdout, progress to stderr, and writes ``<out>/<name>.csv`` (plus ``<name>.json`` with the machine
and the arguments, and a PNG where a curve says more).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "benchmarks" / "results"
#: The keys of ``examples/lm_fabric.py``'s ``final:`` line, in order.
LM_KEYS = (
    "steps", "val_loss", "val_bpb", "wall_s", "iter_ms_median", "iter_ms_mean", "comm_bytes", "comm_bytes_per_iter",
    "rounds", "state_bytes",
)  # fmt: skip

# Wall-clock start of the script (see start_clock), shared with the processes it spawns through the
# environment, so every progress line counts from the same moment.
_START = float(os.environ.get("BENCHMARKS_T0", time.time()))


def start_clock() -> None:
    """Start the script's clock now; the processes it spawns later inherit it. Call it first in main()."""
    global _START
    _START = time.time()
    os.environ["BENCHMARKS_T0"] = repr(_START)


# --- command line -----------------------------------------------------------------------------


def parser(name: str, description: str) -> argparse.ArgumentParser:
    """The arguments every script takes: ``--quick`` and ``--out``; scripts add their own."""
    p = argparse.ArgumentParser(prog=f"benchmarks/{name}.py", description=description)
    p.add_argument(
        "--quick", action="store_true", help="a small, fast run (CI smoke test); numbers are indicative only"
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"folder for CSV/JSON/PNG (default: {DEFAULT_OUT})")
    return p


# --- progress ---------------------------------------------------------------------------------


def progress(message: str) -> None:
    """A progress line on stderr, with the time since the script started. Only rank 0 of a world prints."""
    if os.environ.get("RANK", "0") != "0":
        return
    print(f"[{elapsed():7.1f}s] {message}", file=sys.stderr, flush=True)


def elapsed() -> float:
    """Seconds since the script started."""
    return time.time() - _START


class Progress:
    """Counts done/total units of work and prints a line (with an ETA) at most every ``every_s`` seconds."""

    def __init__(self, label: str, total: int, every_s: float = 5.0) -> None:
        self.label, self.total, self.every_s = label, max(total, 1), every_s
        self.done = 0
        self._start = self._last = time.monotonic()

    def advance(self, n: int = 1, note: str = "") -> None:
        self.done += n
        now = time.monotonic()
        if now - self._last >= self.every_s or self.done >= self.total:
            self._last = now
            rate = (now - self._start) / self.done if self.done else 0.0
            eta = rate * (self.total - self.done)
            suffix = f" {note}" if note else ""
            progress(
                f"{self.label}: {self.done}/{self.total} ({100 * self.done / self.total:.0f}%), eta {eta:.0f}s{suffix}"
            )


# --- machine ----------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    """CPU model, cores, and the versions that matter for the numbers."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count()
    try:
        import lightning_fabric

        fabric_version = lightning_fabric.__version__
    except Exception:  # pragma: no cover - reported, not required
        fabric_version = "?"
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "torch": torch.__version__,
        "lightning_fabric": fabric_version,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


def machine_line(info: dict[str, Any], **extra: Any) -> str:
    parts = [
        f"CPU: {info['cpu']}",
        f"{info['usable_cores']} usable cores (of {info['cores']})",
        f"torch {info['torch']}",
        f"lightning-fabric {info['lightning_fabric']}",
        f"Python {info['python']}",
    ]
    parts += [f"{key.replace('_', ' ')}: {value}" for key, value in extra.items()]
    return "Machine: " + "; ".join(parts)


# --- formatting -------------------------------------------------------------------------------

_NUMERIC = re.compile(r"^[-+]?[\d,]*\.?\d+(e[-+]?\d+)?\s*(x|%|ms|s|B|KiB|MiB|GiB)?$", re.IGNORECASE)


def ratio(value: float) -> str:
    """``1.0734 -> '1.07x'``."""
    if value is None or not math.isfinite(value):
        return "n/a"
    return f"{value:.2f}x" if value < 100 else f"{value:.0f}x"


def ms(seconds: float) -> str:
    """Seconds as milliseconds with 3 significant-ish digits."""
    value = seconds * 1e3
    return f"{value:.3f}" if value < 1 else f"{value:.2f}" if value < 100 else f"{value:.1f}"


def human_bytes(n: float) -> str:
    """``25165824 -> '24.0 MiB'``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def thousands(n: int) -> str:
    return f"{int(n):,}"


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A markdown table; a column whose cells are all numbers (or ratios, sizes) is right-aligned."""
    cells = [[str(c) for c in row] for row in rows]
    right = [
        all(_NUMERIC.match(row[i].replace(",", "")) or row[i] in ("", "n/a", "-") for row in cells) and bool(cells)
        for i in range(len(headers))
    ]
    widths = [max([len(h), 3, *(len(row[i]) for row in cells)]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        return "| " + " | ".join(v.rjust(w) if r else v.ljust(w) for v, w, r in zip(values, widths, right)) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if r else ("-" * (w + 2)) for w, r in zip(widths, right)) + "|"
    return "\n".join([line(headers), rule, *(line(row) for row in cells)])


def median(values: Sequence[float]) -> float:
    return statistics.median(values)


# --- files ------------------------------------------------------------------------------------


def write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> Path:
    """Rows of dicts to CSV (columns in the first row's key order)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else [])
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_json(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")
    return path


def write_results(out: Path, name: str, info: dict[str, Any], args: Any, elapsed: float, rows: list[dict]) -> Path:
    """``<out>/<name>.csv`` (the rows) and ``<out>/<name>.json`` (machine, arguments, rows); returns the CSV."""
    write_json(out / f"{name}.json", {"machine": info, "args": vars(args), "elapsed_s": elapsed, "rows": rows})
    return write_csv(out / f"{name}.csv", rows)


def pyplot() -> Any | None:
    """matplotlib.pyplot with a file-only backend, or None (with a hint on stderr) when it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(
            "matplotlib is not installed, so no PNG is written; install it with"
            " `pip install -e '.[plot]'` (or `pip install matplotlib`).",
            file=sys.stderr,
            flush=True,
        )
        return None
    return plt


# --- inside a world ---------------------------------------------------------------------------


def barrier_timed(fn: Callable[[], Any], calls: int = 1) -> float:
    """Seconds one ``fn()`` took on this rank, starting right after a barrier with every other rank: the mean of
    ``calls`` calls in a row."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def gather(value: Any) -> list[Any]:
    """Every rank's ``value`` (a picklable object), on every rank."""
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


# --- profiling --------------------------------------------------------------------------------


@contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Send file descriptor 2 to /dev/null: the profiler's C++ start/stop lines would bury the progress."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def profile_call(fn: Callable[[], Any], trace_path: Path | None = None) -> dict[str, Any]:
    """Run ``fn()`` once under ``torch.profiler`` and count what it did.

    Returns the collectives (``gloo:*``/``nccl:*`` events as (name, input elements, input dtypes),
    from ``record_shapes``), and the peak of the bytes allocated by PyTorch's CPU allocator during the
    call, above what was allocated when it started: the running sum of the allocation (+) and free
    (-) events that ``profile_memory=True`` records, in time order, maximised. Memory that is
    allocated outside PyTorch's allocator (gloo's own transport buffers) is not seen.
    """
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True) as prof:
        fn()
    # Read from the chrome trace: it holds every allocation event with its size ("Bytes") in order, where
    # FunctionEvents fold an op's allocations into the op, and each op's input dtypes, which FunctionEvents
    # carry only from torch 2.13 on (the GPU machine's torch 2.11 has no `input_dtypes`).
    with tempfile.TemporaryDirectory() as tmp:
        path = trace_path or Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(Path(path).read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    collectives = []
    for event in sorted(events, key=lambda e: (e.get("ts", 0), e.get("args", {}).get("Ev Idx", 0))):
        if event.get("name", "").startswith(("gloo:", "nccl:")) and event.get("ph") == "X":
            args = event.get("args", {})
            inputs = [(d, t) for d, t in zip(args.get("Input Dims", []), args.get("Input type", [])) if d]
            elements = sum(int(torch.Size(dims).numel()) for dims, _ in inputs)
            collectives.append((event["name"], elements, tuple(t for _, t in inputs)))
    memory = sorted(
        (e["ts"], e.get("args", {}).get("Ev Idx", 0), int(e["args"]["Bytes"]))
        for e in events
        if e.get("name") == "[memory]" and "Bytes" in e.get("args", {})
    )
    running = peak = 0
    for _, _, nbytes in memory:
        running += nbytes
        peak = max(peak, running)
    return {"collectives": collectives, "peak_extra_bytes": peak}
