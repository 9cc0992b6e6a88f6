"""The processes of simulated sites: the command that starts each site's launcher (`fabric run`, or an elastic
torchrun agent) inside its namespace, its environment, and the launcher watched, restarted and ended; the exit
code of the script behind a launcher's.

Example::

    command = site_command("fabric", "train.py", [], site=1, sites=net, devices=2, port=29500)
    Launcher(1, command, site_environment(net.run_id, "fabric"), Path("runs/a"), echo=False).start()
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

from fabric_multimodel.sites.network import Sites, SitesError

#: `fabric run` of whichever Lightning package family is installed (the standalone one first, as families.py does).
FABRIC_CLI = next(
    (cli for cli in ("lightning_fabric.cli", "lightning.fabric.cli") if importlib.util.find_spec(cli.split(".")[0])),
    "lightning_fabric.cli",
)


#: torchrun's rendezvous settings for the simulated network (see ``site_command``): heartbeats every second
#: (3 missed: the site is gone), 3 s of last call once a smaller world could form, instead of 5 s and 30 s.
RDZV_CONF = {"join_timeout": 60, "last_call_timeout": 3, "close_timeout": 5, "keep_alive_interval": 1}


#: A torch world's variables, which a launcher started from inside a world must not inherit.
WORLD_ENV = (
    "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
)  # fmt: skip


STDOUT = threading.Lock()  # site 0's two output pumps and the tool's own lines take turns on stdout
_ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):.*?exitcode\s*:\s*(-?\d+)", re.DOTALL)


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
    ``live``: a ``fabric run`` world of the site's own, whose script joins the others through the coordinator in
    the last namespace (``--coordinator ADDRESS:PORT --site S`` after the script's own arguments).
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
    if launcher == "live":  # a world of its own, joined to the others through the coordinator
        return [
            *python, "-m", FABRIC_CLI, "--accelerator", "cpu", "--devices", str(devices), "--main-port", str(port),
            str(script), *args, "--coordinator", f"{sites.addresses[-1]}:{port}", "--site", str(site),
        ]  # fmt: skip
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
    raise SitesError(f"--launcher must be fabric, torchrun or live, got {launcher!r}")


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


def coordinator_command(
    sites: Sites, port: int, command: Sequence[str] | None = None, record: Path | None = None
) -> list[str]:
    """``--live``: the coordinator, in the last namespace (a host of its own, outside every site): ``python -m
    fabric_multimodel.coordinator`` (with ``record``: its status page on a free port, recording the run there), or
    ``command`` with ``{port}`` replaced."""
    default = [sys.executable, "-m", "fabric_multimodel.coordinator", "--port", "{port}"]
    if record is not None:
        default += ["--status-port", "0", "--status-record", str(record.resolve())]
    return [*sites.exec_prefix(sites.count - 1), *(arg.replace("{port}", str(port)) for arg in command or default)]


def draw_timeline(record: Path, say: Callable[[str], None]) -> Path | None:
    """The picture of a live run from the coordinator's ``record`` (``python -m fabric_multimodel.status.timeline``,
    a process of its own: this tool imports no plotting), beside it as ``timeline.png``; None, said in a line, when
    it cannot be drawn (no record, no matplotlib)."""
    if not record.is_file():
        say(f"sites: no timeline: the coordinator wrote no status record ({record})")
        return None
    out = record.with_name("timeline.png")
    command = [sys.executable, "-m", "fabric_multimodel.status.timeline", str(record), "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    lines = (done.stdout + done.stderr).strip().splitlines()
    say(f"sites: {lines[-1] if lines else 'timeline: drew nothing'}")
    return out if done.returncode == 0 else None


class Launcher:
    """One site's launcher: started, restarted, watched and ended; output in ``<out>/<name>.out`` / ``.err`` (the
    name is ``site<r>`` by default)."""

    def __init__(
        self, index: int, command: list[str], env: dict[str, str], out: Path, echo: bool, name: str | None = None
    ) -> None:
        self.index, self.command, self.env, self.echo = index, command, env, echo
        name = name or f"site{index}"
        self.logs = (out / f"{name}.out", out / f"{name}.err")
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
            with STDOUT:
                sys.stdout.write(line)
                sys.stdout.flush()


def _tail(path: Path, size: int = 1 << 16) -> str:
    try:
        with path.open("rb") as file:
            file.seek(max(0, path.stat().st_size - size))
            return file.read().decode(errors="replace")
    except OSError:
        return ""
