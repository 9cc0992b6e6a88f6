"""The Trainer adapter keeps the promises of the ``MultiModelDDPStrategy`` proposal's own tests, walked in the
2-process gloo world of each Lightning family: ``trainer.test`` before and after ``fit``, ``fit`` with validation
dataloaders, mixed precision, checkpoints with plain keys that load without the strategy, models plain again after
teardown, and ``find_unused_parameters`` for one model as the way out of the unused-parameter error (the error itself:
tests/test_lightning.py; what DDP ignores: tests/test_ddp_ignore.py). The GPU-only items (16-mixed, device ids
``[1, 3]``) are ``benchmarks/gpu_check.py``'s."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.test_lightning import FAMILIES, HIDDEN, X_DIM, family, images, trainer


class Generator(nn.Module):
    def __init__(self, spare: bool) -> None:
        super().__init__()
        self.net = nn.Linear(X_DIM, X_DIM)
        if spare:
            self.spare = nn.Linear(1, 1)  # trained by the optimizer, used by no forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).tanh()


def _two_models(fam, spare: bool):
    class TwoModels(fam.pl.LightningModule):
        """A generator and a critic trained by one loss (automatic optimization), validated and tested."""

        def __init__(self) -> None:
            super().__init__()
            self.generator = Generator(spare)
            self.critic = nn.Sequential(nn.Linear(X_DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))

        def _loss(self, batch) -> torch.Tensor:
            return self.critic(self.generator(batch[0])).pow(2).mean()

        def training_step(self, batch, batch_idx):
            return self._loss(batch)

        def validation_step(self, batch, batch_idx):
            self.log("val_loss", self._loss(batch), sync_dist=True)

        def test_step(self, batch, batch_idx):
            self.log("test_loss", self._loss(batch), sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    return TwoModels


def walk(fabric, family_name: str, folder: str) -> dict:
    fam = family(family_name)
    torch.manual_seed(0)
    module_class = _two_models(fam, spare=False)
    module = module_class()
    strategy = fam.adapter.MultiModelDDPStrategy
    seen: dict = {}
    tested = trainer(fam, strategy(), precision="bf16-mixed").test(module, images(2), verbose=False)
    seen["test before fit"] = tested[0]["test_loss"]
    fit = trainer(fam, strategy(), precision="bf16-mixed", limit_val_batches=2, num_sanity_val_steps=0)
    fit.fit(module, train_dataloaders=images(4), val_dataloaders=images(2))
    seen["validated"] = float(fit.callback_metrics["val_loss"])
    seen["plain after teardown"] = not any(isinstance(m, DistributedDataParallel) for m in module.modules()) and all(
        "forward" not in vars(model) for model in (module.generator, module.critic)
    )
    path = Path(folder) / "fit.ckpt"
    fit.save_checkpoint(path)
    dist.barrier()
    saved = torch.load(path, weights_only=False)["state_dict"]
    fresh = module_class()
    fresh.load_state_dict(saved)  # strict: the keys are the LightningModule's own, no wrapper in them
    seen["checkpoint keys"] = sorted(saved)
    seen["loads without the strategy"] = all(torch.equal(a, b) for a, b in zip(fresh.parameters(), module.parameters()))
    seen["test after fit"] = fit.test(module, images(2), verbose=False)[0]["test_loss"]
    seen["parameters"] = [p.detach().clone() for p in module.parameters()]
    unused = _two_models(fam, spare=True)()
    way_out = strategy(ddp_kwargs={"generator": {"find_unused_parameters": True}})
    trainer(fam, way_out).fit(unused, images(2))  # the spare parameter is the generator's only: only it searches
    seen["find_unused_parameters for one model"] = True
    return seen


@pytest.mark.parametrize("family_name", FAMILIES)
def test_the_trainer_adapter_keeps_every_promise_of_the_strategys_tests(worlds, tmp_path, family_name):
    ranks = worlds(2).run(walk, family_name, str(tmp_path))
    for seen in ranks:
        assert seen["plain after teardown"] and seen["loads without the strategy"]
        assert seen["find_unused_parameters for one model"]
        assert seen["checkpoint keys"] == [
            "critic.0.bias", "critic.0.weight", "critic.2.bias", "critic.2.weight",
            "generator.net.bias", "generator.net.weight",
        ]  # fmt: skip
        assert all(torch.isfinite(torch.tensor(seen[k])) for k in ("test before fit", "validated", "test after fit"))
        assert seen["test after fit"] != seen["test before fit"]  # fit trained the models the tests ran
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["parameters"], ranks[1]["parameters"]))  # DDP's sync
    assert ranks[0]["test after fit"] == ranks[1]["test after fit"]  # sync_dist: one figure on every rank
