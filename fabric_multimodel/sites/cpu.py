"""Slower sites: a site's processes run in a cgroup whose CPU quota is a share of one core per process.

Real sites differ in speed (another GPU generation, a shared cluster); every round waits for the slowest.
``--cpu 1:0.5`` gives each of site 1's processes half a core (cgroup v1 ``cpu`` controller:
``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``), so on a machine with a core per process it runs at about
half the speed of the others. The group is made before the site starts, its processes join it as they
start (children inherit it), and it is removed with the rest of the run.

Example::

    with SiteCpu("fmm0fdbcf19s1", share=0.5, processes=2) as cpu:
        subprocess.run([*cpu.prefix(), "python", "train.py"])
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from fabric_multimodel.sites.network import SitesError

#: Where the cgroup v1 ``cpu`` controller is mounted.
CPU_CONTROLLER = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000  # 100 ms, the kernel's default period


def check_share(site: int, share: float, sites: int) -> None:
    """Raise ``SitesError`` unless ``site:share`` fits a run of ``sites`` sites."""
    if not 0 <= site < sites:
        raise SitesError(f"--cpu {site}:{share:g}: the site must be in 0..{sites - 1}")
    if not 0.01 <= share <= 1:
        raise SitesError(f"--cpu {site}:{share:g}: the share must be in 0.01..1 (of one core per process)")


def cpu_controller_problem() -> str | None:
    """Why a CPU quota cannot be set on this machine, or None."""
    if not (CPU_CONTROLLER / "cpu.cfs_quota_us").is_file():
        return f"--cpu needs the cgroup v1 cpu controller at {CPU_CONTROLLER} (cpu.cfs_quota_us); it is not there"
    return None


class SiteCpu:
    """A cgroup named ``name`` that lets its processes use ``share`` x ``processes`` cores, in all."""

    def __init__(self, name: str, share: float, processes: int) -> None:
        self.folder = CPU_CONTROLLER / name
        self.share, self.processes = share, processes

    def __enter__(self) -> SiteCpu:
        self.create()
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def create(self) -> None:
        self.folder.mkdir()
        (self.folder / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (self.folder / "cpu.cfs_quota_us").write_text(str(max(1000, round(self.share * self.processes * PERIOD_US))))

    def prefix(self) -> list[str]:
        """A command prefix that moves the command into the group before it runs (``exec``: the same process)."""
        return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(self.folder / "cgroup.procs")]

    def remove(self, wait_s: float = 5.0) -> None:
        """Kill what still runs in the group, then delete it (a group with processes cannot be deleted)."""
        if not self.folder.exists():
            return
        deadline = time.monotonic() + wait_s
        while True:
            pids = [int(pid) for pid in (self.folder / "cgroup.procs").read_text().split()]
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            if time.monotonic() > deadline:
                raise SitesError(f"{self.folder}: processes {pids} would not end; remove it by hand")
            time.sleep(0.05)
        self.folder.rmdir()

    def __str__(self) -> str:
        return f"{self.share:.0%} of a core per process"
