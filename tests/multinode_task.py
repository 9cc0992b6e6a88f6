"""Run by tests/test_multinode.py on every rank of two simulated nodes (two `fabric run` launchers).

Each rank writes ``<out>/rank<R>.json`` with what it saw: the groups, and per step of each layout
whether a round ran and a fingerprint of its parameters, the bytes sent per level, the errors for
bad layouts, and a resume check.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from lightning_fabric import Fabric
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fabric_multimodel import Averager, node_groups, setup_models  # noqa: E402
from fabric_multimodel.comm.collectives import tensors_fingerprint  # noqa: E402
from fabric_multimodel.run.launch import shutdown  # noqa: E402

NESTEROV = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)


def model(fabric: Fabric, seed: int, **setup) -> nn.Module:
    torch.manual_seed(seed + 100 * fabric.global_rank)  # different on purpose: the layouts must fix it
    (m,) = setup_models(fabric, m=nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)), **setup)
    return m


def train(fabric: Fabric, m: nn.Module, averager: Averager, start: int, stop: int, log: list) -> None:
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    for step in range(start, stop):
        data = torch.Generator().manual_seed(1000 * step + fabric.global_rank)
        loss = nn.functional.mse_loss(m(torch.randn(8, 4, generator=data)), torch.randn(8, 2, generator=data))
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        before = (averager.rounds, averager.node_rounds)
        values = [p.detach().clone().reshape(-1).tolist() for p in m.parameters()]
        averager.step()
        kind = "across" if averager.rounds > before[0] and averager.node_rounds == before[1] else None
        kind = "node" if averager.node_rounds > before[1] else kind
        log.append(
            {
                "step": step + 1,
                "round": kind,
                "params": tensors_fingerprint(m.parameters()),
                "tensors": [tensors_fingerprint([p]) for p in m.parameters()],
                "before": values,
                "after": [p.detach().reshape(-1).tolist() for p in m.parameters()],
                "bytes": averager.traffic.bytes,
            }
        )


def layout_run(fabric: Fabric, groups, layout: str, steps: int) -> dict:
    if layout == "two-level":
        m = model(fabric, 1)
        averager = Averager(fabric, m, period=6, node_period=2, node_group=groups.node, warmup_steps=2)
    elif layout == "islands-fragments":  # streaming DiLoCo across the nodes: two fragments, blocking
        m = model(fabric, 2, process_group=groups.node)
        averager = Averager(
            fabric, m, period=6, warmup_steps=2, process_group=groups.across, outer_optimizer=NESTEROV, fragments=2
        )
    else:
        m = model(fabric, 2, process_group=groups.node)
        options = {"outer_optimizer": NESTEROV, "overlap_steps": 1} if layout == "islands-diloco" else {}
        averager = Averager(fabric, m, period=3, warmup_steps=2, process_group=groups.across, **options)
    log: list = []
    with averager:
        train(fabric, m, averager, 0, steps, log)
    return {
        "log": log,
        "final": tensors_fingerprint(m.parameters()),
        "rounds": averager.rounds,
        "node_rounds": averager.node_rounds,
        "bytes": averager.traffic.bytes,
        "node_bytes": averager.node_traffic.bytes,
        "islands": averager.islands,
        "params": sum(p.numel() for p in m.parameters()),
    }


def resume_run(fabric: Fabric, groups, path: Path) -> bool:
    """Save after sync() in the islands DiLoCo layout, load, continue: bitwise the uninterrupted run."""

    def build() -> tuple[nn.Module, Averager]:
        m = model(fabric, 3, process_group=groups.node)
        return m, Averager(fabric, m, period=3, warmup_steps=2, process_group=groups.across, outer_optimizer=NESTEROV)

    m, averager = build()
    with averager:
        train(fabric, m, averager, 0, 7, [])
        averager.sync()
        fabric.save(path, {"m": m, "averager": averager})
        uninterrupted: list = []
        train(fabric, m, averager, 7, 14, uninterrupted)
    m, averager = build()
    fabric.load(path, {"m": m, "averager": averager})
    resumed: list = []
    with averager:
        train(fabric, m, averager, 7, 14, resumed)
    return [e["params"] for e in uninterrupted] == [e["params"] for e in resumed]


def bad_layouts(fabric: Fabric, groups) -> dict:
    errors = {}
    cases = {
        "uneven nodes": lambda: node_groups(fabric, num_nodes=3),
        "period not a multiple": lambda: Averager(
            fabric, model(fabric, 4), period=6, node_period=4, node_group=groups.node
        ),
        "islands with node_period": lambda: Averager(
            fabric,
            model(fabric, 5, process_group=groups.node),
            period=4,
            node_period=2,
            node_group=groups.node,
            process_group=groups.across,
        ),
        "DDP over the world, averaging across nodes": lambda: Averager(
            fabric, model(fabric, 6), period=4, process_group=groups.across
        ),
    }
    for name, call in cases.items():
        try:
            call()
            errors[name] = None
        except ValueError as error:
            errors[name] = str(error)
    check = torch.ones(1)
    dist.all_reduce(check)  # every rank is still in step: no collective was left half-issued
    errors["still in step"] = check.item()
    return errors


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    fabric = Fabric()  # `fabric run --num-nodes 2 --devices 2` chose everything
    groups = node_groups(fabric)
    result = {
        "rank": fabric.global_rank,
        "node_rank": groups.node_rank,
        "local_rank": groups.local_rank,
        "node": dist.get_process_group_ranks(groups.node),
        "across": dist.get_process_group_ranks(groups.across),
        "layouts": {
            layout: layout_run(fabric, groups, layout, 14)
            for layout in ("islands", "islands-diloco", "islands-fragments", "two-level")
        },
        "resume": resume_run(fabric, groups, args.out / "ckpt.pt"),
        "bad": bad_layouts(fabric, groups),
    }
    (args.out / f"rank{fabric.global_rank}.json").write_text(json.dumps(result))
    del fabric, groups
    shutdown()


if __name__ == "__main__":
    main()
