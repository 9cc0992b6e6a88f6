"""The smallest loop with every part: streaming DiLoCo with fp8 rounds, checkpoints after rounds that send nothing,
a clean stop on SIGTERM, and a resume from --out when the same command runs again.

    fabric run --accelerator cpu --devices 2 examples/minimal_loop.py --steps 400 --out runs/minimal
    torchrun --nproc-per-node 2 examples/minimal_loop.py --steps 400 --out runs/minimal
    python -m fabric_multimodel.sites --sites 2 --devices 1 --bandwidth 10mbit -- examples/minimal_loop.py
"""

import argparse
import functools
import os
import time

import torch
from lightning.fabric import Fabric
from torch import nn

from fabric_multimodel import Averager, Checkpointer, PreemptionStop, setup_models


def batch(step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1000 * step + rank))  # a resumed run reads on
    return x.to(device), x.sin().sum(1, keepdim=True).to(device)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--out", default="runs/minimal", help="checkpoints; a run started again resumes from here")
    args = p.parse_args()
    world, per_node = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    cli = os.environ.get("LT_CLI_USED") == "1"  # `fabric run` started the processes and passes its options
    shape = {} if cli else {"devices": per_node, "num_nodes": world // per_node}  # torchrun's, or one process
    fabric = Fabric(strategy="ddp" if world > 1 else "auto", **shape)
    if not cli:
        fabric.launch()
    torch.manual_seed(0)
    (model,) = setup_models(fabric, model=nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1)))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
    outer = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
    averager = Averager(
        fabric, model, period=32, warmup_steps=0, fragments=2, overlap_steps=2,
        outer_optimizer=outer, comm_dtype=torch.float8_e4m3fn,
    )  # fmt: skip
    checkpointer = Checkpointer(fabric, args.out, averager=averager)
    state = {"model": model, "optimizer": optimizer, "averager": averager, "step": 0}
    if checkpointer.resume(state):
        fabric.print(f"resumed at step {state['step']} from {args.out}")
    stop, wall = PreemptionStop(), time.perf_counter()
    with averager:
        while state["step"] < args.steps:
            x, y = batch(state["step"], fabric.global_rank, fabric.device)
            loss = nn.functional.mse_loss(model(x), y)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            averager.step()
            state["step"] += 1
            if averager.finished_at == averager.steps and not averager.pending:  # a round ended: save, send nothing
                checkpointer.after_round(state)
            # Stop where no round is in flight, so that the run resumed goes on exactly as it would have.
            if stop.requested(state["step"]) and not averager.pending and state["step"] < args.steps:
                checkpointer.save(state)
                break
    stop.close()
    checkpointer.close()  # a write in the background lands before the exit
    if state["step"] < args.steps:
        fabric.print(f"stopped by SIGTERM at step {state['step']}; the same command resumes it")
        return 143
    x, y = batch(10**6, 0, fabric.device)  # held out: no step reads it; every replica is the same now
    val_loss = nn.functional.mse_loss(model(x), y)
    fabric.print(
        f"final: steps={state['step']} val_loss={val_loss.item():.6f} wall_s={time.perf_counter() - wall:.1f}"
        f" comm_bytes={averager.traffic.bytes} rounds={averager.rounds}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
