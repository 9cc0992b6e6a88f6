"""Run by tests/test_sites.py on every rank of simulated sites (``fabric_multimodel.sites``).

Under ``fabric run`` it joins the world through Fabric, under torchrun with ``init_process_group("gloo")``
from torchrun's environment. Every rank prints ``start: world=W rank=R node=N restart=K time=<epoch s>``;
then, as the flags say:

- ``--reps K --bytes N``: times K allreduces of an N-byte float32 tensor (after one that connects every
  pair); rank 0 prints ``allreduce: world=W bytes=N reps=K seconds=T``, every other rank ``allreduced: rank=R``.
- ``--until EPOCH``: allreduces a small tensor every 50 ms until then (rank 0 decides, so that every rank
  stops after the same round, and always after a few rounds). ``--world W``: a smaller world keeps going
  until torch elastic restarts it into a larger one, as a job that waits for its lost site would.
- ``--spin S``: after a barrier, every rank runs a busy loop for S seconds and prints
  ``spin: node=N share=<CPU seconds it got per second>`` (how much of a core its site lets it use).
- ``--fail-node R --code C``: the ranks of node R exit with C once connected; the others sleep, so that
  only the tool can end them.

Rank 0 ends with ``final: world=W rounds=N``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

TIMEOUT = timedelta(seconds=60)
MIN_ROUNDS = 5


def say(line: str) -> None:
    """One write per line: the ranks of a site share one output file, and print() writes the newline apart."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def join() -> None:
    if os.environ.get("LT_CLI_USED") == "1":
        from lightning_fabric import Fabric
        from lightning_fabric.strategies import DDPStrategy

        Fabric(strategy=DDPStrategy(process_group_backend="gloo", timeout=TIMEOUT))  # `fabric run` chose the rest
    else:
        dist.init_process_group("gloo", timeout=TIMEOUT)


def timed_allreduces(nbytes: int, reps: int) -> float:
    tensor = torch.ones(nbytes // 4)
    dist.all_reduce(tensor)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(reps):
        dist.all_reduce(tensor)
    return time.perf_counter() - start


def spin(seconds: float) -> float:
    """The share of one core a busy loop got: its CPU time over the wall-clock time."""
    start, cpu = time.perf_counter(), time.process_time()
    while time.perf_counter() - start < seconds:
        pass
    return (time.process_time() - cpu) / (time.perf_counter() - start)


def loop(until: float, world: int) -> int:
    rounds = 0
    while True:
        done = dist.get_rank() == 0 and rounds >= MIN_ROUNDS and time.time() > until and dist.get_world_size() >= world
        tensor = torch.full((1024,), float(done))
        dist.all_reduce(tensor)
        rounds += 1
        if tensor[0].item():
            return rounds
        time.sleep(0.05)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--bytes", type=int, default=1 << 20)
    p.add_argument("--reps", type=int, default=0)
    p.add_argument("--until", type=float, default=0.0)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--spin", type=float, default=0.0)
    p.add_argument("--fail-node", type=int)
    p.add_argument("--code", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    join()
    world, rank, node = dist.get_world_size(), dist.get_rank(), int(os.environ["GROUP_RANK"])
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    say(f"start: world={world} rank={rank} node={node} restart={restart} time={time.time():.3f}")
    if args.fail_node is not None:
        dist.barrier()
        if node == args.fail_node:
            os._exit(args.code)  # at once: no gloo teardown that could turn the code into an abort
        time.sleep(600)
    if args.spin:
        dist.barrier()
        say(f"spin: node={node} share={spin(args.spin):.3f}")
    if args.reps:
        seconds = timed_allreduces(args.bytes, args.reps)
        if rank == 0:
            say(f"allreduce: world={world} bytes={args.bytes} reps={args.reps} seconds={seconds:.4f}")
        else:
            say(f"allreduced: rank={rank}")  # what a drop after the timed allreduces waits for
    rounds = loop(args.until, args.world)
    if rank == 0:
        say(f"final: world={world} rounds={rounds}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
