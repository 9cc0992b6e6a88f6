"""Real multi-process gloo worlds for the tests, kept alive and reused across many cases.

A :class:`World` spawns ``size`` processes on 127.0.0.1, each with a launched Fabric (DDP strategy,
CPU, gloo), and runs module-level task functions ``fn(fabric, *args)`` on every rank. The processes
come from a fork server that imported torch and Lightning once (``process_context``); joining a
world still costs a second or more, so tests share one world per size and hypothesis draws cases in
the parent. A rank that raises, or a world that does not answer within the timeout, is reported with
every rank's traceback, and the world is replaced so later tests start clean.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fabric_multimodel.run.launch import free_port, join_local_world, process_context, shutdown

# A hung collective turns into an error after this long instead of blocking the suite.
COLLECTIVE_TIMEOUT_S = 60


@dataclass
class Outcome:
    """What one rank's task returned, or the exception it raised."""

    value: Any = None
    error: str | None = None  # "ExceptionType: message"
    traceback: str | None = None


def _worker(rank: int, size: int, port: int, conn: Any) -> None:
    fabric = join_local_world(rank, size, port, COLLECTIVE_TIMEOUT_S)
    conn.send(Outcome(value="ready"))
    while True:
        task = conn.recv()
        if task is None:
            break
        fn, args = task
        try:
            conn.send(Outcome(value=fn(fabric, *args)))
        except BaseException as exc:  # report everything, including assertion failures, to the parent
            conn.send(Outcome(error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc()))
    del fabric
    shutdown()


class World:
    """``size`` ranks of a gloo process group, each holding a launched Fabric.

    Example::

        world = World(2)
        values = world.run(task, 3)   # task(fabric, 3) on both ranks -> [rank0_value, rank1_value]
    """

    def __init__(self, size: int, timeout: float = 180.0) -> None:
        self.size = size
        self.timeout = timeout
        ctx = process_context()
        port = free_port()
        self._conns = []
        self._procs = []
        for rank in range(size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_worker, args=(rank, size, port, child), daemon=True)
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        self._collect()
        self.broken = False

    def outcomes(self, fn: Callable[..., Any], *args: Any) -> list[Outcome]:
        """Run ``fn(fabric, *args)`` on every rank; one :class:`Outcome` per rank, in rank order."""
        for conn in self._conns:
            conn.send((fn, args))
        outcomes = self._collect()
        if any(o.error for o in outcomes):
            self.broken = True  # a rank left mid-collective would desynchronise the next task
        return outcomes

    def run(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """Run ``fn(fabric, *args)`` on every rank and return the values; raise if any rank failed."""
        outcomes = self.outcomes(fn, *args)
        failed = [(rank, o) for rank, o in enumerate(outcomes) if o.error]
        if failed:
            report = "\n".join(f"--- rank {rank}: {o.error}\n{o.traceback}" for rank, o in failed)
            raise AssertionError(f"{fn.__name__} failed on ranks {[r for r, _ in failed]}:\n{report}")
        return [o.value for o in outcomes]

    def _collect(self) -> list[Outcome]:
        outcomes = []
        for rank, conn in enumerate(self._conns):
            if not conn.poll(self.timeout):
                self.close()
                raise TimeoutError(f"rank {rank} of a {self.size}-process world did not answer in {self.timeout} s")
            outcomes.append(conn.recv())
        return outcomes

    def close(self) -> None:
        self.ask_to_leave()
        self.join()

    def ask_to_leave(self) -> None:
        """Tell every rank to leave the world, without waiting for it (:meth:`join` waits)."""
        self.broken = True
        for conn in self._conns:
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass

    def join(self) -> None:
        """Wait for every rank to exit (10 s each at most, then kill it)."""
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


def _fault_worker(
    rank: int, size: int, port: int, timeout_s: float, fn: Callable[..., Any], args: tuple, conn: Any
) -> None:
    import time

    fabric = join_local_world(rank, size, port, timeout_s)
    start = time.monotonic()
    try:
        outcome = Outcome(value=(fn(fabric, *args), time.monotonic() - start))
    except BaseException as exc:
        outcome = Outcome(value=(None, time.monotonic() - start), error=f"{type(exc).__name__}: {exc}")
    conn.send(outcome)


def run_faulty_world(
    size: int, fn: Callable[..., Any], *args: Any, timeout_s: float, wait_for: int = 0, deadline_s: float = 120.0
) -> list[Outcome | None]:
    """Run ``fn(fabric, *args)`` in a fresh world whose ranks may die or stall on purpose.

    Collectives time out after ``timeout_s``. Each rank's :class:`Outcome` has ``value = (result,
    seconds)`` (seconds from the start of ``fn``) and ``error`` if it raised; None for a rank that
    died or had not answered when rank ``wait_for`` answered (or by ``deadline_s``). Every process
    is killed before returning.
    """
    import time

    ctx = process_context()
    port = free_port()
    conns, procs = [], []
    for rank in range(size):
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_fault_worker, args=(rank, size, port, timeout_s, fn, args, child), daemon=True)
        proc.start()
        child.close()
        conns.append(parent)
        procs.append(proc)
    outcomes: list[Outcome | None] = [None] * size
    deadline = time.monotonic() + deadline_s
    pending = dict(enumerate(conns))
    while wait_for in pending and time.monotonic() < deadline:
        for rank, conn in list(pending.items()):
            if conn.poll(0.05):
                try:
                    outcomes[rank] = conn.recv()
                except EOFError:
                    pass  # the rank died without answering
                del pending[rank]
            elif not procs[rank].is_alive() and not conn.poll(0):
                del pending[rank]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join()
    return outcomes


def errors_of(calls: dict[str, Callable[[], Any]]) -> dict[str, tuple[str, str] | None]:
    """Call each; what it raised (a TypeError or ValueError) as (type name, message), or None."""
    errors: dict[str, tuple[str, str] | None] = {}
    for case, call in calls.items():
        try:
            call()
            errors[case] = None
        except (TypeError, ValueError) as error:
            errors[case] = (type(error).__name__, str(error))
    return errors


def in_step() -> float:
    """An allreduce of ones: the world size when every rank is still in step (no collective left half-issued)."""
    import torch
    import torch.distributed as dist

    check = torch.ones(1)
    dist.all_reduce(check)
    return check.item()
