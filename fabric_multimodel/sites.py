"""Simulated sites joined by a slow link: run a training script as S nodes on this machine, each node
in its own network namespace, with every node's link to the others limited to a rate in each direction.

Run it as root (it makes network namespaces)::

    python -m fabric_multimodel.sites --sites 2 --devices 2 --bandwidth 100mbit -- \\
        examples/lm_fabric.py --steps 200 --period 16

or from Python, for benchmarks and tests::

    from fabric_multimodel.sites import run_sites

    result = run_sites("examples/lm_fabric.py", ["--steps", "60"], sites=2, devices=1, bandwidth="20mbit")
    print(result.code, result.measured_mbit_s, result.logs[0])

The network: one namespace per site (``fmm<run id>s<r>``) and a switch namespace (``fmm<run id>sw``)
holding a Linux bridge. Site ``r`` has one veth pair: ``eth0`` at 10.77.0.(r+1)/24 in the site, the
other end (``s<r>``) on the bridge. A ``tbf`` qdisc on each end limits the link: the site's egress is
its upload, the switch port's egress its download. Nothing is made in the host's namespace, so
deleting the namespaces removes every interface.

Each site runs ``fabric run --accelerator cpu --devices D --num-nodes S --node-rank r --main-address
10.77.0.1 --main-port P SCRIPT ARGS`` (or an elastic ``torchrun``) inside its namespace, with
``GLOO_SOCKET_IFNAME=eth0``: gloo traffic between sites crosses the limited links, while traffic
between the processes of one site goes to the site's own address, which the kernel routes over
``lo``: it never reaches the qdisc and is not limited (the tests measure both).
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NoReturn

#: What ``--bandwidth`` accepts, for error messages.
RATE_FORMS = "500kbit, 10mbit, 1gbit, a plain number of bits per second, or none (unlimited)"
MIN_RATE = 8_000  # 1 kB/s: the slowest link worth simulating
MAX_RATE = 100_000_000_000
_UNITS = {"": 1, "bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}  # SI, as tc reads them
_RATE = re.compile(r"(?P<number>\d+(?:\.\d+)?)(?P<unit>[kmg]?bit)?", re.IGNORECASE)

SUBNET = "10.77.0"
NETNS_DIR = Path("/run/netns")
FRAME_BYTES = 1514  # an Ethernet frame of a 1500-byte MTU, as tbf counts it
FAILURE_GRACE_S = 2.0  # after a site fails, how long the others may take to fail on their own
STOP_GRACE_S = 3.0  # SIGTERM, then SIGKILL after this long
TIMEOUT_CODE = 124
#: torchrun's rendezvous settings for the simulated network (see ``site_command``): heartbeats every second
#: (3 missed: the site is gone), 3 s of last call once a smaller world could form, instead of 5 s and 30 s.
#: `fabric run` of whichever Lightning package family is installed (the standalone one first, as families.py does).
FABRIC_CLI = next(
    (cli for cli in ("lightning_fabric.cli", "lightning.fabric.cli") if importlib.util.find_spec(cli.split(".")[0])),
    "lightning_fabric.cli",
)
RDZV_CONF = {"join_timeout": 60, "last_call_timeout": 3, "close_timeout": 5, "keep_alive_interval": 1}
#: A torch world's variables, which a launcher started from inside a world must not inherit.
WORLD_ENV = (
    "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
)  # fmt: skip
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_STDOUT = threading.Lock()  # site 0's two output pumps and the tool's own lines take turns on stdout
_ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):.*?exitcode\s*:\s*(-?\d+)", re.DOTALL)


class SitesError(ValueError):
    """A setting or precondition that stops a run before anything is made (the CLI: one line, exit 2)."""


class Terminated(BaseException):
    """SIGTERM reached the tool; raised in the main thread so that every ``finally`` cleans up."""


# --- rates and the link ---------------------------------------------------------------------------


def parse_rate(text: str) -> int | None:
    """Bits per second for ``text`` (``500kbit``, ``10mbit``, ``1.5gbit``, ``2000000``), or None for ``none``
    (unlimited). Units are SI, as ``tc`` reads them. Raises ``ValueError`` naming the accepted forms.

    Example::

        assert parse_rate("100mbit") == 100_000_000 and parse_rate("none") is None
    """
    if text.strip().lower() == "none":
        return None
    match = _RATE.fullmatch(text.strip())
    if match is None or (match["unit"] is None and "." in match["number"]):
        raise ValueError(f"{text!r} is not a rate: use {RATE_FORMS}")
    bits = round(float(match["number"]) * _UNITS[(match["unit"] or "").lower()])
    if not MIN_RATE <= bits <= MAX_RATE:
        raise ValueError(f"{text!r} is outside {format_rate(MIN_RATE)}..{format_rate(MAX_RATE)}: use {RATE_FORMS}")
    return bits


def format_rate(bits: int | None) -> str:
    """``100mbit``, ``1gbit``, ``1500kbit``, ``12345bit``, or ``unlimited`` for None.

    Example::

        assert format_rate(parse_rate("1000mbit")) == "1gbit"
    """
    if bits is None:
        return "unlimited"
    for unit in ("gbit", "mbit", "kbit"):
        if bits % _UNITS[unit] == 0:
            return f"{bits // _UNITS[unit]}{unit}"
    return f"{bits}bit"


def tbf_settings(bits: int) -> list[str]:
    """The ``tc qdisc ... tbf`` arguments that limit one direction of a link to ``bits`` per second.

    - burst: 1 ms at the rate, at least two full frames. Fewer tokens would make the kernel's timer the
      limit at 1 gbit (256 kB-1 MB transfers took 1.3x their time with 16 kB); more lets small transfers
      through at memory speed (with 16 kB at 10 mbit, a 16 kB message took 7% of its time on the wire).
    - limit (the queue): 200 ms at the rate, at least 256 kB. A queue smaller than one message tail-drops
      it and TCP then waits out a 200 ms retransmission timeout: with 50 ms at 10 mbit a 64 kB
      round trip took 5x its time on the wire; with 200 ms it takes 1.00x.

    Example::

        subprocess.run(["tc", "qdisc", "add", "dev", "eth0", "root", "tbf", *tbf_settings(10**7)], check=True)
    """
    burst = max(2 * FRAME_BYTES, bits // 8 // 1000)
    limit = max(256 * 1024, bits // 8 // 5)
    return ["rate", f"{bits}bit", "burst", str(burst), "limit", str(limit)]


def _must(*command: str) -> None:
    result = subprocess.run(list(command), capture_output=True, text=True)
    if result.returncode:
        raise OSError(f"`{' '.join(command)}` failed: {result.stderr.strip() or result.returncode}")


def namespace_pids(name: str) -> list[int]:
    """Ids of the processes in network namespace ``name`` (``ip netns pids``, read from /proc).

    Example::

        for pid in namespace_pids("fmm1a2b3c4ds1"):
            os.kill(pid, signal.SIGKILL)
    """
    try:
        target = os.stat(NETNS_DIR / name)
    except FileNotFoundError:
        return []
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            ns = os.stat(entry / "ns" / "net")
        except OSError:  # gone, or a zombie (it has no namespace left)
            continue
        if (ns.st_ino, ns.st_dev) == (target.st_ino, target.st_dev):
            pids.append(int(entry.name))
    return pids


def kill_namespace(name: str, wait_s: float = 5.0) -> None:
    """SIGKILL every process in network namespace ``name`` and wait until none is left (at most ``wait_s``).

    Every process a site starts stays in its namespace, in whatever session or process tree it put itself,
    so this ends a launcher and all its workers. Their parent may die first; the kernel then hands them to
    PID 1, which reaps them.

    Example::

        kill_namespace("fmm1a2b3c4ds1")
    """
    deadline = time.monotonic() + wait_s
    while (pids := namespace_pids(name)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.02)


class Sites:
    """``count`` network namespaces ("sites") joined through a switch namespace's bridge, every link limited
    to ``bits`` per second in each direction (None: unlimited). A context manager: the network exists inside
    the ``with`` block, and on leaving it every process in its namespaces is killed and the namespaces (with
    their interfaces) deleted, also after an error.

    Example::

        with Sites(2, parse_rate("20mbit")) as sites:
            print(sites.addresses, measure_link(sites, 0, 1))
            subprocess.run([*sites.exec_prefix(1), "ip", "addr"])
    """

    def __init__(self, count: int, bits: int | None, run_id: str | None = None) -> None:
        if not 1 <= count <= 250:
            raise SitesError(f"sites must be 1..250, got {count}")
        self.count, self.bits = count, bits
        self.run_id = run_id or new_run_id()
        self.switch = f"fmm{self.run_id}sw"
        self.namespaces = [f"fmm{self.run_id}s{r}" for r in range(count)]
        self.addresses = [f"{SUBNET}.{r + 1}" for r in range(count)]

    def __enter__(self) -> Sites:
        try:
            self.create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def create(self) -> None:
        """Make the namespaces, the bridge, one veth pair per site, and the limits."""
        _must("ip", "netns", "add", self.switch)
        _must("ip", "-n", self.switch, "link", "set", "lo", "up")
        _must("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _must("ip", "-n", self.switch, "link", "set", "br0", "up")
        for r, ns in enumerate(self.namespaces):
            _must("ip", "netns", "add", ns)
            _must("ip", "-n", ns, "link", "set", "lo", "up")
            # Both ends are made inside namespaces: the host's namespace never holds an interface of ours.
            _must("ip", "-n", self.switch, "link", "add", f"s{r}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _must("ip", "-n", self.switch, "link", "set", f"s{r}", "master", "br0", "up")
            _must("ip", "-n", ns, "addr", "add", f"{self.addresses[r]}/24", "dev", "eth0")
            _must("ip", "-n", ns, "link", "set", "eth0", "up")
        self.limit()

    def limit(self) -> None:
        """(Re)install the qdiscs, with empty queues: upload on each site's eth0, download on its switch port."""
        for r, ns in enumerate(self.namespaces):
            for where, dev in ((ns, "eth0"), (self.switch, f"s{r}")):
                subprocess.run(["tc", "-n", where, "qdisc", "del", "dev", dev, "root"], capture_output=True)
                if self.bits is not None:
                    _must("tc", "-n", where, "qdisc", "add", "dev", dev, "root", "tbf", *tbf_settings(self.bits))

    def exec_prefix(self, site: int) -> list[str]:
        """The command prefix that runs a program inside site ``site``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[site]]

    def close(self) -> None:
        """Kill every process in the namespaces, then delete them (which deletes their veths and the bridge)."""
        for ns in [*self.namespaces, self.switch]:
            kill_namespace(ns)
            if (NETNS_DIR / ns).exists():
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def new_run_id() -> str:
    """8 hex digits naming a run: its namespaces, log folder, torchrun rendezvous and ``FMM_SITES_RUN``."""
    return secrets.token_hex(4)


_CLONE_NEWNET = 0x40000000


def socket_in(namespace: str) -> socket.socket:
    """A TCP socket that lives in network namespace ``namespace`` (this process stays where it is).

    A socket keeps the namespace it was made in, and setns(2) moves only the calling thread, so a short
    thread enters the namespace and makes the socket.

    Example::

        with socket_in("fmm1a2b3c4ds1") as s:
            s.bind(("10.77.0.2", 0))
    """
    made: list[Any] = []

    def make() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        try:
            fd = os.open(NETNS_DIR / namespace, os.O_RDONLY)
            try:
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {namespace}: {os.strerror(ctypes.get_errno())}")
            finally:
                os.close(fd)
            made.append(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
        except OSError as error:
            made.append(error)

    thread = threading.Thread(target=make)
    thread.start()
    thread.join()
    if isinstance(made[0], OSError):
        raise made[0]
    return made[0]


def measure_link(sites: Sites, source: int = 0, destination: int = 1, seconds: float = 0.5) -> float:
    """Mbit/s of TCP payload from site ``source`` to ``destination`` over ``seconds``, then fresh queues.

    Expect about 95.7% of a limited rate: tbf counts whole frames, 66 of every 1514 bytes are headers.
    With ``source == destination`` it measures traffic inside one site (which the limits never see).

    Example::

        with Sites(2, parse_rate("100mbit")) as sites:
            print(f"{measure_link(sites):.1f} Mbit/s")  # ~95.7
    """
    address = sites.addresses[destination]
    with socket_in(sites.namespaces[destination]) as server, socket_in(sites.namespaces[source]) as client:
        # A receive window of seconds at a slow rate: a busy machine that delays this thread must not idle the
        # link (the default 128 kB window is 50 ms at 20 mbit). The kernel caps it at net.core.rmem_max.
        server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        server.bind((address, 0))
        server.listen(1)
        client.settimeout(seconds + 10)
        server.settimeout(seconds + 10)
        sender = threading.Thread(target=_send_until_closed, args=(client, server.getsockname()), daemon=True)
        sender.start()
        connection, _ = server.accept()
        with connection:
            received, elapsed = _receive_for(connection, seconds)
        sender.join(timeout=10)
    # The receiver stopped reading; what the queues still hold would delay the script's first messages.
    sites.limit()
    return received * 8 / elapsed / 1e6


def _send_until_closed(client: socket.socket, address: tuple[str, int]) -> None:
    chunk = bytes(1 << 16)
    try:
        client.connect(address)
        while True:
            client.sendall(chunk)
    except OSError:  # the receiver closed: the measurement is over
        pass


def _receive_for(connection: socket.socket, seconds: float) -> tuple[int, float]:
    """Bytes received after the first read and the seconds they took, until ``seconds`` have passed (bounded by
    time, so that a slow link and an unlimited one take as long). The first read only starts the clock: its
    bytes, a burst the bucket let through at once, arrived before it."""
    buffer = bytearray(1 << 20)
    connection.recv_into(buffer)
    received, start = 0, time.perf_counter()
    last = start
    while last - start < seconds:
        count = connection.recv_into(buffer)
        if not count:
            break
        received += count
        last = time.perf_counter()
    return received, max(last - start, 1e-9)


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
    if not Path(script).is_file():
        return f"{script}: no such script"
    if os.geteuid() != 0:
        return "needs root: it makes network namespaces and qdiscs (run it with sudo)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"needs {' and '.join(missing)} on PATH (iproute2)"
    return probe_kernel()


def probe_kernel() -> str | None:
    """Make a throwaway namespace with a bridge, a veth pair and a tbf qdisc; the first step that fails, or None."""
    name = f"fmm{new_run_id()}pr"
    steps = [
        ("network namespaces", ["ip", "netns", "add", name]),
        ("bridges", ["ip", "-n", name, "link", "add", "br0", "type", "bridge"]),
        ("veth pairs", ["ip", "-n", name, "link", "add", "v0", "type", "veth", "peer", "name", "v1"]),
        ("tbf qdiscs", ["tc", "-n", name, "qdisc", "add", "dev", "v0", "root", "tbf", *tbf_settings(10**6)]),
    ]
    try:
        for what, command in steps:
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode:
                said = " ".join(result.stderr.split()) or f"exit code {result.returncode}"
                return f"this kernel cannot make {what}: `{' '.join(command)}` said: {said}"
        return None
    finally:
        if (NETNS_DIR / name).exists():
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


# --- the launchers ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Drop:
    """Kill site ``site`` (SIGKILL to its launcher and workers) ``at`` seconds after the scripts started, and
    with ``back``, start it again at that time (same namespace and node rank)."""

    site: int
    at: float
    back: float | None = None

    def check(self, sites: int) -> None:
        """Raise ``SitesError`` unless this drop fits a run of ``sites`` sites."""
        if not 1 <= self.site <= sites - 1:
            span = f"1..{sites - 1}" if sites > 1 else "none with one site"
            raise SitesError(
                f"--drop-site must be a site in {span}, got {self.site}: site 0 hosts the main address and rendezvous"
            )
        if not self.at > 0:
            raise SitesError(f"--at must be > 0 seconds, got {self.at}")
        if self.back is not None and not self.back > self.at:
            raise SitesError(f"--back must be later than --at ({self.at}), got {self.back}")


def site_command(
    launcher: str,
    script: str | Path,
    args: Sequence[str],
    *,
    site: int,
    sites: Sites,
    devices: int,
    port: int,
    max_restarts: int = 3,
) -> list[str]:
    """The command that starts site ``site``'s launcher inside its namespace.

    ``fabric``: node ``site`` of a static ``fabric run`` world whose main address is site 0's.
    ``torchrun``: an elastic agent (1..S nodes) of a c10d rendezvous that site 0's agent hosts; each agent
    names its own address (the machine's hostname resolves to nothing inside a site). With ``RDZV_CONF``, a
    lost site's heartbeats are missed after 3 s and a smaller world forms 3 s later (the last call, which also
    lets every site join the first world, however unevenly they start): on 2 busy cores the survivors' workers
    ran again 8-9 s after a drop, and in the larger world 7-8 s after the site was back.

    Example::

        subprocess.Popen(site_command("fabric", "train.py", [], site=1, sites=net, devices=2, port=29500))
    """
    main = sites.addresses[0]
    python = [*sites.exec_prefix(site), sys.executable]
    if launcher == "fabric":
        return [
            *python, "-m", FABRIC_CLI, "--accelerator", "cpu", "--devices", str(devices),
            "--num-nodes", str(sites.count), "--node-rank", str(site), "--main-address", main,
            "--main-port", str(port), str(script), *args,
        ]  # fmt: skip
    if launcher == "torchrun":
        # Site 0's address is its own, but torch only recognises hostnames and loopback as "this host".
        conf = {"is_host": int(site == 0), **RDZV_CONF}
        return [
            *python, "-m", "torch.distributed.run", "--nnodes", f"1:{sites.count}", "--nproc-per-node", str(devices),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{main}:{port}", "--rdzv-id", sites.run_id,
            "--rdzv-conf", ",".join(f"{k}={v}" for k, v in conf.items()), "--local-addr", sites.addresses[site],
            "--max-restarts", str(max_restarts), str(script), *args,
        ]  # fmt: skip
    raise SitesError(f"--launcher must be fabric or torchrun, got {launcher!r}")


def site_environment(run_id: str, launcher: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment as a fresh shell would pass it to a launcher (no Lightning CLI or torch world
    variables), with gloo on ``eth0``, unbuffered output, ``FMM_SITES_RUN`` and then ``extra``.

    For torchrun, agents do not share the rendezvous store with their workers: with sharing, an agent that
    joins a later round (a site back after a drop) waits for the workers' address forever, since rank 0 only
    publishes it in the first round."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LT_", "TORCHELASTIC_")) and k not in WORLD_ENV}
    env.update(GLOO_SOCKET_IFNAME="eth0", PYTHONUNBUFFERED="1", FMM_SITES_RUN=run_id)
    # The sites share this machine's cores. torchrun sets one OpenMP thread per process only when it starts
    # several on a node; with one, an extra OpenMP thread per process spins and made steps up to 10x slower.
    env.setdefault("OMP_NUM_THREADS", "1")
    if launcher == "torchrun":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return {**env, **(extra or {})}


def script_code(launcher_code: int, stderr_text: str) -> int:
    """A site's exit code as its script's: ``fabric run`` and torchrun exit 1 whenever a worker fails, and name
    the worker's code under "Root Cause" in their report; any other code is the launcher's own.

    Example::

        assert script_code(1, "Root Cause (first observed failure):\\n[0]:\\n  exitcode  : 3 (pid: 7)") == 3
    """
    causes = _ROOT_CAUSE.findall(stderr_text) if launcher_code == 1 else []
    return int(causes[-1]) if causes and int(causes[-1]) != 0 else launcher_code


def shell_code(code: int) -> int:
    """A ``Popen.returncode`` as a shell reports it: -9 (killed by SIGKILL) is 137."""
    return 128 - code if code < 0 else code


class _Site:
    """One site's launcher: started, restarted, watched and ended; output in ``<out>/site<r>.out`` / ``.err``."""

    def __init__(self, index: int, command: list[str], env: dict[str, str], out: Path, echo: bool) -> None:
        self.index, self.command, self.env, self.echo = index, command, env, echo
        self.logs = (out / f"site{index}.out", out / f"site{index}.err")
        self.proc: subprocess.Popen | None = None
        self.code: int | None = None
        self.ended_at: float | None = None  # time.monotonic() when the launcher was seen to have exited
        self.dropped = False  # killed by --drop-site (until it is started again)
        self.stopped = False  # ended by the tool after another site failed, or the timeout
        self.pumps: list[threading.Thread] = []

    def start(self) -> None:
        self.code, self.ended_at, self.dropped = None, None, False
        files = [path.open("a") for path in self.logs]
        try:
            pipes = subprocess.PIPE if self.echo else None
            self.proc = subprocess.Popen(
                self.command,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=pipes or files[0],
                stderr=pipes or files[1],
                text=True,
                errors="replace",
                start_new_session=True,  # its own session: no terminal's Ctrl-C, and killed as a whole
            )
        except BaseException:
            for file in files:
                file.close()
            raise
        if not self.echo:
            for file in files:
                file.close()  # the launcher holds its own copies
            return
        for pipe, file in ((self.proc.stdout, files[0]), (self.proc.stderr, files[1])):
            pump = threading.Thread(target=_pump, args=(pipe, file), daemon=True)
            pump.start()
            self.pumps.append(pump)

    def running(self) -> bool:
        return self.proc is not None and self.code is None

    def failed(self) -> bool:
        """Ended on its own with a nonzero code: what counts toward the run's exit code."""
        return bool(self.code) and not (self.dropped or self.stopped)

    def poll(self) -> bool:
        """True when the launcher has just exited."""
        if not self.running():
            return False
        assert self.proc is not None  # running() checks it
        if self.proc.poll() is None:
            return False
        self.code = script_code(self.proc.returncode, _tail(self.logs[1]))
        self.ended_at = time.monotonic()
        return True

    def finish(self) -> None:
        """After every process of the site is gone: reap the launcher and let the output pumps drain."""
        if self.running():
            assert self.proc is not None  # running() checks it
            self.proc.wait()
            self.poll()
        for pump in self.pumps:
            pump.join(timeout=5)
        self.pumps = []


def _pump(pipe: IO[str], file: IO[str]) -> None:
    with pipe, file:
        for line in pipe:
            file.write(line)
            file.flush()
            with _STDOUT:
                sys.stdout.write(line)
                sys.stdout.flush()


def _tail(path: Path, size: int = 1 << 16) -> str:
    try:
        with path.open("rb") as file:
            file.seek(max(0, path.stat().st_size - size))
            return file.read().decode(errors="replace")
    except OSError:
        return ""


# --- a run ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SitesResult:
    """What a run did.

    ``run_id`` names its namespaces (``fmm<run id>s<r>``) and is in every site process's ``FMM_SITES_RUN``.
    ``codes``: each site's last exit code (its script's, see ``script_code``; negative: the signal that ended
    it). ``code``: the run's, as a shell reports it: the largest of the sites that ended on their own (a
    dropped site and the sites the tool stopped do not count; a site back after a drop counts with its last
    code), 124 after the timeout. ``started``: when the scripts started (``time.time()``); ``wall_s``, ``ended``
    (when each site's launcher was seen to exit, the last time it ran), ``dropped_at`` and ``back_at`` (when
    ``drop`` happened) count from then. ``stopped``: the sites the tool
    ended after another one failed, or at the timeout.
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
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    stream: bool = True,
    port: int = 29500,
    max_restarts: int = 3,
) -> SitesResult:
    """Run ``script args`` as ``sites`` nodes of ``devices`` processes, each site in its own namespace behind a
    link of ``bandwidth`` (``"100mbit"``, bits/s, or None/"none": unlimited) each way, and return what happened.

    Measures the link first; with ``stream``, prints that and site 0's output (stdout and stderr) live. Every
    site's output goes to ``out`` (default ``runs/sites/<run id>``; it must not exist yet): ``site<r>.out`` and
    ``site<r>.err``, and the tool's own lines (measured rate, drops) to ``sites.log``. A site that fails
    stops the others ``FAILURE_GRACE_S`` later; after ``timeout`` seconds everything stops (code 124).
    Everything it made (namespaces, interfaces, processes) is gone when it returns or raises, also on Ctrl-C
    and on SIGTERM (raised as ``Terminated`` when it runs in the main thread). Raises ``SitesError`` for a
    setting or precondition that stops it before anything is made.

    Example::

        result = run_sites("train.py", ["--steps", "10"], sites=2, devices=1, bandwidth="10mbit", timeout=300)
        assert result.code == 0, result.logs
    """
    with _sigterm_raises():  # already for the kernel probe, which makes a namespace too
        try:
            bits = parse_rate(bandwidth) if isinstance(bandwidth, str) else bandwidth
        except ValueError as error:
            raise SitesError(f"--bandwidth {error}") from None
        if launcher not in ("fabric", "torchrun"):
            raise SitesError(f"--launcher must be fabric or torchrun, got {launcher!r}")
        if drop is not None:
            drop.check(sites)
        problem = preconditions(script, sites, devices)
        if problem:
            raise SitesError(problem)
        net = Sites(sites, bits)
        folder = Path(out) if out is not None else Path("runs") / "sites" / net.run_id
        if folder.exists():
            raise SitesError(f"{folder} exists already: give --out a new folder")
        folder.mkdir(parents=True)
        say = _teller(stream, folder / "sites.log")
        try:
            net.create()
            measured = measure_link(net) if sites > 1 else None
            say(_link_line(net, devices, measured))
            environment = site_environment(net.run_id, launcher, env)
            options: dict[str, Any] = {"sites": net, "devices": devices, "port": port, "max_restarts": max_restarts}
            commands = [site_command(launcher, script, args, site=r, **options) for r in range(sites)]
            run = _Run(net, [_Site(r, c, environment, folder, echo=stream and r == 0) for r, c in enumerate(commands)])
            try:
                run.watch(drop, timeout, say)
            finally:
                with _signals_held():
                    run.end()
        finally:
            with _signals_held():
                net.close()
        return run.result(measured, folder, drop)


def _link_line(net: Sites, devices: int, measured: float | None) -> str:
    head = f"sites: run {net.run_id}: {net.count} x {devices} processes, link {format_rate(net.bits)} each way"
    if measured is None:
        return f"{head}; one site: no link to measure"
    return f"{head}, measured {measured:.1f} Mbit/s" if measured < 100 else f"{head}, measured {measured:.0f} Mbit/s"


class _Run:
    """The sites' launchers from start to end: the failure, drop and timeout rules of ``run_sites``."""

    def __init__(self, net: Sites, sites: list[_Site]) -> None:
        self.net, self.sites = net, sites
        self.start, self.started = time.monotonic(), time.time()
        self.dropped_at: float | None = None
        self.back_at: float | None = None
        self.timed_out = False
        self.wall_s = 0.0

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def watch(self, drop: Drop | None, timeout: float | None, say: Callable[[str], None]) -> None:
        """Start every site and watch them until all have ended, dropping and restarting as ``drop`` says."""
        self.start, self.started = time.monotonic(), time.time()
        for site in self.sites:
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
        if self.dropped_at is None and now >= drop.at and site.running():
            self.dropped_at = now
            site.dropped = True
            kill_namespace(self.net.namespaces[drop.site])
            site.finish()
            say(f"sites: dropped site {drop.site} at {now:.1f} s (SIGKILL to its launcher and workers)")
        elif drop.back is not None and self.dropped_at is not None and self.back_at is None and now >= drop.back:
            self.back_at = now
            with site.logs[0].open("a") as log:
                log.write(f"sites: started again at {now:.1f} s\n")
            site.start()
            say(f"sites: site {drop.site} back at {now:.1f} s (same namespace and node rank)")

    def stop(self, sites: list[_Site]) -> None:
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
        """Whatever happened: stop what still runs and collect every launcher."""
        self.stop([s for s in self.sites if s.running()])
        for site in self.sites:
            site.finish()
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
        )


def _teller(stream: bool, log: Path) -> Callable[[str], None]:
    """The tool's own lines: appended to ``log``, and with ``stream`` printed between site 0's lines."""

    def say(line: str) -> None:
        with log.open("a") as file:
            file.write(line + "\n")
        if stream:
            with _STDOUT:
                print(line, flush=True)

    return say


@contextmanager
def _sigterm_raises() -> Iterator[None]:
    """SIGTERM raises ``Terminated`` in the main thread while the block runs (elsewhere: left alone)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: Any) -> NoReturn:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


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


# --- the command line -------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"sites: error: {message}\n")  # one line, as the tool's other errors: no usage block


def _rate_argument(text: str) -> int | None:
    try:
        return parse_rate(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parse_arguments(argv: Sequence[str]) -> argparse.Namespace:
    """The tool's options (before ``--``), and ``script`` and ``args`` (after it)."""
    p = _Parser(
        prog="python -m fabric_multimodel.sites",
        usage="%(prog)s --sites S --devices D --bandwidth RATE [options] -- SCRIPT [ARGS ...]",
        description="Run a Fabric script as S simulated sites (network namespaces) joined by links of a given rate.",
    )
    p.add_argument("--sites", type=int, required=True, help="sites (nodes), each in its own network namespace")
    p.add_argument("--devices", type=int, required=True, help="processes per site")
    p.add_argument("--bandwidth", type=_rate_argument, required=True, help=f"each link, each way: {RATE_FORMS}")
    p.add_argument("--out", type=Path, help="a new folder for the sites' logs (default: runs/sites/<run id>)")
    p.add_argument(
        "--launcher", choices=["fabric", "torchrun"], default="fabric", help="`fabric run` (default) or torchrun"
    )
    p.add_argument("--max-restarts", type=int, default=3, help="torchrun's worker group restarts (default 3)")
    p.add_argument("--drop-site", type=int, help="kill this site (1..S-1) --at seconds after the scripts started")
    p.add_argument("--at", type=float, help="when to drop the site, in seconds")
    p.add_argument("--back", type=float, help="when to start the dropped site again, in seconds")
    p.add_argument("--port", type=int, default=29500, help="site 0's main or rendezvous port (default 29500)")
    p.add_argument("--timeout", type=float, help="stop everything after this many seconds (exit code 124)")
    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args = p.parse_args(argv[:split])
    if not argv[split + 1 :]:
        p.error("give the script after --, as in: --sites 2 --devices 1 --bandwidth 10mbit -- train.py ARGS")
    args.script, args.args = argv[split + 1], argv[split + 2 :]
    if (args.at is not None or args.back is not None) and args.drop_site is None:
        p.error("--at and --back need --drop-site")
    if args.drop_site is not None and args.at is None:
        p.error("--drop-site needs --at SECONDS")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: run the sites, return the worst site's exit code (2: a bad setting, 124: timed out,
    130: Ctrl-C, 143: SIGTERM)."""
    args = parse_arguments(sys.argv[1:] if argv is None else argv)
    drop = Drop(args.drop_site, args.at, args.back) if args.drop_site is not None else None
    try:
        result = run_sites(
            args.script,
            args.args,
            sites=args.sites,
            devices=args.devices,
            bandwidth=args.bandwidth,
            out=args.out,
            launcher=args.launcher,
            drop=drop,
            timeout=args.timeout,
            port=args.port,
            max_restarts=args.max_restarts,
        )
    except SitesError as error:
        print(f"sites: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("sites: interrupted; every site stopped and the network removed", file=sys.stderr)
        return 130
    except Terminated:
        print("sites: terminated; every site stopped and the network removed", file=sys.stderr)
        return 143
    codes = ", ".join(f"{r}: {_describe(code, r, result)}" for r, code in enumerate(result.codes))
    print(f"sites: exit {result.code} after {result.wall_s:.1f} s (sites {codes}); logs in {result.out}", flush=True)
    return result.code


def _describe(code: int, site: int, result: SitesResult) -> str:
    if site in result.stopped:
        return f"{code} (stopped)"
    if result.drop is not None and site == result.drop.site and result.back_at is None:
        return f"{code} (dropped)"
    return str(code)


if __name__ == "__main__":
    sys.exit(main())
