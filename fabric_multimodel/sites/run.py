"""A run of simulated sites: the network made, every site's launcher started and watched, a failing site
stopping the others, a site dropped and started again, the timeout, and everything removed at the end, also
when a signal (SIGINT, SIGTERM) arrives at any moment in between.

Example::

    result = run_sites("train.py", ["--steps", "10"], sites=2, devices=1, bandwidth="10mbit", timeout=300)
    assert result.code == 0, result.logs
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from fabric_multimodel.plan.rates import format_rate, parse_rate
from fabric_multimodel.sites.cpu import SiteCpu, check_share, cpu_controller_problem
from fabric_multimodel.sites.network import Sites, SitesError, kill_namespace, measure_link, probe_kernel
from fabric_multimodel.sites.processes import (
    STDOUT,
    Launcher,
    coordinator_command,
    draw_timeline,
    shell_code,
    site_command,
    site_environment,
)

FAILURE_GRACE_S = 2.0  # after a site fails, how long the others may take to fail on their own
STOP_GRACE_S = 3.0  # SIGTERM, then SIGKILL after this long
TIMEOUT_CODE = 124


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Terminated(BaseException):
    """SIGTERM reached the tool; raised in the main thread so that every ``finally`` cleans up."""


# --- preconditions ----------------------------------------------------------------------------------


def preconditions(script: str | Path, sites: int, devices: int) -> str | None:
    """The first reason a run cannot start, as one line, or None. Checks the settings, root, ``ip`` and
    ``tc``, and that the kernel makes namespaces, bridges, veth pairs and tbf qdiscs (in a throwaway
    namespace, removed again).

    Example::

        problem = preconditions("train.py", sites=2, devices=1)
        if problem:
            sys.exit(problem)
    """
    if sites < 1:
        return f"--sites must be >= 1, got {sites}"
    if devices < 1:
        return f"--devices must be >= 1, got {devices}"
    try:
        if not Path(script).is_file():
            return f"{script}: no such script"
    except OSError as error:  # a folder this user may not enter
        return f"{script}: {error.strerror}"
    if os.geteuid() != 0:
        return "needs root: it makes network namespaces and qdiscs (run it with sudo)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"needs {' and '.join(missing)} on PATH (iproute2)"
    return probe_kernel()


@dataclass(frozen=True)
class Drop:
    """Kill site ``site`` (SIGKILL to its launcher and workers) ``at`` seconds after the scripts started, and
    with ``back``, start it again at that time (same namespace and node rank). With ``seen``, the kill waits until
    the site's output holds that text too, and ``back`` then counts from the kill (``back - at`` seconds later): a
    drop at a point of the script's own, on a machine whose speed varies."""

    site: int
    at: float
    back: float | None = None
    seen: str | None = None

    def check(self, sites: int, launcher: str = "fabric") -> None:
        """Raise ``SitesError`` unless this drop fits a run of ``sites`` sites started by ``launcher``."""
        if launcher == "live" and not 0 <= self.site <= sites - 1:
            raise SitesError(f"--drop-site must be a site in 0..{sites - 1}, got {self.site}")
        if launcher != "live" and not 1 <= self.site <= sites - 1:
            span = f"1..{sites - 1}" if sites > 1 else "none with one site"
            raise SitesError(
                f"--drop-site must be a site in {span}, got {self.site}: site 0 hosts the main address and rendezvous"
                " (with --launcher live, any site may be dropped)"
            )
        if not self.at > 0:
            raise SitesError(f"--at must be > 0 seconds, got {self.at}")
        if self.back is not None and not self.back > self.at:
            raise SitesError(f"--back must be later than --at ({self.at}), got {self.back}")


@dataclass(frozen=True)
class Join:
    """Start site ``site`` only ``at`` seconds after the others: a new site joining a run under way (torchrun's
    elastic agents, whose worlds grow when it arrives). With ``seen``, the start waits until site 0's output holds
    that text too: a join at a point of the run's own, on a machine whose speed varies."""

    site: int
    at: float
    seen: str | None = None

    def check(self, sites: int, launcher: str, drop: Drop | None) -> None:
        """Raise ``SitesError`` unless this join fits a run of ``sites`` sites started by ``launcher``."""
        if not 1 <= self.site <= sites - 1:
            raise SitesError(f"--join-site must be a site in 1..{max(sites - 1, 1)}, got {self.site}")
        if not self.at > 0:
            raise SitesError(f"--join-at must be > 0 seconds, got {self.at}")
        if launcher == "fabric":
            raise SitesError("--join-site needs --launcher torchrun or live: a static `fabric run` world cannot grow")
        if drop is not None and drop.site == self.site:
            raise SitesError(f"--join-site {self.site} is the --drop-site too; join and drop different sites")


@dataclass(frozen=True)
class Churn:
    """Every ``every`` seconds kill the next site and start it again ``down`` seconds later: round robin, site 0
    first with ``--launcher live``; with torchrun from site 1, as its site 0 hosts the rendezvous."""

    every: float
    down: float

    def order(self, launcher: str, sites: int) -> tuple[int, ...]:
        """The sites in the order they are killed (then again, round robin)."""
        return tuple(range(sites)) if launcher == "live" else tuple(range(1, sites))

    def check(self, launcher: str, drop: Drop | None, join: Join | None, sites: int = 2) -> None:
        """Raise ``SitesError`` unless this churn fits the run."""
        if launcher == "fabric" or not self.order(launcher, sites):
            raise SitesError(
                "--churn needs --launcher live (any site), or torchrun with 2 sites or more (site 0, which hosts its"
                " rendezvous, is never killed): a static `fabric run` world cannot lose a site"
            )
        if not (self.every > 0 and 0 < self.down < self.every):
            raise SitesError(f"--churn EVERY:DOWN needs 0 < DOWN < EVERY seconds, got {self.every:g}:{self.down:g}")
        if drop is not None or join is not None:
            raise SitesError("--churn drops and starts sites itself: leave out --drop-site and --join-site")


@dataclass(frozen=True)
class SitesResult:
    """What a run did.

    ``run_id`` names its namespaces (``fmm<run id>s<r>``) and is in every site process's ``FMM_SITES_RUN``.
    ``codes``: each site's last exit code (its script's, see ``script_code``; negative: the signal that ended
    it). ``code``: the run's, as a shell reports it: the largest of the sites that ended on their own (a
    dropped site and the sites the tool stopped do not count; a site back after a drop counts with its last
    code), 124 after the timeout. ``started``: when the scripts started (``time.time()``); ``wall_s``, ``ended``
    (when each site's launcher was seen to exit, the last time it ran), ``dropped_at`` and ``back_at`` (when
    ``drop`` happened) and ``joined_at`` (when ``join``'s site started) count from then. ``stopped``: the sites
    the tool ended after another one failed, or at the timeout. ``churned``: with ``churn``, each site killed,
    when, and when it was started again (None: not again). ``timeline``: a live run's picture
    (:mod:`fabric_multimodel.status.timeline`, from the coordinator's status record), when it could be drawn.
    """

    run_id: str
    codes: tuple[int, ...]
    ended: tuple[float, ...]
    code: int
    measured_mbit_s: float | None
    out: Path
    logs: tuple[tuple[Path, Path], ...]
    wall_s: float
    started: float
    drop: Drop | None = None
    dropped_at: float | None = None
    back_at: float | None = None
    stopped: tuple[int, ...] = ()
    timed_out: bool = False
    joined_at: float | None = None
    churned: tuple[tuple[int, float, float | None], ...] = ()
    timeline: Path | None = None


def run_sites(
    script: str | Path,
    args: Sequence[str] = (),
    *,
    sites: int,
    devices: int,
    bandwidth: str | int | None,
    out: str | Path | None = None,
    launcher: str = "fabric",
    drop: Drop | None = None,
    join: Join | None = None,
    churn: Churn | None = None,
    cpu: Mapping[int, float] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    stream: bool = True,
    port: int = 29500,
    max_restarts: int = 3,
    coordinator: Sequence[str] | None = None,
) -> SitesResult:
    """Run ``script args`` as ``sites`` nodes of ``devices`` processes, each site in its own namespace behind a
    link of ``bandwidth`` (``"100mbit"``, bits/s, or None/"none": unlimited) each way, and return what happened.

    Measures the link first; with ``stream``, prints that and site 0's output (stdout and stderr) live. Every
    site's output goes to ``out`` (default ``runs/sites/<run id>``; it must not exist yet): ``site<r>.out`` and
    ``site<r>.err``, and the tool's own lines (measured rate, drops) to ``sites.log``. A site that fails
    stops the others ``FAILURE_GRACE_S`` later; after ``timeout`` seconds everything stops (code 124).
    Everything it made (namespaces, interfaces, processes) is gone when it returns or raises, also on Ctrl-C
    and on SIGTERM (raised as ``Terminated`` when it runs in the main thread). Raises ``SitesError`` for a
    setting or precondition that stops it before anything is made. ``cpu`` (``{site: share}``) runs each of those
    sites' processes with ``share`` of one core (a cgroup quota, see :mod:`~fabric_multimodel.sites.cpu`), said in
    the first line and removed at the end. ``{site}`` in ``args`` becomes each site's index (``--out
    runs/x/site{site}``: a folder per site, as sites without a shared disk have). ``launcher="live"``: every site
    is a ``fabric run`` world of its own, and the coordinator (``python -m fabric_multimodel.coordinator``) runs
    in a namespace of its own behind the same kind of link; the script gets ``--coordinator ADDRESS:PORT --site
    S`` after ``args``; any site may be dropped, and ``churn`` drops them in turn. ``coordinator``: another
    coordinator's command for live runs (``{port}`` becomes the port the sites are given), such as a peer's
    (torchft's Lighthouse, ``benchmarks/elastic.py``).

    Example::

        result = run_sites("train.py", ["--steps", "10"], sites=2, devices=1, bandwidth="10mbit", timeout=300)
        assert result.code == 0, result.logs
    """
    with _signals_raise():  # already for the kernel probe, which makes a namespace too
        bits = _check_settings(script, sites, devices, bandwidth, launcher, drop, join, churn, cpu, coordinator)
        cpu = dict(cpu or {})
        net = Sites(sites + (launcher == "live"), bits)  # live: the coordinator's host is the last namespace
        folder = Path(out) if out is not None else Path("runs") / "sites" / net.run_id
        if folder.exists():
            raise SitesError(f"{folder} exists already: give --out a new folder")
        folder.mkdir(parents=True)
        say = _teller(stream, folder / "sites.log")
        limits = {site: SiteCpu(net.namespaces[site], share, devices) for site, share in sorted(cpu.items())}
        try:
            net.create()
            for limit in limits.values():
                limit.create()
            measured = measure_link(net) if sites > 1 else None
            say(_link_line(net, sites, devices, measured, limits))
            environment = site_environment(net.run_id, launcher, env)
            options: dict[str, Any] = {"sites": net, "devices": devices, "port": port, "max_restarts": max_restarts}
            commands = [_site_command(r, script, args, launcher, limits, options) for r in range(sites)]
            launchers = [Launcher(r, c, environment, folder, echo=stream and r == 0) for r, c in enumerate(commands)]
            host = None  # the coordinator's launcher
            if launcher == "live":
                record = None if coordinator else folder / "status.jsonl"  # our own coordinator records the run
                command = coordinator_command(net, port, coordinator, record)
                host = Launcher(sites, command, environment, folder, echo=False, name="coordinator")
            run = _Run(net, launchers, host, churn.order(launcher, sites) if churn else ())
            try:
                run.watch(drop, join, timeout, say, churn)
            finally:
                with _signals_held():
                    run.end()
        finally:
            with _signals_held():
                net.close()
                for limit in limits.values():
                    limit.remove()
        result = run.result(measured, folder, drop)
    if launcher == "live" and coordinator is None:
        result = dataclasses.replace(result, timeline=draw_timeline(folder / "status.jsonl", say))
    return result


def _check_settings(
    script: str | Path,
    sites: int,
    devices: int,
    bandwidth: str | int | None,
    launcher: str,
    drop: Drop | None,
    join: Join | None,
    churn: Churn | None,
    cpu: Mapping[int, float] | None,
    coordinator: Sequence[str] | None,
) -> int | None:
    """``run_sites``' settings checked before anything is made (a ``SitesError`` naming the flag); the link's rate."""
    try:
        bits = parse_rate(bandwidth) if isinstance(bandwidth, str) else bandwidth
    except ValueError as error:
        raise SitesError(f"--bandwidth {error}") from None
    if launcher not in ("fabric", "torchrun", "live"):
        raise SitesError(f"--launcher must be fabric, torchrun or live, got {launcher!r}")
    if drop is not None:
        drop.check(sites, launcher)
    if join is not None:
        join.check(sites, launcher, drop)
    if churn is not None:
        churn.check(launcher, drop, join, sites)
    if coordinator is not None and launcher != "live":
        raise SitesError("a coordinator command needs the live launcher (--launcher live)")
    for site, share in (cpu or {}).items():
        check_share(site, share, sites)
    problem = preconditions(script, sites, devices) or (cpu_controller_problem() if cpu else None)
    if problem:
        raise SitesError(problem)
    return bits


def _site_command(
    site: int,
    script: str | Path,
    args: Sequence[str],
    launcher: str,
    limits: Mapping[int, SiteCpu],
    options: dict[str, Any],
) -> list[str]:
    """Site ``site``'s command: its launcher's, under its CPU limit, ``{site}`` in ``args`` made its index."""
    own = [arg.replace("{site}", str(site)) for arg in args]
    prefix = limits[site].prefix() if site in limits else []
    return [*prefix, *site_command(launcher, script, own, site=site, **options)]


def _link_line(net: Sites, sites: int, devices: int, measured: float | None, limits: Mapping[int, SiteCpu]) -> str:
    head = f"sites: run {net.run_id}: {sites} x {devices} processes, link {format_rate(net.bits)} each way"
    if sites < net.count:
        head += f", the coordinator at {net.addresses[-1]}"
    slower = "".join(f"; site {site} at {limit}" for site, limit in limits.items())
    if measured is None:
        return f"{head}; one site: no link to measure{slower}"
    rate = f"{measured:.1f}" if measured < 100 else f"{measured:.0f}"
    return f"{head}, measured {rate} Mbit/s{slower}"


class _Run:
    """The sites' launchers from start to end: the failure, drop and timeout rules of ``run_sites``."""

    def __init__(
        self, net: Sites, sites: list[Launcher], coordinator: Launcher | None = None, churn_order: Sequence[int] = ()
    ) -> None:
        self.net, self.sites, self.coordinator, self.churn_order = net, sites, coordinator, churn_order
        self.churned: list[list[Any]] = []  # [site, killed at, started again at]
        self.start, self.started = time.monotonic(), time.time()
        self.dropped_at: float | None = None
        self.back_at: float | None = None
        self.joined_at: float | None = None
        self.timed_out = False
        self.wall_s = 0.0

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def watch(
        self,
        drop: Drop | None,
        join: Join | None,
        timeout: float | None,
        say: Callable[[str], None],
        churn: Churn | None = None,
    ) -> None:
        """Start every site (``join``'s later) and watch them until all have ended, dropping and restarting as
        ``drop`` and ``churn`` say."""
        if self.coordinator is not None:
            self.coordinator.start()
        self.start, self.started = time.monotonic(), time.time()
        for site in self.sites:
            if join is None or site.index != join.site:
                site.start()
        failed_at: float | None = None
        while True:
            now = self.elapsed()
            if timeout is not None and now > timeout:
                self.timed_out = True
                say(f"sites: timed out after {timeout:g} s; stopping every site")
                self.stop([s for s in self.sites if s.running()])
                break
            if drop is not None and failed_at is None:
                self._drop(drop, now, say)
            if churn is not None and failed_at is None:
                self._churn(churn, now, say)
            if (
                join is not None
                and self.joined_at is None
                and now >= join.at
                and failed_at is None
                and _holds(self.sites[0].logs[0], join.seen)
            ):
                self.joined_at = now
                self.sites[join.site].start()
                say(f"sites: site {join.site} joined at {now:.1f} s")
            for site in self.sites:
                if site.poll() and site.failed() and failed_at is None:
                    failed_at = now
            if failed_at is not None and now - failed_at >= FAILURE_GRACE_S:
                self.stop([s for s in self.sites if s.running()])
            if not any(s.running() for s in self.sites):
                if drop is not None and drop.back is not None and self.dropped_at is not None and self.back_at is None:
                    say(f"sites: site {drop.site} not started again: every other site has ended")
                break
            time.sleep(0.05)
        self.wall_s = self.elapsed()

    def _drop(self, drop: Drop, now: float, say: Callable[[str], None]) -> None:
        site = self.sites[drop.site]
        if self.dropped_at is None and now >= drop.at and site.running() and _holds(site.logs[0], drop.seen):
            self.dropped_at = now
            site.dropped = True
            kill_namespace(self.net.namespaces[drop.site])
            site.finish()
            say(f"sites: dropped site {drop.site} at {now:.1f} s (SIGKILL to its launcher and workers)")
        elif drop.back is not None and self.dropped_at is not None and self.back_at is None and now >= self._back(drop):
            self.back_at = now
            with site.logs[0].open("a") as log:
                log.write(f"sites: started again at {now:.1f} s\n")
            site.start()
            say(f"sites: site {drop.site} back at {now:.1f} s (same namespace and node rank)")

    def _back(self, drop: Drop) -> float:
        assert drop.back is not None and self.dropped_at is not None
        return drop.back if drop.seen is None else self.dropped_at + drop.back - drop.at

    def _churn(self, churn: Churn, now: float, say: Callable[[str], None]) -> None:
        for entry in self.churned:
            site = self.sites[entry[0]]
            if entry[2] is None and now >= entry[1] + churn.down and any(s.running() for s in self.sites):
                entry[2] = now
                site.start()
                say(f"sites: site {site.index} back at {now:.1f} s")
        if now >= (len(self.churned) + 1) * churn.every:
            site = self.sites[self.churn_order[len(self.churned) % len(self.churn_order)]]
            self.churned.append([site.index, now, None])
            if site.running():
                site.dropped = True
                kill_namespace(self.net.namespaces[site.index])
                site.finish()
                say(f"sites: dropped site {site.index} at {now:.1f} s (churn; back in {churn.down:g} s)")

    def stop(self, sites: list[Launcher]) -> None:
        """SIGTERM the launchers (torch elastic then stops its workers), SIGKILL what is left after the grace."""
        for site in sites:
            site.stopped = True
            if site.proc is not None and site.proc.poll() is None:
                site.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        while any(s.proc.poll() is None for s in sites if s.proc) and time.monotonic() < deadline:
            time.sleep(0.05)
        for site in sites:
            kill_namespace(self.net.namespaces[site.index])
            site.finish()

    def end(self) -> None:
        """Whatever happened: stop what still runs (the coordinator last) and collect every launcher."""
        self.stop([s for s in self.sites if s.running()])
        for site in self.sites:
            site.finish()
        if self.coordinator is not None:
            self.stop([self.coordinator] if self.coordinator.running() else [])
            self.coordinator.finish()
        self.wall_s = self.wall_s or self.elapsed()

    def result(self, measured: float | None, out: Path, drop: Drop | None) -> SitesResult:
        counted = [shell_code(s.code) for s in self.sites if s.failed() and s.code is not None]
        return SitesResult(
            run_id=self.net.run_id,
            codes=tuple(s.code if s.code is not None else 0 for s in self.sites),
            ended=tuple(s.ended_at - self.start if s.ended_at is not None else self.wall_s for s in self.sites),
            code=TIMEOUT_CODE if self.timed_out else max(counted, default=0),
            measured_mbit_s=measured,
            out=out,
            logs=tuple(s.logs for s in self.sites),
            wall_s=self.wall_s,
            started=self.started,
            drop=drop,
            dropped_at=self.dropped_at,
            back_at=self.back_at,
            stopped=tuple(s.index for s in self.sites if s.stopped),
            timed_out=self.timed_out,
            joined_at=self.joined_at,
            churned=tuple((site, down, back) for site, down, back in self.churned),
        )


def _holds(log: Path, text: str | None) -> bool:
    """True when ``text`` is None or in ``log`` (read whole: a site's stdout, small)."""
    if text is None:
        return True
    try:
        return text in log.read_text(errors="replace")
    except OSError:
        return False


def _teller(stream: bool, log: Path) -> Callable[[str], None]:
    """The tool's own lines: appended to ``log``, and with ``stream`` printed between site 0's lines."""

    def say(line: str) -> None:
        with log.open("a") as file:
            file.write(line + "\n")
        if stream:
            with STDOUT:
                print(line, flush=True)

    return say


@contextmanager
def _signals_raise() -> Iterator[None]:
    """While the block runs, SIGINT raises ``KeyboardInterrupt`` and SIGTERM ``Terminated`` in the main thread
    (elsewhere: left alone), so that every ``finally`` cleans up.

    SIGINT's handler is set here too: Python leaves SIGINT ignored when it started ignored, as in every
    background job of a non-interactive shell (``cmd &`` in a script, and what such a job starts), and
    the tool then ran on to its timeout, deaf to the SIGINT it was sent.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminated(signum: int, frame: Any) -> NoReturn:
        raise Terminated

    handlers = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: terminated}
    previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@contextmanager
def _signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM while cleaning up (a second Ctrl-C must not leave namespaces behind), then raise
    what arrived."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: received.append(signum)) for sig in _STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if received:
        raise KeyboardInterrupt if received[0] == signal.SIGINT else Terminated
