"""Every Fabric entry point accepts both package families: ``lightning.fabric`` and ``lightning_fabric``.

Each case builds a Fabric of one family inside the session's live 2-process world (Fabric finds
the process group initialised and joins it) and runs the library's whole Fabric path with it.
"""

from __future__ import annotations

import functools
import importlib

import pytest
import torch

from fabric_multimodel import Averager, average_models, frozen, node_groups, replicas_in_sync, setup_models
from fabric_multimodel.checkpoints.files import load_checkpoint, save_checkpoint
from tests.gan import collectives, gan_iteration, make_gan

PACKAGES = ["lightning.fabric", "lightning_fabric"]


def family_fabric(package_name: str):
    package = importlib.import_module(package_name)
    fabric = package.Fabric(
        accelerator="cpu", devices=2, strategy=package.strategies.DDPStrategy(process_group_backend="gloo")
    )
    fabric.launch()
    return fabric


def whole_fabric_path(_, package_name, folder):
    fabric = family_fabric(package_name)
    gen, disc = make_gan(0, 3, 2, [8])
    gen, disc = setup_models(fabric, gen=gen, disc=disc)
    opt_g, opt_d = fabric.setup_optimizers(
        torch.optim.Adam(gen.parameters(), lr=1e-2), torch.optim.Adam(disc.parameters(), lr=1e-2)
    )
    data = torch.Generator().manual_seed(fabric.global_rank)
    batch = lambda: (torch.randn(4, 2, generator=data), torch.randn(4, 3, generator=data))  # noqa: E731
    calls = collectives(gan_iteration, fabric, gen, disc, opt_g, opt_d, *batch(), frozen)
    gradients = sum(n for name, n in calls if name == "gloo:all_reduce")
    nesterov = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
    with Averager(fabric, [gen, disc], period=2, warmup_steps=1, outer_optimizer=nesterov) as averager:
        for _ in range(5):
            gan_iteration(fabric, gen, disc, opt_g, opt_d, *batch(), frozen)
            averager.step()
    in_sync = bool(replicas_in_sync(fabric, [gen, disc]))
    # What fabric.setup_module returned is accepted as set up.
    extra = fabric.setup_module(torch.nn.Linear(2, 2))
    average_models(fabric, [extra])
    groups = node_groups(fabric, num_nodes=1)
    path = save_checkpoint(fabric, f"{folder}/checkpoint.pt", {"gen": gen, "averager": averager})
    state = {"gen": gen, "averager": averager}
    load_checkpoint(fabric, path, state)
    return type(fabric).__module__, gradients, averager.rounds, in_sync, groups.per_node


@pytest.mark.parametrize("package_name", PACKAGES)
def test_the_fabric_path_takes_either_family(worlds, tmp_path, package_name):
    n_params = sum(p.numel() for p in torch.nn.Sequential(*make_gan(0, 3, 2, [8])).parameters())
    for module, gradients, rounds, in_sync, per_node in worlds(2).run(whole_fabric_path, package_name, tmp_path):
        assert module.startswith(package_name)
        assert gradients == n_params  # each model's gradients once: per-model DDP and frozen work
        assert rounds == 2 and in_sync and per_node == 2  # rounds at steps 3 and 5 (leaving the block adds none)


def foreign_fabric(_):
    return [
        error
        for call in (
            lambda: setup_models(object(), gen=torch.nn.Linear(1, 1)),
            lambda: Averager(family_fabric("lightning.fabric"), [torch.nn.Linear(1, 1)], period=2),
        )
        for error in [_error(call)]
    ]


def _error(call) -> str:
    try:
        call()
    except (TypeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def test_what_is_not_a_fabric_or_not_set_up_is_named(worlds):
    for not_fabric, not_set_up in worlds(2).run(foreign_fabric):
        assert "lightning.fabric.Fabric or lightning_fabric.Fabric" in not_fabric and "builtins.object" in not_fabric
        assert "was not set up" in not_set_up
