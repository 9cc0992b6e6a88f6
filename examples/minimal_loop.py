"""The smallest loop with every part: streaming DiLoCo with fp8 rounds (or, with --density 1/64, sparse rounds),
checkpoints after rounds that send nothing, a clean stop on SIGTERM, a resume from --out when the same command runs
again, and sites that join a running run.

    fabric run --accelerator cpu --devices 2 examples/minimal_loop.py --steps 400 --out runs/minimal
    torchrun --nproc-per-node 2 examples/minimal_loop.py --steps 400 --out runs/minimal
    python -m fabric_multimodel.sites --sites 2 --devices 1 --bandwidth 10mbit -- examples/minimal_loop.py
    SITE=a python examples/minimal_loop.py --coordinator HOST:29400  # python -m fabric_multimodel.coordinator
"""

import os

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # before torch: its store client logs with C++ stack frames

import argparse
import functools
import time
import zlib

import torch
from lightning.fabric import Fabric
from torch import nn

from fabric_multimodel import (
    Averager,
    Checkpointer,
    CoordinatorLost,
    Loop,
    Membership,
    RunEnded,
    WrongSecret,
    setup_models,
)  # fmt: skip
from fabric_multimodel.membership.names import SITE_NAME_RULE, is_site_name
from fabric_multimodel.plan.payloads import fraction
from fabric_multimodel.run.cli import configure_logging
from fabric_multimodel.run.launch import start_fabric


def loss_of(model: nn.Module, step: int, rank: int, device: torch.device) -> torch.Tensor:
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1000 * step + rank)).to(device)  # resumes read on
    return nn.functional.mse_loss(model(x), x.sin().sum(1, keepdim=True))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--out", default="runs/minimal", help="checkpoints; a run started again resumes from here")
    p.add_argument("--coordinator", help="HOST:PORT: this world is site $SITE of a run whose sites come and go")
    p.add_argument("--min-sites", type=int, default=1, help="with --coordinator: the sites the run starts with")
    p.add_argument("--grace", type=float, default=300.0, help="seconds the coordinator may be away (it trains on)")
    p.add_argument("--density", type=fraction, default=1.0, help="below 1 (e.g. 1/64): sparse rounds, not fp8 codes")
    p.add_argument("--robust", choices=["none", "clip", "trimmed_mean"], default="none",
                   help="rounds no single site steers alone (fp32 payloads)")  # fmt: skip
    args = p.parse_args()
    site = os.environ.get("SITE", "")
    if args.coordinator and not is_site_name(site):
        p.error(f"SITE={site[:40]!r}...: {SITE_NAME_RULE}")  # before the coordinator hears of it
    configure_logging("INFO")  # the library's lines: epochs, joins and losses, resumes
    fabric = start_fabric(Fabric)  # in the world `fabric run`, torchrun or the sites tool made, or one process
    torch.manual_seed(0)
    (model,) = setup_models(fabric, model=nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1)))
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=3e-3))
    outer = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
    payload = {"comm_dtype": torch.float8_e4m3fn, "outer_optimizer": outer}
    if args.density < 1:  # what a site has not sent yet stands in for the outer momentum (SparseLoCo)
        payload = {"density": args.density}
    if args.robust != "none":  # every site receives every site's pseudo-gradient and applies the rule
        payload = {"robust": args.robust, "outer_optimizer": outer}
    data = zlib.crc32(site.encode()) % 997 if args.coordinator else 0  # each site its own batches
    options = {"device": fabric.device, "min_sites": args.min_sites, "grace_s": args.grace}
    try:  # FABRIC_MULTIMODEL_SECRET: only the sites that hold the run's secret are let in
        membership = Membership(args.coordinator, site, **options) if args.coordinator else None
    except WrongSecret as error:
        raise SystemExit(f"site {site}: {error}") from None
    averager = Averager(fabric, model, period=32, warmup_steps=0, fragments=2, overlap_steps=2, membership=membership,
                        **payload)  # fmt: skip
    checkpointer = Checkpointer(fabric, args.out, averager=averager)
    state = {"model": model, "optimizer": optimizer, "averager": averager, "step": 0}
    if checkpointer.resume(state):  # its own newest; with --coordinator, the sites then agree on the run's newest
        fabric.print(f"resumed at step {state['step']} from {checkpointer.own_path}")
    # A checkpoint after each round (it sends nothing), and on SIGTERM every rank stops at one step after one.
    loop = Loop(averager, args.steps, checkpointer=checkpointer, state=lambda: state | {"step": loop.step},
                checkpoint_rounds=True)  # fmt: skip
    wall = time.perf_counter()
    try:
        with averager:  # with --coordinator, this site joins the run here (behind the others: their step and model)
            if averager.steps > state["step"]:
                fabric.print(f"joined the run at step {averager.steps}")
            for step in loop:
                loss = loss_of(model, step, fabric.global_rank + data, fabric.device)
                fabric.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                if membership is not None:
                    membership.report(loss=loss)  # the status page's loss column (read at the next round)
                averager.step()
    except RunEnded as error:  # it started after the run's last round
        fabric.print(f"run ended: {error}")
        return 0
    except CoordinatorLost as error:  # a site was lost while the coordinator was away, past its grace
        loop.save(reason=f"a lost coordinator ({error})")
    loop.close()  # the checkpoint written in the background lands; a site waiting to join stops waiting
    if loop.stopped:
        fabric.print(f"stopped by {loop.stop_reason} at step {loop.step}; the same command resumes it")
        return 143
    val_loss, seconds = loss_of(model, 10**6, 0, fabric.device).item(), time.perf_counter() - wall  # held out
    fabric.print(
        f"final: steps={loop.step} val_loss={val_loss:.6f} wall_s={seconds:.1f} comm_bytes={averager.traffic.bytes}"
        f" rounds={averager.rounds}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
