"""The Trainer adapter: :class:`MultiModelDDP`, the strategy behind ``fabric_multimodel.lightning`` and
``fabric_multimodel.pytorch_lightning``.
"""
