"""What a model asks DDP to leave alone (PyTorch's ``_ddp_params_and_buffers_to_ignore``) each rank keeps for itself,
whichever way the model is set up: the Trainer adapter of either Lightning family (a child's own list, or the
LightningModule's names under a child), ``setup_models`` in Fabric, and the Averager's rounds. A name that names
nothing is one clear error on every rank before any collective. Real 2-process gloo worlds (tests/worlds.py)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from fabric_multimodel import Averager, setup_models
from fabric_multimodel.averaging.builder import averaged_tensors
from fabric_multimodel.ddp.models import ddp_ignored
from tests.test_lightning import FAMILIES, HIDDEN, X_DIM, family, images, trainer


class Counting(nn.Module):
    """A discriminator with a buffer, ``mine``, that each forward moves by the rank's own amount: DDP's buffer
    broadcast would overwrite rank 1's with rank 0's at every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(X_DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))
        self.register_buffer("mine", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.mine += 1.0 + (dist.get_rank() if dist.is_initialized() else 0)
        return self.net(x)


def _gan_with_a_private_buffer(fam, where: str):
    class WithCounting(fam.pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.generator = nn.Sequential(nn.Linear(X_DIM, X_DIM))
            self.discriminator = Counting()
            if where == "child":
                self.discriminator._ddp_params_and_buffers_to_ignore = ["mine"]
            elif where == "lightning module":
                self._ddp_params_and_buffers_to_ignore = ["discriminator.mine"]
            elif where == "nothing":
                self.discriminator._ddp_params_and_buffers_to_ignore = ["theirs"]

        def training_step(self, batch, batch_idx):
            (x,) = batch
            return self.discriminator(self.generator(x)).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return WithCounting()


def fit_with_a_private_buffer(fabric, family_name: str, where: str):
    fam = family(family_name)
    torch.manual_seed(0)
    module = _gan_with_a_private_buffer(fam, where)
    try:
        trainer(fam, fam.adapter.MultiModelDDPStrategy()).fit(module, images(4))
    except ValueError as error:  # the test asserts on the message
        check = torch.ones(1)
        dist.all_reduce(check)  # nothing was left half-issued
        return str(error), check.item()
    return module.discriminator.mine.tolist(), module.generator[0].weight.detach().clone()


@pytest.mark.parametrize("family_name", FAMILIES)
@pytest.mark.parametrize("where", ["child", "lightning module", "not asked"])
def test_the_trainer_adapter_leaves_what_ddp_ignores_to_each_rank(worlds, family_name, where):
    ranks = worlds(2).run(fit_with_a_private_buffer, family_name, where)
    (mine0, weights0), (mine1, weights1) = ranks
    assert torch.equal(weights0, weights1)  # the rest is DDP's as ever
    # 4 batches, a forward each: rank 0 adds 1, rank 1 adds 2; where DDP broadcasts rank 0's buffer before each
    # forward, rank 1 ends at rank 0's value before the last forward, plus its own 2
    assert mine0 == [4.0] * 3 and mine1 == ([5.0] * 3 if where == "not asked" else [8.0] * 3)


@pytest.mark.parametrize("family_name", FAMILIES)
def test_a_name_the_model_does_not_have_is_one_error_on_every_rank(worlds, family_name):
    for message, check in worlds(2).run(fit_with_a_private_buffer, family_name, "nothing"):
        assert "_ddp_params_and_buffers_to_ignore names 'theirs'" in message and "Counting" in message
        assert check == 2.0


def set_up_and_average(fabric, ignore: bool):
    torch.manual_seed(0)
    disc = Counting()
    if ignore:
        disc._ddp_params_and_buffers_to_ignore = ["mine"]
    (disc,) = setup_models(fabric, disc=disc)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(disc.parameters(), lr=0.01))
    x = torch.randn(4, X_DIM, generator=torch.Generator().manual_seed(fabric.global_rank))
    with Averager(fabric, disc, period=2, average_buffers=True) as averager:
        for _ in range(4):
            disc(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            averager.step()
    return disc.mine.tolist(), [p.detach().clone() for p in disc.parameters()]


@pytest.mark.parametrize("ignore", [True, False], ids=["ignored", "not asked"])
def test_setup_models_and_the_averager_leave_what_ddp_ignores_to_each_rank(worlds, ignore):
    (mine0, params0), (mine1, params1) = worlds(2).run(set_up_and_average, ignore)
    assert all(torch.equal(p, q) for p, q in zip(params0, params1))  # the rounds averaged the parameters
    if ignore:  # neither DDP's broadcast nor a round touched it: 4 forwards of 1 and of 2
        assert mine0 == [4.0] * 3 and mine1 == [8.0] * 3
    else:  # averaged (or broadcast) like any floating buffer
        assert mine0 == mine1


def test_what_ddp_ignores_is_left_out_of_the_averaged_tensors():
    model = Counting()
    model._ddp_params_and_buffers_to_ignore = ["mine", "net.0.bias"]
    _, names, n_params = averaged_tensors([model], average_buffers=True)
    assert names == ["net.0.weight", "net.2.weight", "net.2.bias"] and n_params == 3
    model._ddp_params_and_buffers_to_ignore = ["net.9.weight"]
    with pytest.raises(ValueError, match=r"Averager: Counting._ddp_params_and_buffers_to_ignore names 'net.9.weight'"):
        averaged_tensors([model], average_buffers=True)
    assert ddp_ignored(nn.Linear(1, 1), "setup_models") == []
