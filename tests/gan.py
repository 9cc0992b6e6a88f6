"""A tiny GAN and its training iteration, shared by the distributed tests."""

from __future__ import annotations

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile


def mlp(sizes: list[int], batch_norm: bool = False) -> nn.Sequential:
    layers: list[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(n_in, n_out))
        if i < len(sizes) - 2:
            if batch_norm:
                layers.append(nn.BatchNorm1d(n_out))
            layers.append(nn.LeakyReLU(0.2))
    return nn.Sequential(*layers)


def make_gan(
    seed: int, z_dim: int, x_dim: int, hidden: list[int], batch_norm: bool = False
) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(seed)
    return mlp([z_dim, *hidden, x_dim], batch_norm), mlp([x_dim, *hidden, 1], batch_norm)


def gan_iteration(fabric, gen, disc, opt_g, opt_d, real, z, freeze) -> None:
    """One GAN iteration: D step on real and fake.detach(), then G step through a frozen D.

    ``fabric`` may be None for the single-process reference (plain ``loss.backward()``).
    """
    bce = nn.BCEWithLogitsLoss()
    ones = torch.ones(real.shape[0], 1)
    fake = gen(z)
    d_loss = bce(disc(real), ones) + bce(disc(fake.detach()), torch.zeros_like(ones))
    fabric.backward(d_loss) if fabric is not None else d_loss.backward()
    opt_d.step()
    opt_d.zero_grad()
    with freeze(disc):
        g_loss = bce(disc(fake), ones)
    fabric.backward(g_loss) if fabric is not None else g_loss.backward()
    opt_g.step()
    opt_g.zero_grad()


def collectives(fn, *args) -> list[tuple[str, int]]:
    """Run ``fn(*args)`` under the profiler; the collectives it issued as (name, elements)."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn(*args)
    found = []
    for event in prof.events():
        if event.name.startswith(("gloo:", "nccl:")):
            elements = sum(int(torch.Size(shape).numel()) for shape in event.input_shapes if shape)
            found.append((event.name, elements))
    return found


def allreduce_payloads(fn, *args) -> list[tuple[int, str]]:
    """Run ``fn(*args)`` under the profiler; each allreduce it issued as (elements, dtype)."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn(*args)
    found = []
    for event in prof.events():
        if event.name == "gloo:all_reduce":
            shapes = [(shape, dtype) for shape, dtype in zip(event.input_shapes, event.input_dtypes) if shape]
            found.append((sum(int(torch.Size(s).numel()) for s, _ in shapes), shapes[0][1]))
    return found
