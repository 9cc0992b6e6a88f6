"""The network of simulated sites: one network namespace per site and a switch namespace holding a Linux
bridge, each site's link limited by ``tbf`` in each direction; the rates a link takes, and a measurement of one.

Site ``r`` has one veth pair: ``eth0`` at 10.77.0.(r+1)/24 in the site, the other end (``s<r>``) on the
bridge. A ``tbf`` qdisc on each end limits the link: the site's egress is its upload, the switch port's egress
its download. Nothing is made in the host's namespace, so deleting the namespaces removes every interface.
The sites' TCP runs the reno congestion control (:data:`CONGESTION_CONTROL`: why), whatever the host's.

Example::

    with Sites(2, parse_rate("20mbit")) as sites:
        print(sites.addresses, measure_link(sites, 0, 1))
"""

from __future__ import annotations

import ctypes
import os
import secrets
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

#: The sites' TCP congestion control. A namespace inherits the host's (this project's build machines: bbr) and may
#: set only an allowed one (there: reno, bbr). On the simulated link (no propagation delay, a queue of 256 kB or
#: more) a 872 kB two-way exchange, a 2-site allreduce's bytes, took over its bytes over the rate: bbr 1.28x at 3
#: mbit and 1.23x at 10 mbit, cubic 1.01x and 1.30x, reno 1.01x and 1.02x; one way, all 0.99x (median of 8, one
#: run each). Reno keeps the queue full whichever way the acknowledgements go, so a round's time is its bytes.
CONGESTION_CONTROL = "reno"

SUBNET = "10.77.0"
NETNS_DIR = Path("/run/netns")
FRAME_BYTES = 1514  # an Ethernet frame of a 1500-byte MTU, as tbf counts it


class SitesError(ValueError):
    """A setting or precondition that stops a run before anything is made (the CLI: one line, exit 2)."""


# --- rates and the link ---------------------------------------------------------------------------


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
            _must("ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv4.tcp_congestion_control={CONGESTION_CONTROL}")
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
    """Mbit/s of TCP payload from site ``source`` to ``destination``, the faster of two windows of ``seconds``, then
    fresh queues.

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
            # The faster of two windows: a busy machine that starves the sending thread for a moment lowers
            # one window's rate (seen: 11.9 of 19.1 Mbit/s while the CI machine was loaded), never raises it.
            windows = [_receive_for(connection, seconds) for _ in range(2)]
        sender.join(timeout=10)
    # The receiver stopped reading; what the queues still hold would delay the script's first messages.
    sites.limit()
    return max(received * 8 / elapsed / 1e6 for received, elapsed in windows)


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
