"""What the benchmark scripts share: gloo worlds, tables, CSV, plots, the command line, progress.

Every script is run as ``python benchmarks/<name>.py [--quick] [--out DIR]``; it prints markdown to
stdout, progress to stderr, and writes ``<out>/<name>.csv`` (plus ``<name>.json`` with the machine
and the arguments, and a PNG where a curve says more).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import platform
import re
import socket
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "benchmarks" / "results"

# A collective that hangs becomes an error after this long instead of blocking forever.
COLLECTIVE_TIMEOUT_S = 600

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


# --- gloo worlds ------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port nobody listens on right now, on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_local_world(rank: int, size: int, port: int, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> Any:
    """A launched CPU/gloo ``Fabric`` for rank ``rank`` of a ``size``-process world on 127.0.0.1:``port``.

    Call it in a process that was started externally (spawned); every rank calls it with the same
    ``size`` and ``port``. A collective that hangs raises after ``timeout_s`` seconds.
    """
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
    )
    import torch
    from lightning_fabric import Fabric
    from lightning_fabric.strategies import DDPStrategy

    torch.set_num_threads(1)  # several ranks share the cores; more threads each only contend
    fabric = Fabric(
        accelerator="cpu",
        devices=size,
        strategy=DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=timeout_s)),
    )
    # LOCAL_RANK etc. are set, so Fabric sees externally created processes and only joins the group.
    fabric.launch()
    return fabric


def _rank_main(rank: int, size: int, port: int, fn: Callable[..., Any], args: tuple, conn: Any) -> None:
    try:
        import torch

        fabric = join_local_world(rank, size, port)
        result = fn(fabric, *args)
        conn.send(("ok", result))
        torch.distributed.destroy_process_group()
    except BaseException as exc:  # report everything to the parent, then exit non-zero
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise SystemExit(1) from None


def run_world(size: int, fn: Callable[..., Any], *args: Any, timeout: float = 3600.0) -> list[Any]:
    """Run ``fn(fabric, *args)`` on every rank of a fresh ``size``-process gloo world on 127.0.0.1.

    Each rank has a launched ``Fabric(accelerator="cpu", devices=size, strategy="ddp")`` (gloo) and
    one intra-op thread. ``fn`` must be a module-level function and its result picklable. Returns
    the ranks' results in rank order; raises with the failing ranks' tracebacks, or after
    ``timeout`` seconds (killing the processes it started).
    """
    ctx = mp.get_context("spawn")
    port = free_port()
    conns, procs = [], []
    for rank in range(size):
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_rank_main, args=(rank, size, port, fn, args, child), daemon=True)
        proc.start()
        child.close()
        conns.append(parent)
        procs.append(proc)
    deadline = time.monotonic() + timeout
    results: list[Any] = [None] * size
    errors: dict[int, str] = {}
    pending = dict(enumerate(conns))
    clean = False
    try:
        # Wait on all ranks at once, so the first failure anywhere is reported at once (the other
        # ranks may be blocked in a collective with the rank that failed).
        while pending and not errors:
            if time.monotonic() > deadline:
                errors.update({rank: f"no result after {timeout:.0f} s (timed out)" for rank in pending})
                break
            for conn in mp_connection.wait(list(pending.values()), timeout=1.0):
                rank = next(r for r, c in pending.items() if c is conn)
                del pending[rank]
                try:
                    status, value = conn.recv()
                except EOFError:
                    status, value = "error", f"exited with code {procs[rank].exitcode} without a result"
                if status == "ok":
                    results[rank] = value
                else:
                    errors[rank] = value
        clean = not errors
    finally:
        for proc in procs:
            proc.join(timeout=30 if clean else 1)
            if proc.is_alive():
                proc.kill()
                proc.join()
    if errors:
        report = "\n".join(f"--- rank {rank}: {message}" for rank, message in sorted(errors.items()))
        raise RuntimeError(f"{getattr(fn, '__name__', fn)} failed in a {size}-process world:\n{report}")
    return results


def descendants(pid: int) -> list[int]:
    """Process ids of every descendant of ``pid`` (Linux /proc; empty elsewhere)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            # The parent pid is the 2nd field after the ")" that closes the command name.
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def stop_process_tree(proc: Any, grace_s: float = 15.0) -> None:
    """End ``proc`` (a ``subprocess.Popen``) and every process it started, even those in their own sessions.

    ``fabric run`` starts its ranks through torch elastic, which puts each in a new session; killing
    only the launcher would leave them running (and holding our pipes). First SIGTERM to the launcher,
    which makes torch elastic stop its workers, then SIGKILL whatever of the tree is still alive.
    """
    import signal

    tree = descendants(proc.pid)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except Exception:  # subprocess.TimeoutExpired
            pass
    for pid in [proc.pid, *tree, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


def barrier_timed(fn: Callable[[], Any]) -> float:
    """Seconds ``fn()`` took on this rank, starting right after a barrier with every other rank."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


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
    collectives = []
    for event in prof.events():
        if event.name.startswith(("gloo:", "nccl:")):
            shapes = [shape for shape in event.input_shapes if shape]
            elements = sum(int(torch.Size(shape).numel()) for shape in shapes)
            dtypes = [dtype for shape, dtype in zip(event.input_shapes, event.input_dtypes or []) if shape]
            collectives.append((event.name, elements, tuple(dtypes)))
    # The chrome trace holds every allocation event with its size ("Bytes"); FunctionEvents fold
    # allocations made inside an op into the op, which loses their order.
    with tempfile.TemporaryDirectory() as tmp:
        path = trace_path or Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(Path(path).read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
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
