"""Starting, joining and ending process worlds: what scripts, tests and benchmarks share.

- :func:`join_local_world` and :func:`run_world` make a world of N processes on 127.0.0.1, each
  with a launched Fabric (tests, benchmarks, quick experiments): CPU and gloo by default, or with
  CUDA tensors (see :func:`join_local_world` for where each rank's tensors live). Their processes
  come from :func:`process_context`, which imports torch and Lightning Fabric once, not per process.
- :func:`start_fabric` is a script's launched Fabric in whatever world it was started into (``fabric run``,
  torchrun, SLURM, or plain ``python`` starting its own processes), :func:`launched_by` which launcher that was.
- :func:`shutdown` ends a process's part in a world so that the interpreter exits cleanly.
- :func:`stop_process_tree` ends a launcher (``fabric run``) and every rank it started.
"""

from __future__ import annotations

import gc
import importlib
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import signal
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

#: A collective that hangs in a world made here becomes an error after this many seconds.
COLLECTIVE_TIMEOUT_S = 600


#: Each launcher's own flags for what a script's ``devices``, ``num_nodes`` and ``accelerator`` say (None: it has none).
LAUNCHER_FLAGS = {
    "fabric run": ("--devices", "--num-nodes", "--accelerator"),
    "torchrun": ("--nproc-per-node", "--nnodes", None),
    "SLURM": ("--ntasks-per-node", "--nodes", None),
}


def launched_by() -> str | None:
    """The launcher that started this process as one rank of a world (it owns the devices and the processes):
    ``"fabric run"``, ``"torchrun"``, ``"SLURM"``; None when the script starts its own processes.

    Example::

        if launched_by() is not None and args.devices is not None:
            parser.error(f"--devices: {launched_by()} started the processes; give the number to it instead")
    """
    if os.environ.get("LT_CLI_USED") == "1":  # `fabric run`, which runs torchrun itself: checked first
        return "fabric run"
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return "torchrun"
    if "SLURM_NTASKS" in os.environ and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        return "SLURM"  # srun, as Lightning's SLURMEnvironment detects it
    return None


def world_shape(devices: int | None = None, num_nodes: int = 1) -> tuple[int, int]:
    """(processes per node, nodes) of this process's world: the launcher's (see :func:`launched_by`), else
    ``devices`` (default 1) and ``num_nodes``.

    Example::

        per_node, nodes = world_shape(args.devices, args.num_nodes)
    """
    launcher = launched_by()
    if launcher in ("torchrun", "fabric run"):  # `fabric run` runs torchrun
        per_node = int(os.environ["LOCAL_WORLD_SIZE"])
        return per_node, int(os.environ["WORLD_SIZE"]) // per_node
    if launcher == "SLURM":
        nodes = int(os.environ["SLURM_NNODES"])
        return int(os.environ["SLURM_NTASKS"]) // nodes, nodes
    return devices or 1, num_nodes


def start_fabric(
    fabric_class: type,
    *,
    devices: int | None = None,
    num_nodes: int = 1,
    accelerator: str = "auto",
    timeout: float | None = None,
    **kwargs: Any,
) -> Any:
    """A launched ``fabric_class`` (either family's ``Fabric``) in the world this process was started into: by
    ``fabric run``, torchrun or SLURM (their processes, devices and nodes), or with plain ``python`` the
    ``devices`` x ``num_nodes`` processes it starts itself. The trap it spares a script: under ``fabric run``
    it must not call ``fabric.launch()``, and under plain ``python`` it must. With several processes, a
    collective that waits longer than ``timeout`` seconds for a peer fails instead of hanging for 30 minutes.

    Example::

        from lightning.fabric import Fabric
        fabric = start_fabric(Fabric, devices=args.devices, timeout=300.0)  # any launcher, or none
    """
    strategies = importlib.import_module(fabric_class.__module__.rpartition(".")[0] + ".strategies")
    limit = {} if timeout is None else {"timeout": timedelta(seconds=timeout)}
    if launched_by() == "fabric run":  # it started the processes and passes its settings
        several = int(os.environ["WORLD_SIZE"]) > 1
        return fabric_class(strategy=strategies.DDPStrategy(**limit) if several else "auto", **kwargs)
    per_node, nodes = world_shape(devices, num_nodes)
    strategy = strategies.DDPStrategy(**limit) if per_node * nodes > 1 else "auto"
    fabric = fabric_class(accelerator=accelerator, devices=per_node, num_nodes=nodes, strategy=strategy, **kwargs)
    fabric.launch()  # starts the processes only when no launcher did
    return fabric


def free_port() -> int:
    """A TCP port nobody listens on right now, on 127.0.0.1.

    Example::

        port = free_port()  # for MASTER_PORT or `fabric run --main-port`
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_context() -> Any:
    """The multiprocessing context that world processes start from: a fork server that has imported torch, Lightning
    Fabric and this package (seconds of CPU per process, paid once), where the platform has one; else ``spawn``.

    As with ``spawn``, a child gets its target by reference (a module-level function) and the parent's ``sys.path``
    and working directory. Unlike ``spawn``, it gets the environment the fork server started with (at the first
    world), not the parent's of the moment.

    Example::

        ctx = process_context()
        proc = ctx.Process(target=work, args=(rank,), daemon=True)
    """
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    from fabric_multimodel.ddp.families import fabric_package_name

    ctx = mp.get_context("forkserver")
    # Only the first call's list counts: the server starts once, at the first process it makes. A name that does
    # not import is skipped (the children then import it themselves, and fail as they would under spawn).
    ctx.set_forkserver_preload(["torch", "torch.distributed", fabric_package_name() or "torch", "fabric_multimodel"])
    return ctx


def join_local_world(
    rank: int,
    size: int,
    port: int,
    timeout_s: float = COLLECTIVE_TIMEOUT_S,
    *,
    accelerator: str = "cpu",
    backend: str = "gloo",
    share_device: bool | None = None,
) -> Any:
    """A launched ``Fabric`` for rank ``rank`` of a ``size``-process world on 127.0.0.1:``port``.

    Call it in a process that was started externally (spawned); every rank calls it with the same
    ``size``, ``port`` and placement. A collective that hangs raises after ``timeout_s`` seconds.
    Each rank uses one intra-op thread, since the ranks share the machine's cores.

    ``accelerator`` and ``backend`` are Fabric's and torch.distributed's names (``"cpu"`` and
    ``"gloo"`` by default). Where the ranks' tensors live:

    - ``share_device=False`` (the default on CPU and with NCCL): rank ``r`` gets device ``r``, as
      ``Fabric(devices=size)`` places them, so an accelerator needs ``size`` devices. NCCL requires
      it: it refuses two ranks on one GPU ("Duplicate GPU detected", since NCCL 2.5).
    - ``share_device=True`` (the default on an accelerator with any other backend): every rank uses
      the first device, so 4 ranks can share one GPU over gloo. Fabric accepts at most as many
      devices as the machine has and puts rank ``LOCAL_RANK`` on device ``LOCAL_RANK``, so each
      rank is a node of one device to it: ``fabric.local_rank == 0`` and ``fabric.node_rank ==
      rank`` everywhere (``global_rank`` and ``world_size`` are as usual).

    Example::

        fabric = join_local_world(rank, 2, port)                       # in each of two spawned processes
        fabric = join_local_world(rank, 4, port, accelerator="cuda")   # 4 ranks on one GPU, over gloo
    """
    if share_device is None:
        share_device = accelerator != "cpu" and backend != "nccl"
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(size),
        RANK=str(rank),
        LOCAL_RANK="0" if share_device else str(rank),
        NODE_RANK=str(rank) if share_device else "0",
    )
    import torch

    from fabric_multimodel.ddp.families import fabric_package

    package = fabric_package()
    Fabric, DDPStrategy = package.Fabric, package.strategies.DDPStrategy
    torch.set_num_threads(1)
    if accelerator != "cpu" and backend != "nccl":
        # Fabric binds each rank's GPU to the default group (`device_id`), and torch then makes subgroups by
        # splitting it; gloo claims it can split but has no `perform_nocolor_split` (torch 2.11 to 2.13), so every
        # `new_group` a rank is not in would raise. A group joined unbound here (Fabric finds it made) keeps
        # subgroups working: sites, node groups, FSDP2 meshes.
        torch.distributed.init_process_group(backend, rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s))
    fabric = Fabric(
        accelerator=accelerator,
        devices=1 if share_device else size,
        num_nodes=size if share_device else 1,
        strategy=DDPStrategy(process_group_backend=backend, timeout=timedelta(seconds=timeout_s)),
    )
    # LOCAL_RANK etc. are set, so Fabric sees externally created processes and only joins the group.
    fabric.launch()
    return fabric


def shutdown() -> None:
    """Leave the process group so that the interpreter exits cleanly; call it last, on every rank.

    A gloo worker thread that still holds a finished collective's tensors while Python finalises
    can abort the process (``terminate called without an active exception``) after a run that
    succeeded. Call this once the objects that hold the process group are gone (the models from
    :func:`~fabric_multimodel.setup_models`, their optimizers, the :class:`~fabric_multimodel.Averager`): it
    collects them and destroys the group, which joins those threads while Python is still whole. The simplest way is to
    train inside a function and call ``shutdown()`` after it returns.

    Example::

        def main():
            fabric = Fabric(...); fabric.launch()
            train(fabric)   # models, optimizers and the Averager live and die in here
            shutdown()
    """
    import torch.distributed as dist

    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def _rank_main(
    rank: int, size: int, port: int, placement: dict[str, Any], fn: Callable[..., Any], args: tuple, conn: Any
) -> None:
    try:
        fabric = join_local_world(rank, size, port, **placement)
        result = fn(fabric, *args)
        conn.send(("ok", result))
        del fabric
        shutdown()
    except BaseException as exc:  # report everything to the parent, then exit non-zero
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise SystemExit(1) from None


def run_world(
    size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 3600.0,
    accelerator: str = "cpu",
    backend: str = "gloo",
    share_device: bool | None = None,
) -> list[Any]:
    """Run ``fn(fabric, *args)`` on every rank of a fresh ``size``-process world on 127.0.0.1 (CPU/gloo by default).

    Each rank has a launched Fabric from :func:`join_local_world`, which ``accelerator``, ``backend``
    and ``share_device`` are passed to (``accelerator="cuda"``: every rank on the first GPU, over
    gloo; with ``backend="nccl"`` one GPU per rank). ``fn`` must be a module-level
    function and its result picklable. Returns the ranks' results in rank order; raises with the
    failing ranks' tracebacks, or after ``timeout`` seconds (killing the processes it started).

    Example::

        def total(fabric, x):
            return fabric.all_reduce(torch.tensor(x), reduce_op="sum").item()

        assert run_world(2, total, 1.0) == [2.0, 2.0]
        run_world(4, total, 1.0, accelerator="cuda")  # 4 ranks sharing one GPU
    """
    ctx = process_context()
    port = free_port()
    placement = {"accelerator": accelerator, "backend": backend, "share_device": share_device}
    conns, procs = [], []
    for rank in range(size):
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_rank_main, args=(rank, size, port, placement, fn, args, child), daemon=True)
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
            for ready in mp_connection.wait(list(pending.values()), timeout=1.0):
                rank = next(r for r, c in pending.items() if c is ready)
                conn = pending.pop(rank)
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
    """Process ids of every descendant of ``pid`` (Linux /proc; empty elsewhere).

    Example::

        children = descendants(os.getpid())
    """
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

    Example::

        proc = subprocess.Popen(["fabric", "run", "--devices", "2", "train.py"])
        try:
            proc.wait(timeout=600)
        finally:
            stop_process_tree(proc)
    """
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
