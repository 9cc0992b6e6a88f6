"""The building blocks for ``Trainer`` users of the standalone ``pytorch_lightning`` package.

One DDP per child model (:class:`MultiModelDDPStrategy`) and model averaging per batch
(:class:`ModelAveraging`), for ``pytorch_lightning.Trainer``. With the ``lightning`` package's
``lightning.pytorch.Trainer``, import the same names from ``fabric_multimodel.lightning``
(each family's Trainer accepts only its own strategies). ``import fabric_multimodel`` never
imports this module. Needs ``pip install pytorch-lightning``.

Example::

    from pytorch_lightning import Trainer
    from fabric_multimodel.pytorch_lightning import ModelAveraging, MultiModelDDPStrategy

    trainer = Trainer(
        accelerator="gpu",
        devices=4,
        strategy=MultiModelDDPStrategy(ddp_kwargs={"discriminator": {"broadcast_buffers": False}}),
        callbacks=[ModelAveraging(period=8, warmup_steps=500)],
    )
    trainer.fit(gan)  # gan.generator and gan.discriminator each run in their own DDP
"""

from __future__ import annotations

try:
    import pytorch_lightning as pl
except ImportError as error:  # the family is optional; say which one this module serves
    raise ImportError(
        "fabric_multimodel.pytorch_lightning is for the standalone `pytorch_lightning` package, which is not"
        " installed: pip install pytorch-lightning. With the `lightning` package (lightning.pytorch.Trainer), use"
        " fabric_multimodel.lightning instead."
    ) from error

from fabric_multimodel.trainer.strategy import Averaging, MultiModelDDP

__all__ = ["ModelAveraging", "MultiModelDDPStrategy"]


class MultiModelDDPStrategy(MultiModelDDP, pl.strategies.DDPStrategy):
    __doc__ = MultiModelDDP.__doc__
    _pl = pl
    _fabric = "lightning_fabric"


class ModelAveraging(Averaging, pl.Callback):
    __doc__ = Averaging.__doc__
    _pl = pl
