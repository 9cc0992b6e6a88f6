"""Train the 8-Gaussian ring GAN with the Lightning ``Trainer``: one DDP per model, and (optionally) local SGD.

Run it::

    python examples/gan_trainer.py --devices 4 --accelerator cpu               # 4 processes, synchronous DDP
    python examples/gan_trainer.py --devices 4 --accelerator cpu --period 8    # local SGD, average every 8 batches
    python examples/gan_trainer.py                                             # one process

The ``LightningModule`` holds ``generator`` and ``discriminator`` and optimizes them manually with
two optimizers, as Lightning's GAN tutorial does. ``MultiModelDDPStrategy`` gives each its own
``DistributedDataParallel``; the generator step runs the discriminator inside ``frozen(...)``, so
that step allreduces the generator's gradients only, and no ``find_unused_parameters`` is needed.
With ``--period N`` the ``ModelAveraging`` callback runs ``--warmup-steps`` synchronous batches,
then local steps with no communication, averaging the replicas every N batches.

Rank 0 writes ``OUT/checkpoint.ckpt`` (plain parameter names: it loads without the strategy) and
CSV losses under ``OUT/logs/``, and its last line is machine-readable, in the format of
``gan_fabric.py`` (wrapped here)::

    final: steps=3000 modes_captured=8/8 high_quality=0.901 wall_s=143.1 iter_ms_median=37.46
        iter_ms_mean=37.66 comm_bytes=410148000 comm_bytes_per_iter=136716.0 rounds=0

That is the first command with ``--devices 4`` on a 2-core CPU (AMD EPYC, seed 0, 2026-12-02); the
gradient bytes are exactly ``gan_fabric.py``'s. With ``--period 8`` the same machine reached 8/8
modes and 0.872 high quality in 313 averaging rounds, sending 48% of the bytes, in 105.6 s.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from common import run_folder
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader, IterableDataset

from fabric_multimodel import frozen
from fabric_multimodel.lightning import ModelAveraging, MultiModelDDPStrategy
from fabric_multimodel.ring import N_MODES, ring_gan, ring_quality, sample_ring
from fabric_multimodel.run.cli import Parser
from fabric_multimodel.run.launch import LAUNCHER_FLAGS, launched_by, shutdown, world_shape
from fabric_multimodel.run.report import GradientBytes, final_line

EVAL_SAMPLES = 2500


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = Parser("gan_trainer.py", __doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3000, help="training batches (iterations)")
    p.add_argument("--batch-size", type=int, default=64, help="per process")
    p.add_argument("--lr", type=float, default=4e-3, help="Adam's learning rate, decayed linearly to 1%% of it")
    p.add_argument("--seed", type=int, default=0, help="initial weights (the same on every rank) and data")
    p.add_argument("--period", type=int, default=0, help="0: synchronous DDP; N: average every N batches")
    p.add_argument("--warmup-steps", type=int, default=500, help="synchronous batches before local SGD")
    p.add_argument("--log-every", type=int, default=0, help="0: every 10%% of --steps")
    p.add_argument("--out", type=Path, help="run folder (default: runs/gan_trainer/<settings>-seed<seed>)")
    p.add_argument("--devices", type=int, help="processes to start (default 1; under torchrun, its --nproc-per-node)")
    p.add_argument(
        "--accelerator", choices=["auto", "cpu", "cuda", "gpu", "mps"], default="auto", help="where to train"
    )
    args = p.parse_args(argv)
    # Every rank runs this identically, before any collective, so a bad flag stops all of them.
    for flag, minimum in [("steps", 1), ("batch_size", 1), ("period", 0), ("warmup_steps", 0), ("log_every", 0)]:
        if getattr(args, flag) < minimum:
            p.error(f"--{flag.replace('_', '-')} must be >= {minimum}, got {getattr(args, flag)}")
    if args.devices is not None and args.devices < 1:
        p.error(f"--devices must be >= 1, got {args.devices}")
    launcher = launched_by()
    if launcher is not None and args.devices is not None:
        p.error(
            f"--devices: {launcher} started the processes; give {LAUNCHER_FLAGS[launcher][0]} to {launcher} instead"
        )
    if not (math.isfinite(args.lr) and args.lr > 0):
        p.error(f"--lr must be a positive number, got {args.lr}")
    args.log_every = args.log_every or max(1, args.steps // 10)
    mode = f"period{args.period}-warmup{args.warmup_steps}" if args.period else "sync"
    args.out = run_folder(p, args, "gan_trainer", mode, checkpoint="checkpoint.ckpt")
    return args


def quiet_lightning() -> None:
    """Keep the screen to progress and results: Lightning's start-up notes (GPU/TPU availability, tips, the
    process group banner) and deprecation notices from inside Lightning are not the user's concern here."""
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    logging.getLogger("lightning.fabric").setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    warnings.filterwarnings("ignore", message=r".*`weights_only` was not set")


class RingBatches(IterableDataset):
    """An endless stream of (real points, latent) batches; each rank passes its own ``seed``."""

    def __init__(self, batch_size: int, z_dim: int, seed: int) -> None:
        self.batch_size, self.z_dim, self.seed = batch_size, z_dim, seed

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        g = torch.Generator().manual_seed(self.seed)
        while True:
            yield sample_ring(self.batch_size, generator=g), torch.randn(self.batch_size, self.z_dim, generator=g)


class RingGAN(pl.LightningModule):
    """The ring GAN as a LightningModule with manual optimization (two optimizers, one batch = one iteration).

    Example::

        trainer = pl.Trainer(devices=4, strategy=MultiModelDDPStrategy(), limit_train_batches=3000, max_epochs=1)
        trainer.fit(RingGAN())
    """

    def __init__(
        self, lr: float = 4e-3, batch_size: int = 64, seed: int = 0, z_dim: int = 2, steps: int = 3000
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator, self.discriminator = ring_gan(z_dim)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        real, z = batch
        opt_g, opt_d = self.optimizers()
        # As examples/gan_fabric.py: a linear decay to 1% of lr at the last step keeps the modes tight.
        # (Under manual optimization global_step counts optimizer steps: two per batch here.)
        lr = self.hparams.lr * (1 - 0.99 * (self.global_step // 2) / max(1, self.hparams.steps - 1))
        for opt in (opt_g, opt_d):
            for group in opt.param_groups:
                group["lr"] = lr
        ones = torch.ones(real.shape[0], 1, device=real.device)
        fake = self.generator(z)
        d_loss = F.binary_cross_entropy_with_logits(self.discriminator(real), ones)
        d_loss = d_loss + F.binary_cross_entropy_with_logits(self.discriminator(fake.detach()), 1 - ones)
        self.manual_backward(d_loss)
        opt_d.step()
        opt_d.zero_grad()
        with frozen(self.discriminator):  # D is used, not trained: no gradients for it, no allreduce of them
            g_loss = F.binary_cross_entropy_with_logits(self.discriminator(fake), ones)
        self.manual_backward(g_loss)
        opt_g.step()
        opt_g.zero_grad()
        self.log_dict({"d_loss": d_loss, "g_loss": g_loss})

    def configure_optimizers(self) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
        betas = (0.5, 0.999)
        return (
            torch.optim.Adam(self.generator.parameters(), lr=self.hparams.lr, betas=betas),
            torch.optim.Adam(self.discriminator.parameters(), lr=self.hparams.lr, betas=betas),
        )

    def train_dataloader(self) -> DataLoader:
        # Different data on every rank, the same initial weights everywhere (DDP broadcasts rank 0's).
        seed = self.hparams.seed * 1_000_003 + self.global_rank
        return DataLoader(RingBatches(self.hparams.batch_size, self.hparams.z_dim, seed), batch_size=None)

    @torch.no_grad()
    def sample(self, n: int) -> torch.Tensor:
        """``n`` generated points from a fixed latent (the same on every rank and run)."""
        z = torch.randn(n, self.hparams.z_dim, generator=torch.Generator().manual_seed(1234))
        return self.generator(z.to(self.device)).cpu()


class Meter(pl.Callback):
    """Gradient bytes (a comm hook on each model's DDP), per-batch times and rank 0's progress lines."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.grad = GradientBytes([])
        self.iter_seconds: list[float] = []
        self._tick = 0.0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.world_size == 1:
            return  # DDP's allreduce over one rank sends nothing
        self.grad = GradientBytes(trainer.strategy.ddp_modules.values())

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        self._tick = time.perf_counter()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        step = idx + 1
        if not self.args.period or step > self.args.warmup_steps:  # time the steady state only
            self.iter_seconds.append(time.perf_counter() - self._tick)
        if trainer.is_global_zero and (step % self.args.log_every == 0 or step == self.args.steps):
            losses = " ".join(f"{k}={v.item():.3f}" for k, v in trainer.callback_metrics.items())
            print(f"step {step}/{self.args.steps} {losses}", flush=True)


def train(args: argparse.Namespace) -> tuple[str | None, list[Any]]:
    """Fit; rank 0 gets its final line (other ranks None), and the launcher's child processes."""
    torch.set_num_threads(1)  # several processes share the cores; more threads each only contend
    quiet_lightning()
    pl.seed_everything(args.seed, verbose=False)  # the same initial weights on every rank
    meter = Meter(args)
    averaging = ModelAveraging(args.period, args.warmup_steps, average_optimizer_state=True) if args.period else None
    devices, nodes = world_shape(args.devices)
    trainer = pl.Trainer(
        accelerator=args.accelerator,
        devices=devices,
        num_nodes=nodes,
        strategy=MultiModelDDPStrategy(),  # also for one process, where ModelAveraging's rounds send nothing
        max_epochs=1,
        limit_train_batches=args.steps,
        callbacks=[meter] + ([averaging] if averaging is not None else []),
        logger=CSVLogger(args.out, name="logs"),
        log_every_n_steps=args.log_every,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    gan = RingGAN(args.lr, args.batch_size, args.seed, steps=args.steps)
    wall = time.perf_counter()
    trainer.fit(gan)
    wall = time.perf_counter() - wall
    trainer.save_checkpoint(args.out / "checkpoint.ckpt")  # every rank calls it; rank 0 writes
    children = list(getattr(trainer.strategy.launcher, "procs", []))
    if not trainer.is_global_zero:
        return None, children
    quality = ring_quality(gan.sample(EVAL_SAMPLES))
    comm = meter.grad.bytes + (averaging.traffic.bytes if averaging is not None else 0)
    result = f"modes_captured={quality.modes_captured}/{N_MODES} high_quality={quality.high_quality:.3f}"
    rounds = averaging.rounds if averaging is not None else 0
    final = final_line(args.steps, result, wall_s=wall, iter_seconds=meter.iter_seconds, comm_bytes=comm, rounds=rounds)
    return f"run folder: {args.out} (checkpoint.ckpt, logs/)\n{final}", children


def main() -> None:
    args = parse_args()
    final, children = train(args)
    # The Trainer, the models' DDPs and the optimizers are gone with train()'s frame; leaving the
    # process group now keeps gloo's threads from aborting the interpreter at exit.
    shutdown()
    failed = [(rank, proc.wait()) for rank, proc in enumerate(children, start=1)]
    failed = [(rank, code) for rank, code in failed if code != 0]
    if failed:
        sys.exit(f"gan_trainer.py: error: ranks {[r for r, _ in failed]} exited with codes {[c for _, c in failed]}")
    if final is not None:
        print(final, flush=True)  # after every rank has exited: the last line of stdout


if __name__ == "__main__":
    main()
