"""Train a GAN on the 8-Gaussian ring with per-model DDP, ``frozen`` and (optionally) local SGD.

Run it any of these ways::

    fabric run --accelerator cpu --devices 4 examples/gan_fabric.py              # 4 processes, synchronous DDP
    fabric run --accelerator cpu --devices 4 examples/gan_fabric.py --period 8   # local SGD, average every 8 steps
    python examples/gan_fabric.py --devices 4 --accelerator cpu                  # the script starts the processes
    python examples/gan_fabric.py                                                # one process
    python examples/gan_fabric.py --resume runs/gan/ring-sync-seed0/checkpoint.pt --steps 4000  # continue to 4000 steps
    python examples/gan_fabric.py --dataset digits                               # 8x8 digits (scikit-learn)

Generator and discriminator each get their own ``DistributedDataParallel`` (``setup_models``). The
generator step runs the discriminator inside ``frozen(disc)``, so that step allreduces the
generator's gradients only. With ``--period N`` an ``Averager`` runs ``--warmup-steps`` synchronous
steps, then local steps with no communication, averaging the replicas every N steps. With ``--shard node``
(and ``--period N``) both models are sharded with FSDP2 over each node's processes instead, and the
rounds average each shard across nodes; checkpoints are then a folder per node (``OUT/checkpoint``,
``OUT/checkpoint.replica1``, ...).

Rank 0 writes ``OUT/checkpoint.pt``, CSV metrics under ``OUT/logs/`` and a picture of the samples
(with matplotlib), and its last line is machine-readable (wrapped here)::

    final: steps=3000 modes_captured=8/8 high_quality=0.947 wall_s=162.5 iter_ms_median=52.53
        iter_ms_mean=54.02 comm_bytes=410148000 comm_bytes_per_iter=136716.0 rounds=0

That is the first command on a 2-core CPU (AMD EPYC, 4 processes, seed 0, 2026-12-02); with
``--period 8`` the same machine reached 8/8 modes and 0.935 high quality in 317 averaging rounds,
sending 49% of the bytes, in 77.6 s (iter_ms_mean=21.73).
"""

from __future__ import annotations

import os

os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # before torch: its store client logs with C++ stack frames

import argparse
import importlib.util
import inspect
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from common import (
    CoordinatorGuard,
    add_averaging_arguments,
    add_run_arguments,
    check_arguments,
    checkpoints,
    data_rank,
    join_run,
    layout,
    main,
    mode_name,
    report_membership,
    run_config,
    run_folder,
    start_averager,
    stopped,
    summary,
    warmup_ended,
)
from lightning.fabric import Fabric
from lightning.fabric.loggers import CSVLogger
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fabric_multimodel import Loop, frozen, setup_models
from fabric_multimodel.ring import N_MODES, ring_gan, ring_modes, ring_quality, sample_ring
from fabric_multimodel.run import cli
from fabric_multimodel.run.cli import Parser
from fabric_multimodel.run.progress import Progress, StartPhases
from fabric_multimodel.run.report import GradientBytes, final_line, state_bytes

Sampler = Callable[[int, torch.Generator], torch.Tensor]  # (batch size, generator) -> real batch
EVAL_SAMPLES = 2500
# torch 2.13 renamed DDP's `broadcast_buffers` to `forward_sync_buffers` (the old name warns).
SYNC_BUFFERS = next(
    n
    for n in ("forward_sync_buffers", "broadcast_buffers")
    if n in inspect.signature(DistributedDataParallel).parameters
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser(
        "gan_fabric.py", "Train a GAN on the 8-Gaussian ring with per-model DDP, frozen and (optionally) local SGD."
    )
    p.add_argument(
        "--dataset",
        choices=["ring", "digits"],
        default="ring",
        help="ring: 8 Gaussians on a circle; digits: scikit-learn's 8x8 digits (the digits extra)",
    )
    p.add_argument("--steps", type=int, default=3000, help="total iterations, counting those before --resume")
    p.add_argument("--batch-size", type=int, default=64, help="per process")
    p.add_argument(
        "--lr", type=float, default=4e-3, help="Adam's learning rate, decayed linearly to 1%% of it by --steps"
    )
    p.add_argument("--seed", type=int, default=0, help="initial weights (the same on every rank) and data")
    add_averaging_arguments(p, warmup_steps=500)
    add_run_arguments(p)
    args = p.parse_args(argv)
    check_arguments(p, args)
    if args.dataset == "digits" and importlib.util.find_spec("sklearn") is None:
        p.error("--dataset digits needs scikit-learn: pip install 'fabric-multimodel[digits]'")
    args.out = run_folder(p, args, "gan", args.dataset, mode_name(args))
    return args


def digits_gan(z_dim: int) -> tuple[nn.Module, nn.Module, Sampler]:
    """A small conv GAN for the 8x8 digits that ship with scikit-learn (no download)."""
    from sklearn.datasets import load_digits

    images = torch.tensor(load_digits().images, dtype=torch.float32).unsqueeze(1) / 8 - 1  # 0..16 -> [-1, 1]
    gen = nn.Sequential(
        nn.Linear(z_dim, 64 * 2 * 2),
        nn.Unflatten(1, (64, 2, 2)),
        nn.BatchNorm2d(64),
        nn.ReLU(),
        nn.ConvTranspose2d(64, 32, 4, 2, 1),
        nn.BatchNorm2d(32),
        nn.ReLU(),  # 4x4
        nn.ConvTranspose2d(32, 1, 4, 2, 1),
        nn.Tanh(),  # 8x8
    )
    disc = nn.Sequential(
        nn.Conv2d(1, 32, 4, 2, 1),
        nn.LeakyReLU(0.2),  # 4x4
        nn.Conv2d(32, 64, 4, 2, 1),
        nn.BatchNorm2d(64),
        nn.LeakyReLU(0.2),  # 2x2
        nn.Flatten(),
        nn.Linear(64 * 2 * 2, 1),
    )
    return gen, disc, lambda n, g: images[torch.randint(len(images), (n,), generator=g)]


def build(fabric: Fabric, args: argparse.Namespace, setup: dict[str, Any]) -> tuple[Any, ...]:
    torch.manual_seed(args.seed)  # same initial weights on every rank
    if args.dataset == "ring":
        z_dim, ddp_kwargs = 2, None  # a 2-D latent for 2-D data covers the ring more reliably; no buffers
        gen, disc = ring_gan(z_dim)
        sample_real: Sampler = lambda n, g: sample_ring(n, generator=g)  # noqa: E731
    else:
        z_dim = 32
        gen, disc, sample_real = digits_gan(z_dim)
        # D runs three forwards per iteration. DDP would broadcast its BatchNorm statistics from
        # rank 0 before each (a collective per forward, overwriting tensors autograd may have saved);
        # D only ever runs in training mode, so its running statistics are unused and can stay local.
        ddp_kwargs = {"disc": {SYNC_BUFFERS: False}}
    if "shard" in setup:  # FSDP2 keeps each rank's BatchNorm statistics local: there is nothing to broadcast
        ddp_kwargs = None
    gen, disc = setup_models(fabric, gen=gen, disc=disc, ddp_kwargs=ddp_kwargs, **setup)
    opt_g = torch.optim.Adam(gen.parameters(), lr=args.lr, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(disc.parameters(), lr=args.lr, betas=(0.5, 0.999))
    opt_g, opt_d = fabric.setup_optimizers(opt_g, opt_d)
    return gen, disc, opt_g, opt_d, sample_real, z_dim, GradientBytes([gen, disc])


def learning_rate(args: argparse.Namespace, step: int, last: int) -> float:
    """Linear decay from --lr to 1% of it at the ``last`` step (a paced site's: its own): a high rate trains the
    ring fast, a low one ends it tight."""
    return args.lr * (1 - 0.99 * (step - 1) / max(1, last - 1))


def set_learning_rate(optimizers: list[Any], lr: float) -> None:
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = lr


@torch.no_grad()
def generate(gen: nn.Module, n: int, z_dim: int) -> torch.Tensor:
    # The plain module, not the DDP wrapper: rank 0 runs this alone, and DDP's forward may communicate. An FSDP2
    # module gathers its shards inside the site: every process of the site calls this.
    module = gen.module
    module.eval()
    z = torch.randn(n, z_dim, generator=torch.Generator().manual_seed(1234))
    samples = module(z.to(next(module.parameters()).device)).cpu()
    module.train()
    return samples


def save_picture(path: Path, samples: torch.Tensor) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"no picture: pip install 'fabric-multimodel[plot]' to get {path}")
        return
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 5))
    if samples.ndim == 2:  # ring points
        modes = ring_modes()
        ax.scatter(samples[:, 0], samples[:, 1], s=2, alpha=0.3, label=f"{len(samples)} generated")
        ax.scatter(modes[:, 0], modes[:, 1], s=60, c="red", marker="x", label=f"{N_MODES} real modes")
        ax.set_aspect("equal")
        ax.legend(loc="upper right", fontsize=8)
    else:  # 64 digits in an 8x8 grid, with grey lines between them
        tiles = F.pad(samples[:64, 0], (1, 1, 1, 1), value=0.0)
        ax.imshow(tiles.reshape(8, 8, 10, 10).permute(0, 2, 1, 3).reshape(80, 80), cmap="gray", vmin=-1, vmax=1)
        ax.axis("off")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def train(args: argparse.Namespace) -> int | None:
    torch.set_num_threads(1)  # several processes share the cores; more threads each only contend
    phases = StartPhases()
    fabric = cli.start_fabric(Fabric, args, loggers=CSVLogger(root_dir=args.out, name="logs"))
    phases.mark("fabric")
    placement = layout(fabric, args)
    sharded = args.shard == "node"  # every process of a site then takes part in its forwards (evaluation too)
    phases.mark("groups")
    gen, disc, opt_g, opt_d, sample_real, z_dim, grad_bytes = build(fabric, args, placement.setup)
    phases.mark("models")
    averager = start_averager(fabric, args, [gen, disc], placement, [opt_g, opt_d])  # None: synchronous DDP
    phases.mark("averager")
    config = run_config(args, dataset=args.dataset, z_dim=z_dim)
    state: dict[str, Any] = {  # a site that joins a running run starts at the others' step
        "gen": gen, "disc": disc, "opt_g": opt_g, "opt_d": opt_d, "grad_bytes": 0, "config": config,
        **({"averager": averager, "step": averager.steps} if averager else {"step": 0}),
    }  # fmt: skip
    checkpointer = checkpoints(fabric, args, state, averager, phases)  # resumed: the values in `state`
    join_run(fabric, averager, state)  # --coordinator: this site joins the run (the newest state any holds)
    grad_bytes.bytes = state["grad_bytes"]

    def checkpoint() -> dict[str, Any]:  # what a checkpoint holds, at the loop's step
        return state | dict(step=loop.step, grad_bytes=grad_bytes.bytes, world_size=fabric.world_size)

    loop = Loop(averager, args.steps, checkpointer=checkpointer, state=checkpoint, start=state["step"],
                checkpoint_every=args.checkpoint_every, checkpoint_rounds=args.checkpoint_rounds)  # fmt: skip
    # Different data on every rank (and after a resume); the same weights everywhere (seeded in build).
    data_gen = torch.Generator().manual_seed(hash((args.seed, data_rank(fabric, args), state["step"])))
    ones = torch.ones(args.batch_size, 1, device=fabric.device)
    progress = Progress(loop.last, loop.step, args.log_every, fabric.is_global_zero)
    iter_seconds: list[float] = []
    memory = 0  # state_bytes, measured at the last step
    wall = time.perf_counter()
    if averager is not None and loop.step >= args.warmup_steps:  # resumed past warm-up: the pace is known
        warmup_ended(fabric, averager, loop, progress)
    epoch_seen = report_membership(fabric, averager, (0, None))
    with CoordinatorGuard() as guard, averager or nullcontext():
        for step in loop:
            tick = time.perf_counter()
            set_learning_rate([opt_g, opt_d], learning_rate(args, step, loop.last))
            real = sample_real(args.batch_size, data_gen).to(fabric.device)
            z = torch.randn(args.batch_size, z_dim, generator=data_gen).to(fabric.device)
            fake = gen(z)
            d_loss = F.binary_cross_entropy_with_logits(disc(real), ones) + F.binary_cross_entropy_with_logits(
                disc(fake.detach()), 1 - ones
            )
            fabric.backward(d_loss)
            opt_d.step()
            if step == loop.last:  # the state at its largest: D's gradients, then (below) G's, before zero_grad
                memory = state_bytes([gen, disc], [opt_g, opt_d], averager)
            opt_d.zero_grad()
            with frozen(disc):  # D is used, not trained: no gradients for it, no allreduce of them
                g_loss = F.binary_cross_entropy_with_logits(disc(fake), ones)
            fabric.backward(g_loss)
            opt_g.step()
            if step == loop.last:
                memory = max(memory, state_bytes([gen, disc], [opt_g, opt_d], averager))
            opt_g.zero_grad()
            if averager is not None:
                if averager.membership is not None:  # the status page's figures, read at the next boundary
                    averager.membership.report(d_loss=d_loss, g_loss=g_loss)
                averager.step()
                epoch_seen = report_membership(fabric, averager, epoch_seen)
                if step == args.warmup_steps:
                    warmup_ended(fabric, averager, loop, progress)
            if averager is None or step > args.warmup_steps:  # time the steady state only
                iter_seconds.append(time.perf_counter() - tick)

            progress(step, lambda d=d_loss, g=g_loss: {"d_loss": d.item(), "g_loss": g.item()})
            if step % args.log_every == 0 or step == loop.last:
                metrics = {"d_loss": d_loss.item(), "g_loss": g_loss.item()}
                if args.dataset == "ring" and (fabric.is_global_zero or sharded):  # rank 0's replica, cheap
                    metrics.update(ring_quality(generate(gen, EVAL_SAMPLES, z_dim))._asdict())
                fabric.log_dict(metrics, step=step)
    if loop.stopped or guard.error:  # every rank stopped at one step, after a checkpoint
        return stopped(fabric, loop, guard)
    # Leaving the Averager's block averaged once more: all replicas are identical now.
    wall = time.perf_counter() - wall
    progress.close()
    checkpointer.save(checkpoint())  # leaving the block averaged already
    round_checkpoints = loop.close()
    fabric.logger.finalize("success")
    if fabric.is_global_zero or sharded:
        samples = generate(gen, EVAL_SAMPLES if args.dataset == "ring" else 64, z_dim)
    if not fabric.is_global_zero:
        return None

    picture = args.out / ("samples.png" if args.dataset == "ring" else "digits.png")
    save_picture(picture, samples)
    comm = grad_bytes.bytes + (averager.traffic.bytes if averager is not None else 0)
    if args.dataset == "ring":
        quality = ring_quality(samples)
        result = f"modes_captured={quality.modes_captured}/{N_MODES} high_quality={quality.high_quality:.3f}"
    else:
        result = "dataset=digits"
    print(summary(args, grad_bytes, averager, picture.name, round_checkpoints))
    print(final_line(loop.last, result, wall_s=wall, iter_seconds=iter_seconds, comm_bytes=comm,
                     state_bytes=memory, averager=averager), flush=True)  # fmt: skip
    return None


if __name__ == "__main__":
    main(lambda: train(parse_args()))
