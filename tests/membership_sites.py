"""Sites of a live-membership run for the tests: each a process of its own (no world in common) that joins a
coordinator and reports what it saw. Module-level functions, so that the test's processes can run them."""

from __future__ import annotations

import functools
import os
import time
from types import SimpleNamespace
from typing import Any

import torch
import torch.distributed as dist

from fabric_multimodel.comm.collectives import wait_all
from fabric_multimodel.membership.membership import Membership


def _leave_abruptly(queue: Any, report: Any) -> None:
    queue.put(report)
    queue.close()
    queue.join_thread()  # what was put reaches the parent before the exit
    os._exit(0)


def _membership(address: str, name: str, plan: dict[str, Any], **more: Any) -> Membership:
    return Membership(
        address,
        name,
        min_sites=plan.get("min_sites", 1),
        timeout=plan.get("timeout", 5.0),
        heartbeat_s=0.5,
        run=plan["run"],
        **more,
    )


def counting_site(address: str, name: str, plan: dict[str, Any], queue: Any) -> None:
    """Round after round, sum this site's ``value`` over the epoch's group and agree on the round's number (the
    largest any member has done, plus one); recover when a round fails, ask at each boundary whether sites joined.
    Ends after round ``rounds``, or abruptly after ``die_after``. Reports (epoch, sites, sum) per round."""
    membership = _membership(address, name, plan)
    epoch = membership.join()
    seen: list[tuple[int, tuple[str, ...], float]] = []
    done = 0
    while done < plan["rounds"]:
        time.sleep(plan.get("round_s", 0.02))
        values = torch.tensor([plan["value"], float(done)])
        try:  # a peer that left makes the survivors stop waiting at once, not after the group's timeout
            total = values[:1].clone()
            wait_all([dist.all_reduce(total, group=epoch.group, async_op=True)], membership.failing)
            wait_all([dist.all_reduce(values[1:], dist.ReduceOp.MAX, epoch.group, True)], membership.failing)
        except RuntimeError:
            epoch = membership.recover()
            continue
        done = int(values[1]) + 1
        seen.append((epoch.number, epoch.sites, float(total)))
        if plan.get("die_after") == done:
            _leave_abruptly(queue, (name, seen, None))
        changed = membership.at_boundary(done)
        epoch = changed or epoch
    queue.put((name, seen, membership.waited_s))
    membership.close()


def averaging_site(address: str, name: str, plan: dict[str, Any], queue: Any) -> None:
    """A process of a site training a small model with an Averager that takes ``membership``, for the run's
    ``steps`` (a site that joins late starts at the step it is given). A site of one process sets the model up with
    Lightning Fabric; with ``site_port``, the process is ``local_rank`` of a site of ``processes`` (a gloo world of
    its own at that port, DDP inside it, or FSDP2 with ``shard``). ``options``: the Averager's (with ``outer_lr``
    for DiLoCo's Nesterov SGD); ``momentum``: the inner SGD's, averaged with the model; ``die_at``: exit abruptly
    before that step; ``receive_delay_s``: a site that joins receives the state that much later; ``poison``: its
    parameters are multiplied by 100 once it joined. Reports, under the site's name (``name/i`` from its process
    i > 0), the epochs it saw, its final parameters' fingerprint (FSDP2: its shard's) and its optimizer state's,
    its steps, its period (None: "auto" chose none), the sites' periods with pace="speed", its rounds, its last and
    highest loss, its membership wait, what ``on_transfer`` said and, per epoch entered, the collectives of its
    start, their seconds and the state bytes it received or sent. With pace="speed" the loop ends at
    ``local_steps``."""
    from fabric_multimodel import Averager
    from fabric_multimodel.comm.collectives import ALL_GATHER_SINGLE, tensors_fingerprint
    from fabric_multimodel.rounds.optimizer_state import optimizer_state

    entries: list[dict[str, int]] = []  # per epoch entered: the collectives its start issued

    def counting(kind: str) -> Any:
        call = getattr(dist, kind)

        def counted(*args: Any, **kwargs: Any) -> Any:
            if entries:
                entries[-1][kind] = entries[-1].get(kind, 0) + 1
            return call(*args, **kwargs)

        return counted

    for kind in ("all_reduce", ALL_GATHER_SINGLE, "broadcast"):
        setattr(dist, kind, counting(kind))
    from fabric_multimodel.averaging.epochs import Epochs

    enter = Epochs._enter_epoch

    def entering(self: Epochs, epoch: Any) -> None:
        entries.append({"epoch": epoch.number})
        start = time.perf_counter()
        enter(self, epoch)
        entries[-1]["seconds"] = time.perf_counter() - start
        entries[-1]["state_bytes"] = self.state_traffic.bytes
        entries.append({})  # what follows is no epoch's start

    Epochs._enter_epoch = entering  # type: ignore[method-assign]
    if plan.get("receive_delay_s"):  # a slow link to this site: the state it receives arrives that much later
        import fabric_multimodel.averaging.epochs as epochs

        relay = epochs.relay_bytes

        def late(*args: Any, **kwargs: Any) -> Any:
            time.sleep(plan["receive_delay_s"])
            return relay(*args, **kwargs)

        epochs.relay_bytes = late  # type: ignore[assignment]

    local_rank = plan.get("local_rank", 0)
    report = name if local_rank == 0 else f"{name}/{local_rank}"
    torch.manual_seed(sum(map(ord, name)))  # every site its own start: the first epoch starts them all from one
    model: Any = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    if "site_port" in plan:  # a site of several processes: DDP inside its own world
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{plan['site_port']}", rank=local_rank, world_size=plan["processes"]
        )
        if plan.get("shard"):  # FSDP2 inside the site: process i holds shard i
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            model = fully_shard(model, mesh=init_device_mesh("cpu", (plan["processes"],)))
        else:
            model = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=plan.get("momentum", 0.0))
        device: Any = SimpleNamespace(device=torch.device("cpu"))  # what the Averager asks of a Fabric
        backward = torch.Tensor.backward
    else:
        from lightning_fabric import Fabric

        device = fabric = Fabric(accelerator="cpu", devices=1)
        inner = torch.optim.SGD(model.parameters(), lr=0.05, momentum=plan.get("momentum", 0.0))
        model, opt = fabric.setup(model, inner)
        backward = fabric.backward
    options = dict(plan["options"])
    if "outer_lr" in options:
        outer_lr = options.pop("outer_lr")
        options["outer_optimizer"] = functools.partial(torch.optim.SGD, lr=outer_lr, momentum=0.9, nesterov=True)
    transfers: list[tuple[int, int]] = []  # what on_transfer said: (bytes done, bytes in all)
    membership = _membership(address, name, plan, on_transfer=lambda done, total, _: transfers.append((done, total)))
    generator = torch.Generator().manual_seed(sum(map(ord, name)) + local_rank)
    epochs = []
    worst = 0.0
    optimizers = [opt] if plan.get("momentum") else []  # the momentum is averaged with the model
    with Averager(device, model, membership=membership, optimizers=optimizers, **options) as averager:
        if plan.get("poison"):  # what a site sends in its first round after it joined must weigh nothing
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.mul_(100.0)
        while averager.steps < averager.local_steps(plan["steps"]):  # pace="speed": a slower site makes fewer
            if not epochs or membership.epoch.number != epochs[-1][0]:
                epochs.append((membership.epoch.number, membership.epoch.sites))
            x = torch.randn(32, 8, generator=generator)
            loss = ((model(x) - x.sum(dim=1, keepdim=True)) ** 2).mean()
            opt.zero_grad()
            backward(loss)
            opt.step()
            if plan.get("die_at") == averager.steps + 1:
                _leave_abruptly(queue, (report, {"epochs": epochs}, None))
            averager.step()
            worst = max(worst, float(loss.detach()))
            time.sleep(plan.get("step_s", 0.0))
    result = {
        "epochs": epochs,
        "params": tensors_fingerprint([getattr(p, "_local_tensor", p) for p in model.parameters()]),  # FSDP2: shard
        "optimizer": tensors_fingerprint(optimizer_state([opt])),
        "steps": averager.steps,
        "period": averager.period if averager.config.period != "auto" or averager.period_choice else None,
        "pace": averager.pace.periods if averager.pace is not None else None,
        "rounds": averager.rounds,
        "wait_s": averager.membership_wait_s,
        "loss": float(loss.detach()),
        "worst": worst,  # the highest loss of its steps
        "starts": [e for e in entries if "epoch" in e],
        "transfers": transfers,
    }
    membership.close()
    if "site_port" in plan:
        dist.destroy_process_group()
    queue.put((report, result, None))
