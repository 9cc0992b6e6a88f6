"""Progress a person can follow on a long run: a bar or log lines for the steps (:class:`Progress`), lines for a
long transfer (:func:`transfer_printer`), and where a process's start went (:class:`StartPhases`).

Example::

    phases = StartPhases()          # from the process's creation: interpreter, imports, arguments
    fabric = start_fabric(Fabric)
    phases.mark("launch")
    progress = Progress(total=steps, start=0, every=100, enabled=fabric.is_global_zero, unit="tok")
    for step in loop:
        ...
        progress(step + 1, lambda: {"loss": loss.item()}, scale=tokens_per_step)
    progress.close()
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

_log = logging.getLogger(__name__)


class Progress:
    """Rank 0's progress: a tqdm bar on a terminal, else a line every ``every`` steps through the logger
    ``fabric_multimodel.run.progress`` (INFO).

    The bar counts steps; the rate in ``unit``/s (``scale`` units per step) is shown every ``every`` steps.
    """

    def __init__(self, total: int, start: int, every: int, enabled: bool, unit: str = "it") -> None:
        self.total, self.every, self.enabled, self.unit = total, every, enabled, unit
        self.mark = (time.perf_counter(), start)  # rates count from here: right after a resume too
        self.bar = None
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="it", dynamic_ncols=True, leave=True)

    def __call__(self, step: int, metrics: Callable[[], dict[str, float]], scale: float = 1.0) -> None:
        """Advance to ``step``; ``metrics()`` is only evaluated when something is shown; ``scale`` units per step."""
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
        if step % self.every and step != self.total:
            return
        now = time.perf_counter()
        rate = (step - self.mark[1]) * scale / max(now - self.mark[0], 1e-9)
        self.mark = (now, step)
        shown = {k: f"{v:.3f}" for k, v in metrics().items()}
        if self.bar is not None:
            # tqdm shows steps per second already; a unit of its own gets its own rate.
            self.bar.set_postfix({**shown, f"{self.unit}/s": f"{rate:,.0f}"} if self.unit != "it" else shown)
            return
        shown_text = " ".join(f"{k}={v}" for k, v in shown.items())
        _log.info("step %d/%d %s %s %s/s", step, self.total, shown_text, f"{rate:,.0f}", self.unit)

    def set_total(self, total: int) -> None:
        """A new last step (a paced site's, known at the end of warm-up)."""
        self.total = total
        if self.bar is not None:
            self.bar.total = total
            self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def transfer_printer(what: str, enabled: bool = True) -> Callable[[int, int, float], None]:
    """A ``progress`` callback for a long transfer (``Checkpointer.resume``, ``Membership(on_transfer=)``) that
    logs ``<what>: 1.00 of 9.00 MB in 8.1 s`` (INFO, ``fabric_multimodel.run.progress``) where ``enabled`` (each
    node's first process, say).

    Example::

        checkpointer.resume(state, progress=transfer_printer("resume", fabric.local_rank == 0))
    """

    def show(done: int, total: int, seconds: float) -> None:
        if enabled:
            _log.info("%s: %.2f of %.2f MB in %.1f s", what, done / 1e6, total / 1e6, seconds)

    return show


class StartPhases:
    """Where this process's start went, in seconds per phase.

    ``start`` runs from the process's creation (Linux: ``/proc``; elsewhere it is left out) to this
    object: the interpreter, the imports, the arguments. Each :meth:`StartPhases.mark` ends the phase of its name.

    Example::

        phases = StartPhases()
        fabric = start_fabric(Fabric)
        phases.mark("launch")
        print(phases)  # start=2.1 launch=0.8
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.time()
        created = process_started()
        if created is not None:
            self.seconds["start"] = self._last - created

    def mark(self, name: str) -> None:
        """End the phase ``name`` now (the next one starts)."""
        now = time.time()
        self.seconds[name], self._last = now - self._last, now

    def __str__(self) -> str:
        return " ".join(f"{name}={seconds:.1f}" for name, seconds in self.seconds.items())


def process_started() -> float | None:
    """Unix time this process was created, from ``/proc`` (None where there is none)."""
    try:
        stat = Path("/proc/self/stat").read_text()
        boot = next(line for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime "))
    except (OSError, StopIteration):
        return None
    ticks = int(stat.rpartition(")")[2].split()[19])  # field 22, starttime, counted after the name
    return int(boot.split()[1]) + ticks / os.sysconf("SC_CLK_TCK")
