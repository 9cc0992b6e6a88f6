"""The building blocks for ``Trainer`` users of the ``lightning`` package (``import lightning as L``).

One DDP per child model (:class:`MultiModelDDPStrategy`) and model averaging per batch
(:class:`ModelAveraging`), for ``lightning.pytorch.Trainer``. With the standalone
``pytorch_lightning.Trainer``, import the same names from ``fabric_multimodel.pytorch_lightning``
(each family's Trainer accepts only its own strategies). ``import fabric_multimodel`` never
imports this module. Needs ``pip install lightning``.

Example::

    from lightning.pytorch import Trainer
    from fabric_multimodel.lightning import ModelAveraging, MultiModelDDPStrategy

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
    import lightning.pytorch as pl
except ImportError as error:  # the family is optional; say which one this module serves
    raise ImportError(
        "fabric_multimodel.lightning is for the `lightning` package (lightning.pytorch.Trainer), which is not"
        " installed: pip install lightning. With the standalone pytorch_lightning.Trainer, use"
        " fabric_multimodel.pytorch_lightning instead."
    ) from error

from fabric_multimodel.trainer.strategy import Averaging, MultiModelDDP

__all__ = ["ModelAveraging", "MultiModelDDPStrategy"]


# The shared mixins are typed against the standalone family (pytorch_lightning); lightning.pytorch holds the same
# classes under other names, which the type checker takes for conflicting definitions.
class MultiModelDDPStrategy(MultiModelDDP, pl.strategies.DDPStrategy):  # type: ignore[misc]
    __doc__ = MultiModelDDP.__doc__
    _pl = pl
    _fabric = "lightning.fabric"


class ModelAveraging(Averaging, pl.Callback):  # type: ignore[misc]  # the same, for the Callback
    __doc__ = Averaging.__doc__
    _pl = pl
